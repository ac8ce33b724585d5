"""
loading.py: what every program of the project (the CLI, serve.py, bench.py, harness.py) does to get a model onto a
device: the --device and --dtype it runs in, and load_model said on stderr (a live line on a terminal, then one
summary line), the guide's small files checked against the model's before its weights are read.
"""
import sys
import time

import torch

from chat import load_tokenizer
from guided import check_guide
from model import load_model, read_config, resolve_model_dir
from quant import weight_bytes


def pick_device_dtype(device: str | None, dtype: str | None):
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available here: use --device cpu")
    if device not in ("cpu", "mps") and not device.startswith("cuda"):
        raise ValueError(f"unknown --device {device!r}: use cpu or cuda (cuda:N)")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in dtypes:
        raise ValueError(f"unknown --dtype {dtype!r}: use float32, bfloat16 or float16")
    if device == "cpu" and dtype == "float16":
        raise ValueError("--dtype float16 is not supported on CPU: use float32 (or bfloat16)")
    if device.startswith("cuda") and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU does not support bfloat16: use --dtype float16 or float32")
    return torch.device(device), dtypes[dtype]


def load(what: str, model_dir: str, device, dtype, quantize=None):
    """load_model, said on stderr (stdout holds only answers): on a terminal a live line (shard i of n, GB
    read), then one summary line, the only one when stderr is a file or a pipe."""
    start, tty, seen = time.perf_counter(), sys.stderr.isatty(), {"shown": 0.0, "total": 0}

    def progress(shard, n, done, total):
        seen["total"] = total
        if tty and time.perf_counter() - seen["shown"] > 0.1:
            seen["shown"] = time.perf_counter()
            print(f"\rloading {what}: shard {shard} of {n}, {done / 1e9:.1f} of {total / 1e9:.1f} GB", end="",
                  file=sys.stderr, flush=True)
    try:
        model = load_model(model_dir, device=device, dtype=dtype, progress=progress, quantize=quantize)
    finally:
        if seen["shown"]:
            print("\r\x1b[K", end="", file=sys.stderr)    # clear the live line
    size = lambda n: f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"      # noqa: E731
    held = f"{quantize} weights: {size(weight_bytes(model))} held, {size(seen['total'])} read" if quantize else \
        size(seen["total"])
    print(f"loaded {what} in {time.perf_counter() - start:.2f} s ({held})", file=sys.stderr)
    return model


def load_guide(guide_dir, args, cfg, chat, device, dtype):
    """--guide: check that it shares the model's token ids on its small files, then load it (or None)."""
    if not guide_dir:
        return None
    try:   # with both tokenizers every shared id is compared token by token; else the configs' ids
        guide_tok = load_tokenizer(guide_dir)
    except FileNotFoundError:
        guide_tok = None
    check_guide(cfg, read_config(guide_dir), chat.tok, guide_tok)
    try:
        return load(f"the guide {args.guide}", resolve_model_dir(args.guide, role="guide"), device, dtype, args.quantize)
    except ValueError as e:     # a truncated or corrupt file: say it is the guide's
        raise ValueError(f"the guide {args.guide}: {e}") from None
