"""
tools/side_by_side.py: ours against the official Fast-dLLM LLaDA decode (`generate`, `generate_with_prefix_cache`,
`generate_with_dual_cache` of NVlabs/Fast-dLLM llada/generate.py at the commit tools/gpu_prep.py pins), on the same
device in the same run: tools/gpu_check.py's "official" phase.

Both sides decode the same random prompts with the same settings (gen 128, block 32, temperature 0; one token a step,
or threshold 0.9) on LLaDA-8B's shape with the same random bf16 weights: every checkpoint tensor drawn from a generator
seeded by its name (`fill`), into our fused layout on our side and into the official LLaDAModelLM on theirs, so both
decode the same model (their ids' agreement is reported: bf16 kernels of other shapes round differently). Each row:
model calls, seconds, ms per call, tokens/s (every generated token of every row), after one untimed call with the
same settings. Ours runs its default path (CUDA graphs on CUDA: a CudaGraphs per mode, which the untimed call warms
up), and eager (cuda_graphs=False) where asked.

The official code runs in a process of its own: tools/gpu_prep.py's wheels (transformers 4.49.0, the release its
requirements.txt pins) first on its path, its folder `llada/` next (its `model` package would shadow our model.py);
its LLaDAModelLM is made on the meta device and filled on the device, no checkpoint. At the pinned commit its generate
functions decode one row (their canvas is (1, L)): the child tries two rows first, and if they are refused, its rows
at batch B are its batch-1 run, one row after another (`batched` False, the batch-1 numbers).
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib

import torch

from fastdllm import CudaGraphs, generate
from layout import checkpoint_names, fused_parts, stored_at

MODES = {"none": "generate", "prefix": "generate_with_prefix_cache", "dual": "generate_with_dual_cache"}
RULES = {"1/step": None, "tau 0.9": 0.9}


def seeded(name: str, device) -> torch.Generator:
    return torch.Generator(device).manual_seed(zlib.crc32(name.encode()))


def fill(model) -> None:
    """Random weights by checkpoint tensor, as the official side fills its own: N(0, 0.02) from a generator seeded by
    the tensor's checkpoint name (an expert's, a part of a fused weight: into its rows), the 1-D ones (norms) 1."""
    params, parts = dict(model.named_parameters()), fused_parts(model)
    with torch.no_grad():
        for theirs, ours in checkpoint_names(model.config, model).items():
            target, where, _, flip = stored_at(params, parts, ours)
            t = params[target] if where is None else params[target][where]
            t = t.t() if flip else t
            t.normal_(0, 0.02, generator=seeded(theirs, t.device)) if t.ndim > 1 else t.fill_(1.0)


CHILD = r"""
import json, sys, time, zlib, torch
spec = json.load(open(sys.argv[1]))
sys.path[:0] = [p for p in (spec["site"], spec["llada"]) if p]   # the carried wheels, then the official llada/
import generate as G
from model.configuration_llada import LLaDAConfig
from model.modeling_llada import LLaDAModelLM
dev, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
torch.set_default_dtype(dtype)
with torch.device("meta"):
    model = LLaDAModelLM(LLaDAConfig(**spec["config"]), init_params=False)
torch.set_default_dtype(torch.float32)
model.to_empty(device=dev)
with torch.no_grad():             # tools/side_by_side.py fill(): the same tensor from the same name
    for name, p in model.named_parameters():
        gen = torch.Generator(dev).manual_seed(zlib.crc32(name.encode()))
        p.normal_(0, 0.02, generator=gen) if p.ndim > 1 else p.fill_(1.0)
model.eval()
sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
prompts = torch.tensor(spec["prompts"], device=dev)
gen, block, mask = spec["gen_length"], spec["block_length"], spec["config"]["mask_token_id"]
print(json.dumps(dict(ready=True, transformers=getattr(sys.modules.get("transformers"), "__version__", None))),
      flush=True)

def run(fn, x, threshold):
    sync()
    t0 = time.perf_counter()
    out, nfe = fn(model, x, steps=gen, gen_length=gen, block_length=block, temperature=0.0, mask_id=mask,
                  threshold=threshold)
    sync()
    return out, nfe, time.perf_counter() - t0

try:                              # does its generate take a batch? (at the pinned commit: one row)
    G.generate(model, prompts[:2], steps=block, gen_length=block, block_length=block, mask_id=mask)
    batched = True
except RuntimeError:
    batched = False
