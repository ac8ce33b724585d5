"""
bench.py: what each decoding mode costs (time, model calls, tokens fed, memory) and what its approximations
cost in quality (agreement with the exact decode), in one table; the random checkpoints it measures on; and
the one prepared GPU check.

    python fastdllm.py --model demo/llada-arith --bench ...   # the modes table on a real model and prompt
    python bench.py modes --d-model 512 --layers 4            # the same table on a random LLaDA-format checkpoint
    python bench.py sweep --lengths 128,256,512,1024          # cost per generated token as the answer grows
    python bench.py compare before.json after.json            # two `--json` results side by side, row by row
    python bench.py gpu-check --out gpu.json                  # 8B-shaped LLaDA and Dream-7B-shaped, in one go
    python bench.py checkpoint DIR --family dream ...         # only write a random checkpoint

A row of the modes table:
- NFE (model calls), tokens committed per call, canvas positions fed per call (per row of the batch);
- wall time of the whole generate() call (after a warm-up), and tokens/s counted two ways: answer tokens
  (each row up to its first end token) and all generated tokens (batch x gen_length, which is what most
  published numbers count, end-of-text filler included);
- peak memory: torch.cuda.max_memory_allocated on CUDA; on CPU the process's RSS high-water mark (VmHWM),
  reset before each row (Linux), so it is the resident weights plus what the row allocated;
- agreement: the share of answer tokens equal to the *exact* decode (no cache, one token per step, the same
  steps), and the first answer position where they differ. An approximate cache's or a parallel rule's cost
  in quality sits next to its speed.
Speed is only ever reported, never asserted; tests/test_bench.py checks that the numbers are computed right.
"""
import argparse
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

from fastdllm import generate
from model import ModelConfig, Transformer, checkpoint_names, load_model

ROOT = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(ROOT, "tests", "golden")
MiB = 2 ** 20

# ----------------------------------------------------------------------------------------------------------
# 1. Random checkpoints in the real on-disk formats

# The real models' shapes (spec/llada.md and spec/dream.md, section 1) and the small ones measured on a CPU.
SHAPES = {
    "llada-8b": dict(family="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn=12288, vocab=126464),
    "dream-7b": dict(family="dream", d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn=18944, vocab=152064),
    "llada-tiny": dict(family="llada", d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, ffn=192, vocab=1024),
    "dream-tiny": dict(family="dream", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=192, vocab=1024),
}
# Special ids keep their distance from the end of the vocabulary, so the real vocabulary gets the real ids
# (LLaDA: mask 126336, eos = pad 126081; Dream: mask 151666, bos = eos = pad 151643).
SPECIALS_FROM_END = {"llada": dict(mask=128, eos=383), "dream": dict(mask=398, eos=421)}


def hf_config(family: str, d_model: int, n_layers: int, vocab: int, n_heads: int, n_kv_heads: int,
              ffn: int) -> dict:
    """config.json with every field the real one has: the golden tiny checkpoint's (a copy of the real
    file at small sizes), resized."""
    with open(os.path.join(GOLDEN, f"{family}-tiny", "config.json")) as f:
        cfg = json.load(f)
    mask, eos = vocab - SPECIALS_FROM_END[family]["mask"], vocab - SPECIALS_FROM_END[family]["eos"]
    if family == "llada":   # mlp_ratio stays 4 as in the real file, whose mlp_hidden_size is 3x d_model
        cfg.update(d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, mlp_hidden_size=ffn,
                   embedding_size=vocab, vocab_size=vocab, mask_token_id=mask, eos_token_id=eos, pad_token_id=eos,
                   max_sequence_length=4096)
    else:
        cfg.update(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                   num_key_value_heads=n_kv_heads, intermediate_size=ffn, vocab_size=vocab, mask_token_id=mask,
                   bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    return cfg


def make_checkpoint(folder: str, family: str, d_model: int, n_layers: int, vocab: int, n_heads: int | None = None,
                    n_kv_heads: int | None = None, ffn: int | None = None, shards: int = 1, gain: float = 1.13,
                    logit_std: float = 13.0, seed: int = 0, device="cpu") -> int:
    """
    Write a random bf16 checkpoint in the real layout into `folder`: config.json, the real tensor names
    (model.WEIGHT_MAP, which the golden tests check against the official formats), one model.safetensors or
    `shards` files plus model.safetensors.index.json. Returns the weights' size in bytes.

    Weights are N(0, (gain / sqrt(d_model))^2) and norms 1; the LM head has std logit_std / sqrt(d_model),
    so logits have std ~logit_std. Why not the models' init_std 0.02 everywhere: at width 512 it makes
    attention flat, every masked position then gets the same hidden state and the same confidence, and a
    126k-way softmax at that scale never reaches 0.9; a parallel rule would commit all of a block or one
    token per step. These defaults (std 0.05 at width 512, ~0.018 at 4096, close to 0.02) spread them: on
    the 512-wide checkpoint of the README, the first step's confidences have deciles 0.41 (10%) to 0.99 (90%),
    30% of positions at >= 0.9, and threshold 0.9 commits ~2.5 tokens per call.
    device: where the random numbers are drawn ("cuda" writes an 8B checkpoint in seconds, not minutes).
    Defaults: head_dim 128 (both real models), ffn 3x d_model (LLaDA-8B's ratio).
    """
    n_heads = n_heads or max(1, d_model // 128)
    hf = hf_config(family, d_model, n_layers, vocab, n_heads, n_kv_heads or n_heads, ffn or 3 * d_model)
    cfg = ModelConfig.from_hf(hf)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(cfg).named_parameters()}

    def layer(item):   # the checkpoints store tensors layer by layer: embeddings, blocks 0..n-1, norm, head
        ours = item[1]
        m = re.match(r"layers\.(\d+)\.", ours)
        return (1, int(m[1])) if m else (0, 0) if ours.startswith("embed") else (2, 0)
    names = sorted(checkpoint_names(cfg).items(), key=layer)      # [(checkpoint name, our name)]
    sizes = [shapes[ours].numel() * 2 for _, ours in names]
    total = sum(sizes)
    # Shard i holds the tensors whose middle falls in the i-th part of the bytes, as HF's sharding does.
    shard_of, offset = [], 0
    for n in sizes:
        shard_of.append(min(shards - 1, int((offset + n / 2) / total * shards)))
        offset += n
    files = (["model.safetensors"] if shards == 1 else
             [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)])
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    for i, file in enumerate(files):
        tensors = {}
        for (theirs, ours), s in zip(names, shard_of):
            if s != i:
                continue
            shape = shapes[ours]
            if ours.endswith("norm.weight"):
                t = torch.ones(shape)
            else:
                std = (logit_std if ours == "lm_head.weight" else gain) / d_model ** 0.5
                t = torch.randn(shape, generator=gen, device=device).mul_(std)
            tensors[theirs] = t.to(torch.bfloat16).cpu()
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        del tensors
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {t: files[s] for (t, _), s in zip(names, shard_of)}}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if family == "dream":   # Dream's from_pretrained requires it; its ids follow config.json
        with open(os.path.join(GOLDEN, "dream-tiny", "generation_config.json")) as f:
            gc = json.load(f)
        gc.update(bos_token_id=hf["bos_token_id"], eos_token_id=hf["eos_token_id"], pad_token_id=hf["pad_token_id"])
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump(gc, f, indent=2)
    return total


