"""
bench.py: what each decoding mode costs (time, model calls, tokens fed, memory) and what its approximations
cost in quality (agreement with the exact decode), in one table.

    python apps/bench.py run --model demo/llada-arith --gen-length 32 --block-length 8   # a real model and prompt
    python apps/bench.py modes --d-model 512 --layers 4            # the same table on a random LLaDA-format checkpoint
    python apps/bench.py sweep --lengths 128,256,512,1024          # cost per generated token as the answer grows
    python apps/bench.py compare before.json after.json            # two `--json` results side by side, row by row

(tools/checkpoint.py writes the random checkpoints; tools/gpu_check.py is the prepared GPU check.)

A row: model calls (NFE: forward passes of the batch; and per problem, generate()'s row_nfe averaged over the
rows, the papers' NFE, the same at any batch size), tokens committed and canvas positions fed per call of a
row; the wall time of the whole generate() call after a warm-up; tokens/s counting answer tokens (each row up
to its first end token: the project's one definition of tokens/s) and, labelled apart, all generated tokens
(batch x gen_length, end-of-text filler included, as most published numbers count); peak memory (CUDA:
max_memory_allocated; CPU: the RSS high-water mark VmHWM, reset per row); and agreement: the share of answer
tokens equal to the *exact* decode (no cache, one token per step, the same steps), and the first position
where they differ, so an approximation's cost in quality sits next to its speed. Speed is only reported,
never asserted; tests/test_bench.py checks that the numbers are computed right.
"""
import argparse
import contextlib
import hashlib
import os
import resource
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)     # the method's modules (fastdllm.py, model.py, ...) live at the repository's root
import cli  # noqa: E402
import loading  # noqa: E402
from guided import OWN as GUIDED_OWN
from fastdllm import generate
from options import check_settings, settings as settled
from guided import check_guide
from model import ModelConfig, load_model, read_config, resolve_model_dir
from quant import active_bytes, int8_quantizer, weight_bytes
from shapes import check_fits, load_random, random_prompts, reusable, shape_config
from flags import REFUSED, Parser, integer, listing, nonempty, random_arguments, rows_arguments, run_arguments
from results import environment, measured_rows, write_json

MiB = 2 ** 20
PROMPT = "Tom has 23 apples and buys 45 more. How many apples does he have?"   # `run`'s default

# ----------------------------------------------------------------------------------------------------------
# 1. Measuring one row

class PeakMemory:
    """Peak memory between construction and read(). CUDA: max_memory_allocated (tensors only). CPU: the
    RSS high-water mark, reset through /proc/self/clear_refs (Linux >= 4.0); where that fails, ru_maxrss,
    the peak of the whole process so far, and `what` says so."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.what = "peak GPU memory (max_memory_allocated)"
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.what = "peak RSS (VmHWM, reset per row)"
        except OSError:
            self.what = "peak RSS (ru_maxrss: process lifetime)"

    def read(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if "VmHWM" in self.what:
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # kB on Linux


def answer_lengths(gen: torch.Tensor, eos_ids) -> torch.Tensor:
    """(B,) tokens before each row's first end token (gen_length if it has none)."""
    is_end = torch.isin(gen, torch.tensor(sorted(eos_ids), dtype=torch.long, device=gen.device))
    return torch.where(is_end.any(-1), is_end.int().argmax(-1), gen.shape[1])


