"""
tools/step_count.py: what a GPU would feel of one decoding step, counted on the CPU, where counts are exact and
times are noise. A TorchDispatchMode sees every aten op generate() dispatches: each is one kernel launch on a
GPU, and some make the host wait for the device (a value read back: `.item()`, `bool(t)`, `.tolist()`,
`nonzero`, boolean indexing, ...). Reported per step, split into the loop's own ops (sampling, selection,
commit, stop, the one read), the model call's ops outside its layers, and the ops of one layer, then scaled to
32 layers (LLaDA-8B; Dream-7B has 28, LLaDA-MoE 16: the last column is at the real depth). Then CPU seconds of
generate() eager against compile=True on one checkpoint, side by side, with the ids of both. `moe`: the bytes of
weights a LLaDA-MoE or LLaDA2.x (--family llada2) call reads, against the dense LLaDA-8B.

    python tools/step_count.py counts                          # every mode, both families, batch 1 and 16
    python tools/step_count.py counts --shape real --batch 1 --modes dual   # the same at LLaDA-8B/Dream-7B widths
    python tools/step_count.py counts --families llada,lladamoe --shape real --batch 1 --modes dual
    python tools/step_count.py moe --shape real --batch 1 --modes dual     # LLaDA-MoE: weight bytes per step
    python tools/step_count.py moe --family llada2 --model /tmp/llada2-real --batch 1 --modes prefix --dtype float32
    python tools/checkpoint.py /tmp/mid512 --d-model 512 --layers 2 && python tools/step_count.py wall --model /tmp/mid512

The counts do not depend on widths or the vocabulary (`--shape real` gives the same numbers, 2 layers at the
real widths, bf16): the default small shape keeps the vocabulary's special ids where the real models have them.
"""
import argparse
import os
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from shapes import SHAPES, hf_config, random_prompts  # noqa: E402
if "--root" in sys.argv:        # count another checkout's generate() (before/after a change)
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--root") + 1]))
    for name in ("model", "cache", "sampler", "fastdllm", "checks", "chat", "guided"):
        sys.modules.pop(name, None)
from fastdllm import generate  # noqa: E402
from model import ModelConfig, Transformer, load_model  # noqa: E402

aten = torch.ops.aten
# Ops whose result the host must wait for: a value read back, or an output whose size depends on values.
SYNCS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select, aten.unique_dim,
         aten._unique2, aten.bincount, aten.histc, aten.allclose}
METADATA = {aten.detach.default, aten._to_copy.default} - {aten._to_copy.default}   # ops that launch nothing


class StepCounter(TorchDispatchMode):
    """Counts aten ops by region ("loop", "call" = the model outside its layers, "layer", "guide") and host
    syncs, in one bucket per decoding step (closed by generate()'s on_step)."""

    def __init__(self, model, guide=None):
        super().__init__()
        self.where, self.steps, self.bucket, self.model = "loop", [], Counter(), model
        self.hooks = [model.register_forward_pre_hook(lambda *a: self.go("call")),    # an older checkout's call
                      model.register_forward_hook(lambda *a: self.go("loop"))]
        hidden, logits = getattr(model, "hidden", None), getattr(model, "logits", None)

        def call(*args):                     # this checkout's step calls model.hidden, then model.logits
            self.go("call")
            return hidden(*args)

        def head(*args):
            out = logits(*args)
            self.go("loop")
            return out
        if hidden is not None:
            model.hidden, model.logits = call, head
        for layer in model.layers:
            self.hooks += [layer.register_forward_pre_hook(lambda *a: self.go("layer")),
                           layer.register_forward_hook(lambda *a: self.go("call"))]
        if guide is not None:
            self.hooks += [guide.register_forward_pre_hook(lambda *a: self.go("guide")),
                           guide.register_forward_hook(lambda *a: self.go("loop"))]
        self.layers = len(model.layers)

    def go(self, where):
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.bucket[self.where] += not func.is_view and func not in METADATA    # a view launches no kernel
        bool_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
        self.bucket["syncs"] += func.overloadpacket in SYNCS or bool_index
        return func(*args, **(kwargs or {}))

    def on_step(self, x, stats):
        self.steps.append((stats["fed"][-1], self.bucket))
        self.bucket = Counter()

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        self.model.__dict__.pop("hidden", None), self.model.__dict__.pop("logits", None)
        return super().__exit__(*exc)


def counted(model, prompt, guide=None, **kw):
    """Run generate() under the counter -> [(tokens fed, Counter)] per step. `.tolist()` reads a tensor without
    dispatching an op on the CPU (on a GPU it is a copy to the host): it is counted as a sync by hand."""
    real_tolist = torch.Tensor.tolist
    counter = StepCounter(model, guide)

    def tolist(t):
        counter.bucket["syncs"] += 1
        return real_tolist(t)
    torch.Tensor.tolist = tolist
    try:
        with counter:
            generate(model, prompt, on_step=counter.on_step, guide=guide, **kw)
    finally:
        torch.Tensor.tolist = real_tolist
    return counter.steps[1:], counter.layers        # the first step also holds the plan's setup: left out


