"""
graphs.py: how a step's model call runs. The layers (model.hidden) run eager, or replayed from CUDA graphs (the
default on CUDA: `CudaGraphs`), or through torch.compile (compile=True: `Compiled`); the LM head stays eager, on the
block's open columns only, whichever runs the layers.

Why CUDA graphs: at batch 1 an eager call of an 8B model launches ~1,000 small kernels, and the host takes longer to
launch them than the GPU to run them (docs/benchmarks.md, "The GPU check": busy ~11% of an eager step). A CUDA graph
records the kernels of one call once and replays them with one launch. That needs a call whose shapes and memory
addresses never change, and this loop has one: every step of a feed width has the same shapes (the slots are
tensors, not offsets), the KV cache is allocated once at fixed addresses, and the step reads the device once, after
the call. So each feed width's call is captured once, with its own static input buffers (ids, positions, slots,
mask), and replayed after the step's inputs are copied into them; as SGLang and dInfer run their decoders. No code
is generated (compile=True's inductor takes tens of seconds per width; a capture takes a few calls' time).
On a CPU the same code path runs with the capture replaced by a direct call on the static buffers (no graph), so
the tests check everything a capture needs (tests/test_graphs.py).
"""
import time
import warnings
from functools import partial

import torch

from cache import KVCache


def model_call(model, compile, cuda_graphs, policy, B: int, L: int, wrap=None):
    """What runs the layers of this generate() call, decided once before the loop -> (layers(ids, pos, kv, slots,
    mask) -> hidden states, the KV cache or None). compile (True or a Compiled): torch.compile, whose inductor
    captures its own CUDA graphs on CUDA. Else cuda_graphs (None: on CUDA only; True; False: off; or a CudaGraphs,
    which keeps its graphs for the next call). A policy whose feed changes width within a block (fixed_width False)
    stays eager: a graph per step would not pay. wrap: a family's own call around model.hidden (sampler.Parts.layers:
    DiffusionGemma's passes the tensors its model.hidden reads beyond the five, which the runners treat alike)."""
    wrap, runner = wrap or (lambda layers: layers), None
    if policy.fixed_width and compile:
        runner = compile if isinstance(compile, Compiled) else Compiled()
    elif policy.fixed_width and (cuda_graphs if cuda_graphs is not None else model.lm_head.weight.is_cuda):
        runner = cuda_graphs if isinstance(cuda_graphs, CudaGraphs) else CudaGraphs()
    if runner is None:
        return wrap(model.hidden), KVCache.for_model(model, B, L, policy.spare) if policy.keeps_cache else None
    return wrap(partial(runner, model)), runner.start(model, B, L, policy)


class Captured:
    """One feed width's call: its static input buffers, and on CUDA the graph recorded on them (on a CPU, `run` is
    called at every replay instead). `out` is the static output: the next replay overwrites it."""

    def __init__(self, fn, inputs, pool):
        self.fn, self.inputs, self.graph, self.out = fn, [None if t is None else t.clone() for t in inputs], None, None
        if self.inputs[0].is_cuda:
            # Warm up on a side stream first (lazily initialised kernels and cuBLAS workspaces must not be
            # recorded), as torch.cuda.graph's documentation does; the warm-up writes the KV cache as the call would.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.run()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.out = self.run()            # recorded, not run: the first replay runs it

    def run(self):
        """The captured call itself: the layers on the static buffers (on CUDA only while capturing)."""
        return self.fn(*self.inputs)

    def replay(self, inputs):
        for static, t in zip(self.inputs, inputs):
            if static is not None:
                static.copy_(t)
        if self.graph is not None:
            self.graph.replay()
        elif self.out is None:
            self.out = self.run()
        else:
            self.out.copy_(self.run())
        return self.out


