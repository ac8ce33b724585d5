"""
tools/reading.py: the definitions of this repository one decoding step runs, and the set-up before the loop, by
file: the least a reader who opens each one on the path opens (README "How it works" gives what readers new to the
code counted, who also open the definitions that hold a default or a field). sys.setprofile around generate() on
tiny checkpoints in the released formats, CPU, float32, batch 1, temperature 0. A lambda or comprehension counts as
the definition it is written in; a dataclass or NamedTuple built on the path counts as its class; the model's
layers count as one entry per definition, as they run.

    python tools/reading.py                        # LLaDA, Dream (DualCache, threshold 0.9), Fast-dLLM v2 (prefix),
                                                   #   DiffusionGemma (dual): the step at block step 1, the set-up
    python tools/reading.py --paths llada --list   # one path, every definition by name

The step is the first with block step 1 in a block after the first (Fast-dLLM v2's first block is the prompt's).
"""
import os
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import flags  # noqa: E402
import fastdllm  # noqa: E402
from model import load_model  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "golden")
DUAL = dict(cache="dual", threshold=0.9, gen_length=32, block_length=8)
# path -> (checkpoint: a folder, or a released repo tools/checkpoint.py writes at tiny sizes; generate()'s settings)
PATHS = {"llada": (os.path.join(ROOT, "demo", "llada-arith"), DUAL),
         "dream": (os.path.join(GOLDEN, "dream-tiny"), DUAL),
         "fastdllm_v2": ("Efficient-Large-Model/Fast_dLLM_v2_7B", dict(cache="prefix", gen_length=64)),
         "diffusiongemma": (os.path.join(GOLDEN, "diffusiongemma", "tiny_dg_seed1234"), dict(cache="dual"))}


def definition(frame) -> tuple[str, str] | None:
    """(file, name) of the repository's definition a frame runs, or None (torch, the standard library, this tool)."""
    code = frame.f_code
    if code.co_filename == "<string>" and code.co_name in ("__init__", "<lambda>"):    # a dataclass, a NamedTuple
        obj = frame.f_locals.get("self", frame.f_locals.get("_cls"))
        kind = obj if isinstance(obj, type) else type(obj)
        path = getattr(sys.modules.get(kind.__module__), "__file__", None) or ""
        return (os.path.relpath(path, ROOT), kind.__qualname__) if path.startswith(ROOT) else None
    if not code.co_filename.startswith(ROOT) or code.co_filename == os.path.abspath(__file__):
        return None
    name = getattr(code, "co_qualname", code.co_name).split(".<locals>")[0]   # a lambda: where it is written
    return os.path.relpath(code.co_filename, ROOT), name


def trace(model, prompt, settings: dict) -> dict:
    """generate() under sys.setprofile -> {"set-up": {(file, name)}, "step": {(file, name)}}: the set-up until the
    first feed; the step from the feed at block step 1 (of the second block, if there are two) to the next feed or
    the next block's start_block."""
    seen, now = defaultdict(set), ["set-up"]

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "feed" and code.co_filename == fastdllm.__file__:
            blocks, s, i = frame.f_locals["self"].canvas.blocks, frame.f_locals["s"], frame.f_locals["i"]
            now[0] = "step" if i == 1 and s == blocks[min(1, len(blocks) - 1)][0] else "after"
        elif code.co_name == "start_block" and now[0] == "step":
            now[0] = "after"
        where = definition(frame)
        if where and now[0] != "after":
            seen[now[0]].add(where)

    sys.setprofile(profile)
    try:
        fastdllm.generate(model, prompt, **settings)
    finally:
        sys.setprofile(None)
    seen["step"].add(("fastdllm.py", "generate"))       # the loop's own lines are generate's
    return dict(seen)


def checkpoint(where: str, scratch: str) -> str:
    if os.path.isdir(where):
        return where
    from tools.checkpoint import make_release
    folder = os.path.join(scratch, where.replace("/", "--"))
    os.makedirs(folder)
    make_release(folder, where)
    return folder


def main(argv=None):
    p = flags.Parser(prog="tools/reading.py", description="The definitions one decoding step, and its set-up, run.")
    p.add_argument("--paths", type=flags.listing(tuple(PATHS), empty=False), default=list(PATHS),
                   help=f"comma-separated, of {', '.join(PATHS)} (default: all)")
    p.add_argument("--list", action="store_true", help="every definition by name")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        for path in args.paths:
            folder, settings = PATHS[path]
            model = load_model(checkpoint(folder, scratch), device="cpu", dtype=torch.float32)
            prompt = torch.arange(11, 21)[None] % model.config.vocab_size
            for part, names in trace(model, prompt, settings).items():
                files = sorted({f for f, _ in names})
                print(f"{path} {part}: {len(names)} definitions in {len(files)} files ({', '.join(files)})")
                for f, n in sorted(names) if args.list else ():
                    print(f"    {f}: {n}")


if __name__ == "__main__":
    flags.run(main)