def agreement(gen: torch.Tensor, ref: torch.Tensor, eos_ids):
    """Share of the reference's answer tokens (up to and including its first end token) that `gen` has at the
    same positions, over all rows, and the first such position where they differ (None: no difference)."""
    n = (answer_lengths(ref, eos_ids) + 1).clamp(max=ref.shape[1])
    scored = torch.arange(ref.shape[1], device=ref.device) < n[:, None]
    differ = (gen != ref) & scored
    first = differ.any(0).nonzero()
    return 1 - differ.sum().item() / scored.sum().item(), (first[0].item() if len(first) else None)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_row(model, prompt, mode: dict, kw: dict, guide=None, eos_ids=None, repeat: int = 1, seed: int = 0):
    """One generate() call (the best wall time of `repeat`) -> (generated ids (B, G), row dict)."""
    device = prompt.device
    eos_ids = set(eos_ids or [model.config.eos_id]) - {None}
    call = dict(kw, cache=mode["cache"], threshold=mode["threshold"], factor=mode["factor"])
    if not mode["guided"]:      # the guide's settings belong to the guided rows only
        call = {k: v for k, v in call.items() if k not in GUIDED_OWN}
    call.update(stop_at_eos=mode["stop"], **({"eos_ids": sorted(eos_ids)} if mode["stop"] else {}))
    if mode["guided"]:
        call.update(guide=guide, accept=mode["guided"])
    best = None
    for _ in range(repeat):
        peak = PeakMemory(device)
        gen = torch.Generator(device).manual_seed(seed)
        sync(device)
        t0 = time.perf_counter()
        ids, st = generate(model, prompt, generator=gen, **call)
        sync(device)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[0]:
            best = seconds, peak.read()
    seconds, peak = best
    B, G = prompt.shape[0], kw["gen_length"]
    out = ids[:, prompt.shape[1]:]
    answer = answer_lengths(out, eos_ids).sum().item()
    # Older generate() versions (the before/after LM-head measurement runs one) lack "committed" and "row_nfe":
    # without early stop every generated token was committed by some call, and at batch 1 a call serves the row.
    committed = sum(st["committed"]) if "committed" in st else B * G
    committed = answer if model.config.mask_id < 0 else committed   # DiffusionGemma: its samples renoise (run())
    row_calls = sum(st["row_nfe"]) if "row_nfe" in st else B * st["nfe"]
    row = label(mode, kw, B) | dict(
        nfe=st["nfe"], calls_per_problem=row_calls / B, tokens_per_call=committed / row_calls,
        fed_per_call=sum(st["fed"]) / st["nfe"], seconds=seconds, answer_tokens=answer,
        answer_tokens_per_s=answer / seconds, all_tokens_per_s=B * G / seconds, peak_mib=peak / MiB,
        calls_saved=st.get("calls_saved", 0), guide_calls=st.get("guide_calls", 0),
        ids_sha1=hashlib.sha1(str(out.tolist()).encode()).hexdigest()[:12])
    return out, row


# ----------------------------------------------------------------------------------------------------------
# 2. The modes table

def modes(caches, thresholds=(), factors=(), stops=(False,), guided=()):
    """Every (cache, rule, early stop) combination; the exact reference (no cache, one token per step,
    no early stop) always comes first. A guided mode is one per acceptance rule, at every cache."""
    rules = [(None, None, None)] + [(t, None, None) for t in thresholds] + [(None, f, None) for f in factors]
    rules += [(None, None, g) for g in guided]
    out = [dict(cache="none", threshold=None, factor=None, stop=False, guided=None)]
    for t, f, g in rules:
        for stop in stops:
            for cache in caches:
                m = dict(cache=cache, threshold=t, factor=f, stop=stop, guided=g)
                if not any(m == o and type(stop) is type(o["stop"]) for o in out):   # k=1 is not True
                    out.append(m)
    return out


def label(mode, kw, batch: int) -> dict:
    """What names a row (in the tables, and to `compare`): its cache, rule, early stop, batch and gen length."""
    if mode["guided"]:
        rule = f"{'speculative' if kw.get('speculative') else 'guided'} {mode['guided']}"
    elif mode["threshold"] is not None:
        rule = f"tau {mode['threshold']:g}"
    elif mode["factor"] is not None:
        rule = f"factor {mode['factor']:g}"
    elif kw.get("entropy_bound") is not None:     # DiffusionGemma's acceptance
        rule = f"entropy bound {kw['entropy_bound']:g}"
    else:
        rule = f"{kw['gen_length'] / (kw.get('steps') or kw['gen_length']):g} tok/step"
    stop = "-" if mode["stop"] is False else "block" if mode["stop"] is True else f"k={mode['stop']}"
    return dict(cache=mode["cache"], rule=rule, stop=stop, batch=batch, gen_length=kw["gen_length"])


def warm_up(model, prompt, caches, kw):
    """One block of each cache, untimed: first-call costs (allocator, kernel choice) stay out of the rows."""
    bl = kw.get("block_length") or kw["gen_length"]
    for cache in dict.fromkeys(caches):
        with contextlib.suppress(ValueError):    # a mode these settings forbid: its row will say so
            generate(model, prompt, **dict(kw, gen_length=bl, block_length=bl, steps=bl, cache=cache))


