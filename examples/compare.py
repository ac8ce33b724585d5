"""
examples/compare.py: every method of examples/ and the built-in modes on the demo task, each as its command line
runs it, and the demo model's weights in bf16 and int8: the tables (on stdout, or docs/methods.md with what each
method buys against the built-in row it changes) and a figure (valid answers against model calls per answer, each
point numbered as its row, with its 95% interval).

    python examples/compare.py -n 20            # a quick look: the tables on stdout, nothing written
    python examples/compare.py --out docs       # 200 held-out problems -> docs/methods.md, docs/methods.png
    python examples/compare.py --out docs --pdf # and docs/methods.pdf, the figure as vector graphics

Each row is a command line on the demo model (--model demo/llada-arith --gen-length 32 --block-length 8):
`python fastdllm.py FLAGS` for a built-in mode, `python examples/<method>.py FLAGS` for a fork. This script makes
the generate() call that command line makes (cli.parse_args and cli.settings; a fork's hooks from the
`cli.run(fork, **flags)` its file calls as a program, caught here; --dtype and --quantize load the model so) and
decodes every held-out problem alone (batch 1), saying on stderr how far each row has got. valid: demo/eval.py's
check of the whole worked solution; final number: "The answer is N." with the right N; calls, tokens fed per call
and time are generate()'s own stats. A fork file not in this checkout, or an int8 row without torchao, is
skipped, and the table says so. The figure needs matplotlib (requirements-extras.txt); without it the tables are
still written, and one line says how to get the figure.
"""
import argparse
import datetime
import inspect
import math
import os
import platform
import re
import runpy
import shlex
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "demo")]
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import cli  # noqa: E402

import loading
from chat import load_tokenizer  # noqa: E402
from eval import TEMPLATES, answer_text, heldout, is_valid  # noqa: E402
from fastdllm import generate  # noqa: E402
from model import load_model, read_config  # noqa: E402

DEMO = ["--gen-length", "32", "--block-length", "8"]
BUILT_IN, HEADLINE, OTHER = "Built-in modes", "The five methods, each at its headline setting", "Other settings"
WEIGHTS = "The weights in bf16 and int8 (float32 above)"
# (table, name, the fork's file in examples/ or None for fastdllm.py, its flags, the number of the built-in row that
# decodes as it does but for the method: same cache, stop and steps)
ROWS = [
    (BUILT_IN, "one token a step", None, "--cache none --threshold none --no-early-stop", None),
    (BUILT_IN, "one token a step, early stop", None, "--cache none --threshold none", None),
    (BUILT_IN, "4 tokens a step", None, "--cache none --threshold none --steps 8 --no-early-stop", None),
    (BUILT_IN, "threshold 0.9, early stop", None, "--cache none", None),
    (BUILT_IN, "threshold 0.9, dual, early stop", None, "", None),
    (HEADLINE, "EB-Sampler, gamma 0.01", "eb_sampler.py", "", 5),
    (HEADLINE, "KLASS, conf 0.9, KL 0.01", "klass.py", "", 4),
    (HEADLINE, "dKV-Cache-Decode, refresh 8", "dkv_cache.py", "--threshold none --no-early-stop", 1),
    (HEADLINE, "DPad, window 256", "dpad.py", "", 5),
    (HEADLINE, "Prophet, gaps 7.5/5/2.5", "prophet.py", "", 1),
    (OTHER, "EB-Sampler, gamma 1", "eb_sampler.py", "--gamma 1", 5),
    (OTHER, "KLASS, history 1", "klass.py", "--history 1", 4),
    (OTHER, "DPad, window 32", "dpad.py", "--window 32", 5),
    (OTHER, "Prophet, gaps x3", "prophet.py", "--early 22.5 --mid 15 --late 7.5", 1),
    (OTHER, "Prophet, gaps x3, no suffix", "prophet.py", "--early 22.5 --mid 15 --late 7.5 --suffix '' --suffix-at -21",
     1),
    (WEIGHTS, "threshold 0.9, dual, early stop, bf16", None, "--dtype bfloat16", 5),
    (WEIGHTS, "threshold 0.9, dual, early stop, int8", None, "--quantize int8", 5),
    (WEIGHTS, "threshold 0.9, dual, early stop, int8 + bf16", None, "--quantize int8 --dtype bfloat16", 5),
    (WEIGHTS, "one token a step, int8", None, "--cache none --threshold none --no-early-stop --quantize int8", 1),
]
COLORS = {None: "tab:blue", "eb_sampler.py": "tab:green", "klass.py": "tab:red", "dkv_cache.py": "tab:purple",
          "dpad.py": "tab:brown", "prophet.py": "tab:orange", WEIGHTS: "tab:gray"}
