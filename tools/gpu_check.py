"""
tools/gpu_check.py: the prepared GPU check of the fixed-shape decoding step, one command, under 8 minutes on one
H200. Every phase is time-boxed (skipped, and said so, when the budget left is too small) and prints as it goes;
the JSON is rewritten after every phase, so a run cut short keeps what it measured. --phases and --variants
pick what runs; --budget 0 runs every picked phase whatever the time (the CPU test: it checks the script, so
what runs must not depend on the machine's speed).

    python tools/gpu_check.py --out gpu.json                                # LLaDA-8B shape, bf16, CUDA
    python tools/gpu_check.py --shape tiny --device cpu --out /tmp/g.json   # the whole path on a CPU
    python tools/gpu_check.py --shape tiny --device cpu --budget 0 --variants eager --out /tmp/g.json   # tested

1. build: LLaDA-8B's shape (32 layers, d 4096, vocab 126,464) with random weights made on the device: no
   checkpoint, no download, the weights never exist twice.
2. speed: the uncached baseline (cache none, one token a step) and DualCache + threshold 0.9, eager, then
   compile=True (its warm-up, which compiles, reported apart): tokens/s, ms per step by step type (refresh,
   cached), GPU busy time (the profiler's kernel time) against wall time, bytes moved per step (weights + KV
   cache + activations) and their share of the device's HBM bandwidth, read from the device's properties.
3. batch: 16 rows decoded together against each row alone, eager and compiled (bf16 kernels may differ with
   the batch size: the share of equal rows is the finding).
4. golden: the official golden runs (tests/golden) on this device, float32 (must be exact) and bf16 (agreement),
   LLaDA-MoE's included (its deterministic runs; --golden-runs N: the first N of each family).
5. moe: the speed rows again on LLaDA-MoE-7B-A1B's shape (16 layers, 64 experts of width 1024, top-8;
   random weights made on the device), in "moe_speed": its bytes per step are every weight but the embedding, as
   our MoE block reads every expert once when a step routes more (token, expert) pairs than there are experts.
6. int8: the model of 1. to weight-only int8 in place (quant.py, torchao), then its weight bytes against bf16's,
   the logits' largest difference from bf16 on one canvas, the DualCache + threshold ids' agreement with bf16's,
   the peak memory, and the speed rows again ("int8_speed"); skipped, and said so, without torchao.
"""
import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from cli import pick_device_dtype  # noqa: E402
from fastdllm import Compiled, generate  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from quant import nbytes, quantize_int8, weight_bytes  # noqa: E402
from tools.checkpoint import SHAPES, hf_config, lladamoe_config, random_prompts  # noqa: E402
from tools.flags import Parser, integer, listing, out_file  # noqa: E402

MODES = {"baseline": dict(cache="none"), "dual 0.9": dict(cache="dual", threshold=0.9)}
PHASES, VARIANTS = ("speed", "batch", "golden", "moe", "int8"), ("eager", "compiled")


def budget(text: str) -> float:
    """Seconds for the whole run, a finite number >= 0; 0: no time box."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0: no time box), got {text!r}")
    return value


def hbm_bandwidth(device) -> tuple[float, str]:
    """Peak memory bandwidth in bytes/s from the device's own properties: 2 (DDR) x memory clock x bus width,
    from torch's properties where it has them, else the CUDA driver's attributes (36, 37). (0, why) elsewhere."""
    if device.type != "cuda":
        return 0.0, "not a CUDA device"
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    source = "torch device properties"
    if not clock_khz or not bus_bits:
        try:
            cuda, value = ctypes.CDLL("libcuda.so.1"), ctypes.c_int()
            cuda.cuInit(0)
            attrs = []
            for attr in (36, 37):    # CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE (kHz), _GLOBAL_MEMORY_BUS_WIDTH (bits)
                cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, device.index or 0)
                attrs.append(value.value)
            (clock_khz, bus_bits), source = attrs, "CUDA driver attributes"
        except OSError as e:
            return 0.0, f"unknown ({e})"
    return 2 * clock_khz * 1e3 * bus_bits / 8, f"{source}: {clock_khz / 1e3:.0f} MHz x {bus_bits} bits x 2"


def build(shape: str, device, dtype, moe: bool = False):
    """A random model of the real shape, made on the device in `dtype` (meta first: nothing is allocated twice).
    moe: LLaDA-MoE-7B-A1B's shape (tiny: 2 layers of width 64, 8 experts of width 32, top-2)."""
    if moe:
        s = SHAPES["lladamoe-7b"] if shape == "8b" else dict(d_model=64, n_layers=2, vocab=1024, n_heads=4,
                                                            n_kv_heads=4, ffn=128, experts=8, top_k=2, expert_ffn=32)
        hf = lladamoe_config(s["d_model"], s["n_layers"], s["vocab"], s["n_heads"], s["n_kv_heads"], s["ffn"],
                             s["experts"], s["top_k"], s["expert_ffn"])
    else:
        s = SHAPES["llada-8b" if shape == "8b" else "llada-tiny"]
        hf = hf_config("llada", s["d_model"], s["n_layers"], s["vocab"], s["n_heads"], s["n_kv_heads"], s["ffn"])
    cfg = ModelConfig.from_hf(hf)
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen) if p.ndim > 1 else p.fill_(1.0)
    return model.eval()


