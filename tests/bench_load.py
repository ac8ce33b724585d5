"""
bench_load.py: how much memory load_model needs, and what int8 weights save, measured. A benchmark to run by hand,
not a test (it writes a checkpoint to a temp folder: about 1 GB and a minute by default, 16 GB with --shape 8b).

    python tests/bench_load.py                          # ~1 GB checkpoint, 6 shards: bf16, float32, int8
    python tests/bench_load.py --gb 4                   # bigger
    python tests/bench_load.py --shape 8b --decode 8    # LLaDA-8B's shape (16 GB), and a short decode per row

It writes a synthetic checkpoint with LLaDA's layout (its tensor names, config.json fields and sharding
into model-0000i-of-00006.safetensors + model.safetensors.index.json, only random), then loads it in a fresh
Python process per row, so that nothing but the load counts, with `model.load_model(path, device="cpu",
dtype=..., quantize=...)`. That process reads its RSS just before the call and its peak RSS (VmHWM in
/proc/self/status) just after, and the weights' bytes as stored (quant.weight_bytes: an int8 weight's values and
scales). The goals: for bf16 -> bf16 a peak of at most 1.2x the checkpoint (the weights once, plus the pages of
the file being read: safetensors maps it); for int8 at most 1.2x the int8 weights (each weight quantized as it is
read, its pages let go: never the bf16 model). Loading bf16 as float32 needs 2x by construction; it is reported,
not judged, and left out where it would not fit in memory. --decode G then times one generate() per row (prompt
G random ids, gen G, one block, DualCache, threshold 0.9, this process's threads; random weights, so the ids
only say whether int8 decodes as bf16 does). Linux only.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from shapes import SHAPES, make_checkpoint  # noqa: E402  (the one writer of random checkpoints)

GB = 1e9

CHILD = """
import json, sys, time, torch
sys.path.insert(0, {root!r})
import model, quant
from fastdllm import generate

def status(field):   # kB -> bytes
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

quant.int8_quantizer({quantize!r})   # torchao's import (~150 MB of code and data, whatever the model) before "before"
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")       # reset VmHWM to the current RSS (Linux >= 4.0), so import spikes do not count
except OSError:
    pass
before, t0 = status("VmRSS"), time.perf_counter()
m = model.load_model({path!r}, device="cpu", dtype=getattr(torch, {dtype!r}), quantize={quantize!r})
seconds, peak, after = time.perf_counter() - t0, status("VmHWM"), status("VmRSS")
for t in m.state_dict().values():
    getattr(t, "qdata", t).max()     # read every weight once, as the first forward pass will (a mapped file's pages)
out = dict(before=before, peak=peak, after=after, touched=status("VmHWM"), seconds=seconds,
           weights=quant.weight_bytes(m))
if {decode}:
    prompt = torch.randint(0, m.config.mask_id, (1, {decode}), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ids, st = generate(m, prompt, gen_length={decode}, block_length={decode}, cache="dual", threshold=0.9)
    out.update(nfe=st["nfe"], decode_s=st["seconds"], ids=ids[0, {decode}:].tolist(), threads=torch.get_num_threads())
print(json.dumps(out))
"""


def write_checkpoint(folder: str, gb: float, shape: str, n_shards: int = 6) -> int:
    """A random bf16 LLaDA-layout checkpoint (tools/checkpoint.py): about `gb` GB, or LLaDA-8B's shape."""
    if shape == "8b":
        s = SHAPES["llada-8b"]
        return make_checkpoint(folder, "llada", s["d_model"], s["n_layers"], s["vocab"], s["n_heads"], s["n_kv_heads"],
                               s["ffn"], shards=n_shards)
    d_model, vocab = 1536, 32768
    per_layer = (4 * d_model * d_model + 9 * d_model * d_model + 2 * d_model) * 2
    n_layers = max(1, round((gb * GB - 2 * vocab * d_model * 2) / per_layer))
    return make_checkpoint(folder, "llada", d_model, n_layers, vocab, shards=n_shards)


def measure(folder: str, dtype: str, quantize: str | None, decode: int) -> dict:
    code = CHILD.format(root=ROOT, path=folder, dtype=dtype, quantize=quantize, decode=decode)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description="peak RSS of model.load_model on a synthetic LLaDA checkpoint")
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (bf16)")
    p.add_argument("--shape", choices=("gb", "8b"), default="gb", help="8b: LLaDA-8B's shape (16 GB), not --gb")
    p.add_argument("--decode", type=int, default=0, help="also time one decode of this many tokens per row")
    p.add_argument("--dir", default=None, help="where to write it (default: a temp folder, removed after)")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="bench_load_", dir=args.dir)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        size = write_checkpoint(folder, args.gb, args.shape)
        n = len([f for f in os.listdir(folder) if f.endswith(".safetensors")])
        first = None
        for dtype, quantize in (("bfloat16", None), ("bfloat16", "int8"), ("float32", None), ("float32", "int8")):
            if dtype == "float32" and quantize is None and 2.2 * size > ram:
                print(f"as float32: not run, {2 * size / GB:.1f} GB of weights in {ram / GB:.1f} GB of memory")
                continue
            r = measure(folder, dtype, quantize, args.decode)
            load, used, w = r["peak"] - r["before"], r["touched"] - r["before"], r["weights"]
            what = f"{dtype}{' int8' * bool(quantize)}"
            print(f"checkpoint {size / GB:.2f} GB (bf16, {n} shards) as {what}: weights {w / GB:.2f} GB | peak RSS "
                  f"during load +{load / GB:.2f} GB = {load / size:.2f}x the checkpoint, {load / w:.2f}x the weights "
                  f"| once every weight is read +{used / GB:.2f} GB = {used / w:.2f}x the weights | load "
                  f"{r['seconds']:.0f} s (raw: {r['before'] / GB:.2f} GB before, {r['peak'] / GB:.2f} GB peak)",
                  flush=True)
            if args.decode:
                first = first or r["ids"]
                same = sum(a == b for a, b in zip(r["ids"], first)) / len(first)
                print(f"  decode {args.decode} tokens ({r['threads']} threads): {r['nfe']} calls, {r['decode_s']:.1f} "
                      f"s, {args.decode / r['decode_s']:.2f} tokens/s, {r['decode_s'] / r['nfe']:.1f} s a call; ids "
                      f"equal to the first row's: {same:.0%}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
