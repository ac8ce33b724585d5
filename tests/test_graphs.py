"""CUDA graphs (graphs.CudaGraphs, generate()'s default on CUDA): on the CPU the same static-buffer path runs, each
capture replaced by a direct call on the static buffers. Here, in float32, for every family (LLaDA, Dream, LLaDA-MoE,
Fast-dLLM v2, SDAR, LLaDA2), every cache, one token a step and threshold 0.9, one row and a padded batch: the ids and
calls are eager's, and every call of the generation does what a capture needs. The captured call (graphs.Captured.run)
reads no value back to the host, reads memory only at fixed addresses (its static buffers, the weights, the KV
cache; the same views of them at every replay), and runs the same ops on the same shapes at every replay as at its
capture, so it allocates the same; outside
it, a replay allocates nothing (it copies the step's inputs into the static buffers, and that is all); each width
is captured once."""
import os
import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import graphs
from conftest import GOLDEN, ROOT
from fastdllm import CudaGraphs, generate, pad_prompts
from model import load_model

sys.path.insert(0, ROOT)
from tools.step_count import SYNCS, random_model  # noqa: E402

DENSE = [dict(cache=c, **r) for c in ("none", "prefix", "dual", "free") for r in ({}, {"threshold": 0.9})]
BLOCK = [dict(cache=c, **r) for c in ("none", "prefix", "dual") for r in ({}, {"threshold": 0.9})]
FAMILIES = ("llada", "dream", "lladamoe", "fastdllm_v2", "sdar", "llada2")


