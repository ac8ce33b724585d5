"""
flags.py: the flags of apps/bench.py and tools/, each type- and range-checked. A bad value is one line that
names its flag (`error: bench.py run: argument --batch: expected an integer >= 1, got '0'`), exit status 2,
no traceback; combinations are checked where they are used (shapes.py shape_config, bench.py).
"""
import argparse
import json
import math
import os
import tempfile


class Parser(argparse.ArgumentParser):
    """argparse, with every error one line naming the flag, and no usage block."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def new_parser(**kw) -> argparse.ArgumentParser:
    """An ArgumentParser whose errors are one line, a ValueError the programs print as `error: ...` (fastdllm.py's
    command line and serve.py: cli.run; argparse would print its usage too)."""
    p = argparse.ArgumentParser(**kw)

    def error(message):
        raise ValueError(f"{message} (see --help)")
    p.error = error
    return p


def integer(low: int, high: int | None = None):
    """An integer >= low (and <= high)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}{f' and <= {high}' * (high is not None)}"
                                             f", got {text!r}")
        return value
    return parse


def positive(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def listing(kind, empty=True):
    """Comma-separated values, each parsed by `kind` (one of these types, or a tuple of allowed names)."""
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        for t in items if isinstance(kind, tuple) else ():
            if t not in kind:
                raise argparse.ArgumentTypeError(f"unknown value {t!r}: use {', '.join(kind)}")
        values = items if isinstance(kind, tuple) else [kind(t) for t in items]
        if not values and not empty:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values
    return parse


def stop(text: str):
    """An early stop value: off | on (at a block's end) | k >= 1 (k end tokens in a row, FlashDLM)."""
    t = text.strip().lower()
    if t not in ("off", "on") and not (t.isdigit() and int(t) >= 1):
        raise argparse.ArgumentTypeError(f"expected off, on or k >= 1 (k end tokens in a row), got {text!r}")
    return t == "on" if t in ("off", "on") else int(t)


def writable(folder: str) -> bool:
    """Whether a file can be created in `folder`, by trying (os.access says yes to root on a read-only disk)."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
        return True
    except OSError:
        return False


def out_file(path: str) -> str:
    """A file we may write, checked now, not after the whole run: in an existing, writable folder, and new,
    empty or an earlier result of these tools (a JSON object with "rows"). Any other file is never overwritten."""
    folder = os.path.dirname(os.path.abspath(path)) if path.strip() else ""
    if not folder or os.path.isdir(path) or not os.path.isdir(folder) or not writable(folder):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: name a file in an existing, writable folder")
    if os.path.exists(path) and not (os.path.isfile(path) and os.access(path, os.W_OK) and is_result(path)):
        raise argparse.ArgumentTypeError(f"{path!r} exists and is not an earlier result of these tools (a JSON "
                                         f"file with rows): name a new file, nothing else is overwritten")
    return path


def is_result(path: str) -> bool:
    """Empty, or a JSON object with "rows" (bench.py --json, tools/gpu_check.py --out)."""
    if os.path.getsize(path) == 0:
        return True
    if os.path.getsize(path) > 1 << 28:      # no result is this large: don't read a checkpoint to find out
        return False
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):            # ValueError: not UTF-8, not JSON
        return False
    return isinstance(data, dict) and "rows" in data


def nonempty(text: str) -> str:
    """A path (or name) that is not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


# ----------------------------------------------------------------------------------------------------------
# The flag groups

def shape_arguments(p):
    p.add_argument("--family", default="llada", choices=("llada", "dream", "lladamoe", "fastdllm_v2", "sdar", "llada2"),
                   help="default: %(default)s")
    p.add_argument("--d-model", type=integer(2), default=512, help="default: %(default)s")
    p.add_argument("--layers", type=integer(1), default=4, help="default: %(default)s")
    p.add_argument("--heads", type=integer(1), default=None, help="default d_model / 128")
    p.add_argument("--kv-heads", type=integer(1), default=None, help="default = heads")
    p.add_argument("--ffn", type=integer(1), default=None, help="default 3 x d_model")
    p.add_argument("--vocab", type=integer(1), default=126464, help="default %(default)s, LLaDA's real embedding_size")
    p.add_argument("--shards", type=integer(1), default=1, help="default: %(default)s")
    p.add_argument("--gain", type=positive, default=1.13, help="random weights' std x sqrt(d_model) "
                   "(default: %(default)s)")
    p.add_argument("--logit-std", type=positive, default=13.0, help="std of the random LM head's logits "
                   "(default: %(default)s)")


def rows_arguments(p, thresholds="0.9", factors="1.0", stops="off,on"):
    """Which rows the table has, and how each is timed (bench.py run / modes / sweep, tools/gpu_check.py)."""
    from cache import CACHE_POLICIES    # here, not at the top: tools/load.py uses these types without torch
    p.add_argument("--caches", type=listing(tuple(CACHE_POLICIES), empty=False), default="none,prefix,dual,free",
                   help="cache modes, comma-separated (default: %(default)s)")
    p.add_argument("--thresholds", type=listing(positive), default=thresholds, help="threshold values, "
                   "comma-separated, '' = none (default: %(default)s)")
    if factors is not None:
        p.add_argument("--factors", type=listing(positive), default=factors, help="factor values, "
                       "comma-separated, '' = none (default: %(default)s)")
        p.add_argument("--stops", type=listing(stop, empty=False), default=stops, help="early stop values: "
                       "off, on (at a block's end), k (k end tokens in a row) (default: %(default)s)")
    p.add_argument("--repeat", type=integer(1), default=1, help="best wall time of this many runs per row "
                   "(default: %(default)s)")


def random_arguments(p):
    """The random checkpoint (tools/checkpoint.py) and the random prompt of modes and sweep."""
    shape_arguments(p)
    p.add_argument("--dir", type=nonempty, default=None, help="keep the checkpoint here (reused if it has this shape)")
    p.add_argument("--prompt-length", type=integer(1), default=64, help="default: %(default)s")
    p.add_argument("--block-length", type=integer(1), default=32, help="default: %(default)s")
    p.add_argument("--batch", type=integer(1), default=1, help="default: %(default)s")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--quantize", choices=("int8",), default=None, help="int8: weight-only int8 layers (quant.py)")
    p.add_argument("--json", type=out_file, default=None, help="write every row, the settings and the environment")


REFUSED = {"--cache": "pass --caches (a row per cache)", "--threshold": "pass --thresholds (rows per value)",
           "--batch-size": "pass --batch (the prompt, repeated)", "--prompt-file": "it decodes one --prompt",
           "--interactive": "it decodes one --prompt", "--trace": "it prints no answer",
           "--no-stream": "it prints no answer", "--no-early-stop": "pass --stops off"}


class Refused(argparse.Action):
    """A fastdllm.py flag that has no meaning here (why, e.g. "has no meaning in the modes table: ..."): refused in
    one line, never silently ignored, and not listed by --help."""

    def __init__(self, option_strings, dest, why="", **kw):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{self.option_strings[0]} {self.why}")


def run_arguments(p):
    """bench.py run's own flags; the rest are fastdllm.py's (bench.py adds them: cli.add_flags), and those with no
    meaning in a table are refused."""
    rows_arguments(p)
    # Parsed here, not passed through: they are prefixes of --prompt-file and --factors, which argparse would
    # otherwise take them for.
    p.add_argument("--prompt", default=None, help="the user message (default: the demo's first question)")
    p.add_argument("--factor", type=positive, default=None, help="adds a row per cache at this factor")
    p.add_argument("--batch", type=integer(1), default=1, help="the prompt, repeated (default: %(default)s)")
    p.add_argument("--json", type=out_file, default=None, help="write every row, the settings and the environment")
    for flag, why in REFUSED.items():
        p.add_argument(flag, action=Refused, why=f"has no meaning in the modes table: {why}")


def optional_float(text: str):
    try:
        return None if text.lower() in ("none", "off") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None


def optional_int(text: str):
    try:
        return None if text.lower() in ("none", "off") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or none, got {text!r}") from None


def checked(kind, ok, what: str):
    """An argparse type: kind(text), refused unless ok(value) (NaN fails every comparison), e.g.
    "argument --accept-k: expected an integer >= 1, got '0'"."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def run(main):
    """A tool's `__main__`: main(), with a bad input one line on stderr and exit status 2, no traceback."""
    import sys
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