def random_prompts(cfg: ModelConfig, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) ids below every special id (mask, eos, pad, bos), so no prompt holds one."""
    top = min(i for i in (cfg.mask_id, cfg.eos_id, cfg.pad_id, cfg.bos_id, cfg.vocab_size) if i is not None)
    return torch.randint(0, top, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------
# 2. Measuring one row

class PeakMemory:
    """Peak memory between construction and read(). CUDA: max_memory_allocated (tensors only). CPU: the
    RSS high-water mark, reset through /proc/self/clear_refs (Linux >= 4.0); where that fails, ru_maxrss,
    the peak of the whole process so far, and `what` says so."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.what = "peak GPU memory (max_memory_allocated)"
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.what = "peak RSS (VmHWM, reset per row)"
        except OSError:
            self.what = "peak RSS (ru_maxrss: process lifetime)"

    def read(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if "VmHWM" in self.what:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # kB on Linux


def answer_lengths(gen: torch.Tensor, eos_ids) -> torch.Tensor:
    """(B,) tokens before each row's first end token (gen_length if it has none)."""
    is_end = torch.isin(gen, torch.tensor(sorted(eos_ids), dtype=torch.long, device=gen.device))
    return torch.where(is_end.any(-1), is_end.int().argmax(-1), gen.shape[1])


def agreement(gen: torch.Tensor, ref: torch.Tensor, eos_ids):
    """Share of the reference's answer tokens (up to and including its first end token) that `gen` has at the
    same positions, over all rows, and the first such position where they differ (None: no difference)."""
    n = (answer_lengths(ref, eos_ids) + 1).clamp(max=ref.shape[1])
    scored = torch.arange(ref.shape[1], device=ref.device) < n[:, None]
    differ = (gen != ref) & scored
    first = differ.any(0).nonzero()
    return 1 - differ.sum().item() / scored.sum().item(), (first[0].item() if len(first) else None)


def rss() -> int:
    """The process's resident memory now, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
    except OSError:
        return 0


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_row(model, prompt, mode: dict, kw: dict, guide=None, eos_ids=None, repeat: int = 1, seed: int = 0):
    """One generate() call (the best wall time of `repeat`) -> (generated ids (B, G), row dict)."""
    device = prompt.device
    eos_ids = set(eos_ids or [model.config.eos_id]) - {None}
    call = dict(kw, cache=mode["cache"], threshold=mode["threshold"], factor=mode["factor"])
    if mode["stop"]:
        call.update(stop_at_eos=mode["stop"], eos_ids=sorted(eos_ids))
    if mode["guided"]:
        call.update(guide=guide, accept=mode["guided"])
    best = None
    for _ in range(repeat):
        peak = PeakMemory(device)
        gen = torch.Generator(device).manual_seed(seed)
        sync(device)
        t0 = time.perf_counter()
        ids, st = generate(model, prompt, generator=gen, **call)
        sync(device)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[0]:
            best = seconds, peak.read()
    seconds, peak = best
    B, G = prompt.shape[0], kw["gen_length"]
    out = ids[:, prompt.shape[1]:]
    answer = answer_lengths(out, eos_ids).sum().item()
    # Older generate() versions (the before/after LM-head measurement runs one) lack "committed": without
    # early stop every generated token was committed by some call.
    committed = sum(st["committed"]) if "committed" in st else B * G
    row = dict(cache=mode["cache"], rule=rule_name(mode, kw), stop=stop_name(mode["stop"]), batch=B,
               gen_length=G, nfe=st["nfe"], tokens_per_call=committed / st["nfe"],
               fed_per_call=sum(st["fed"]) / st["nfe"], seconds=seconds, answer_tokens=answer,
               answer_tokens_per_s=answer / seconds, all_tokens_per_s=B * G / seconds,
               peak_mib=peak / MiB, calls_saved=st.get("calls_saved", 0), guide_calls=st.get("guide_calls", 0),
               ids_sha1=hashlib.sha1(str(out.tolist()).encode()).hexdigest()[:12])
    return out, row


# ----------------------------------------------------------------------------------------------------------
# 3. The modes table

def modes(caches, thresholds=(), factors=(), stops=(False,), guided=()):
    """Every (cache, rule, early stop) combination; the exact reference (no cache, one token per step,
    no early stop) always comes first. A guided mode is one per acceptance rule, at every cache."""
    rules = [(None, None, None)] + [(t, None, None) for t in thresholds] + [(None, f, None) for f in factors]
    rules += [(None, None, g) for g in guided]
    out = [dict(cache="none", threshold=None, factor=None, stop=False, guided=None)]
    for t, f, g in rules:
        for stop in stops:
            for cache in caches:
                m = dict(cache=cache, threshold=t, factor=f, stop=stop, guided=g)
                if m not in out:
                    out.append(m)
    return out


def rule_name(mode, kw) -> str:
    if mode["guided"]:
        return f"guided {mode['guided']}"
    if mode["threshold"] is not None:
        return f"tau {mode['threshold']:g}"
    if mode["factor"] is not None:
        return f"factor {mode['factor']:g}"
    return f"{kw['gen_length'] / (kw.get('steps') or kw['gen_length']):g} tok/step"


def stop_name(stop) -> str:
    return "-" if stop is False else "block" if stop is True else f"k={stop}"


def warm_up(model, prompt, caches, kw):
    """One block of each cache, untimed: first-call costs (allocator, kernel choice) stay out of the rows."""
    bl = kw.get("block_length") or kw["gen_length"]
    for cache in dict.fromkeys(caches):
        try:
            generate(model, prompt, **dict(kw, gen_length=bl, block_length=bl, steps=bl, cache=cache))
        except ValueError:   # a mode these settings forbid: its row will say so
            pass


def run_modes(model, prompt, mode_list, kw, guide=None, eos_ids=None, repeat=1, seed=0, warmup=True, ref=None):
    """Run every mode on the same prompt(s) -> (rows, ref). Agreement and speed-up are against `ref` =
    (generated ids, seconds) of the exact decode, by default the first mode's (modes() puts it first). A
    mode the settings do not allow (e.g. a cache with Dream's whole-canvas sampler) becomes a row with `error`."""
    eos_ids = set(eos_ids or [model.config.eos_id]) - {None}
    if warmup:
        warm_up(model, prompt, [m["cache"] for m in mode_list], kw)
    rows = []
    for mode in mode_list:
        try:
            out, row = run_row(model, prompt, mode, kw, guide, eos_ids, repeat, seed)
        except ValueError as e:
            rows.append(dict(cache=mode["cache"], rule=rule_name(mode, kw), stop=stop_name(mode["stop"]),
                             batch=prompt.shape[0], gen_length=kw["gen_length"], error=str(e)))
            continue
        ref = ref or (out, row["seconds"])
        row["agreement"], row["first_diff"] = agreement(out, ref[0], eos_ids)
        row["speedup"] = ref[1] / row["seconds"]
        rows.append(row)
        print(f"  {row['cache']:6s} {row['rule']:14s} stop {row['stop']:5s} NFE {row['nfe']:4d} "
              f"{row['seconds']:8.3f} s", file=sys.stderr, flush=True)
    return rows, ref


def table(rows, columns) -> str:
    """A markdown table; columns = [(header, row -> str)]."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        if "error" in r:   # one cell: this mode cannot run with these settings, and why
            lines.append(f"| {r['cache']}, {r['rule']}, early stop {r['stop']}: n/a ({r['error']}) |")
        else:
            lines.append("| " + " | ".join(fn(r) for _, fn in columns) + " |")
    return "\n".join(lines)


def first_diff(r) -> str:
    return "-" if r["first_diff"] is None else str(r["first_diff"])


MODE_COLUMNS = [
    ("cache", lambda r: r["cache"]), ("rule", lambda r: r["rule"]), ("early stop", lambda r: r["stop"]),
    ("NFE", lambda r: str(r["nfe"])), ("tokens/call", lambda r: f"{r['tokens_per_call']:.2f}"),
    ("fed/call", lambda r: f"{r['fed_per_call']:.0f}"), ("wall s", lambda r: f"{r['seconds']:.3f}"),
    ("answer tok/s", lambda r: f"{r['answer_tokens_per_s']:.1f}"),
    ("all tok/s", lambda r: f"{r['all_tokens_per_s']:.1f}"), ("speed-up", lambda r: f"{r['speedup']:.2f}x"),
    ("peak MiB", lambda r: f"{r['peak_mib']:.0f}"), ("agreement", lambda r: f"{r['agreement']:.3f}"),
    ("first diff", first_diff),
]


def environment(device, dtype) -> dict:
    device = torch.device(device)
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):   # Linux names the CPU model here (platform.processor() often is "")
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    return dict(date=time.strftime("%Y-%m-%d %H:%M %Z"), torch=torch.__version__, python=platform.python_version(),
                device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                cuda=torch.version.cuda,
                dtype=str(dtype).replace("torch.", ""), threads=torch.get_num_threads(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"), cpu=cpu, cpu_count=os.cpu_count(), commit=commit)


def write_json(path: str, **parts):
    """Written to a temporary file and renamed, so an interrupted run leaves the last complete state."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(parts, f, indent=1)
    os.replace(tmp, path)


def add_arguments(p):
    """fastdllm.py's --bench flags."""
    p.add_argument("--bench", action="store_true", help="every decoding mode side by side: calls, tokens fed, "
                   "time, tokens/s, memory and agreement with the exact decode (bench.py)")
    p.add_argument("--bench-caches", default="none,prefix,dual,free", help="--bench: cache modes, "
                   "comma-separated (default: %(default)s)")
    p.add_argument("--bench-thresholds", default="0.9", help="--bench: threshold values, comma-separated "
                   "(default: %(default)s)")
    p.add_argument("--bench-factors", default="1.0", help="--bench: factor values, comma-separated ('' = none) "
                   "(default: %(default)s)")
    p.add_argument("--bench-stop", default="off,on", help="--bench: early stop values: off, on (at a block's end), "
                   "k (k end tokens in a row) (default: %(default)s)")
    p.add_argument("--bench-batch", type=int, default=1, help="--bench: batch size, the prompt repeated "
                   "(default: %(default)s)")
    p.add_argument("--bench-repeat", type=int, default=1, help="--bench: best wall time of this many runs per row "
                   "(default: %(default)s)")
    p.add_argument("--bench-json", default=None, help="--bench: also write every row, the settings and the "
                   "environment to this JSON file")


def cli_bench(model, prompt, args, base: dict, eos_ids=None, guide=None):
    """fastdllm.py --bench: the modes table from the CLI's --bench-* flags and decoding settings `base`."""
    device = prompt.device
    factors = split(args.bench_factors, float)
    factors += [args.factor] if args.factor is not None and args.factor not in factors else []   # --factor F too
    mode_list = modes(split(args.bench_caches, str), split(args.bench_thresholds, float), factors,
                      split(args.bench_stop, parse_stop),
                      [base.get("accept", "deterministic")] if guide is not None else [])
    kw = {k: v for k, v in base.items() if k not in ("cache", "threshold", "factor")}
    rows, _ = run_modes(model, prompt, mode_list, kw, guide, eos_ids, args.bench_repeat, args.seed)
    env = environment(device, model.lm_head.weight.dtype)
    print(f"batch {prompt.shape[0]}, prompt {prompt.shape[1]} tokens, gen {kw['gen_length']}, block "
          f"{kw.get('block_length')}, {env['dtype']} on {env['gpu'] or env['cpu']}, {env['threads']} threads; "
          f"{PeakMemory(device).what}")
    print(table(rows, MODE_COLUMNS))
    if args.bench_json:
        write_json(args.bench_json, settings=dict(kw, batch=prompt.shape[0], prompt_length=prompt.shape[1]),
                   environment=env, rows=rows)


def split(text: str | None, kind):
    return [kind(t) for t in (text or "").split(",") if t.strip()]


def parse_stop(text: str):
    """Early stop values: off | on (at a block's end) | k (k end tokens in a row, FlashDLM)."""
    t = text.strip().lower()
    return False if t == "off" else True if t == "on" else int(t)


# ----------------------------------------------------------------------------------------------------------
# 4. Cost growth: the same modes at growing answer lengths

def sweep(model, prompt, lengths, caches, block_length, threshold=None, repeat=1):
    """Per gen length and cache: seconds and canvas positions fed per generated token (one row of the
    batch). Without a cache every call feeds the whole canvas, so its cost per token grows with the length;
    prefix feeds the block and all after it; dual and free feed less (cache.py)."""
    rows = []
    warm_up(model, prompt, caches, dict(gen_length=block_length, block_length=block_length))
    for G in lengths:
        kw = dict(gen_length=G, block_length=block_length, steps=G)
        for cache in caches:
            mode = dict(cache=cache, threshold=threshold, factor=None, stop=False, guided=None)
            _, r = run_row(model, prompt, mode, kw, repeat=repeat)
            r["ms_per_token"] = 1e3 * r["seconds"] / (prompt.shape[0] * G)
            r["fed_per_token"] = r["fed_per_call"] * r["nfe"] / G
            base = next((b for b in rows if b["cache"] == cache), r)
            r["ms_growth"] = r["ms_per_token"] / base["ms_per_token"]
            rows.append(r)
            print(f"  gen {G:5d} {cache:6s} NFE {r['nfe']:4d} {r['seconds']:8.2f} s", file=sys.stderr, flush=True)
    return rows


SWEEP_COLUMNS = [
    ("gen", lambda r: str(r["gen_length"])), ("cache", lambda r: r["cache"]), ("rule", lambda r: r["rule"]),
    ("NFE", lambda r: str(r["nfe"])), ("fed/token", lambda r: f"{r['fed_per_token']:.1f}"),
    ("ms/token", lambda r: f"{r['ms_per_token']:.1f}"), ("ms/token vs shortest", lambda r: f"{r['ms_growth']:.2f}x"),
    ("wall s", lambda r: f"{r['seconds']:.2f}"),
]


# ----------------------------------------------------------------------------------------------------------
# 5. The GPU check: 8B-shaped checkpoints, every mode, roofline, golden parity, optional torch.compile

GOLDEN_CHILD = """
import json, sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
import test_golden as G, test_flashdlm as F, test_guided as GD
from fastdllm import generate
from model import load_model
dev, dtype = torch.device({device!r}), getattr(torch, {dtype!r})
models = {{f: load_model(f"{{G.GOLDEN}}/{{f}}-tiny", device=dev, dtype=dtype) for f in ("llada", "dream")}}
prompts = json.load(open(f"{{G.GOLDEN}}/llada-golden.json"))["prompts"]
cases = [("llada", r["fn"], prompts[r["batch"]], G.llada_call(r), r["output"], r["nfe"], None) for r in G.LLADA_RUNS]
cases += [("dream", r["name"], r["input_ids"], G.dream_call(r), r["sequences"], r["nfe"], None) for r in G.DREAM_RUNS]
cases += [("dream", r["name"], [F.FLASH["prompts"][r["prompt"]]], F.freecache_call(r["settings"]), [r["output"]],
           r["nfe"], r["settings"].get("eos_bias", {{}}).get("dream")) for r in F.FREECACHE_RUNS]
guide = load_model(f"{{G.GOLDEN}}/qwen2-tiny", device=dev, dtype=dtype)
cases += [("dream", r["name"], [F.FLASH["prompts"][r["prompt"]]], dict(GD.guided_call(r["settings"]), guide=guide),
           [r["output"]], r["nfe"], r["settings"].get("eos_bias", {{}}).get("dream")) for r in GD.GUIDED_RUNS]

def eos_bias(bias, eos):   # the golden EOS runs add `bias` to the eos logit at every forward
    def hook(module, inputs, out):
        return out.index_add(-1, torch.tensor([eos], device=out.device),
                             torch.full((*out.shape[:-1], 1), float(bias), device=out.device, dtype=out.dtype))
    return hook

runs = []
for family, name, prompt, kw, want, nfe, bias in cases:
    model = models[family]
    prompt, want = torch.tensor(prompt, device=dev), torch.tensor(want, device=dev)
    hook = model.lm_head.register_forward_hook(eos_bias(bias, model.config.eos_id)) if bias else None
    out, st = generate(model, prompt, **kw)
    if hook:
        hook.remove()
    gen, ref = out[:, prompt.shape[1]:], want[:, prompt.shape[1]:]
    runs.append(dict(family=family, name=name, exact=bool(torch.equal(out, want)) and st["nfe"] == nfe,
                     agreement=(gen == ref).float().mean().item(), nfe=st["nfe"], golden_nfe=nfe))
print(json.dumps(runs))
"""


def golden_parity(device: str, dtype: str) -> dict:
    """Every golden run of the official code (tests/golden) on this device and dtype, in a fresh process (it
    imports the test modules, which pin the CPU to one thread). float32 must be exact; bf16 is reported."""
    code = GOLDEN_CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), device=device, dtype=dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        return dict(error=out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed")
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(runs=runs, exact=sum(r["exact"] for r in runs), total=len(runs),
                agreement=sum(r["agreement"] for r in runs) / len(runs))


def step_bytes(model) -> int:
    """Weight bytes one step must read: every parameter except the embedding table, of which a step reads
    only the rows of the tokens it feeds. The LM head is read whole, whatever the number of open positions."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed"))


def gpu_check(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shapes = ([SHAPES["llada-8b"], SHAPES["dream-7b"]] if args.shape == "8b" else
              [SHAPES["llada-tiny"], SHAPES["dream-tiny"]])
    shapes = [s for s in shapes if s["family"] in split(args.families, str)]
    work = tempfile.mkdtemp(prefix="fastdllm_gpu_check_", dir=args.dir)
    result = dict(environment=environment(device, dtype), settings=vars(args), load={}, rows=[], golden={})
    mode_list = modes(split(args.caches, str), split(args.thresholds, float), split(args.factors, float))
    kw = dict(gen_length=args.gen_length, block_length=args.block_length)
    t_start = time.perf_counter()
    try:
        for shape in shapes:
            family = shape["family"]
            folder = os.path.join(work, family)
            t0 = time.perf_counter()
            size = make_checkpoint(folder, **shape, shards=args.shards, device=device if device.type == "cuda" else "cpu")
            write_s = time.perf_counter() - t0
            before, host, t0 = rss(), PeakMemory("cpu"), time.perf_counter()
            model = load_model(folder, device=device, dtype=dtype)   # from the page cache: it was just written
            sync(device)
            load = dict(checkpoint_gb=size / 1e9, write_s=write_s, load_s=time.perf_counter() - t0,
                        host_rss_before_gb=before / 1e9, host_rss_peak_gb=host.read() / 1e9, host_rss_what=host.what,
                        gpu_allocated_gb=torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None)
            result["load"][family] = load
            print(f"{family}: {load}", file=sys.stderr, flush=True)
            bytes_per_step = step_bytes(model)
            prompts = random_prompts(model.config, max(split(args.batches, int)), args.prompt_length).to(device)
            variants = [("eager", model)]
            if args.compile:   # one model, compiled: same weights, same generate(); dynamic shapes, as the fed
                # span and the number of open positions change from step to step
                variants.append(("compiled", torch.compile(model, dynamic=True, mode=args.compile)))
            for batch in split(args.batches, int):
                ref = None
                for name, m in variants:
                    todo = mode_list if name == "eager" else [x for x in mode_list if x["cache"] != "none"]
                    t0 = time.perf_counter()
                    if name == "compiled":   # compile for every mode's shapes first: reported, not timed
                        for x in todo:
                            run_row(m, prompts[:batch], x, kw)
                    warm = time.perf_counter() - t0
                    # compiled rows: agreement and speed-up against the *eager* exact decode
                    rows, ref = run_modes(m, prompts[:batch], todo, kw, warmup=name == "eager", ref=ref)
                    eager = {(r["cache"], r["rule"]): r.get("ids_sha1") for r in result["rows"]
                             if r["family"] == family and r["batch"] == batch}
                    for r in rows:
                        r.update(family=family, variant=name)
                        if "error" not in r:
                            r.update(steps_per_s=r["nfe"] / r["seconds"],
                                     roofline=bytes_per_step * r["nfe"] / r["seconds"] / args.peak_bandwidth)
                        if name == "compiled":
                            r.update(compile_s=warm, same_ids_as_eager=eager.get((r["cache"], r["rule"])) == r.get("ids_sha1"))
                    result["rows"] += rows
                    write_json(args.out, **result)
            del model, variants, m      # `m` too: the loop variable would keep the weights alive
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)   # 16 GB each: the disk holds one at a time
        if not args.no_golden:
            for dt in ("float32", "bfloat16"):
                result["golden"][dt] = golden_parity(str(device), dt)
                write_json(args.out, **result)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["total_s"] = time.perf_counter() - t_start
    write_json(args.out, **result)
    print(gpu_report(result, args))
    return result


GPU_COLUMNS = [
    ("model", lambda r: r["family"]), ("batch", lambda r: str(r["batch"])),
    ("run", lambda r: r["variant"] if "same_ids_as_eager" not in r else
     f"compiled ({'same ids as eager' if r['same_ids_as_eager'] else 'ids differ from eager'})"),
    ("cache", lambda r: r["cache"]), ("rule", lambda r: r["rule"]), ("NFE", lambda r: str(r["nfe"])),
    ("tokens/call", lambda r: f"{r['tokens_per_call']:.2f}"), ("fed/call", lambda r: f"{r['fed_per_call']:.0f}"),
    ("wall s", lambda r: f"{r['seconds']:.2f}"), ("steps/s", lambda r: f"{r['steps_per_s']:.1f}"),
    ("roofline", lambda r: f"{100 * r['roofline']:.0f}%"), ("all tok/s", lambda r: f"{r['all_tokens_per_s']:.0f}"),
    ("peak GiB", lambda r: f"{r['peak_mib'] / 1024:.1f}"), ("agreement", lambda r: f"{r['agreement']:.3f}"),
]


def gpu_report(result, args) -> str:
    env = result["environment"]
    lines = [f"{env['gpu'] or env['cpu']}, torch {env['torch']}, {env['dtype']}, {env['date']}; prompt "
             f"{args.prompt_length}, gen {args.gen_length}, block {args.block_length}; roofline = weight bytes "
             f"(all but the embedding) x steps/s / {args.peak_bandwidth / 1e12:g} TB/s"]
    for family, ld in result["load"].items():
        gpu = f", GPU memory {ld['gpu_allocated_gb']:.1f} GB" if ld["gpu_allocated_gb"] is not None else ""
        lines.append(f"{family}: checkpoint {ld['checkpoint_gb']:.3g} GB, written in {ld['write_s']:.0f} s, "
                     f"loaded in {ld['load_s']:.1f} s, host RSS {ld['host_rss_before_gb']:.2f} GB before the load, "
                     f"peak {ld['host_rss_peak_gb']:.2f} GB{gpu}")
    warmups = {(r["family"], r["batch"]): r["compile_s"] for r in result["rows"] if "compile_s" in r}
    for (family, batch), s in warmups.items():
        lines.append(f"{family} batch {batch}: torch.compile warm-up (compiling, then one run of each cached mode) "
                     f"{s:.0f} s, not in the timings")
    for dt, g in result["golden"].items():
        lines.append(f"golden runs in {dt}: " + (g["error"] if "error" in g else
                     f"{g['exact']}/{g['total']} exact, token agreement {g['agreement']:.4f}"))
    return "\n".join(lines) + "\n\n" + table(result["rows"], GPU_COLUMNS)


# ----------------------------------------------------------------------------------------------------------
# 6. Command line

def compare(a_path: str, b_path: str) -> str:
    """Two --json results of the same modes (e.g. two commits, two machines) row by row."""
    a, b = (json.loads(open(p).read()) for p in (a_path, b_path))

    def key(r):
        return r.get("family"), r.get("variant"), r["batch"], r["cache"], r["rule"], r["stop"]
    old = {key(r): r for r in a["rows"] if "error" not in r}
    rows = [dict(r, before=old[key(r)]) for r in b["rows"] if "error" not in r and key(r) in old]
    return table(rows, [
        ("cache", lambda r: r["cache"]), ("rule", lambda r: r["rule"]), ("early stop", lambda r: r["stop"]),
        ("NFE before", lambda r: str(r["before"]["nfe"])), ("NFE after", lambda r: str(r["nfe"])),
        ("wall s before", lambda r: f"{r['before']['seconds']:.2f}"), ("wall s after", lambda r: f"{r['seconds']:.2f}"),
        ("after / before", lambda r: f"{r['seconds'] / r['before']['seconds']:.2f}x"),
        ("same ids", lambda r: "yes" if r["ids_sha1"] == r["before"]["ids_sha1"] else "no")])


def random_model(args, device, dtype):
    """Write (or reuse, with --dir) the random checkpoint the arguments describe and load it."""
    folder = args.dir or tempfile.mkdtemp(prefix="fastdllm_bench_")
    try:
        if not os.path.exists(os.path.join(folder, "config.json")):
            make_checkpoint(folder, args.family, args.d_model, args.layers, args.vocab, args.heads, args.kv_heads,
                            args.ffn, shards=args.shards, gain=args.gain, logit_std=args.logit_std)
        return load_model(folder, device=device, dtype=dtype)
    finally:
        if not args.dir:   # the loaded model holds its own copy (float32) or the mapped pages (bf16)
            shutil.rmtree(folder, ignore_errors=True)


def main(argv=None):
    shape = argparse.ArgumentParser(add_help=False)
    shape.add_argument("--family", default="llada", help="llada | dream")
    shape.add_argument("--d-model", type=int, default=512)
    shape.add_argument("--layers", type=int, default=4)
    shape.add_argument("--heads", type=int, default=None, help="default d_model / 128")
    shape.add_argument("--kv-heads", type=int, default=None, help="default = heads")
    shape.add_argument("--ffn", type=int, default=None, help="default 3 x d_model")
    shape.add_argument("--vocab", type=int, default=126464, help="default LLaDA's real embedding_size")
    shape.add_argument("--shards", type=int, default=1)
    shape.add_argument("--gain", type=float, default=1.13, help="random weights' std x sqrt(d_model)")
    shape.add_argument("--logit-std", type=float, default=13.0, help="std of the random LM head's logits")
    shape.add_argument("--dir", default=None, help="keep the checkpoint here (reused if it exists)")
    run = argparse.ArgumentParser(add_help=False)
    run.add_argument("--prompt-length", type=int, default=64)
    run.add_argument("--block-length", type=int, default=32)
    run.add_argument("--batch", type=int, default=1)
    run.add_argument("--caches", default="none,prefix,dual,free")
    run.add_argument("--threshold", "--thresholds", dest="thresholds", default="0.9", help="comma-separated")
    run.add_argument("--device", default=None)
    run.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    run.add_argument("--repeat", type=int, default=1, help="best wall time of this many runs per row")
    run.add_argument("--json", default=None, help="write every row, the settings and the environment here")

    p = argparse.ArgumentParser(description="fastdllm benchmarks (see the module docstring)")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("modes", parents=[shape, run], help="the modes table on a random checkpoint")
    m.add_argument("--gen-length", type=int, default=128)
    m.add_argument("--steps", type=int, default=None, help="default gen-length")
    m.add_argument("--factors", default="", help="comma-separated factor values (e.g. 1.0)")
    m.add_argument("--stops", default="off", help="early stop values: off,on,k")
    m.add_argument("--guide", default=None, help="a causal guide model folder: adds guided rows")
    s = sub.add_parser("sweep", parents=[shape, run], help="cost per token against gen length")
    s.add_argument("--lengths", default="128,256,512,1024")
    s.set_defaults(thresholds="")   # one token per step: a token's cost is then one call's (uses the first value)
    c = sub.add_parser("compare", help="two --json results side by side")
    c.add_argument("before")
    c.add_argument("after")
    g = sub.add_parser("gpu-check", help="the prepared GPU check (8B-shaped checkpoints)")
    g.add_argument("--out", required=True, help="JSON results (rewritten after every row)")
    g.add_argument("--shape", default="8b", help="8b (LLaDA-8B and Dream-7B shapes) | tiny (the CPU test)")
    g.add_argument("--families", default="llada,dream")
    g.add_argument("--batches", default="1,16")
    g.add_argument("--caches", default="none,prefix,dual,free")
    g.add_argument("--thresholds", default="0.9")
    g.add_argument("--factors", default="1.0")
    g.add_argument("--prompt-length", type=int, default=64)
    g.add_argument("--gen-length", type=int, default=256)
    g.add_argument("--block-length", type=int, default=32)
    g.add_argument("--shards", type=int, default=4)
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--peak-bandwidth", type=float, default=4.8e12, help="bytes/s (default: H200, 4.8 TB/s)")
    g.add_argument("--compile", nargs="?", const="default", default=None,
                   help="also run the cached modes through torch.compile(model) (optional mode, e.g. max-autotune)")
    g.add_argument("--no-golden", action="store_true", help="skip the golden parity runs")
    g.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp folder)")
    g.add_argument("--keep", action="store_true", help="keep the checkpoints")
    k = sub.add_parser("checkpoint", parents=[shape], help="write a random checkpoint")
    k.add_argument("out")
    args = p.parse_args(argv)

    if args.cmd == "compare":
        return print(compare(args.before, args.after))
    if args.cmd == "gpu-check":
        return gpu_check(args)
    if args.cmd == "checkpoint":
        size = make_checkpoint(args.out, args.family, args.d_model, args.layers, args.vocab, args.heads,
                               args.kv_heads, args.ffn, shards=args.shards, gain=args.gain, logit_std=args.logit_std)
        return print(f"{args.out}: {size / 1e9:.3f} GB")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = random_model(args, device, dtype)
    prompt = random_prompts(model.config, args.batch, args.prompt_length).to(device)
    env = environment(device, dtype)
    about = (f"random {args.family} checkpoint d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; "
             f"batch {args.batch}, prompt {args.prompt_length}, block {args.block_length}, {env['dtype']} on "
             f"{env['gpu'] or env['cpu']}, {env['threads']} threads")
    if args.cmd == "sweep":
        rows = sweep(model, prompt, split(args.lengths, int), split(args.caches, str), args.block_length,
                     (split(args.thresholds, float) or [None])[0], args.repeat)
        print(about + "\n\n" + table(rows, SWEEP_COLUMNS))
    else:
        guide = load_model(args.guide, device=device, dtype=dtype) if args.guide else None
        kw = dict(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps)
        mode_list = modes(split(args.caches, str), split(args.thresholds, float), split(args.factors, float),
                          split(args.stops, parse_stop), ["deterministic"] if guide is not None else [])
        rows, _ = run_modes(model, prompt, mode_list, kw, guide, repeat=args.repeat)
        print(about + f", gen {args.gen_length}; {PeakMemory(device).what}\n\n" + table(rows, MODE_COLUMNS))
    if args.json:
        write_json(args.json, settings=vars(args), environment=env, rows=rows)


if __name__ == "__main__":
    main()
