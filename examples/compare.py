"""
examples/compare.py: every method of examples/ and the built-in modes on the demo task, each as its command line
runs it -> docs/methods.md (one table) and docs/methods.png (valid answers against model calls per answer).

    python examples/compare.py                  # 200 held-out demo problems (minutes on a CPU)
    python examples/compare.py -n 20 --out /tmp  # a quick look, written elsewhere

Each row is a command line on the demo model (--model demo/llada-arith --gen-length 32 --block-length 8):
`python fastdllm.py FLAGS` for a built-in mode, `python examples/<method>.py FLAGS` for a fork. This script makes
the generate() call that command line makes (cli.parse_args and cli.settings; a fork's hooks from the
`cli.run(fork, **flags)` its file calls as a program, caught here) and decodes every held-out problem alone
(batch 1). valid: demo/eval.py's check of the whole worked solution; final number: "The answer is N." with the
right N; calls, tokens fed per call and time are generate()'s own stats. A fork file not in this checkout is
skipped, and the table says so.
"""
import argparse
import os
import re
import runpy
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "demo")]
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import cli  # noqa: E402
from eval import TEMPLATES, answer_text, heldout, is_valid  # noqa: E402
from fastdllm import generate  # noqa: E402
from model import load_model  # noqa: E402
from tools.png import scatter  # noqa: E402

DEMO = ["--gen-length", "32", "--block-length", "8"]
# (name, the fork's file in examples/ or None for fastdllm.py, its flags)
ROWS = [
    ("1 token/step", None, "--cache none --threshold none --no-early-stop"),
    ("1 token/step, early stop", None, "--cache none --threshold none"),
    ("4 tokens/step", None, "--cache none --threshold none --steps 8 --no-early-stop"),
    ("threshold 0.9", None, "--cache none --no-early-stop"),
    ("threshold 0.9, dual, early stop (CLI default)", None, ""),
    ("threshold 0.7, dual, early stop", None, "--threshold 0.7"),
    ("threshold 0.5, dual, early stop", None, "--threshold 0.5"),
    ("EB-Sampler", "eb_sampler.py", ""),
    ("KLASS", "klass.py", ""),
    ("dKV-Cache", "dkv_cache.py", ""),
    ("DPad", "dpad.py", ""),
    ("Prophet", "prophet.py", ""),
    ("Prophet, thresholds x3", "prophet.py", "--early 22.5 --mid 15 --late 7.5"),
    ("Prophet, thresholds x3, no suffix", "prophet.py", "--early 22.5 --mid 15 --late 7.5 --suffix '' --suffix-at -21"),
]
COLORS = {None: (31, 119, 180), "eb_sampler.py": (44, 160, 44), "klass.py": (214, 39, 40),
          "dkv_cache.py": (148, 103, 189), "dpad.py": (140, 86, 75), "prophet.py": (255, 127, 14)}


def fork_of(path: str):
    """Run a fork's file as a program with cli.run caught -> (its fork(**flags) -> hooks, its flags' defaults)."""
    caught, run = {}, cli.run
    cli.run = lambda fork=None, **own: caught.update(fork=fork, own=own)
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        cli.run = run
    return caught.get("fork"), caught.get("own", {})


def settings(model_dir: str, example: str | None, flags: str) -> tuple[dict, bool]:
    """The generate() keywords of the row's command line -> (keywords, whether to pass a seeded generator)."""
    argv, hooks = ["--model", model_dir, *DEMO, "--prompt", "-", *shlex.split(flags)], {}
    if example:
        fork, own = fork_of(os.path.join(HERE, example))
        values, rest = cli.own_flags(argv, **own)
        saved, sys.argv = sys.argv, [example, *argv]      # a fork's builder may read the CLI's flags (prophet.py)
        try:
            hooks = fork(**values) if fork else {}
        finally:
            sys.argv = saved
        argv = rest
    args = cli.parse_args(argv, hooks)
    args.hooks = hooks
    return cli.settings(args) | dict(stop_at_eos=not args.no_early_stop and "stop" not in hooks), "propose" not in hooks