def run_modes(model, prompt, mode_list, kw, guide=None, eos_ids=None, repeat=1, seed=0, warmup=True, ref=None):
    """Run every mode on the same prompt(s) -> (rows, ref). Agreement and speed-up are against `ref` =
    (generated ids, seconds) of the exact decode, by default the first mode's (modes() puts it first). A
    mode the settings do not allow (e.g. a cache with Dream's whole-canvas sampler) becomes a row with `error`."""
    eos_ids = set(eos_ids or [model.config.eos_id]) - {None}
    if warmup:
        warm_up(model, prompt, [m["cache"] for m in mode_list], kw)
    rows = []
    for mode in mode_list:
        try:
            out, row = run_row(model, prompt, mode, kw, guide, eos_ids, repeat, seed)
        except ValueError as e:     # the row says why
            rows.append(label(mode, kw, prompt.shape[0]) | {"error": str(e)})
            continue
        ref = ref or (out, row["seconds"])
        row["agreement"], row["first_diff"] = agreement(out, ref[0], eos_ids)
        row["speedup"] = ref[1] / row["seconds"]
        rows.append(row)
        print(f"  {row['cache']:6s} {row['rule']:14s} stop {row['stop']:5s} NFE {row['nfe']:4d} "
              f"{row['seconds']:8.3f} s", file=sys.stderr, flush=True)
    return rows, ref


