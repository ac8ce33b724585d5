"""
bench_load.py: how much memory load_model needs, measured. A benchmark to run by hand, not a test (it
writes about 1 GB to a temp folder and takes a minute on a laptop CPU).

    python tests/bench_load.py            # ~1 GB checkpoint, 6 shards
    python tests/bench_load.py --gb 4     # bigger

It writes a synthetic checkpoint with LLaDA's layout (its tensor names, config.json fields and sharding
into model-0000i-of-00006.safetensors + model.safetensors.index.json, only smaller and random), then loads
it in a fresh Python process, so that nothing but the load counts, with
`model.load_model(path, device="cpu", dtype=...)`. That process reads its RSS just before the call and its
peak RSS (VmHWM in /proc/self/status) just after. The goal for bf16 -> bf16 is a peak of at most 1.2x the
checkpoint: the weights once, plus the pages of the one shard being read (safetensors maps it). Loading the
same bf16 file as float32 needs 2x by construction; it is reported, not judged. Linux only.
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
from tools.checkpoint import make_checkpoint  # noqa: E402  (the one writer of random checkpoints in the real format)

GB = 1e9

CHILD = """
import json, sys, torch
sys.path.insert(0, {root!r})
import model

def status(field):   # kB -> bytes
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")       # reset VmHWM to the current RSS (Linux >= 4.0), so import spikes do not count
except OSError:
    pass
before = status("VmRSS")
m = model.load_model({path!r}, device="cpu", dtype=getattr(torch, {dtype!r}))
peak, after = status("VmHWM"), status("VmRSS")
for p in m.parameters():
    p.max()            # read every weight once, as the first forward pass will (pages in a mapped file)
print(json.dumps(dict(before=before, peak=peak, after=after, touched=status("VmHWM"),
                      params=sum(p.numel() * p.element_size() for p in m.parameters()))))
"""


def write_checkpoint(folder: str, gb: float, n_shards: int = 6) -> int:
    """A random bf16 LLaDA-layout checkpoint of about `gb` GB (tools/checkpoint.py); returns its bytes."""
    d_model, vocab = 1536, 32768
    per_layer = (4 * d_model * d_model + 9 * d_model * d_model + 2 * d_model) * 2
    n_layers = max(1, round((gb * GB - 2 * vocab * d_model * 2) / per_layer))
    return make_checkpoint(folder, "llada", d_model, n_layers, vocab, shards=n_shards)


def measure(folder: str, dtype: str) -> dict:
    code = CHILD.format(root=ROOT, path=folder, dtype=dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description="peak RSS of model.load_model on a synthetic LLaDA checkpoint")
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (bf16)")
    p.add_argument("--dir", default=None, help="where to write it (default: a temp folder, removed after)")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="bench_load_", dir=args.dir)
    try:
        size = write_checkpoint(folder, args.gb)
        n = len([f for f in os.listdir(folder) if f.endswith(".safetensors")])
        for dtype in ("bfloat16", "float32"):
            r = measure(folder, dtype)
            load, used = r["peak"] - r["before"], r["touched"] - r["before"]
            print(f"checkpoint {size / GB:.2f} GB (bf16, {n} shards) as {dtype} | peak RSS during load "
                  f"+{load / GB:.2f} GB = {load / size:.2f}x, once every weight is read +{used / GB:.2f} GB = "
                  f"{used / size:.2f}x (raw: {r['before'] / GB:.2f} GB before, {r['peak'] / GB:.2f} GB peak, "
                  f"{r['touched'] / GB:.2f} GB after reading; params {r['params'] / GB:.2f} GB)", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