def random_model(family: str, shape: str, dtype):
    """A random model of the family: the real widths with 2 layers (--shape real), or 2 small layers with the
    real models' special ids at a 4,096 vocabulary (the counts are the same)."""
    base = {"llada": "llada-8b", "dream": "dream-7b", "qwen2": "dream-7b", "lladamoe": "lladamoe-7b",
            "fastdllm_v2": "fastdllm-v2-7b", "llada2": "llada2-mini"}[family]
    s = dict(SHAPES[base], n_layers=2) if shape == "real" else dict(family=family, d_model=128, n_layers=2,
                                                                      n_heads=4,
                                                                      n_kv_heads=4 if "llada" in family else 2,
                                                                      ffn=256, vocab=4096)
    hf = hf_config("dream" if family == "qwen2" else family, s["d_model"], 2, s["vocab"], s["n_heads"],
                   s["n_kv_heads"], s["ffn"])
    if family == "qwen2":
        hf.update(model_type="qwen2", tie_word_embeddings=True)
    if family == "fastdllm_v2":            # the release's mask id is its tokenizer's: given here directly
        hf.update(mask_token_id=s["vocab"] - 399)
    cfg = ModelConfig.from_hf(hf)
    with torch.device("cpu"):
        model = Transformer(cfg)
    torch.manual_seed(0)
    for name, p in model.named_parameters():   # LLaDA2's expert bias N(0, 0.01^2), as tools/checkpoint.py draws
        # it: at std 1 the bias alone would choose the experts
        torch.nn.init.normal_(p, std=0.02 if p.ndim > 1 else 0.01 if name.endswith("expert_bias") else 1.0)
    return model.to(dtype).eval()


DEPTH = {"llada": 32, "dream": 28, "lladamoe": 16, "fastdllm_v2": 28}     # the released checkpoints' layers
MODES = {"none": dict(cache="none"), "prefix": dict(cache="prefix"), "dual": dict(cache="dual"),
         "free": dict(cache="free"), "guided": dict(cache="prefix", guide=True), "guided-free": dict(cache="free", guide=True)}


def counts(args):
    dtype = torch.bfloat16
    rows = []
    for family in args.families:
        model = random_model(family, args.shape, dtype)
        guide = random_model("qwen2", args.shape, dtype) if family == "dream" else None
        for name in args.modes:
            mode = dict(MODES[name])
            if model.config.family in ("fastdllm_v2", "sdar") and (name not in ("none", "prefix", "dual")):
                continue                  # block diffusion: its exact prefix cache, the sub-block cache, none
            if mode.pop("guide", False):
                if guide is None:
                    continue
                mode["guide"] = guide
            for rule in ("tau 0.9", "1/step") if "guide" not in mode else ("guided",):
                kw = dict(mode, gen_length=32, block_length=8, **(dict(sub_block=4) if model.config.family == "fastdllm_v2" else
                                                                   dict(steps=32)))
                if rule == "tau 0.9":
                    kw["threshold"] = 0.9
                for B in args.batch:
                    prompt = random_prompts(model.config, B, 16)
                    steps, n_layers = counted(model, prompt, **kw)
                    L = prompt.shape[1] + 32
                    cached = [c for fed, c in steps if fed < L] or [c for _, c in steps]
                    n = len(cached)
                    mean = lambda k: sum(c[k] for c in cached) / n           # noqa: E731
                    layer = mean("layer") / n_layers
                    rows.append(dict(family=family, mode=name, rule=rule, batch=B, steps=n,
                                     syncs=mean("syncs"), syncs_max=max(c["syncs"] for c in cached),
                                     loop=mean("loop"), call=mean("call"), layer=layer, guide=mean("guide"),
                                     at32=mean("loop") + mean("call") + 32 * layer + mean("guide"),
                                     at_depth=mean("loop") + mean("call") + DEPTH[family] * layer + mean("guide")))
                    print(row_text(rows[-1]), flush=True)
    return rows


def row_text(r) -> str:
    return (f"| {r['family']} | {r['mode']} | {r['rule']} | {r['batch']} | {r['syncs']:.2f} (max {r['syncs_max']}) | "
            f"{r['loop']:.0f} | {r['call']:.0f} | {r['layer']:.0f} | {r['guide']:.0f} | {r['at32']:.0f} | "
            f"{r['at_depth']:.0f} |")


MOE_FAMILIES = {"lladamoe": ("LLaDA-MoE", "lladamoe-7b"), "llada2": ("LLaDA2.x-mini", "llada2-mini")}