class CudaGraphs:
    """cuda_graphs=: the layers of each feed width captured once as a CUDA graph and replayed (on a CPU: called
    directly on the same static buffers). A width is captured the second time it is fed, so a width fed once (a
    fork's odd feed, the last block of the prefix cache) costs no capture. The graphs read the weights and the KV
    cache at their addresses: this owns the KV cache, and a new model, new weights (quantize_int8 replaces them) or
    another canvas shape drop every graph. Pass one instance to every call (the CLI, serve.py, bench.py and harness.py
    do) to keep the graphs; generate()'s own lives for one call. The graphs of one instance share one memory pool. A
    width whose capture fails (an op a graph cannot record) runs eager, said once in a warning. The hidden states a
    call returns are overwritten by the next call of that width, as with compile=True."""

    def __init__(self):
        self.graphs, self.seen, self.eager, self.kv, self.key, self.pool = {}, set(), set(), None, None, None
        self.capture_s = 0.0          # seconds spent capturing (the warm-up): tools/gpu_check.py reports it

    def start(self, model, B: int, L: int, policy) -> KVCache | None:
        """The KV cache of a generate() call (None: the policy keeps none): the previous call's when nothing the
        graphs read has changed (every generation's first call feeds the whole canvas, so nothing stale is read)."""
        key = (id(model), tuple(map(id, model.parameters())), B, L, policy.spare if policy.keeps_cache else None)
        if key != self.key:
            self.graphs, self.seen, self.eager, self.key = {}, set(), set(), key
            self.kv = KVCache.for_model(model, B, L, policy.spare) if policy.keeps_cache else None
        return self.kv

    def __call__(self, model, ids, pos, kv, slots, mask, *more):
        """model.hidden(ids, pos, kv, slots, mask, *more), replayed: the fed positions' hidden states (more: the
        tensors a family's own call reads besides, DiffusionGemma's, copied into static buffers as the others)."""
        inputs = (ids, pos, slots, mask, *more)
        key = (id(kv), *(None if t is None else (tuple(t.shape), t.dtype) for t in inputs))
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen or key in self.eager:     # fed for the first time, or not capturable: eager
                self.seen.add(key)
                return model.hidden(ids, pos, kv, slots, mask, *more)
            t0 = time.perf_counter()
            if ids.is_cuda and self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            layers = lambda i, p, s, m, *x: model.hidden(i, p, kv, s, m, *x)          # noqa: E731
            try:
                graph = self.graphs[key] = Captured(layers, inputs, self.pool)
            except RuntimeError as e:        # an op the graph cannot record (a fork's, a library's): eager, said once
                self.eager.add(key)
                warnings.warn(f"CUDA graphs: a call of {tuple(ids.shape)} tokens could not be captured, it runs eager "
                              f"({str(e).splitlines()[0][:200]}); cuda_graphs=False (--no-cuda-graphs) runs all eager")
                return model.hidden(ids, pos, kv, slots, mask, *more)
            finally:
                self.capture_s += time.perf_counter() - t0
        return graph.replay(inputs)


# ----------------------------------------------------------------------------------------------------------
# The compiled call (compile=True): the model's layers through torch.compile, with the KV cache its graphs write.

def hidden_states(model, ids, pos, kv, slots, mask, *more):
    return model.hidden(ids, pos, kv, slots, mask, *more)


class Compiled:
    """compile=True: the layers (model.hidden) through torch.compile, one graph per feed shape (fullgraph, static:
    the slots are tensors, so one graph serves every block); on CUDA with CUDA graphs, one launch instead of ~1,150
    kernels. The LM head stays eager, on the open columns only (on a CPU the head on every column cost up to 1.7x).
    CUDA graphs write the KV cache in place at fixed addresses, so this keeps the last call's cache for the next of
    the same shape: pass one instance to every call (the CLI, serve.py, harness.py do). emulate_precision_casts: bf16
    ids equal eager's on the CPU (tests/test_compile.py). backend "aot_eager": the same graphs, no code generated."""

    def __init__(self, backend: str = "inductor"):
        if backend not in torch.compiler.list_backends(exclude_tags=()):
            raise ValueError(f"Compiled(backend={backend!r}): not a torch.compile backend here (see "
                             f"torch.compiler.list_backends(exclude_tags=()); default 'inductor')")
        self.fn, self.kv, self.key, self.backend = None, None, None, backend

    def start(self, model, B: int, L: int, policy) -> KVCache | None:
        return self.cache(model, B, L, policy.spare) if policy.keeps_cache else None

    def cache(self, model, B: int, L: int, spare: int) -> KVCache:
        """A KV cache for this call: the previous call's when the shape is the same (every generation's first
        call feeds the whole canvas, so nothing stale is ever read)."""
        if self.key != (id(model), B, L, spare):
            self.kv, self.key = KVCache.for_model(model, B, L, spare), (id(model), B, L, spare)
            for t in self.kv.k + self.kv.v if self.kv.k[0].is_cuda else ():
                torch._dynamo.mark_static_address(t, guard=False)     # written in place by the CUDA graphs
        return self.kv

    def __call__(self, model, ids, pos, kv, slots, mask, *more):
        """model.hidden(ids, pos, kv, slots, mask, *more), compiled: the fed positions' hidden states."""
        cuda = model.lm_head.weight.is_cuda
        if self.fn is None:
            options = {"emulate_precision_casts": True} | ({"triton.cudagraphs": True} if cuda else {})
            self.fn = torch.compile(hidden_states, fullgraph=True, dynamic=False, backend=self.backend,
                                    options=options if self.backend == "inductor" else None)
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()   # the previous step's hidden states are no longer read
        with torch._dynamo.config.patch(recompile_limit=256):
            return self.fn(model, ids, pos, kv, slots, mask, *more)
