"""
demo/eval.py: what Fast-dLLM's parallel decoding does to the demo model's answers, on a CPU in seconds.

    python demo/eval.py                 # markdown table: valid accuracy / mean NFE / tokens/s per setting
    python demo/eval.py --trace         # which tokens each step unmasks, at threshold 0.9 and 0.5, and guided

"valid" checks the whole worked solution, not only the final number: "x op y = z. The answer is z." must
parse, use each number of the question exactly once, be right, and end with the right answer. Threshold
decoding at a low tau commits two tokens that are each likely but not jointly (the first number of
"45 + 23" next to the second of "23 + 45"), which the final answer alone can hide.
"""
import argparse
import os
import re
import sys

import torch
from tokenizers import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # the repo root
sys.path.insert(0, HERE)
from terminal import render_trace
from fastdllm import generate
from model import load_model
from train import TEMPLATES, heldout

GEN = dict(gen_length=32, block_length=8)
SETTINGS = [  # (name, steps, threshold): steps over the whole 32-token answer
    ("1 token/step", 32, None),
    ("tau 0.9", 32, 0.9),
    ("tau 0.7", 32, 0.7),
    ("tau 0.5", 32, 0.5),
    ("fixed 4 tokens/step", 8, None),
]
SOLUTION = re.compile(r"(\d+) ([+-]) (\d+) = (\d+)\. The answer is (\d+)\.")


def is_valid(answer: str, key) -> bool:
    """The worked solution is complete and right; key = (template, a, b) of the question."""
    m = SOLUTION.fullmatch(answer)
    if m is None:
        return False
    x, op, y, z, final = int(m[1]), m[2], int(m[3]), int(m[4]), int(m[5])
    t, a, b = key
    truth = a + b if TEMPLATES[t][0] == "+" else a - b
    used = [x, y, z]
    uses_each_once = used.count(a) == (2 if a == b else 1) and used.count(b) == (2 if a == b else 1)
    right = (x + y if op == "+" else x - y) == z
    return uses_each_once and right and final == truth


def answer_text(tok, ids: list[int], eos_id: int) -> str:
    """As the CLI does: cut at the first eos, decode without specials."""
    cut = ids.index(eos_id) if eos_id in ids else len(ids)
    return tok.decode(ids[:cut], skip_special_tokens=True).strip()


def solve(model, tok, problems, **kw):
    """Decode a batch of problems (all templates have the same token length, so no padding is needed).
    -> (answers, per-problem NFE, tokens/s). A batch runs until its slowest row is done; a problem's own
    NFE counts only the steps that unmasked one of its tokens, i.e. the model calls it would have needed
    alone (every step unmasks >= 1 token in each row that still has masks)."""
    cfg = model.config
    prompt = torch.tensor([e.ids for e in tok.encode_batch([q for q, _, _ in problems], add_special_tokens=False)])
    masks_left = [torch.full((len(problems),), kw["gen_length"])]
    nfe = torch.zeros(len(problems))

    def count(x, stats):
        left = (x == cfg.mask_id).sum(-1)
        nfe.add_(left < masks_left[0])
        masks_left[0] = left

    out, stats = generate(model, prompt, on_step=count, **kw)
    answers = [answer_text(tok, row[prompt.shape[1]:], cfg.eos_id) for row in out.tolist()]
    return answers, nfe, stats["tokens_per_s"]


@torch.inference_mode()
def guide_greedy(model, tok, problems, gen_length: int = 32):
    """The causal guide (demo/qwen2-arith) on its own: greedy next-token decoding with a KV cache, one token
    per forward, the whole batch at once (equal prompt lengths). -> answers."""
    from cache import KVCache
    prompt = torch.tensor([e.ids for e in tok.encode_batch([q for q, _, _ in problems], add_special_tokens=False)])
    B, P = prompt.shape
    kv = KVCache.for_model(model, B, P + gen_length)
    logits, out = model(prompt, cache=kv)[:, -1], []
    for i in range(gen_length):
        out.append(logits.argmax(-1))                                          # (B,)
        logits = model(out[-1][:, None], cache=kv, start=P + i)[:, -1]
    ids = torch.stack(out, 1).tolist()
    return [answer_text(tok, row, model.config.eos_id) for row in ids]


GUIDED = [  # (name, acceptance): FlashDLM's rules; k = 2 since the demo vocabulary has only 48 tokens
    ("guided, deterministic", dict(accept="deterministic")),
    ("guided, top-2", dict(accept="topk", accept_k=2)),
    ("guided, top-2 relative 0.5", dict(accept="topk_relative", accept_k=2, accept_ratio=0.5)),
    # the speculative variant commits the guide's token where it rejects a draft: the guide's quality
    ("speculative, deterministic", dict(accept="deterministic", speculative=True)),
    ("speculative, top-2", dict(accept="topk", accept_k=2, speculative=True)),
    ("speculative, top-2 relative 0.5", dict(accept="topk_relative", accept_k=2, accept_ratio=0.5, speculative=True)),
]


def solve_guided(model, guide, tok, problems, **kw):
    """Guided decoding of a batch, decoded together (each row as it would be alone) -> (answers, mean NFE, mean
    guide forwards, tokens/s), per problem as alone: its diffusion calls (solve() counts them), and its guide
    calls, one to read its prompt and one verification per step (32 drafts or fewer fit one chunk of 32)."""
    answers, nfe, tps = solve(model, tok, problems, guide=guide, gen_length=GEN["gen_length"], **kw)
    return answers, nfe.mean().item(), 1 + nfe.mean().item(), tps