def weight_split(model):
    """A MoE model's bf16 weight bytes by what a call reads, the embedding aside (a call reads only its rows):
    -> dense layers (list of bytes), the MoE layers' non-expert bytes (attention, norms, router, expert bias, shared
    expert: list), bytes per expert, experts and top-k per MoE layer, the LM head with the final norm."""
    from model import MoE
    nbytes = lambda m: sum(p.numel() * 2 for p in m.parameters())           # noqa: E731
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    E = moes[0].w_gate.shape[0]
    per_expert = sum(getattr(moes[0], name).numel() for name in MoE.stacks) // E * 2
    dense = [nbytes(layer) for layer in model.layers if not isinstance(layer.mlp, MoE)]
    other = [nbytes(layer) - E * per_expert for layer in model.layers if isinstance(layer.mlp, MoE)]
    head = nbytes(model) - nbytes(model.embed) - sum(nbytes(layer) for layer in model.layers)
    return dense, other, per_expert, E, moes[0].top_k, head


def moe_weights(args):
    """LLaDA-MoE or LLaDA2.x-mini (--family): bytes of weights one decoding call reads, against the dense LLaDA-8B
    (bf16, the embedding aside: a call reads only its rows). Per token only its top-k experts are needed; a call's
    tokens together need the union of theirs (measured here on the random checkpoint's routing, the ids each MoE
    block's own `route` returns, cached calls of the given mode); our MoE block reads every expert once when the
    call routes at least as many (token, expert) pairs as there are experts. A checkpoint of a few layers at the
    real widths is scaled to the real depth: its dense layers (LLaDA2's first_k_dense_replace) stay as many, each
    MoE layer is the measured MoE layers' mean. llada2 adds LLaDA2.x-flash's totals, built on the meta device."""
    from model import MoE
    label, real = MOE_FAMILIES[args.family]
    dtype = getattr(torch, args.dtype)
    model = (load_model(args.model, device="cpu", dtype=dtype) if args.model else
             random_model(args.family, args.shape, dtype))
    moe = model.config.moe
    held = None if moe is None else "llada2" if moe.router == "sigmoid" else "lladamoe"
    if held != args.family:
        print(f"error: --model {args.model} holds {f'a {held}' if held else 'no MoE'} checkpoint, not --family "
              f"{args.family}: pass the matching --family", file=sys.stderr)
        sys.exit(2)
    dense, other, per_expert, E, k, head = weight_split(model)
    n_dense, depth = len(dense), SHAPES[real]["n_layers"]
    dense_bytes, other = sum(dense), sum(other) / len(other)        # the dense layers once, the mean MoE layer

    def at_depth(experts):        # bytes of a call that reads `experts` experts in each MoE layer
        return dense_bytes + (depth - n_dense) * (other + experts * per_expert) + head
    seen, steps = [], []

    def recording(route):          # the block's own router: its ids are the experts the call uses
        def routed(x):
            weights, ids = route(x)
            seen.append((x.shape[0], ids.unique().numel()))
            return weights, ids
        return routed
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.route = recording(m.route)
    prompt = random_prompts(model.config, args.batch[0], 64)
    mode = dict(MODES[args.modes[0]], gen_length=args.gen_length, block_length=32, threshold=0.9)
    try:
        with torch.inference_mode():
            generate(model, prompt, on_step=lambda x, st: (steps.append((st["fed"][-1], list(seen))), seen.clear()),
                     **mode)
    finally:
        for m in moes:
            del m.route
    L = prompt.shape[1] + args.gen_length
    cached = [layers for fed, layers in steps[1:] if fed < args.batch[0] * L]
    if not cached:
        print(f"error: the decode made no cached call after its first ({len(steps)} calls): pass a longer "
              f"--gen-length", file=sys.stderr)
        sys.exit(2)
    by_fed = Counter(layers[0][0] for layers in cached)
    N = by_fed.most_common(1)[0][0]           # the tokens most cached calls feed
    mean_union = lambda n: (sum(u for layers in cached if layers[0][0] == n for _, u in layers) /   # noqa: E731
                            sum(len(layers) for layers in cached if layers[0][0] == n))
    union = mean_union(N)
    with torch.device("meta"):
        dense8b = Transformer(ModelConfig.from_hf(hf_config("llada", **{key: v for key, v in SHAPES["llada-8b"].items()
                                                                          if key != "family"})))
    uniform = E * (1 - (1 - k / E) ** N)      # if each token's k experts were drawn uniformly at random
    rows = [("LLaDA-8B (dense): every weight", sum(p.numel() * 2 for n, p in dense8b.named_parameters()
                                                    if not n.startswith("embed"))),
            (f"{label}: every expert (our block, {E} per layer)", at_depth(E)),
            (f"{label}: the union of the step's routed experts ({union:.1f} of {E} per layer, measured)",
             at_depth(union)),
            (f"{label}: the same if routing were uniform ({uniform:.1f} of {E})", at_depth(uniform)),
            (f"{label}: one token's {k} experts per layer", at_depth(k))]
    if args.family == "llada2":    # LLaDA2.x-flash at its real size: no weights needed to count its bytes
        s = SHAPES["llada2-flash"]
        with torch.device("meta"):
            flash = Transformer(ModelConfig.from_hf(hf_config("llada2", s["d_model"], s["n_layers"], s["vocab"],
                                                              s["n_heads"], s["n_kv_heads"], s["ffn"])))
        f_dense, f_other, f_per, f_E, f_k, f_head = weight_split(flash)     # every layer real: nothing scaled
        reads = lambda experts: sum(f_dense) + sum(f_other) + len(f_other) * experts * f_per + f_head   # noqa: E731
        rows += [(f"LLaDA2.x-flash: every expert (our block, {f_E} per layer; union not measured)", reads(f_E)),
                 (f"LLaDA2.x-flash: one token's {f_k} experts per layer", reads(f_k))]
    fed = ", ".join(f"{c} of {n} tokens (union {mean_union(n):.1f})" for n, c in sorted(by_fed.items()))
    if args.family == "lladamoe":
        print(f"{len(cached)} cached steps ({args.modes[0]}, batch {args.batch[0]}, {N} tokens fed per step), "
              f"{depth} layers, bf16, embedding aside")
    else:
        print(f"{len(cached)} cached calls ({args.modes[0]}, batch {args.batch[0]}, gen {args.gen_length}; {fed}), "
              f"{depth} layers ({n_dense} dense), {args.dtype} run, bf16 bytes, embedding aside")
    print("| weights read per step | GB |\n|---|---|")
    for name, b in rows:
        print(f"| {name} | {b / 1e9:.2f} |")
    return dict(rows=rows, union=union, fed=dict(by_fed), E=E, k=k, per_expert=per_expert, dense=dense_bytes,
                other=other, head=head)


