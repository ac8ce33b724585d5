"""
tools/step_count.py: what a GPU would feel of one decoding step, counted on the CPU, where counts are exact and
times are noise. A TorchDispatchMode sees every aten op generate() dispatches: each is one kernel launch on a
GPU, and some make the host wait for the device (a value read back: `.item()`, `bool(t)`, `.tolist()`,
`nonzero`, boolean indexing, ...). Reported per step, split into the loop's own ops (sampling, selection,
commit, stop, the one read), the model call's ops outside its layers, and the ops of one layer, then scaled to
32 layers (LLaDA-8B; Dream-7B has 28, LLaDA-MoE 16: the last column is at the real depth). Then CPU seconds of
generate() eager against compile=True on one checkpoint, side by side, with the ids of both. `moe`: the bytes of
weights a LLaDA-MoE step reads, against the dense LLaDA-8B.

    python tools/step_count.py counts                          # every mode, both families, batch 1 and 16
    python tools/step_count.py counts --shape real --batch 1 --modes dual   # the same at LLaDA-8B/Dream-7B widths
    python tools/step_count.py counts --families llada,lladamoe --shape real --batch 1 --modes dual
    python tools/step_count.py moe --shape real --batch 1 --modes dual     # LLaDA-MoE: weight bytes per step
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

from tools.checkpoint import SHAPES, hf_config, random_prompts  # noqa: E402
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
            "fastdllm_v2": "fastdllm-v2-7b"}[family]
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
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02 if p.ndim > 1 else 1.0)
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


def moe_weights(args):
    """LLaDA-MoE: bytes of weights one decoding step reads, against the dense LLaDA-8B (bf16, the embedding aside:
    a step reads only its rows). Per token only its top-k experts are needed; a step's tokens together need the
    union of theirs (measured here on the random checkpoint's routing, cached steps of the given mode); our MoE
    block reads every expert once when the step routes more (token, expert) pairs than there are experts."""
    from model import MoE
    model = (load_model(args.model, device="cpu", dtype=torch.bfloat16) if args.model else
             random_model("lladamoe", args.shape, torch.bfloat16))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    E, F_, D = moes[0].w_gate.shape
    k, per_expert = moes[0].top_k, 3 * F_ * D * 2
    depth = SHAPES["lladamoe-7b"]["n_layers"]
    nbytes = lambda m: sum(p.numel() * 2 for n, p in m.named_parameters() if not n.startswith("embed"))  # noqa: E731
    experts = sum(3 * p.numel() * 2 for m in moes for p in [m.w_gate])
    other = (nbytes(model) - experts - model.lm_head.weight.numel() * 2) / len(moes)     # one layer's non-experts
    head = model.lm_head.weight.numel() * 2
    seen, steps = [], []

    def route(module, inputs):
        x = inputs[0].reshape(-1, D)
        ids = torch.softmax(module.router(x).float(), -1).topk(k, -1).indices
        seen.append((x.shape[0], ids.unique().numel()))
    hooks = [m.register_forward_pre_hook(route) for m in moes]
    prompt = random_prompts(model.config, args.batch[0], 64)
    mode = dict(MODES[args.modes[0]], gen_length=128, block_length=32, threshold=0.9)
    with torch.inference_mode():
        generate(model, prompt, on_step=lambda x, st: (steps.append((st["fed"][-1], list(seen))), seen.clear()), **mode)
    for h in hooks:
        h.remove()
    L = prompt.shape[1] + 128
    cached = [layers for fed, layers in steps[1:] if fed < args.batch[0] * L]
    union = sum(u for layers in cached for _, u in layers) / sum(len(layers) for layers in cached)
    with torch.device("meta"):
        dense = Transformer(ModelConfig.from_hf(hf_config("llada", **{key: v for key, v in SHAPES["llada-8b"].items()
                                                                          if key != "family"})))
    N = cached[0][0][0] if cached else 0
    uniform = E * (1 - (1 - k / E) ** N)      # if each token's k experts were drawn uniformly at random
    rows = [("LLaDA-8B (dense): every weight", nbytes(dense)),
            (f"LLaDA-MoE: every expert (our block, {E} per layer)", depth * (other + E * per_expert) + head),
            (f"LLaDA-MoE: the union of the step's routed experts ({union:.1f} of {E} per layer, measured)",
             depth * (other + union * per_expert) + head),
            (f"LLaDA-MoE: the same if routing were uniform ({uniform:.1f} of {E})",
             depth * (other + uniform * per_expert) + head),
            (f"LLaDA-MoE: one token's {k} experts per layer", depth * (other + k * per_expert) + head)]
    print(f"{len(cached)} cached steps ({args.modes[0]}, batch {args.batch[0]}, {N} tokens fed per step), "
          f"{depth} layers, bf16, embedding aside")
    print("| weights read per step | GB |\n|---|---|")
    for name, b in rows:
        print(f"| {name} | {b / 1e9:.2f} |")


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
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--root", default=ROOT, help="the checkout whose generate() is counted (before/after)")
    args = p.parse_args(argv)
    if args.what == "counts":
        print("| family | mode | rule | batch | host syncs / cached step | loop ops | call ops | ops / layer | "
              "guide ops | ops / step at 32 layers | at the real depth |\n" + "|---" * 11 + "|")
        counts(args)
    elif args.what == "moe":
        moe_weights(args)
    else:
        wall(args)


if __name__ == "__main__":
    main()