@pytest.fixture(scope="module")
def models(llada, dream):
    tiny = lambda name: load_model(os.path.join(GOLDEN, name), device="cpu", dtype=torch.float32)   # noqa: E731
    return dict(llada=llada, dream=dream, lladamoe=tiny("lladamoe-tiny"), sdar=tiny("sdar-tiny"),
                llada2=tiny("llada2-tiny"), fastdllm_v2=random_model("fastdllm_v2", "small", torch.float32))


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Audit(TorchDispatchMode):
    """Every op dispatched while on: whether it ran inside the captured call (`inside`, set by Captured.run), its
    outputs' shapes, and the storages it read that no op of the same region had written."""

    def __init__(self):
        super().__init__()
        self.inside, self.regions = False, []

    def region(self, inside: bool):
        self.inside = inside
        self.regions.append(dict(inside=inside, ops=[], made=set(), read=set(), at=set(), syncs=0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        r = self.regions[-1]
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and storage(t) not in r["made"]]
        r["read"] |= {storage(t) for t in ins}
        r["at"] |= {(t.data_ptr(), tuple(t.shape), t.stride()) for t in ins}
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        r["made"] |= {storage(t) for t in outs}
        r["ops"].append((func, tuple(tuple(t.shape) for t in outs)))
        r["syncs"] += func.overloadpacket in SYNCS
        return out


class Audited(CudaGraphs):
    """A CudaGraphs whose every call is recorded: what kind it was (eager, capture, replay), the graph it used, and
    the regions of ops inside and outside the captured call."""

    def __init__(self, audit: Audit):
        super().__init__()
        self.audit, self.calls = audit, []

    def __call__(self, model, ids, pos, kv, slots, mask, *more):
        before = dict(self.graphs)
        self.audit.region(False)
        first = len(self.audit.regions) - 1
        out = super().__call__(model, ids, pos, kv, slots, mask, *more)
        graph = next((g for g in self.graphs.values() if g.out is out), None)
        kind = "eager" if graph is None else "replay" if graph in before.values() else "capture"
        self.calls.append(dict(kind=kind, graph=graph, regions=self.audit.regions[first:]))
        self.audit.region(False)
        return out


@pytest.fixture
def audit(monkeypatch):
    mode, run = Audit(), graphs.Captured.run
    tolist = torch.Tensor.tolist

    def audited_run(self):
        mode.region(True)
        try:
            return run(self)
        finally:
            mode.region(False)

    def counted_tolist(t):      # a read to the host that dispatches no op on the CPU
        mode.regions[-1]["syncs"] += 1
        return tolist(t)
    monkeypatch.setattr(graphs.Captured, "run", audited_run)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with mode:
        mode.region(False)
        yield mode


def prompts(model, batch: int):
    rows = [[(7 * i + 3 * b) % 500 + 1 for i in range(12 - 5 * b)] for b in range(batch)]
    ids, am = pad_prompts(rows, model.config.pad_id if model.config.pad_id is not None else model.config.eos_id)
    return ids, am


def check_captures(g: Audited, model):
    """What a capture needs, on every call a generation made through g."""
    params = {storage(t) for t in [*model.parameters(), *model.buffers()]}
    kv = set() if g.kv is None else {storage(t) for t in [*g.kv.k, *g.kv.v, g.kv.rows]}
    traces, kinds = {}, [c["kind"] for c in g.calls]
    for call in g.calls:
        inside = [r for r in call["regions"] if r["inside"]]
        outside = [r for r in call["regions"] if not r["inside"]]
        if call["kind"] == "eager":
            assert not inside
            continue
        static = {storage(t) for t in call["graph"].inputs if t is not None}
        for r in inside:
            assert r["syncs"] == 0, "the captured call reads a value back to the host"
            assert r["read"] <= static | params | kv, "the captured call reads memory that is not at a fixed address"
        trace = ([op for r in inside for op in r["ops"]], set().union(*(r["at"] for r in inside)))
        first = traces.setdefault(id(call["graph"]), trace)
        assert trace[0] == first[0], "a replay ran other ops or shapes than its capture"
        assert trace[1] == first[1], "a replay read other addresses, shapes or strides than its capture"
        if call["kind"] == "replay":
            ops = {func for r in outside for func, _ in r["ops"]}
            assert ops <= {torch.ops.aten.copy_.default}, f"a replay allocated outside the captured call: {ops}"
            assert sum(r["syncs"] for r in outside) == 0
    assert kinds.count("capture") == len(g.graphs)
    return kinds.count("replay")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_static_buffers_give_eager_ids_and_everything_a_capture_needs(models, audit, family, batch):
    model = models[family]
    block = model.config.family in ("fastdllm_v2", "sdar", "llada2")
    ids, am = prompts(model, batch)
    kw = dict(gen_length=32) if block else dict(gen_length=16, block_length=8, steps=16)
    replays = 0
    for mode in BLOCK if block else DENSE:
        eager, st = generate(model, ids, attention_mask=am, **mode, **kw)
        g = Audited(audit)
        out, st2 = generate(model, ids, attention_mask=am, cuda_graphs=g, **mode, **kw)
        assert torch.equal(out, eager) and st2["fed"] == st["fed"], mode
        replays += check_captures(g, model)
    assert replays > 10                # one token a step replays every cached width


@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_diffusiongemma_replays_its_own_call(audit, cache):
    """DiffusionGemma's own call (gemma.DiffusionGemma.hidden: the encoder for what a call commits, the decoder for the
    canvas, self-conditioned on the last step's logits) through the same static buffers, a padded batch with a
    generator per row: eager's ids, calls and draws, each width fed twice captured once (prefix: a canvas's first
    call and its steps; none: the canvas grows, a width per canvas), and what a capture needs, its self-conditioning
    logits and per-row flag among the static inputs (a canvas's first step reads them too: a zero signal)."""
    model = load_model(os.path.join(GOLDEN, "diffusiongemma", "tiny_dg_seed1234"), device="cpu", dtype=torch.float32)
    ids, am = pad_prompts([[2, 45, 300, 17, 999], [2, 811, 64, 3, 520, 77, 913, 402, 11]], 0)
    kw = dict(attention_mask=am, gen_length=48, steps=4, cache=cache)
    gens = lambda: [torch.Generator().manual_seed(3 + b) for b in range(2)]     # noqa: E731
    eager, st = generate(model, ids, generator=(eager_gens := gens()), **kw)
    g = Audited(audit)
    out, st2 = generate(model, ids, generator=(graph_gens := gens()), cuda_graphs=g, **kw)
    assert torch.equal(out, eager) and st2["fed"] == st["fed"] and st2["row_nfe"] == st["row_nfe"]
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(eager_gens, graph_gens))
    assert len(g.graphs) == len({w for w in st["fed"] if st["fed"].count(w) > 1}) and check_captures(g, model) > 4
    assert all(len(graph.inputs) == 8 for graph in g.graphs.values())      # the loop's four, and DiffusionGemma's


def test_guided_and_dreams_own_sampler_too(dream, qwen2):
    """Guided diffusion's diffusion calls (its prefix cache; its FreeCache changes width every step: eager) and
    Dream's whole-canvas sampler."""
    ids, am = prompts(dream, 2)
    for kw in (dict(guide=qwen2, cache="prefix"), dict(guide=qwen2, cache="free"), dict(block_length=None, steps=16)):
        eager, st = generate(dream, ids, attention_mask=am, gen_length=16, **kw)
        g = CudaGraphs()
        out, st2 = generate(dream, ids, attention_mask=am, gen_length=16, cuda_graphs=g, **kw)
        assert torch.equal(out, eager) and st2["nfe"] == st["nfe"]
        assert bool(g.graphs) == (kw.get("cache") != "free")