def wall(args):
    """CPU seconds (best of --repeat, process time) of generate() eager and compile=True, one mode at a time,
    the compiled one after a warm-up call that compiles its graphs; the ids of both must be equal."""
    from fastdllm import Compiled
    torch.set_num_threads(1)
    model = load_model(args.model, device="cpu", dtype=torch.float32)
    prompt = random_prompts(model.config, args.batch[0], 64)
    args.modes = [m for m in args.modes if "guided" not in m]       # the guide is not compiled: nothing to compare
    print("| mode | NFE | eager CPU s | compiled CPU s | compiled / eager | same ids |\n|---|---|---|---|---|---|")
    for name in args.modes:
        for rule in ({"threshold": 0.9}, {}):
            kw = dict(MODES[name], gen_length=64, block_length=32, steps=64, **rule)
            times = {}
            compiled = Compiled()
            for label, c in (("eager", False), ("compiled", compiled)):
                generate(model, prompt, compile=c, **kw)                 # warm-up (compiles the graphs)
                best = float("inf")
                for _ in range(args.repeat):
                    t0 = time.process_time()
                    out, st = generate(model, prompt, compile=c, **kw)
                    best = min(best, time.process_time() - t0)
                times[label] = best, out
            (e, a), (c, b) = times["eager"], times["compiled"]
            print(f"| {name} {'tau 0.9' if rule else '1/step'} | {st['nfe']} | {e:.3f} | {c:.3f} | {c / e:.2f} | "
                  f"{torch.equal(a, b)} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="tools/step_count.py", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("counts", "wall", "moe"))
    p.add_argument("--families", type=lambda t: t.split(","), default=["llada", "dream"])
    p.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES))
    p.add_argument("--batch", type=lambda t: [int(b) for b in t.split(",")], default=[1, 16])
    p.add_argument("--shape", choices=("small", "real"), default="small")
    p.add_argument("--model", help="wall, moe: a checkpoint folder (tools/checkpoint.py)")
    p.add_argument("--family", choices=tuple(MOE_FAMILIES), default="lladamoe", help="moe: the family counted")
    p.add_argument("--gen-length", type=int, default=128, help="moe: the answer's tokens")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="moe: the decode's dtype "
                   "(the bytes are counted at bf16 either way; a CPU multiplies float32 faster)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--root", default=ROOT, help="the checkout whose generate() is counted (before/after)")
    args = p.parse_args(argv)
    if args.what == "counts":
        print("| family | mode | rule | batch | host syncs / cached step | loop ops | call ops | ops / layer | "
              "guide ops | ops / step at 32 layers | at the real depth |\n" + "|---" * 11 + "|")
        counts(args)
    elif args.what == "moe":
        return moe_weights(args)
    else:
        wall(args)


if __name__ == "__main__":
    main()