def step_bytes(model, B: int, fed: int, L: int, cols: int) -> int:
    """Bytes one model call moves: every weight but the embedding (a step reads only its rows), the whole KV
    cache read and the fed span written, and the activations in and out of every matmul (2 bytes each in bf16)."""
    c, e = model.config, model.lm_head.weight.element_size()
    weights = sum(nbytes(p) for n, p in [*model.named_parameters(), *model.named_buffers()] if n[:5] != "embed")
    kv = 2 * c.n_layers * B * c.n_kv_heads * c.head_dim * (L + fed) * e
    width = c.moe.n_experts * c.moe.ffn_dim if c.moe else c.ffn_dim     # the MoE block: one SwiGLU over every expert
    per_layer = fed * (2 * c.dim + 2 * c.n_kv_heads * c.head_dim + 2 * c.dim + 3 * width) * e
    return weights + kv + B * c.n_layers * per_layer + B * cols * c.vocab_size * e


def timed(model, prompt, kw, compile_=False):
    """One generate() with a timestamp after every step (the loop's one host read has waited for the device, so
    consecutive timestamps are per-step latency) -> (ids, stats, [(fed, seconds)])."""
    sync = (lambda: torch.cuda.synchronize(prompt.device)) if prompt.is_cuda else (lambda: None)
    marks = []
    sync()
    t0 = time.perf_counter()
    out, st = generate(model, prompt, compile=compile_, on_step=lambda x, s: marks.append((s["fed"][-1], time.perf_counter())),
                       **kw)
    sync()
    steps = [(fed, t - prev) for (fed, t), prev in zip(marks, [t0] + [t for _, t in marks[:-1]])]
    return out, st, steps


def busy(model, prompt, kw, compile_) -> dict:
    """GPU kernel time against wall time for one generate(), from torch.profiler. The timed call's settings: a shorter
    canvas would compile new graphs inside the profile (an H200 run showed busy 0.003 that way)."""
    if not prompt.is_cuda:
        return {}
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(model, prompt, compile=compile_, **kw)
        torch.cuda.synchronize(prompt.device)
    wall = time.perf_counter() - t0
    kernels = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    return dict(profiled_wall_s=wall, kernel_s=kernels, busy=kernels / wall)


def speed(model, prompt, args, bandwidth, compiled, out, left, key="speed"):
    kw = dict(gen_length=args.gen_length, block_length=args.block_length)
    rows = []
    for variant, c in (("eager", False), ("compiled", compiled)):
        for name, mode in MODES.items() if variant in args.variants else ():
            if left() < (150 if c else 30):
                print(f"{key} {variant} {name}: skipped, {left():.0f} s left", flush=True)
                continue
            warm = time.perf_counter()
            if c:
                generate(model, prompt, compile=c, **kw, **mode)              # compiles its graphs: not timed
            warm = time.perf_counter() - warm
            ids, st, steps = timed(model, prompt, dict(kw, **mode), c)
            B, L, N = prompt.shape[0], prompt.shape[1] + args.gen_length, args.block_length
            by = {}
            for fed, s in steps:
                by.setdefault("refresh" if fed == L else "cached", []).append((fed, s))
            row = dict(variant=variant, mode=name, batch=B, nfe=st["nfe"], seconds=sum(s for _, s in steps),
                       compile_s=warm if c else None, tokens_per_s=B * args.gen_length / sum(s for _, s in steps))
            for kind, xs in by.items():
                ms = 1e3 * sum(s for _, s in xs) / len(xs)
                nbytes = sum(step_bytes(model, B, fed, L, N if c else min(N, fed)) for fed, _ in xs) / len(xs)
                row[kind] = dict(steps=len(xs), ms=ms, bytes=nbytes,
                                 hbm=nbytes / (ms / 1e3) / bandwidth if bandwidth else None)
            row.update(busy(model, prompt, dict(kw, **mode), c))   # the timed call's shapes: no graph compiled
            rows.append(row)
            out[key] = rows
            write(args.out, out)
            print(f"{key} {json.dumps(row)}", flush=True)
    return rows