# What each method does differently from its built-in row (the numbers come from the run, beside it).
WHY = {
    "eb_sampler.py": "It commits the most confident masks while their entropies, summed less the largest, stay under "
                     "gamma: as many as the model is jointly sure of, where threshold 0.9 tests each token alone.",
    "klass.py": "It commits a mask only once its distribution has stopped moving (KL under 0.01 for `history` "
                "steps) and it is confident: at least `history` calls a block, where threshold 0.9 often takes one.",
    "dkv_cache.py": "It feeds only the positions still masked a step ago (a token's keys are cached one step after it "
                    "is decoded; the canvas refreshed at a block's first two steps and every 8th): the same calls, "
                    "fewer tokens fed per call, each its own RoPE position and KV slot (the set's width costs one "
                    "more host read a step).",
    "dpad.py": "It drops a random, distance-decayed share of the masked suffix from a block's calls. The demo's suffix "
               "is at most 24 positions, which the default window (256) mostly keeps; a window of 32 drops the far "
               "ones, and this model's answers break without them.",
    "prophet.py": "Its thresholds are raw top-1 minus top-2 logit gaps, set for LLaDA-8B; the demo model's gaps are "
                  "larger, so the official ones end every answer at the first call (filled with that call's argmax): "
                  "the final number is often right, the worked solution rarely. Gaps x3 end later; the forced suffix "
                  "\"The answer is\" sits at one answer offset (9), which fits a solution only when its three "
                  "numbers have two digits each: without it (--suffix '' --suffix-at -21: the window at offset 12) "
                  "the early commit costs no valid answer here.",
}

WEIGHTS_WHY = ("bf16 rounds every weight and activation to 8 significant bits; int8 stores each linear layer's weight "
               "as 8-bit integers with one scale per output channel (the embedding and the head stay float), half "
               "bf16's bytes. On this CPU both are slower than float32: its bf16 matmuls are, and int8 converts "
               "its weights back at every call, through torchao's tensor subclass (a GPU's compiled kernels fuse "
               "the conversion).")


def fork_of(path: str):
    """Run a fork's file as a program with cli.run caught -> (its fork(**flags) -> hooks, its flags' defaults)."""
    caught, run = {}, cli.run
    cli.run = lambda fork=None, **own: caught.update(fork=fork, own=own)
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        cli.run = run
    return caught.get("fork"), caught.get("own", {})


def settings(model_dir: str, example: str | None, flags: str) -> tuple[dict, bool, tuple]:
    """The generate() keywords of the row's command line -> (keywords, whether to pass a seeded generator, the
    weights it loads: (dtype, quantize))."""
    argv, hooks = ["--model", model_dir, *DEMO, "--prompt", "-", *shlex.split(flags)], {}
    if example:
        fork, own = fork_of(os.path.join(HERE, example))
        values, argv = cli.own_flags(argv, **own)
        needs = inspect.signature(fork).parameters       # what cli.run hands a fork that asks: the checkpoint's
        values |= {k: v for k, v in (("config", read_config(model_dir)), ("tokenizer", load_tokenizer(model_dir)))
                   if k in needs}
        hooks = fork(**values)
    args = cli.parse_args(argv, hooks)
    args.hooks = hooks
    weights = (loading.pick_device_dtype("cpu", args.dtype)[1], args.quantize)
    return (cli.settings(args) | dict(stop_at_eos=not args.no_early_stop and "stop" not in hooks),
            "propose" not in hooks, weights)