def test_one_instance_keeps_its_graphs_and_drops_them_for_new_weights(llada):
    """A CudaGraphs passed to every call captures each width once; another canvas shape, or new weights (a graph
    reads the weights at their addresses), drops them. A width fed once is never captured."""
    ids, am = prompts(llada, 1)
    kw = dict(gen_length=16, block_length=8, steps=16, cache="dual")
    g = CudaGraphs()
    first, _ = generate(llada, ids, cuda_graphs=g, **kw)
    graphs_ = dict(g.graphs)
    assert len(graphs_) == 2                              # the refresh and the block step
    again, _ = generate(llada, ids, cuda_graphs=g, **kw)
    assert torch.equal(again, first) and g.graphs == graphs_
    generate(llada, ids[:, 1:], cuda_graphs=g, **kw)      # another canvas
    assert not set(g.graphs.values()) & set(graphs_.values())
    generate(llada, ids, cuda_graphs=g, **kw | dict(gen_length=8))   # one block: its refresh width is fed once
    assert [k[1][0] for k in g.graphs] == [(1, 8)]


def test_the_default_is_on_cuda_only_and_the_setting_is_checked(llada, monkeypatch):
    """cuda_graphs=None (the default): CudaGraphs for a model on CUDA, eager on the CPU; compile=True and a policy
    whose width changes within a block come first. The CLI's --no-cuda-graphs is False; another type is one line."""
    import cli
    from cache import DualCache
    from guided import GuidedFreeCache
    for runner in (graphs.CudaGraphs, graphs.Compiled):
        monkeypatch.setattr(runner, "start", lambda self, *a: "kv")
    monkeypatch.setattr(graphs.KVCache, "for_model", lambda *a: "eager kv")
    on_cuda = SimpleNamespace(lm_head=SimpleNamespace(weight=SimpleNamespace(is_cuda=True)), hidden=None)
    layers, kv = graphs.model_call(on_cuda, False, None, DualCache(), 1, 16)
    assert isinstance(layers.func, CudaGraphs) and kv == "kv"
    assert not isinstance(graphs.model_call(on_cuda, False, False, DualCache(), 1, 16)[0], partial)
    assert isinstance(graphs.model_call(on_cuda, True, None, DualCache(), 1, 16)[0].func, graphs.Compiled)
    assert graphs.model_call(on_cuda, False, None, GuidedFreeCache(), 1, 16)[0] is None     # on_cuda.hidden: eager
    assert graphs.model_call(llada, False, None, DualCache(), 1, 16) == (llada.hidden, "eager kv")
    assert isinstance(graphs.model_call(llada, False, True, DualCache(), 1, 16)[0].func, CudaGraphs)
    args = cli.parse_args(["--prompt", "hi", "--no-cuda-graphs"])
    assert cli.settings(args)["cuda_graphs"] is False
    ids, _ = prompts(llada, 1)
    with pytest.raises(ValueError, match=r"cuda_graphs must be None \(on CUDA only\), True, False or a "
                                         r"fastdllm.CudaGraphs \(got 'yes'\)"):
        generate(llada, ids, gen_length=8, block_length=8, cuda_graphs="yes")


def test_a_call_that_cannot_be_captured_runs_eager_and_says_so(llada, monkeypatch):
    """An op a CUDA graph cannot record (a fork's host read, a library's kernel) must not end the decode: that width
    runs eager from then on, with one warning for it, and the ids are eager's."""
    def refuse(self, fn, inputs, pool):
        raise RuntimeError("operation not permitted when stream is capturing")
    ids, _ = prompts(llada, 1)
    kw = dict(gen_length=16, block_length=8, steps=16, cache="dual")
    eager, _ = generate(llada, ids, **kw)
    monkeypatch.setattr(graphs.Captured, "__init__", refuse)
    g = CudaGraphs()
    with pytest.warns(UserWarning, match=r"could not be captured, it runs eager \(operation not permitted") as w:
        out, _ = generate(llada, ids, cuda_graphs=g, **kw)
    assert torch.equal(out, eager) and not g.graphs and len(g.eager) == 2 and len(w) == 2