def batch(model, prompts, args, compiled, out, left):
    kw = dict(gen_length=args.gen_length, block_length=args.block_length, **MODES["dual 0.9"])
    res = {}
    for variant, c in (("eager", False), ("compiled", compiled)):
        if variant not in args.variants:
            continue
        if left() < (200 if c else 60):
            print(f"batch {variant}: skipped, {left():.0f} s left", flush=True)
            continue
        together, _ = generate(model, prompts, compile=c, **kw)
        same = [torch.equal(together[i], generate(model, prompts[i:i + 1], compile=c, **kw)[0][0])
                for i in range(prompts.shape[0])]
        res[variant] = dict(rows=len(same), equal=sum(same))
        out["batch"] = res
        write(args.out, out)
        print(f"batch {variant}: {sum(same)} of {len(same)} rows equal their solo run", flush=True)
    return res


GOLDEN_CHILD = """
import json, sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
import test_golden as G
from fastdllm import generate
from model import load_model
dev, dtype = torch.device({device!r}), getattr(torch, {dtype!r})
prompts = json.load(open(f"{{G.GOLDEN}}/llada-golden.json"))["prompts"]
runs = []
for family, name, prompt, kw, want, nfe in (
        [("llada", r["fn"], prompts[r["batch"]], G.llada_call(r), r["output"], r["nfe"]) for r in G.LLADA_RUNS[:{limit}]] +
        [("dream", r["name"], r["input_ids"], G.dream_call(r), r["sequences"], r["nfe"]) for r in G.DREAM_RUNS[:{limit}]]):
    model = load_model(f"{{G.GOLDEN}}/{{family}}-tiny", device=dev, dtype=dtype)
    out, st = generate(model, torch.tensor(prompt, device=dev), **kw)
    want_t = torch.tensor(want, device=dev)
    runs.append(dict(name=name, exact=bool(torch.equal(out, want_t)) and st["nfe"] == nfe,
                     agreement=(out == want_t).float().mean().item()))
import test_moe as M
moe = load_model(f"{{G.GOLDEN}}/lladamoe-tiny", device=dev, dtype=dtype)
for r in M.DETERMINISTIC[:{limit}]:
    if "rng" in r["flags"]:
        continue                 # the official draws came from the CPU's generator
    out, st = M.official_call(moe, r)
    want_t = torch.tensor(r["output"], device=dev)
    runs.append(dict(name="lladamoe " + r["name"], exact=bool(torch.equal(out, want_t)) and st["nfe"] == r["nfe"],
                     agreement=(out == want_t).float().mean().item()))
print(json.dumps(runs))
"""


def golden(device, dtype: str, timeout: float, limit: int | None = None) -> dict:
    code = GOLDEN_CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), device=str(device), dtype=dtype,
                               limit=limit)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return dict(error=f"out of time ({timeout:.0f} s)")
    if r.returncode:
        return dict(error=(r.stderr.strip().splitlines() or ["failed"])[-1])
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    return dict(exact=sum(x["exact"] for x in runs), total=len(runs),
                agreement=sum(x["agreement"] for x in runs) / len(runs))


def int8(model, prompt, args, bandwidth, out, left):
    """The int8 phase (the docstring's 6.) on the model of 1., which it quantizes in place."""
    kw = dict(gen_length=args.gen_length, block_length=args.block_length, **MODES["dual 0.9"])
    x = torch.nn.functional.pad(prompt, (0, args.gen_length), value=model.config.mask_id)
    sync = (lambda: torch.cuda.synchronize(prompt.device)) if prompt.is_cuda else (lambda: None)
    before, ref, (ids, _) = weight_bytes(model), model(x).float(), generate(model, prompt, **kw)
    t0 = time.perf_counter()
    try:
        quantize_int8(model)
    except ValueError as e:      # no torchao here: said, and the other phases still run
        out["int8"] = dict(error=str(e))
        return print(f"int8: skipped, {e}", flush=True)
    sync()
    res = dict(quantize_s=time.perf_counter() - t0, bytes_before=before, bytes_int8=weight_bytes(model),
               max_logit=ref.abs().max().item(), max_logit_diff=(model(x).float() - ref).abs().max().item(),
               ids_agreement=(generate(model, prompt, **kw)[0] == ids).float().mean().item())
    if prompt.is_cuda:
        res["peak_gib"] = torch.cuda.max_memory_allocated(prompt.device) / 2 ** 30
    out["int8"] = res
    write(args.out, out)
    print(f"int8 {json.dumps(res)}", flush=True)
    speed(model, prompt, args, bandwidth, Compiled(), out, left, key="int8_speed")


