"""
tools/gpu_check.py: the prepared GPU check of the fixed-shape decoding step, one command, under 8 minutes on one
H100 or H200. Every phase is time-boxed (skipped, and said so, when the budget left is too small) and prints as it
goes; the JSON is rewritten after every phase, so a run cut short keeps what it measured. --phases and --variants
pick what runs (the phases run in the order below); --budget 0 runs every picked phase whatever the time (the CPU
test: it checks the script, so what runs must not depend on the machine's speed).

    python tools/gpu_prep.py --official DIR        # where a package index is reachable: .official/ and .whl/
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl        # then on the GPU machine
    python3 tools/gpu_check.py --out gpu.json --official-site /tmp/site --phases speed,official,profile,launches,graphs_ids,golden
    python tools/gpu_check.py --shape tiny --device cpu --out /tmp/g.json   # the whole path on a CPU

1. build: LLaDA-8B's shape (32 layers, d 4096, vocab 126,464) with random weights made on the device, each
   checkpoint tensor from a generator seeded by its name (tools/side_by_side.py fill): no checkpoint, no download.
2. speed: the uncached baseline (cache none, one token a step) and DualCache + threshold 0.9, for each variant:
   eager (cuda_graphs=False), graphs (the default on CUDA: each feed width replayed from a CUDA graph) and compiled
   (compile=True); the first call of graphs and compiled warms up (captures, compiles) and is reported apart
   (warm_s; capture_s the captures alone): tokens/s, ms per step by step type (refresh, cached), GPU busy time (the
   profiler's kernel time) against wall time and kernels per call, bytes moved per step (weights + KV cache +
   activations) and their share of the device's HBM bandwidth, read from the device's properties; the ids against
   eager's (same_ids_as_eager).
3. official: ours against NVlabs/Fast-dLLM's LLaDA generate, generate_with_prefix_cache, generate_with_dual_cache
   (tools/side_by_side.py; the code and wheels tools/gpu_prep.py carries, installed at --official-site) on the same
   weights, batch 1 and --batch, one token a step and threshold 0.9: ms per call, tokens/s, ours / official ("rows");
   ours is the default path (CUDA graphs), eager too at batch 1 with --official-eager. Compiled's speed rows run after
   it (their warm-up compiles for a minute).
4. profile: the kernels of one cached DualCache call (a block of 32 fed against the KV cache, the LM head on its
   columns) per variant, from torch.profiler over --profile-calls calls: each kernel's launches and time per call,
   the GEMMs (the kernels that read the weights) against the rest, and the call's bytes against its time: the share of
   the HBM roofline ("profile"; --trace DIR also writes each variant's Chrome trace there).
5. launches: aten ops that launch a kernel per call, ours against a minimal LLaMA-style forward (tools/launches.py).
6. graphs_ids: in float32 on the device, CUDA graphs against eager, every family's golden tiny checkpoint (Fast-dLLM
   v2: a random one), every cache, one token a step and threshold 0.9, one row and a padded pair; and LLaDA-8B's
   width at 2 layers: the ids and calls must be equal.
7. batch: 16 rows decoded together against each row alone, per variant (bf16 kernels may differ with the batch
   size: the share of equal rows is the finding).
8. int8: the model of 1. to weight-only int8 in place (quant.py, torchao), then its weight bytes against bf16's,
   the logits' largest difference from bf16 on one canvas, the DualCache + threshold ids' agreement with bf16's,
   the peak memory, and the speed rows again ("int8_speed"); skipped, and said so, without torchao.
9. golden: the official golden runs (tests/golden) on this device with generate()'s defaults (on CUDA: CUDA graphs),
   float32 (must be exact) and bf16 (agreement), LLaDA-MoE's included (its deterministic runs; --golden-runs N: the
   first N of each family).
10. moe: the speed rows again on LLaDA-MoE-7B-A1B's shape (16 layers, 64 experts of width 1024, top-8;
   random weights made on the device), in "moe_speed": its bytes per step are every weight but the embedding, as
   our MoE block reads every expert once when a step routes more (token, expert) pairs than there are experts.
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

from cache import DualCache, KVCache  # noqa: E402
from cli import pick_device_dtype  # noqa: E402
from fastdllm import Compiled, CudaGraphs, generate  # noqa: E402
from model import ModelConfig, Transformer, load_model  # noqa: E402
from quant import nbytes, quantize_int8, weight_bytes  # noqa: E402
from tools import launches, side_by_side  # noqa: E402
from shapes import SHAPES, hf_config, lladamoe_config, random_prompts  # noqa: E402
from flags import Parser, integer, listing, out_file  # noqa: E402

MODES = {"baseline": dict(cache="none"), "dual 0.9": dict(cache="dual", threshold=0.9)}
PHASES = ("speed", "official", "profile", "launches", "graphs_ids", "batch", "int8", "golden", "moe")
VARIANTS = ("eager", "graphs", "compiled")
WARM = {"eager": 30, "graphs": 40, "compiled": 150}     # seconds a variant's row needs at least (compiling: most)
# Kernels that read the weights: cuBLAS's and CUTLASS's GEMMs (their names), inductor's generated matmuls.
GEMM = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "matmul", "mm_", "triton_tem", "aten::mm", "aten::addmm")


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


def hf_shape(shape: str, moe: bool = False) -> dict:
    """config.json of the model a run builds: LLaDA-8B's (tiny: 2 layers of width 64), or LLaDA-MoE-7B-A1B's (tiny: 2
    layers of width 64, 8 experts of width 32, top-2)."""
    if moe:
        s = SHAPES["lladamoe-7b"] if shape == "8b" else dict(d_model=64, n_layers=2, vocab=1024, n_heads=4,
                                                            n_kv_heads=4, ffn=128, experts=8, top_k=2, expert_ffn=32)
        return lladamoe_config(s["d_model"], s["n_layers"], s["vocab"], s["n_heads"], s["n_kv_heads"], s["ffn"],
                               s["experts"], s["top_k"], s["expert_ffn"])
    s = SHAPES["llada-8b" if shape == "8b" else "llada-tiny"]
    return hf_config("llada", s["d_model"], s["n_layers"], s["vocab"], s["n_heads"], s["n_kv_heads"], s["ffn"])


def build(hf: dict, device, dtype):
    """A random model of the config, made on the device in `dtype` (meta first: nothing is allocated twice), every
    checkpoint tensor drawn from a generator seeded by its name, as the official side draws its own."""
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(hf)).to(dtype)
    model.to_empty(device=device)
    side_by_side.fill(model)
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


def runner(variant: str, graphs: CudaGraphs, compiled: Compiled) -> dict:
    """generate()'s settings of a variant: eager, the default path's CUDA graphs (one instance for the run), compiled."""
    return dict(eager=dict(cuda_graphs=False), graphs=dict(cuda_graphs=graphs), compiled=dict(compile=compiled))[variant]


def timed(model, prompt, kw):
    """One generate() with a timestamp after every step (the loop's one host read has waited for the device, so
    consecutive timestamps are per-step latency) -> (ids, stats, [(fed, seconds)])."""
    sync = (lambda: torch.cuda.synchronize(prompt.device)) if prompt.is_cuda else (lambda: None)
    marks = []
    sync()
    t0 = time.perf_counter()
    out, st = generate(model, prompt, on_step=lambda x, s: marks.append((s["fed"][-1], time.perf_counter())), **kw)
    sync()
    steps = [(fed, t - prev) for (fed, t), prev in zip(marks, [t0] + [t for _, t in marks[:-1]])]
    return out, st, steps


def busy(model, prompt, kw) -> dict:
    """GPU kernel time against wall time for one generate(), and kernels per call, from torch.profiler. The timed
    call's settings: a shorter canvas would compile or capture new graphs inside the profile (an H200 run showed busy
    0.003 that way)."""
    if not prompt.is_cuda:
        return {}
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, st = generate(model, prompt, **kw)
        torch.cuda.synchronize(prompt.device)
    wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    seconds = sum(e.self_device_time_total for e in kernels) / 1e6
    return dict(profiled_wall_s=wall, kernel_s=seconds, busy=seconds / wall,
                kernels_per_call=sum(e.count for e in kernels) / st["nfe"])


def speed(model, prompt, args, bandwidth, graphs, compiled, out, left, key="speed", variants=VARIANTS):
    kw = dict(gen_length=args.gen_length, block_length=args.block_length)
    rows = out.get(key, [])
    eager_ids = {r["mode"]: r["ids"] for r in rows if r["variant"] == "eager"}
    for variant in (v for v in variants if v in args.variants):
        for name, mode in MODES.items():
            if left() < WARM[variant]:
                print(f"{key} {variant} {name}: skipped, {left():.0f} s left", flush=True)
                continue
            settings = dict(kw, **mode, **runner(variant, graphs, compiled))
            captured, warm = graphs.capture_s, time.perf_counter()
            if variant != "eager":
                generate(model, prompt, **settings)              # captures or compiles its graphs: not timed
            warm = time.perf_counter() - warm
            ids, st, steps = timed(model, prompt, settings)
            ids = ids[:, -args.gen_length:].tolist()
            eager_ids.setdefault(name, ids) if variant == "eager" else None
            B, L, N = prompt.shape[0], prompt.shape[1] + args.gen_length, args.block_length
            by = {}
            for fed, s in steps:
                by.setdefault("refresh" if fed == L else "cached", []).append((fed, s))
            row = dict(variant=variant, mode=name, batch=B, nfe=st["nfe"], seconds=sum(s for _, s in steps),
                       warm_s=warm if variant != "eager" else None, compile_s=warm if variant == "compiled" else None,
                       capture_s=graphs.capture_s - captured if variant == "graphs" else None,
                       tokens_per_s=B * args.gen_length / sum(s for _, s in steps),
                       same_ids_as_eager=ids == eager_ids[name] if name in eager_ids else None, ids=ids)
            for kind, xs in by.items():
                ms = 1e3 * sum(s for _, s in xs) / len(xs)
                nbytes = sum(step_bytes(model, B, fed, L, min(N, fed)) for fed, _ in xs) / len(xs)
                row[kind] = dict(steps=len(xs), ms=ms, bytes=nbytes,
                                 hbm=nbytes / (ms / 1e3) / bandwidth if bandwidth else None)
            row.update(busy(model, prompt, settings))   # the timed call's shapes: nothing captured or compiled
            rows.append(row)
            out[key] = rows
            write(args.out, out)
            print(f"{key} {json.dumps({k: v for k, v in row.items() if k != 'ids'})}", flush=True)
    return rows


def official(model, hf, prompts, args, device, dtype, out, left):
    """The side-by-side phase (tools/side_by_side.py): the official rows in a child process, then ours."""
    llada = args.official_dir
    if not os.path.isfile(os.path.join(llada, "generate.py")):
        out["official"] = dict(error=f"skipped: no {llada}/generate.py (run python tools/gpu_prep.py where a package "
                                     f"index is reachable, and carry .official and .whl)")
        return print(f"official: {out['official']['error']}", flush=True)
    rows = side_by_side.rows(sorted({1, args.batch}))
    spec = dict(site=args.official_site, llada=llada, device=str(device), dtype=str(dtype).split(".")[-1], config=hf,
                prompts=prompts.tolist(), gen_length=args.gen_length, block_length=args.block_length, rows=rows)
    t0 = time.perf_counter()
    theirs, error = side_by_side.official(spec, min(left() - 60, 0.55 * left()) if args.budget else 3600)
    res = out["official"] = dict(official_s=time.perf_counter() - t0, error=error, official=theirs, ours=[])
    print(f"official: {len(theirs)} of {len(rows)} official rows in {res['official_s']:.0f} s"
          f"{f' ({error})' if error else ''}", flush=True)
    write(args.out, out)
    for row in rows:      # ours: the default path (eager at batch 1: add --official-eager)
        for graphs in (True, False) if args.official_eager and row["batch"] == 1 else (True,):
            if left() < (20 if row["batch"] == 1 else 40):
                print(f"official ours {row['cache']} {row['rule']} batch {row['batch']}: skipped, {left():.0f} s "
                      f"left", flush=True)
                continue
            res["ours"].append(side_by_side.ours(model, prompts, row, args.gen_length, args.block_length, graphs))
    out["rows"] = side_by_side.compare(res["ours"], theirs)
    write(args.out, out)
    for line in out["rows"]:
        print(f"official {json.dumps(line)}", flush=True)


def kernel_table(model, variant, graphs, compiled, args, bandwidth, trace) -> dict:
    """One cached DualCache call (the block fed against the KV cache its refresh wrote, the LM head on the block's
    columns), --profile-calls times under torch.profiler: each kernel's launches and time per call (on a CPU: each
    aten op's), the GEMMs against the rest, and the call's bytes against its wall time."""
    from torch.profiler import ProfilerActivity, profile
    cuda = model.lm_head.weight.is_cuda
    B, P, N = 1, args.prompt_length, args.block_length
    L = P + args.gen_length
    x = random_prompts(model.config, B, L).to(model.lm_head.weight.device)
    ar, rows = torch.arange(L, device=x.device), torch.arange(N, device=x.device)
    if variant == "eager":
        layers, kv = model.hidden, KVCache.for_model(model, B, L)
    else:       # the run's CudaGraphs or Compiled: the speed rows' graphs of these shapes, and their KV cache
        run = graphs if variant == "graphs" else compiled
        layers, kv = (lambda *a: run(model, *a)), run.start(model, B, L, DualCache())
    sync = (lambda: torch.cuda.synchronize(x.device)) if cuda else (lambda: None)
    one = lambda: model.logits(layers(x[:, P:P + N], ar[None, P:P + N], kv, ar[P:P + N], None), rows)  # noqa: E731
    layers(x, ar[None], kv, ar, None)                                   # the refresh
    for _ in range(3):                                                  # fed once, captured, replayed
        one()
    sync()
    acts = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profile(activities=acts) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(args.profile_calls):
            one()
        sync()
        wall = (time.perf_counter() - t0) / args.profile_calls
    if trace:
        prof.export_chrome_trace(os.path.join(trace, f"trace_{variant}.json"))
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind and (cuda or e.key.startswith("aten::"))]
    us = lambda e: (e.self_device_time_total if cuda else e.self_cpu_time_total) / args.profile_calls   # noqa: E731
    table = sorted(({"kernel": e.key[:160], "per_call": e.count / args.profile_calls, "us": us(e),
                     "gemm": any(g in e.key.lower() for g in GEMM)} for e in events), key=lambda k: -k["us"])
    total = sum(k["us"] for k in table)
    gemm = sum(k["us"] for k in table if k["gemm"])
    call_bytes = step_bytes(model, B, N, L, N)
    weights = sum(nbytes(p) for n, p in model.named_parameters() if n[:5] != "embed")
    return dict(calls=args.profile_calls, wall_ms=1e3 * wall, kernel_ms=total / 1e3, gemm_ms=gemm / 1e3,
                other_ms=(total - gemm) / 1e3, launches_per_call=sum(k["per_call"] for k in table), bytes=call_bytes,
                hbm=call_bytes / wall / bandwidth if bandwidth else None,
                gemm_hbm=weights / (gemm / 1e6) / bandwidth if bandwidth and gemm else None, kernels=table[:60])


def graphs_ids(device, args, out, left) -> dict:
    """CUDA graphs against eager in float32 on the device (the docstring's 6.): every run's ids and calls equal."""
    from tools.step_count import random_model
    models = {name: lambda name=name: load_model(os.path.join(ROOT, "tests", "golden", f"{name}-tiny"), device=device,
                                                 dtype=torch.float32)
              for name in ("llada", "dream", "lladamoe", "sdar", "llada2")}
    models["fastdllm_v2"] = lambda: random_model("fastdllm_v2", "small", torch.float32).to(device)
    if args.shape == "8b":     # LLaDA-8B's widths, 2 layers
        models["llada-8b-width"] = lambda: build(dict(hf_shape("8b"), n_layers=2), device, torch.float32)
    res = dict(equal=0, total=0, differ=[])
    for name, make in models.items():
        if left() < 20:
            res.setdefault("skipped", []).append(name)
            continue
        model = make()
        block = model.config.family in ("fastdllm_v2", "sdar", "llada2")
        caches = ("none", "prefix", "dual") if block else ("none", "prefix", "dual", "free")
        kw = dict(gen_length=32) if block else dict(gen_length=16, block_length=8)
        top = min(i for i in (model.config.mask_id, model.config.eos_id, model.config.pad_id, 900) if i is not None)
        for batch in (1, 2):
            ids = torch.randint(0, top, (batch, 12), generator=torch.Generator().manual_seed(batch)).to(device)
            am = torch.ones_like(ids)
            am[1:, :5] = 0                                   # the second row left-padded
            for cache in caches:
                for threshold in (None, 0.9):
                    run = dict(kw, cache=cache, threshold=threshold, attention_mask=am)
                    a, sa = generate(model, ids, cuda_graphs=False, **run)
                    b, sb = generate(model, ids, cuda_graphs=CudaGraphs(), **run)
                    same = bool(torch.equal(a, b)) and sa["nfe"] == sb["nfe"]
                    res["total"] += 1
                    res["equal"] += same
                    if not same:
                        res["differ"].append(f"{name} batch {batch} {cache} {threshold}")
        del model
    out["graphs_ids"] = res
    print(f"graphs_ids: {res['equal']} of {res['total']} equal eager's{'; ' + ', '.join(res['differ']) if res['differ'] else ''}",
          flush=True)
    return res


def batch(model, prompts, args, graphs, compiled, out, left):
    kw = dict(gen_length=args.gen_length, block_length=args.block_length, **MODES["dual 0.9"])
    res = {}
    for variant in (v for v in VARIANTS if v in args.variants):
        if left() < 2 * WARM[variant]:
            print(f"batch {variant}: skipped, {left():.0f} s left", flush=True)
            continue
        settings = dict(kw, **runner(variant, graphs, compiled))
        together, _ = generate(model, prompts, **settings)
        same = [torch.equal(together[i], generate(model, prompts[i:i + 1], **settings)[0][0])
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
    speed(model, prompt, args, bandwidth, CudaGraphs(), Compiled(), out, left, key="int8_speed")


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
                   help="speed, profile and batch: eager, graphs, compiled (default: %(default)s)")
    p.add_argument("--prompt-length", type=integer(1), default=64)
    p.add_argument("--gen-length", type=integer(1), default=128)
    p.add_argument("--block-length", type=integer(1), default=32)
    p.add_argument("--batch", type=integer(1), default=16)
    p.add_argument("--golden-runs", type=integer(1), default=None, help="golden: the first N runs of each family "
                   "(default: all; the CPU test's quick path)")
    p.add_argument("--official-site", default=None, help="official: the folder tools/gpu_prep.py's wheels were "
                   "installed in (pip install --no-index --no-deps --target DIR .whl/*.whl); default: none, the "
                   "Python's own packages")
    p.add_argument("--official-dir", default=os.path.join(ROOT, ".official", "llada"), help="official: the official "
                   "llada/ folder (default: tools/gpu_prep.py's, .official/llada)")
    p.add_argument("--official-eager", action="store_true", help="official: ours eager too, at batch 1 (the speed "
                   "phase has eager's baseline and DualCache rows)")
    p.add_argument("--profile-calls", type=integer(1), default=20, help="profile: calls profiled (default: %(default)s)")
    p.add_argument("--trace", default=None, help="profile: a folder for each variant's Chrome trace")
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
               torch=torch.__version__, hbm_bytes_per_s=bandwidth, hbm_source=source, settings=vars(args), rows=[])
    print(f"{out['device']}, {dtype}, HBM {bandwidth / 1e12:.2f} TB/s ({source})", flush=True)
    t0 = time.perf_counter()
    hf = hf_shape(args.shape)
    model = build(hf, device, dtype)
    out["build_s"] = time.perf_counter() - t0
    print(f"build: {out['build_s']:.1f} s, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    prompts = random_prompts(model.config, args.batch, args.prompt_length).to(device)
    graphs, compiled = CudaGraphs(), Compiled()
    with torch.inference_mode():
        if "speed" in args.phases:       # compiled last (its warm-up compiles for a minute): after the official
            speed(model, prompts[:1], args, bandwidth, graphs, compiled, out, left, variants=("eager", "graphs"))
        if "official" in args.phases and left() < 90:
            print(f"official: skipped, {left():.0f} s left", flush=True)
        elif "official" in args.phases:
            official(model, hf, prompts, args, device, dtype, out, left)
        if "speed" in args.phases:
            speed(model, prompts[:1], args, bandwidth, graphs, compiled, out, left, variants=("compiled",))
        for variant in (v for v in VARIANTS if v in args.variants) if "profile" in args.phases else ():
            if left() < (WARM[variant] if variant == "compiled" and compiled.fn is None else 20):   # not compiled yet
                print(f"profile {variant}: skipped, {left():.0f} s left", flush=True)
                continue
            out.setdefault("profile", {})[variant] = kernel_table(model, variant, graphs, compiled, args, bandwidth,
                                                                  args.trace)
            write(args.out, out)
            t = out["profile"][variant]
            print(f"profile {variant}: {t['wall_ms']:.2f} ms a call, kernels {t['kernel_ms']:.2f} ms (GEMMs "
                  f"{t['gemm_ms']:.2f}), {t['launches_per_call']:.0f} launches, HBM share {t['hbm']}", flush=True)
        if "launches" in args.phases:
            cfg = launches.config("llada")
            a, b = launches.ours(cfg, dtype), launches.minimal(cfg, dtype)
            out["launches"] = dict(ours=a.total, minimal=b.total, ratio=a.total / b.total, dtype=str(dtype))
            write(args.out, out)
            print(f"launches: ours {a.total}, the minimal forward {b.total} ({a.total / b.total:.2f}x)", flush=True)
        if "graphs_ids" in args.phases:
            graphs_ids(device, args, out, left)
            write(args.out, out)
        if "batch" in args.phases:
            batch(model, prompts, args, graphs, compiled, out, left)
        if "int8" in args.phases and left() < 60:
            print(f"int8: skipped, {left():.0f} s left", flush=True)
        elif "int8" in args.phases:      # the model's last use: it ends quantized
            int8(model, prompts[:1], args, bandwidth, out, left)
    del model, graphs, compiled
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
        moe = build(hf_shape(args.shape, moe=True), device, dtype)
        out["moe_build_s"] = time.perf_counter() - t0
        print(f"moe build: {out['moe_build_s']:.1f} s, {sum(p.numel() for p in moe.parameters()) / 1e9:.2f} B "
              f"parameters", flush=True)
        with torch.inference_mode():
            speed(moe, random_prompts(moe.config, 1, args.prompt_length).to(device), args, bandwidth, CudaGraphs(),
                  Compiled(), out, left, key="moe_speed")
        del moe
    out["total_s"] = time.perf_counter() - start
    write(args.out, out)
    print(f"done in {out['total_s']:.0f} s: {args.out}")


if __name__ == "__main__":
    main()