def table(rows, columns) -> str:
    """A markdown table; columns = [(header, row -> str)]."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        if "error" in r:   # one cell: this mode cannot run with these settings, and why
            lines.append(f"| {r['cache']}, {r['rule']}, early stop {r['stop']}: n/a ({r['error']}) |")
        else:
            lines.append("| " + " | ".join(fn(r) for _, fn in columns) + " |")
    return "\n".join(lines)


MODE_COLUMNS = [
    ("cache", lambda r: r["cache"]), ("rule", lambda r: r["rule"]), ("early stop", lambda r: r["stop"]),
    ("NFE", lambda r: str(r["nfe"])), ("NFE/problem", lambda r: f"{r['calls_per_problem']:.2f}"),
    ("tokens/call", lambda r: f"{r['tokens_per_call']:.2f}"), ("fed/call", lambda r: f"{r['fed_per_call']:.0f}"),
    ("wall s", lambda r: f"{r['seconds']:.3f}"), ("answer tok/s", lambda r: f"{r['answer_tokens_per_s']:.1f}"),
    ("all tok/s", lambda r: f"{r['all_tokens_per_s']:.1f}"), ("speed-up", lambda r: f"{r['speedup']:.2f}x"),
    ("peak MiB", lambda r: f"{r['peak_mib']:.0f}"), ("agreement", lambda r: f"{r['agreement']:.3f}"),
    ("first diff", lambda r: "-" if r["first_diff"] is None else str(r["first_diff"])),
]


# ----------------------------------------------------------------------------------------------------------
# 3. Cost growth: the same modes at growing answer lengths

def sweep(model, prompt, lengths, caches, block_length, threshold=None, repeat=1):
    """Per gen length and cache: seconds and canvas positions fed per generated token (one row of the
    batch). Without a cache every call feeds the whole canvas, so its cost per token grows with the length;
    prefix feeds the block and all after it; dual and free feed less (cache.py)."""
    rows = []
    warm_up(model, prompt, caches, dict(gen_length=block_length, block_length=block_length))
    for G in lengths:
        kw = dict(gen_length=G, block_length=block_length, steps=G)
        for cache in caches:
            mode = dict(cache=cache, threshold=threshold, factor=None, stop=False, guided=None)
            _, r = run_row(model, prompt, mode, kw, repeat=repeat)
            r["ms_per_token"] = 1e3 * r["seconds"] / (prompt.shape[0] * G)
            r["fed_per_token"] = r["fed_per_call"] * r["nfe"] / G
            base = next((b for b in rows if b["cache"] == cache), r)
            r["ms_growth"] = r["ms_per_token"] / base["ms_per_token"]
            rows.append(r)
            print(f"  gen {G:5d} {cache:6s} NFE {r['nfe']:4d} {r['seconds']:8.2f} s", file=sys.stderr, flush=True)
    return rows


SWEEP_COLUMNS = [
    ("gen", lambda r: str(r["gen_length"])), ("cache", lambda r: r["cache"]), ("rule", lambda r: r["rule"]),
    ("NFE", lambda r: str(r["nfe"])), ("fed/token", lambda r: f"{r['fed_per_token']:.1f}"),
    ("ms/token", lambda r: f"{r['ms_per_token']:.1f}"), ("ms/token vs shortest", lambda r: f"{r['ms_growth']:.2f}x"),
    ("wall s", lambda r: f"{r['seconds']:.2f}"),
]


def compare(a_path: str, b_path: str) -> str:
    """Two --json results of the same modes (e.g. two commits, two machines) row by row."""
    runs = [measured_rows(a_path), measured_rows(b_path)]

    key = lambda r: (r.get("family"), r.get("variant"), r["batch"], r["cache"], r["rule"], r["stop"])  # noqa: E731
    old = {key(r): r for r in runs[0]}
    rows = [dict(r, before=old[key(r)]) for r in runs[1] if key(r) in old]
    if not rows:
        raise ValueError(f"no row of {b_path} has the mode of a row of {a_path} (cache, rule, early stop, batch): "
                         f"compare results of the same modes")
    return table(rows, MODE_COLUMNS[:3] + [     # cache, rule, early stop
        ("NFE before", lambda r: str(r["before"]["nfe"])), ("NFE after", lambda r: str(r["nfe"])),
        ("wall s before", lambda r: f"{r['before']['seconds']:.2f}"), ("wall s after", lambda r: f"{r['seconds']:.2f}"),
        ("after / before", lambda r: f"{r['seconds'] / r['before']['seconds']:.2f}x"),
        ("same ids", lambda r: "yes" if r["ids_sha1"] == r["before"]["ids_sha1"] else "no")])


# ----------------------------------------------------------------------------------------------------------
# 4. Command line: every flag checked before anything is loaded, each error one line that names the flag

def run(args, parser):
    """bench.py run: the modes table on a real checkpoint and prompt, with fastdllm.py's decoding flags (its
    --factor is the table's: a row per cache)."""
    a = cli.finish_args(parser, argparse.Namespace(**vars(args) | {"prompt": args.prompt or PROMPT, "factor": None}))
    cli.check_early(cli.settings(a, cache="none", threshold=None, **{} if a.block_given else dict(block_length=None)))
    # (every row sets its own cache and rule; without --block-length the model's block is the checkpoint's, load_all)
    model, chat, cfg, device = cli.load_all(a)        # the CLI's checks and loading; one Compiled (--compile)
    guide, dtype = a.guide_model, model.lm_head.weight.dtype
    ids = chat.encode(chat.render([{"role": "user", "content": a.prompt}]))
    a.gen_length = cli.fit_gen_length(a, len(ids), cfg.max_seq_len)
    prompt = torch.tensor([ids] * args.batch, device=device)
    factors = args.factors + ([args.factor] if args.factor is not None and args.factor not in args.factors else [])
    if cfg.family == "diffusion_gemma" and (args.thresholds or factors):     # it accepts by its entropy bound
        print("note: DiffusionGemma has no threshold or factor rows (--thresholds, --factors): it accepts by its "
              "entropy bound", file=sys.stderr)
        args.thresholds, factors = [], []
    mode_list = modes(args.caches, args.thresholds, factors, args.stops, [a.accept] if guide is not None else [])
    kw = {k: v for k, v in cli.settings(a).items() if k not in ("cache", "threshold", "factor")}
    if cfg.family == "diffusion_gemma":     # its own settings as its checkpoint decides them, named in its rows
        kw |= {k: getattr(settled(cfg, kw), k) for k in ("steps", *cli.GEMMA_OWN)}
    rows, _ = run_modes(model, prompt, mode_list, kw, guide, sorted(chat.stop_ids | set(cfg.eos_ids)), args.repeat,
                        a.seed)
    env, active = environment(device, dtype), active_bytes(model)
    # A mixture of experts: a token reads its top-k experts, a call the union of its tokens' (at most all of them).
    moe = f" at most (one token reads its active {active / MiB:.1f} MiB)" if active < weight_bytes(model) else ""
    print(f"batch {args.batch}, prompt {prompt.shape[1]} tokens, gen {kw['gen_length']}, block "
          f"{kw['block_length']}, {env['dtype']}{' int8 weights' * bool(a.quantize)} on {env['gpu'] or env['cpu']}, "
          f"{env['threads']} threads; each call reads the {weight_bytes(model) / MiB:.1f} MiB of weights once{moe}; "
          f"{PeakMemory(device).what}\n\n" + table(rows, MODE_COLUMNS))
    return dict(kw, batch=args.batch, prompt_length=prompt.shape[1], quantize=a.quantize), env, rows