def write(path, out):
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def main(argv=None):
    p = Parser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=out_file, help="JSON results, rewritten after every phase")
    p.add_argument("--shape", choices=("8b", "tiny"), default="8b", help="8b: LLaDA-8B's; tiny: the CPU test")
    p.add_argument("--device", default=None)
    p.add_argument("--budget", type=budget, default=480, help="seconds for the whole run, 0: no time box "
                   "(default: %(default)s)")
    p.add_argument("--phases", type=listing(PHASES, empty=False), default=",".join(PHASES),
                   help="which phases run, comma-separated (default: %(default)s)")
    p.add_argument("--variants", type=listing(VARIANTS, empty=False), default=",".join(VARIANTS),
                   help="speed and batch: eager, compiled or both (default: %(default)s)")
    p.add_argument("--prompt-length", type=integer(1), default=64)
    p.add_argument("--gen-length", type=integer(1), default=128)
    p.add_argument("--block-length", type=integer(1), default=32)
    p.add_argument("--batch", type=integer(1), default=16)
    p.add_argument("--golden-runs", type=integer(1), default=None, help="golden: the first N runs of each family "
                   "(default: all; the CPU test's quick path)")
    args = p.parse_args(argv)
    if args.gen_length % args.block_length:
        raise ValueError("--block-length must divide --gen-length")
    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start) if args.budget else math.inf     # noqa: E731
    device, dtype = pick_device_dtype(args.device, None)
    if args.shape == "8b" and device.type != "cuda":
        raise ValueError("--shape 8b makes a 16 GB model, for a GPU: pass --device cuda on a CUDA machine, or "
                         "--shape tiny to run the whole path here")
    bandwidth, source = hbm_bandwidth(device)
    out = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", dtype=str(dtype),
               torch=torch.__version__, hbm_bytes_per_s=bandwidth, hbm_source=source, settings=vars(args))
    print(f"{out['device']}, {dtype}, HBM {bandwidth / 1e12:.2f} TB/s ({source})", flush=True)
    t0 = time.perf_counter()
    model = build(args.shape, device, dtype)
    out["build_s"] = time.perf_counter() - t0
    print(f"build: {out['build_s']:.1f} s, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    prompts = random_prompts(model.config, args.batch, args.prompt_length).to(device)
    compiled = Compiled()
    with torch.inference_mode():
        if "speed" in args.phases:
            speed(model, prompts[:1], args, bandwidth, compiled, out, left)
        if "batch" in args.phases:
            batch(model, prompts, args, compiled, out, left)
        if "int8" in args.phases and left() < 60:
            print(f"int8: skipped, {left():.0f} s left", flush=True)
        elif "int8" in args.phases:      # the model's last use: it ends quantized
            int8(model, prompts[:1], args, bandwidth, out, left)
    del model
    for dt in ("float32", "bfloat16") if "golden" in args.phases else ():
        if left() < 30:
            out.setdefault("golden", {})[dt] = dict(error=f"skipped, {left():.0f} s left")
        else:     # no time box: still bounded, by what the golden runs take on a slow CPU many times over
            out.setdefault("golden", {})[dt] = golden(device, dt, min(left() - 10, 1800), args.golden_runs)
        print(f"golden {dt}: {out['golden'][dt]}", flush=True)
    if "moe" in args.phases and left() < 60:
        print(f"moe: skipped, {left():.0f} s left", flush=True)
    elif "moe" in args.phases:
        t0 = time.perf_counter()
        moe = build(args.shape, device, dtype, moe=True)
        out["moe_build_s"] = time.perf_counter() - t0
        print(f"moe build: {out['moe_build_s']:.1f} s, {sum(p.numel() for p in moe.parameters()) / 1e9:.2f} B "
              f"parameters", flush=True)
        with torch.inference_mode():
            speed(moe, random_prompts(moe.config, 1, args.prompt_length).to(device), args, bandwidth, Compiled(), out,
                  left, key="moe_speed")
        del moe
    out["total_s"] = time.perf_counter() - start
    write(args.out, out)
    print(f"done in {out['total_s']:.0f} s: {args.out}")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