def measure(model, tok, problems, kw: dict, seeded: bool, progress=lambda done: None) -> dict:
    """Every problem alone (batch 1): the shares valid and with the right final number, the mean calls per
    answer and tokens fed per call, and the median milliseconds per answer (a shared machine's pauses skew a mean).
    progress(problems done) after each one."""
    generate(model, torch.tensor([tok.encode(problems[0][0], add_special_tokens=False).ids]), **kw)   # warm-up
    valid = right = calls = fed = 0
    seconds = []
    for question, _, key in problems:
        prompt = torch.tensor([tok.encode(question, add_special_tokens=False).ids])
        gen = torch.Generator().manual_seed(0) if seeded else None
        out, st = generate(model, prompt, generator=gen, **kw)
        answer = answer_text(tok, out[0, prompt.shape[1]:].tolist(), model.config.eos_id)
        t, a, b = key
        final = re.search(r"The answer is (\d+)\.$", answer)
        valid += is_valid(answer, key)
        right += final is not None and int(final[1]) == (a + b if TEMPLATES[t][0] == "+" else a - b)
        calls, fed, seconds = calls + st["nfe"], fed + sum(st["fed"]), seconds + [st["seconds"]]
        progress(len(seconds))
    n = len(problems)
    return dict(valid=valid / n, right=right / n, calls=calls / n, fed=fed / calls, ms=1000 * sorted(seconds)[n // 2])


def machine() -> str:
    """The CPU's model name, its cores, and torch's version: where the times were taken."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "a CPU")
    except OSError:
        cpu = platform.processor() or "a CPU"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def main(argv=None):
    p = argparse.ArgumentParser(description="Every method of examples/ and the built-in modes on the demo task.")
    p.add_argument("-n", type=int, default=200, help="held-out problems (default: %(default)s)")
    p.add_argument("--out", help="write methods.md and methods.png in this folder (docs: the project's own); "
                   "default: the tables on stdout, nothing written")
    p.add_argument("--pdf", action="store_true", help="with --out: the figure as methods.pdf too (vector)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    args = p.parse_args(argv)
    if args.pdf and not args.out:
        p.error("--pdf writes beside methods.md: add --out FOLDER")
    if args.out and not (os.path.isdir(args.out) and os.access(args.out, os.W_OK | os.X_OK)):   # before the rows run
        why = "is not a writable folder" if os.path.isdir(args.out) else "is not a folder" if os.path.exists(
            args.out) else "does not exist"
        p.exit(2, f"error: --out {args.out} {why}: create it (mkdir -p) or pick another; nothing was run\n")
    torch.set_num_threads(args.threads)
    model_dir = os.path.join(ROOT, "demo", "llada-arith")
    models = {}      # (dtype, quantize) -> the model, loaded once
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    problems, results, tables, points = heldout(args.n), {}, {}, []
    for number, (table, name, example, flags, _) in enumerate(ROWS, 1):
        command = f"{'examples/' + example if example else 'fastdllm.py'} {flags}".strip()
        row = f"| {number} | {name} | `{command}` |"
        if example and not os.path.isfile(os.path.join(HERE, example)):
            skipped = f"examples/{example} is not in this checkout"
        else:
            kw, seeded, weights = settings(model_dir, example, flags)
            try:
                if weights not in models:
                    models[weights] = load_model(model_dir, device="cpu", dtype=weights[0], quantize=weights[1])
                skipped = None
            except ValueError as e:      # --quantize int8 without torchao
                skipped = str(e)
        if skipped:
            tables.setdefault(table, []).append(f"{row} not run: {skipped} | | | | |")
            print(f"skipped {name}: {skipped}", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        r = results[number] = measure(models[weights], tok, problems, kw, seeded,
                                      progress(f"[{number}/{len(ROWS)}] {name}", args.n))
        print(f"{name}: {r} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        tables.setdefault(table, []).append(f"{row} {r['valid']:.1%} | {r['right']:.1%} | {r['calls']:.1f} | "
                                            f"{r['fed']:.1f} | {r['ms']:.1f} |")
        points.append((number, f"{number} {name}", r["calls"], r["valid"], COLORS[WEIGHTS if table == WEIGHTS
                                                                                  else example]))
    intro = INTRO.format(n=args.n, threads=args.threads, argv="".join(" " + a for a in argv or sys.argv[1:]),
                         machine=machine(), date=datetime.date.today().isoformat())
    text = ("# The methods on the demo task\n\n" + wrap(" ".join(intro.split())) +
            "\n\n![valid answers against model calls per answer](methods.png)\n")
    for table, rows in tables.items():
        text += f"\n**{table}**\n\n{COLUMNS}" + "\n".join(rows) + "\n"
    text += NOTES + "\n## What each method buys here\n\n" + buys(results)
    if not args.out:
        print("nothing written: --out FOLDER writes the tables and the figure there (docs: the project's)",
              file=sys.stderr)
        return print(text)
    with open(os.path.join(args.out, "methods.md"), "w") as f:
        f.write(text)
    written = ["methods.md"]
    try:
        written += figure(points, os.path.join(args.out, "methods"), f"demo/llada-arith: {args.n} held-out problems",
                          args.n, args.pdf)
    except ImportError:
        print("no figure: matplotlib is not installed (pip install -r requirements-extras.txt)", file=sys.stderr)
    print(f"wrote {', '.join(os.path.join(args.out, w) for w in written)}", file=sys.stderr)


def progress(label: str, n: int, stream=None):
    """A row's progress on stderr, from its start: one live line on a terminal, else a line at each tenth of its
    problems (a 200-problem row can take a minute)."""
    stream = stream or sys.stderr
    tty, every = stream.isatty(), max(1, n // 10)

    def show(done: int):
        if tty or done % every == 0 or done == n:
            print("\r" * tty + f"{label}: {done}/{n} problems", end="" if tty and done < n else "\n", file=stream,
                  flush=True)
    show(0)
    return show


def interval(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share p of n (95% at z = 1.96): (low, high)."""
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def figure(points, stem: str, title: str, n: int, pdf: bool = False) -> list[str]:
    """Valid answers against calls per answer (log 2 scale), each point its row's number with its 95% interval,
    the rows' names in a key -> stem.png (and stem.pdf) with matplotlib. Rows at the same point share one label."""
    import matplotlib
    matplotlib.use("Agg")                # files only, no window
    from matplotlib import pyplot as plt, ticker, transforms
    plt.rcParams.update({"font.size": 11})     # read at a README's width, about half the figure's 1500 pixels
    fig, ax = plt.subplots(figsize=(10, 5), dpi=150, layout="constrained")
    for number, name, calls, valid, color in points:
        low, high = interval(valid, n)
        ax.errorbar(calls, valid, yerr=[[valid - low], [high - valid]], fmt="o", color=color, ms=6, capsize=3,
                    label=name)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_major_formatter(ticker.PercentFormatter(1.0))
    ax.set(title=title, xlabel="model calls per answer (log scale)", ylabel="valid answers (95% interval)",
           xlim=(0.8, 48), ylim=(-0.03, 1.2), yticks=[i / 5 for i in range(6)])
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=10, frameon=False,
              title="the rows of docs/methods.md", title_fontsize=10, handletextpad=0.3, labelspacing=0.35)
    labels = {}       # one label per place: the rows whose points coincide (within 3% of calls, 0.5% of valid)
    for number, _, calls, valid, color in points:
        key = next((k for k in labels if abs(math.log(k[0] / calls)) < 0.03 and abs(k[1] - valid) < 0.005),
                   (calls, valid))
        labels.setdefault(key, []).append((str(number), color))
    # Each label beside its point, else above it (one level higher at a time), else below: the first place
    # that covers no dot and no other label, inside the axes (laid out first, then kept as laid out).
    fig.draw_without_rendering()
    fig.set_layout_engine("none")
    renderer, frame = fig.canvas.get_renderer(), ax.get_window_extent()
    taken = [transforms.Bbox.from_bounds(*(ax.transData.transform((c, v)) - 5), 10, 10)
             for _, _, c, v, _ in points]
    places = [(7, 0, "left", "center"), (-7, 0, "right", "center"), *[(0, 7 + 12 * k, "center", "bottom")
                                                                     for k in range(5)], (0, -8, "center", "top")]
    for (calls, valid), numbers in sorted(labels.items()):
        for dx, dy, ha, va in places:
            t = ax.annotate(", ".join(n for n, _ in numbers), (calls, valid), xytext=(dx, dy), ha=ha, va=va,
                            textcoords="offset points", color=numbers[0][1])
            box = t.get_window_extent(renderer)
            if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) and \
                    not any(box.overlaps(b) for b in taken):
                break
            if (dx, dy) != places[-1][:2]:
                t.remove()           # the last place stays even if crowded: every point keeps its number
        taken.append(box)
    written = []
    for ext in ("png", "pdf") if pdf else ("png",):
        fig.savefig(f"{stem}.{ext}", metadata={"Software": None} if ext == "png" else {"Creator": None})
        written.append(os.path.basename(f"{stem}.{ext}"))
    plt.close(fig)
    return written


