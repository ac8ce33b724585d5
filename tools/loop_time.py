"""
tools/loop_time.py: the CPU seconds of generate() per decoding mode, for one checkout, so that two checkouts
(say, before and after a change to the loop) can be compared on a shared machine, where CPU time is steadier
than wall time. Prints one JSON line: mode -> [best CPU seconds, NFE, a hash of the output ids].

    python tools/checkpoint.py /tmp/mid512                                # a random 512-wide LLaDA checkpoint
    git worktree add /tmp/old16 808e5a1
    python tools/loop_time.py --root /tmp/old16 --model /tmp/mid512      # then --root . ; take turns
    python tools/loop_time.py --root . --model demo/llada-arith --gen-length 32 --block-length 8 --repeat 20
"""
import argparse
import json
import os
import sys
import time

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--root", default=".", help="the checkout whose fastdllm.py is timed (default: this one)")
p.add_argument("--model", required=True, help="a checkpoint folder")
p.add_argument("--gen-length", type=int, default=64)
p.add_argument("--block-length", type=int, default=32)
p.add_argument("--prompt-length", type=int, default=64, help="random prompt ids (the demo model: its question)")
p.add_argument("--repeat", type=int, default=3, help="best of this many runs per mode")
args = p.parse_args()
sys.path.insert(0, os.path.abspath(args.root))
import torch  # noqa: E402
from fastdllm import generate  # noqa: E402
from model import load_model  # noqa: E402

torch.set_num_threads(1)
model = load_model(args.model, device="cpu", dtype=torch.float32)
if os.path.exists(os.path.join(args.model, "tokenizer.json")) and model.config.vocab_size < 1000:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    ids = tok.encode("Tom has 23 apples and buys 45 more. How many apples does he have?", add_special_tokens=False).ids
    prompt = torch.tensor([ids])
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
