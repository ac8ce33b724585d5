"""
demo/bench_guided.py: guided decoding's answer tokens/s at several batch sizes, for two checkouts side by side
(e.g. main's row-by-row guided batches against batches decoded together), in one run.

    python demo/bench_guided.py --before /tmp/old                # this checkout against the one at /tmp/old
    python demo/bench_guided.py --root . --json                  # one checkout, JSON rows (what the above runs)

The same 16 held-out demo problems at every batch size (decoded in 16 / B batches of B), gen 32, float32,
one CPU thread; the best of --repeat passes, the two checkouts taking turns. Answer tokens: each row up to
its first end token.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = [  # (name, generate() settings); the speculative rows need a checkout that has them
    ("guided assisted", dict(accept="deterministic")),
    ("guided speculative", dict(accept="deterministic", speculative=True)),
    ("tau 0.9 dual (reference)", dict(block_length=8, steps=32, cache="dual", threshold=0.9)),
]


def measure(root: str, batches, caches, n: int, repeat: int):
    """Import `root`'s fastdllm and time every mode -> rows (dicts)."""
    sys.path[:0] = [root, os.path.join(root, "demo")]
    import torch
    from tokenizers import Tokenizer
    from fastdllm import generate
    from model import load_model
    from train import heldout
    torch.set_num_threads(1)
    model = load_model(os.path.join(root, "demo", "llada-arith"), device="cpu", dtype=torch.float32)
    guide = load_model(os.path.join(root, "demo", "qwen2-arith"), device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_file(os.path.join(root, "demo", "llada-arith", "tokenizer.json"))
    prompt = torch.tensor([e.ids for e in tok.encode_batch([q for q, _, _ in heldout(n)], add_special_tokens=False)])
    eos = model.config.eos_id
    rows = []
    for name, kw in MODES:
        for cache in caches if "guided" in name else [None]:
            call = dict(kw, gen_length=32) | ({"guide": guide, "cache": cache} if cache else {})
            try:
                generate(model, prompt[:1], **call)                       # warm-up, and "does it have it"
            except TypeError:
                continue
            for B in batches:
                wall = cpu = float("inf")
                for _ in range(repeat):
                    t0, c0, answer, calls = time.perf_counter(), time.process_time(), 0, [0, 0]
                    for i in range(0, n, B):
                        out, st = generate(model, prompt[i:i + B], **call)
                        for row in out[:, prompt.shape[1]:].tolist():
                            answer += row.index(eos) if eos in row else len(row)
                        calls = [calls[0] + st["nfe"], calls[1] + st.get("guide_calls", 0)]
                    wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
                rows.append(dict(mode=name, cache=cache or "dual", batch=B, seconds=wall, cpu_seconds=cpu,
                                 answer_tokens=answer, tokens_per_s=answer / wall, tokens_per_cpu_s=answer / cpu,
                                 nfe=calls[0], guide_calls=calls[1]))
    return rows


def run(root: str, args) -> list:
    """One measuring pass of `root` in its own process (its own imports) -> rows."""
    cmd = [sys.executable, os.path.abspath(__file__), "--root", root, "--json", "--batches", args.batches,
           "--caches", args.caches, "-n", str(args.n), "--repeat", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)


def best_of(passes) -> dict:
    """Rows of several passes -> per (mode, cache, batch), the fastest wall time and the fastest CPU time."""
    best = {}
    for rows in passes:
        for r in rows:
            b = best.setdefault((r["mode"], r["cache"], r["batch"]), dict(r))
            for t, rate in (("seconds", "tokens_per_s"), ("cpu_seconds", "tokens_per_cpu_s")):
                if r[t] < b[t]:
                    b[t], b[rate] = r[t], r[rate]
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description="Guided decoding's answer tokens/s per batch size, two checkouts "
                                "side by side.")
    p.add_argument("--before", help="the other checkout (e.g. a `git worktree add /tmp/old 808e5a1`)")
    p.add_argument("--root", default=os.path.dirname(HERE), help="the checkout to measure (default: this one)")
    p.add_argument("--batches", default="1,4,16", help="batch sizes (default: %(default)s)")
    p.add_argument("--caches", default="prefix,free", help="guided cache modes (default: %(default)s)")
    p.add_argument("-n", type=int, default=16, help="problems (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="best of this many passes (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="measure --root only and print JSON rows")
    args = p.parse_args(argv)
    batches, caches = [int(b) for b in args.batches.split(",")], args.caches.split(",")
    if args.json:
        return print(json.dumps(measure(args.root, batches, caches, args.n, args.repeat)))
    # The two checkouts take turns, pass after pass, so a busy spell of a shared machine hits both alike.
    passes = [(run(args.before, args) if args.before else [], run(args.root, args)) for _ in range(args.repeat)]
    before, after = best_of(p[0] for p in passes), list(best_of(p[1] for p in passes).values())
    print(f"{args.n} demo problems, gen 32, float32, 1 thread, best of {args.repeat} passes; answer tokens per second "
          f"of CPU time (tok/cpu-s: what the decode itself ran, robust on a shared machine) and of wall time "
          f"(tok/s); diffusion / guide forwards summed over the {args.n} problems\n")
    print("| decoding | cache | batch | before tok/cpu-s | after tok/cpu-s | after / before | before tok/s | "
          "after tok/s | after / before | before NFE / guide | after NFE / guide |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in after:
        b = before.get((r["mode"], r["cache"], r["batch"]))
        cells = []
        for rate in ("tokens_per_cpu_s", "tokens_per_s"):
            cells += [f"{b[rate]:.0f}" if b else "-", f"{r[rate]:.0f}", f"{r[rate] / b[rate]:.2f}x" if b else "-"]
        calls = f"{b['nfe']} / {b['guide_calls']}" if b else "-"
        print(f"| {r['mode']} | {r['cache']} | {r['batch']} | {' | '.join(cells)} | {calls} | "
              f"{r['nfe']} / {r['guide_calls']} |")


if __name__ == "__main__":
    main()