def buys(results: dict) -> str:
    """A bullet a method: its headline row against the built-in row it changes (that row's numbers in brackets),
    why, and its other settings beneath."""
    def line(number, ref):
        r, b = results[number], results[ref]
        return (f"(#{number}; in brackets #{ref}, {ROWS[ref - 1][1]}): {r['calls']:.1f} calls per answer "
                f"({b['calls']:.1f}), {r['fed']:.1f} tokens fed per call ({b['fed']:.1f}), valid {r['valid']:.1%} "
                f"({b['valid']:.1%}), final number {r['right']:.1%} ({b['right']:.1%}), {r['ms']:.1f} ms "
                f"({b['ms']:.1f}).")
    out = []
    for number, (table, name, example, _, ref) in enumerate(ROWS, 1):
        if table == HEADLINE and number in results:
            out.append(wrap(f"- **{name}** {line(number, ref)} {WHY[example]}", "  "))
            out += [wrap(f"  - {other[1]} {line(n, other[4])}", "    ") for n, other in enumerate(ROWS, 1)
                    if other[0] == OTHER and other[2] == example and n in results]
    weights = [wrap(f"  - {name} {line(n, ref)}", "    ") for n, (table, name, _, _, ref) in enumerate(ROWS, 1)
               if table == WEIGHTS and n in results and ref in results]
    if weights:
        out += [wrap(f"- **The weights** against float32's: {WEIGHTS_WHY}", "  "), *weights]
    return "\n".join(out) + "\n"


def wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, 118, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


INTRO = """Written by `python examples/compare.py{argv}` on {date}: {n} held-out problems of demo/eval.py, each
decoded alone (batch 1), on {machine}, {threads} torch thread(s). Each row is a command line on the demo model,
`python COMMAND --model demo/llada-arith --gen-length 32 --block-length 8 --prompt "..."`; the number is the
point's in the plot.
**valid**: the whole worked solution is right (demo/eval.py's check); **final number**: "The answer is N." with the
right N; **calls**: model calls per answer; **fed**: tokens fed per call (the canvas is 50 tokens: an 18-token
question and 32 answer positions); **ms**: the median time per answer, generate()'s own clock (a shared machine:
compare times within one run only). Each method is set against the built-in row that decodes as it does but for
the method (the same cache, stop and steps). Each fork's docstring names its paper, its official code and its
defaults. The plot's bars are the 95% (Wilson) interval of valid over the {n} problems."""
COLUMNS = """| # | method | command | valid | final number | calls | fed | ms |
|---|---|---|---|---|---|---|---|
"""
NOTES = """
The built-in modes: one token a step is the exact baseline; early stop ends an answer once a finished block holds
the end token; 4 tokens a step is a fixed parallel schedule; threshold decoding (Fast-dLLM 3.3) commits every token
at least that confident; dual (Fast-dLLM's DualCache) feeds the block alone after its first step. The weights: rows
1-15 run float32; bf16 is `--dtype bfloat16`, int8 `--quantize int8` (weight-only int8 through torchao, the
activations in the model's dtype; quant.py).
"""


if __name__ == "__main__":
    main()