def table(model, tok, problems, caches, guide=None):
    solve(model, tok, problems[:8], steps=32, cache="none", **GEN)     # warm-up, not timed
    valid = lambda answers: sum(is_valid(a, key) for a, (_, _, key) in zip(answers, problems)) / len(problems)  # noqa
    print(f"| decoding | cache | valid | mean NFE | mean guide calls | tokens/s (batch {len(problems)}) |\n"
          f"|---|---|---|---|---|---|")
    for name, steps, tau in SETTINGS:
        for cache in caches:
            answers, nfe, tps = solve(model, tok, problems, steps=steps, cache=cache, threshold=tau, **GEN)
            print(f"| {name} | {cache} | {valid(answers):.3f} | {nfe.mean():.1f} | | {tps:.0f} |", flush=True)
    for name, acc in GUIDED if guide is not None else []:
        for cache in ("prefix", "free"):
            answers, nfe, calls, tps = solve_guided(model, guide, tok, problems, cache=cache, **acc)
            print(f"| {name} | {cache} | {valid(answers):.3f} | {nfe:.1f} | {calls:.1f} | {tps:.0f} |", flush=True)


def trace(model, tok, problem, tau: float, cache: str):
    """Print the answer canvas after every step (terminal.render_trace: _ = still masked, [tok] = unmasked at this
    step, $ = eos)."""
    cfg = model.config
    prompt = torch.tensor([tok.encode(problem[0], add_special_tokens=False).ids])
    P = prompt.shape[1]
    steps = []
    print(f"threshold {tau}, cache {cache}:")
    out, stats = generate(model, prompt, steps=32, cache=cache, threshold=tau,
                          on_step=lambda x, st: steps.append(x[0, P:].tolist()), **GEN)
    for line in render_trace(steps, tok, cfg.mask_id, {cfg.eos_id}):
        print(f"  {line}")
    answer = answer_text(tok, out[0, P:].tolist(), cfg.eos_id)
    print(f"  -> {answer!r} ({'valid' if is_valid(answer, problem[2]) else 'INVALID'}), NFE {stats['nfe']}\n")


def trace_guided(model, guide, tok, problem, cache="prefix", **acc):
    """A guided decode step by step: the drafts of each step (the diffusion model's argmax at every open
    position), the run the guide accepted, and where it cut it."""
    cfg = model.config
    prompt = torch.tensor([tok.encode(problem[0], add_special_tokens=False).ids])
    P, steps, drafts = prompt.shape[1], [], []
    argmax = model.forward

    def spy(*a, **k):                       # keep the drafts this step proposes, for the printout
        logits = argmax(*a, **k)
        drafts.append(logits[0].argmax(-1).tolist())
        return logits
    model.forward = spy
    try:
        out, stats = generate(model, prompt, guide=guide, gen_length=GEN["gen_length"], cache=cache,
                              on_step=lambda x, st: steps.append(x[0, P:].tolist()), **acc)
    finally:
        del model.forward
    print(f"guided ({acc or 'deterministic'}), cache {cache}:")
    name = lambda t: "$" if t == cfg.eos_id else tok.id_to_token(t)   # noqa: E731
    for i, (line, d, n) in enumerate(zip(render_trace(steps, tok, cfg.mask_id, {cfg.eos_id}), drafts,
                                          stats["committed"])):
        print(f"  {line}")
        print(f"          committed: {' '.join(name(t) for t in d[:n])} | not committed: {' '.join(name(t) for t in d[n:n + 6])} ...")
    answer = answer_text(tok, out[0, P:].tolist(), cfg.eos_id)
    print(f"  -> {answer!r} ({'valid' if is_valid(answer, problem[2]) else 'INVALID'}), NFE {stats['nfe']}, "
          f"guide calls {stats['guide_calls']}\n")


def main(argv=None):
    p = argparse.ArgumentParser(description="Evaluate Fast-dLLM decoding settings on the demo model.")
    p.add_argument("--model", default=os.path.join(HERE, "llada-arith"), help="model folder")
    p.add_argument("-n", type=int, default=200, help="held-out problems to evaluate")
    p.add_argument("--caches", default="none,prefix,dual,free", help="comma-separated cache modes for the table")
    p.add_argument("--trace", action="store_true", help="print a decoding trace at threshold 0.9 and 0.5 instead")
    p.add_argument("--index", type=int, default=None,
                   help="held-out problem to trace (default: the first that 0.9 solves and 0.5 breaks)")
    p.add_argument("--guide", default=os.path.join(HERE, "qwen2-arith"), help="guide for the guided rows "
                   "('' = none)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    problems = heldout(args.n)
    guide = load_model(args.guide, device="cpu", dtype=torch.float32) if args.guide else None
    if not args.trace:
        return table(model, tok, problems, args.caches.split(","), guide)
    index = args.index
    if index is None:
        good = solve(model, tok, problems, steps=32, cache="dual", threshold=0.9, **GEN)[0]
        bad = solve(model, tok, problems, steps=32, cache="dual", threshold=0.5, **GEN)[0]
        index = next((i for i, (g, b, (_, _, k)) in enumerate(zip(good, bad, problems))
                      if is_valid(g, k) and not is_valid(b, k)), 0)
    print(f"problem {index}: {problems[index][0]}\n")
    for tau in (0.9, 0.5):
        trace(model, tok, problems[index], tau, "dual")
    if guide is not None:
        trace_guided(model, guide, tok, problems[index])


if __name__ == "__main__":
    main()