def measure(model, tok, problems, kw: dict, seeded: bool) -> dict:
    """Every problem alone (batch 1): the shares valid and with the right final number, the mean calls per
    answer, tokens fed per call and seconds per answer."""
    generate(model, torch.tensor([tok.encode(problems[0][0], add_special_tokens=False).ids]), **kw)   # warm-up
    valid = right = calls = fed = seconds = 0
    for question, _, key in problems:
        prompt = torch.tensor([tok.encode(question, add_special_tokens=False).ids])
        gen = torch.Generator().manual_seed(0) if seeded else None
        out, st = generate(model, prompt, generator=gen, **kw)
        answer = answer_text(tok, out[0, prompt.shape[1]:].tolist(), model.config.eos_id)
        t, a, b = key
        final = re.search(r"The answer is (\d+)\.$", answer)
        valid += is_valid(answer, key)
        right += final is not None and int(final[1]) == (a + b if TEMPLATES[t][0] == "+" else a - b)
        calls, fed, seconds = calls + st["nfe"], fed + sum(st["fed"]), seconds + st["seconds"]
    n = len(problems)
    return dict(valid=valid / n, right=right / n, calls=calls / n, fed=fed / calls, ms=1000 * seconds / n)


def main(argv=None):
    p = argparse.ArgumentParser(description="Every method of examples/ and the built-in modes on the demo task.")
    p.add_argument("-n", type=int, default=200, help="held-out problems (default: %(default)s)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs"), help="folder for methods.md and methods.png")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = os.path.join(ROOT, "demo", "llada-arith")
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    problems, lines, points = heldout(args.n), [], []
    for name, example, flags in ROWS:
        command = f"{'examples/' + example if example else 'fastdllm.py'} {flags}".strip()
        if example and not os.path.isfile(os.path.join(HERE, example)):
            lines.append(f"| {name} | `{command}` | not run: examples/{example} is not in this checkout | | | | |")
            print(f"skipped {name}: examples/{example} is not in this checkout", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        r = measure(model, tok, problems, *settings(model_dir, example, flags))
        print(f"{name}: {r} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        lines.append(f"| {name} | `{command}` | {r['valid']:.1%} | {r['right']:.1%} | {r['calls']:.1f} | "
                     f"{r['fed']:.1f} | {r['ms']:.1f} |")
        points.append((r["calls"], r["valid"], name, COLORS[example]))
    scatter(points, os.path.join(args.out, "methods.png"), f"The demo task, {args.n} held-out problems",
            "model calls per answer", "valid answers", [("built-in modes (fastdllm.py)", COLORS[None])] +
            [(f"examples/{f}", c) for f, c in COLORS.items() if f and any(p[3] == c for p in points)])
    with open(os.path.join(args.out, "methods.md"), "w") as f:
        f.write(HEADER.format(n=args.n, threads=args.threads, argv="".join(" " + a for a in argv or sys.argv[1:])) +
                "\n".join(lines) + "\n" + NOTES)
    print(f"wrote {args.out}/methods.md and methods.png", file=sys.stderr)


HEADER = """# The methods on the demo task

Written by `python examples/compare.py{argv}` ({n} held-out problems of demo/eval.py, each decoded alone, batch 1,
on the CPU with {threads} torch thread(s)). Each row is a command line on the demo model, `python COMMAND --model
demo/llada-arith --gen-length 32 --block-length 8 --prompt "..."`. **valid**: the whole worked solution is right
(demo/eval.py's check); **final number**: "The answer is N." with the right N; **calls**: model calls per answer;
**fed**: tokens fed per call (the canvas is 50 tokens: an 18-token question and 32 answer positions); **ms**: time
per answer, generate()'s own clock (the machine is shared: compare times within one run only).

![valid answers against model calls per answer](methods.png)

| method | command | valid | final number | calls | fed | ms |
|---|---|---|---|---|---|---|
"""
NOTES = """
What the rows show (each fork's docstring gives its paper and official settings):
- Built-in modes: one token a step is the exact baseline; early stop ends an answer once a finished block holds the
  end token; threshold decoding (Fast-dLLM 3.3) commits every token at least that confident; DualCache feeds the
  block alone after its first step.
- Prophet's thresholds are raw logit gaps set for LLaDA-8B. The demo model's gaps over the answer window are larger
  (16 to 20 at every call on three problems measured), so the official 7.5 / 5.0 / 2.5 stop at the first call:
  the final number is often right, the worked solution rarely. Thresholds x3 stop later. The forced suffix "The
  answer is" sits at a fixed answer offset (9), which fits the demo's solution only when its numbers have the
  usual digit counts; without it (--suffix '' --suffix-at -21: the window starts at answer offset 12) the early
  exit costs no valid answer here.
"""


if __name__ == "__main__":
    main()
