"""
tools/loop_time.py: the CPU seconds of generate() per decoding mode, for one checkout, so that two checkouts
(say, before and after a change to the loop) can be compared on a shared machine, where CPU time is steadier
than wall time. Prints one JSON line: mode -> [best CPU seconds, NFE, a hash of the output ids].

    python tools/checkpoint.py /tmp/mid512                                # a random 512-wide LLaDA checkpoint
    git worktree add /tmp/old16 808e5a1
    python tools/loop_time.py --root /tmp/old16 --model /tmp/mid512      # then --root . ; take turns
    python tools/loop_time.py --root . --model demo/llada-arith --gen-length 32 --block-length 8 --repeat 20
"""
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run as a script from anywhere

import flags  # noqa: E402
from flags import Parser, integer, nonempty  # noqa: E402  (standard library only: imports no fastdllm)


def main(argv=None):
    p = Parser(prog="tools/loop_time.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--root", type=nonempty, default=ROOT, help="the checkout whose fastdllm.py is timed "
                   "(default: this one)")
    p.add_argument("--model", type=nonempty, required=True, help="a checkpoint folder")
    p.add_argument("--gen-length", type=integer(1), default=64, help="default: %(default)s")
    p.add_argument("--block-length", type=integer(1), default=32, help="default: %(default)s")
    p.add_argument("--prompt-length", type=integer(1), default=64, help="random prompt ids (the demo model: its "
                   "question) (default: %(default)s)")
    p.add_argument("--repeat", type=integer(1), default=3, help="best of this many runs per mode (default: "
                   "%(default)s)")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.root, "fastdllm.py")):
        raise ValueError(f"--root {args.root} holds no fastdllm.py: pass a checkout of this repository")
    sys.path.insert(0, os.path.abspath(args.root))     # its fastdllm and model, not this checkout's
    import torch
    from fastdllm import generate
    from model import load_model

    torch.set_num_threads(1)
    model = load_model(args.model, device="cpu", dtype=torch.float32)
    if os.path.exists(os.path.join(args.model, "tokenizer.json")) and model.config.vocab_size < 1000:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
        question = "Tom has 23 apples and buys 45 more. How many apples does he have?"
        prompt = torch.tensor([tok.encode(question, add_special_tokens=False).ids])
    else:
        prompt = torch.randint(0, 1000, (1, args.prompt_length), generator=torch.Generator().manual_seed(0))
    G = args.gen_length
    rows = {}
    for mode in [dict(cache=c, **r) for c in ("none", "prefix", "dual", "free") for r in ({}, {"threshold": 0.9})]:
        best = float("inf")
        for _ in range(args.repeat):
            c0 = time.process_time()
            out, st = generate(model, prompt, gen_length=G, block_length=args.block_length, steps=G, **mode)
            best = min(best, time.process_time() - c0)
        rows[json.dumps(mode)] = [round(best, 4), st["nfe"], hash(tuple(out[0].tolist())) % 10**8]
    print(json.dumps(rows))


if __name__ == "__main__":
    flags.run(main)