def random_table(args):
    """bench.py modes / sweep: the table on a random checkpoint and random prompt ids."""
    hf, sweeping = shape_config(args), args.cmd == "sweep"
    lengths = args.lengths if sweeping else [args.gen_length]
    for G in lengths:
        try:
            check_settings(gen_length=G, block_length=args.block_length, steps=G if sweeping else args.steps or G,
                             cache="none", threshold=None, factor=None, temperature=0.0)
        except ValueError as e:
            raise ValueError(f"{'--lengths' if sweeping else '--gen-length'} {G}: {e}") from None
    top = ModelConfig.from_hf(hf).max_seq_len
    if args.prompt_length + max(lengths) > top:
        raise ValueError(f"--prompt-length {args.prompt_length} plus the gen length exceed the checkpoint's {top} "
                         "positions")
    if sweeping and len(args.thresholds) > 1:
        raise ValueError("--thresholds: a sweep measures one rule, so pass at most one value")
    device, dtype = loading.pick_device_dtype(args.device, args.dtype)
    int8_quantizer(args.quantize)   # --quantize int8 without torchao: said before the checkpoint is written
    if not reusable(args, hf):      # --dir: refused now if it holds anything but this tool's checkpoint
        check_fits(hf, args.dir or tempfile.gettempdir(), device, dtype)
    guide = None
    if getattr(args, "guide", None):   # a causal LM sharing the random model's ids, checked on its small files
        guide_dir = resolve_model_dir(args.guide, role="guide")
        try:
            check_guide(ModelConfig.from_hf(hf), read_config(guide_dir))
        except ValueError as e:
            raise ValueError(f"--guide {args.guide}: {e}") from None
        guide = load_model(guide_dir, device=device, dtype=dtype, quantize=args.quantize)
    model = load_random(args, hf, device, dtype)
    prompt = random_prompts(model.config, args.batch, args.prompt_length).to(device)
    env = environment(device, dtype)
    about = (f"random {args.family} checkpoint d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; "
             f"batch {args.batch}, prompt {args.prompt_length}, block {args.block_length}, {env['dtype']}"
             f"{' int8 weights' * bool(args.quantize)} on {env['gpu'] or env['cpu']}, {env['threads']} threads; "
             f"each call reads its {weight_bytes(model) / MiB:.1f} MiB of weights once")
    if sweeping:
        rows = sweep(model, prompt, args.lengths, args.caches, args.block_length, (args.thresholds or [None])[0],
                     args.repeat)
        print(about + "\n\n" + table(rows, SWEEP_COLUMNS))
    else:
        kw = dict(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps)
        mode_list = modes(args.caches, args.thresholds, args.factors, args.stops,
                          ["deterministic"] if guide is not None else [])
        rows, _ = run_modes(model, prompt, mode_list, kw, guide, repeat=args.repeat)
        print(about + f"; gen {args.gen_length}; {PeakMemory(device).what}\n\n" + table(rows, MODE_COLUMNS))
    return vars(args), env, rows


def main(argv=None):
    p = Parser(prog="bench.py", description="fastdllm benchmarks (see the module docstring)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the modes table on a real model and prompt")
    run_arguments(r)
    cli.add_flags(r.add_argument_group("decoding (fastdllm.py's flags; --guide adds a guided row per cache)"),
                  omit=(*REFUSED, "--prompt", "--factor"))
    m = sub.add_parser("modes", help="the modes table on a random checkpoint")
    random_arguments(m)
    rows_arguments(m, factors="", stops="off")
    m.add_argument("--gen-length", type=integer(1), default=128, help="default: %(default)s")
    m.add_argument("--steps", type=integer(1), default=None, help="default: gen-length")
    m.add_argument("--guide", type=nonempty, default=None, help="a causal guide model folder: adds guided rows")
    s = sub.add_parser("sweep", help="cost per token against gen length, one token per step")
    random_arguments(s)
    rows_arguments(s, thresholds="", factors=None)
    s.add_argument("--lengths", type=listing(integer(1), empty=False), default="128,256,512,1024",
                   help="gen lengths, comma-separated (default: %(default)s)")
    c = sub.add_parser("compare", help="two --json results side by side")
    c.add_argument("before")
    c.add_argument("after")
    args = p.parse_args(argv)
    if args.cmd == "compare":
        return print(compare(args.before, args.after))
    settings, env, rows = run(args, r) if args.cmd == "run" else random_table(args)
    if args.json:
        write_json(args.json, settings=settings, environment=env, rows=rows)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:   # OSError: a file we cannot read or write
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