done = {}
for row in spec["rows"]:
    fn, B, threshold = getattr(G, row["fn"]), row["batch"], row["threshold"]
    if B > 1 and not batched and (row["fn"], threshold) in done:
        print(json.dumps(dict(row, **done[row["fn"], threshold], batch=B, batched=False)), flush=True)
        continue
    x = prompts[:B if batched else 1]
    run(fn, x, threshold)                                # untimed: the first call's set-up
    out, nfe, seconds = run(fn, x, threshold)
    res = dict(nfe=nfe, seconds=seconds, ms_per_call=1e3 * seconds / nfe,
               tokens_per_s=x.shape[0] * gen / seconds, ids=out[:, -gen:].tolist())
    done[row["fn"], threshold] = res
    print(json.dumps(dict(row, **res, batched=batched or B == 1)), flush=True)
"""


def official(spec: dict, timeout: float) -> tuple[list, str | None]:
    """The official rows, run in a child process -> (the rows it finished, an error or None). `spec`: site, llada,
    device, dtype, config, prompts, gen_length, block_length, rows [{fn, cache, rule, threshold, batch}]."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH="")         # nothing of ours on its path: its `model` is its own
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, f.name], capture_output=True, text=True,
                           timeout=max(timeout, 1), env=env, cwd=tempfile.gettempdir())
        out, err = r.stdout, None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]
    except subprocess.TimeoutExpired as e:
        out, err = e.stdout or "", f"out of time ({timeout:.0f} s)"
        out = out.decode() if isinstance(out, bytes) else out
    finally:
        os.unlink(f.name)
    lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    if not any(ln.get("ready") for ln in lines) and err is None:
        err = "the official code printed nothing"
    return [ln for ln in lines if not ln.get("ready")], err


def ours(model, prompts, row: dict, gen: int, block: int, graphs: bool) -> dict:
    """Our row: one untimed call, then one timed, with the row's settings (graphs: the default path on CUDA)."""
    B, threshold = row["batch"], row["threshold"]
    kw = dict(gen_length=gen, block_length=block, cache=row["cache"], threshold=threshold,
              cuda_graphs=CudaGraphs() if graphs else False)
    x = prompts[:B]
    sync = (lambda: torch.cuda.synchronize(x.device)) if x.is_cuda else (lambda: None)
    t0 = time.perf_counter()
    generate(model, x, **kw)
    warm = time.perf_counter() - t0
    sync()
    t0 = time.perf_counter()
    out, st = generate(model, x, **kw)
    sync()
    seconds = time.perf_counter() - t0
    return dict(row, side="ours, CUDA graphs" if graphs else "ours, eager", nfe=st["nfe"], seconds=seconds,
                warm_s=warm, ms_per_call=1e3 * seconds / st["nfe"], tokens_per_s=B * gen / seconds,
                ids=out[:, -gen:].tolist())


def rows(batches) -> list[dict]:
    return [dict(fn=fn, cache=cache, rule=rule, threshold=t, batch=B) for B in batches
            for rule, t in RULES.items() for cache, fn in MODES.items()]


def compare(ours_rows: list, theirs: list) -> list[dict]:
    """One line per mode and batch: ms per call and tokens/s of each, ours / official (graphs and eager), and the share
    of our default path's ids equal to the official's."""
    key = lambda r: (r["cache"], r["rule"], r["batch"])      # noqa: E731
    official_by = {key(r): r for r in theirs}
    table = []
    for r in (r for r in ours_rows if r["side"] == "ours, CUDA graphs"):
        o, e = official_by.get(key(r)), next((x for x in ours_rows if x["side"] == "ours, eager" and key(x) == key(r)),
                                             None)
        line = dict(cache=r["cache"], rule=r["rule"], batch=r["batch"], ours_nfe=r["nfe"], ours_ms=r["ms_per_call"],
                    ours_tokens_per_s=r["tokens_per_s"], eager_ms=e and e["ms_per_call"])
        if o:
            same = [a == b for x, y in zip(r["ids"], o["ids"]) for a, b in zip(x, y)]
            line.update(official_nfe=o["nfe"], official_ms=o["ms_per_call"], official_tokens_per_s=o["tokens_per_s"],
                        official_batched=o["batched"], ms_ratio=r["ms_per_call"] / o["ms_per_call"],
                        tokens_ratio=r["tokens_per_s"] / o["tokens_per_s"],
                        eager_ms_ratio=e and e["ms_per_call"] / o["ms_per_call"], ids_agreement=sum(same) / len(same))
        table.append(line)
    return table
