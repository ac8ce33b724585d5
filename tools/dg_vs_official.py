"""
tools/dg_vs_official.py: DiffusionGemma on the CPU, ours against the official `generate` (transformers v5.23.0,
src/transformers/models/diffusion_gemma/generation_diffusion_gemma.py) on the same checkpoint, side by side in one
run; and, from the same prompts, tokens per decoder call beside LLaDA (DualCache, threshold 0.9) and Fast-dLLM v2.

    python tools/dg_vs_official.py --official-python /tmp/side/venv/bin/python --json dg.json
    python tools/dg_vs_official.py --steps 4 --gen-lengths 16 --repeat 1       # our side only: the table says so

Table 1. Both sides decode the same prompts with the release's settings (the checkpoint's generation_config.json:
48 steps, entropy bound 0.1, temperature 0.8 down to 0.4, adaptive stopping 1 / 0.005, its end tokens), float32, one
thread, the same seed (ours: torch.Generator().manual_seed(seed), one generator for the batch; theirs:
torch.manual_seed(seed); the same stream, docs/parity.md). They take turns, row by row, and each row's CPU seconds are
the best of --repeat runs (one untimed run of each side first). Ours runs the prefix cache (the official keeps the
committed canvases in its KV cache too). Per row: CPU seconds, decoder calls (batched: one per step of the batch) and
per row, steps per canvas, the randomness fingerprint (the generator's next randint(0, 2**31 - 1) after the decode),
and whether the two sides agree on each. Sampled ids are not compared for equality: each step feeds its logits back,
and a float32 difference in the last bits grows about tenfold a step (docs/parity.md), so `ids equal` is reported,
not expected.

The official side runs in a process of its own, started with --official-python (an environment with transformers
5.23.0 and torch, outside this project: fastdllm never imports transformers) from a temporary folder, with a script
this tool writes there (CHILD). It counts the official decoder calls by wrapping the model's own methods: a canvas
starts at each encoder call, each call of the model's forward is a decoder call, and a row's calls are counted as
generate() counts them (a step counts for the rows not yet finished).

Table 2. Tokens per decoder call (answer tokens up to the first end token / calls) and calls per canvas (block) of
our DiffusionGemma (table 1's batch-1 runs), LLaDA with DualCache and threshold 0.9 (blocks as long as the canvas),
and Fast-dLLM v2 (its block 32, sub-blocks of 8, its sub-block cache, threshold 0.9), on the same token-id prompts.
The tiny checkpoints share no tokenizer: the prompts are ids that every one holds and none treats as special, and
with random weights only the counts mean anything.
"""
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run as a script from anywhere

import flags  # noqa: E402
from flags import Parser, integer, listing, nonempty  # noqa: E402  (standard library only)

GOLDEN = os.path.join(ROOT, "tests", "golden")
RELEASE = ("steps", "entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold")

# The official side: our own script, written to a temporary folder and run by --official-python. One JSON line in
# (a decode to run), one JSON line out (what it did); its first line says what it runs on, or why it cannot.
CHILD = r'''
import json, sys, time
try:   # the official implementation, in its own environment (--official-python): the project never imports it
    import importlib
    import torch
    transformers = importlib.import_module("transformers")
    DiffusionGemmaForBlockDiffusion = transformers.DiffusionGemmaForBlockDiffusion
    EntropyBoundSamplerConfig = importlib.import_module(
        "transformers.models.diffusion_gemma.generation_diffusion_gemma").EntropyBoundSamplerConfig
except Exception as e:
    print(json.dumps(dict(error=f"{type(e).__name__}: {e}")), flush=True)
    sys.exit(0)
torch.set_num_threads(1)
model = DiffusionGemmaForBlockDiffusion.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
count = {}
forward, encoder = model.forward, model.model.encoder.forward
step, finalize = model._denoising_step, model._finalize_canvas

def counted_encoder(*a, **k):           # a canvas starts with the encoder's commit of what came before it
    count["canvases"].append(0)
    return encoder(*a, **k)

def counted_forward(*a, **k):           # generate() calls the model's forward for the decoder only
    count["canvases"][-1] += 1
    return forward(*a, **k)

def counted_step(*a, **k):              # a step counts for a row neither done denoising nor finished
    count["rows"] += (~(k["finished_denoising"] | count["finished"])).long()
    return step(*a, **k)

def counted_finalize(*a, **k):          # the rows finished after each canvas
    out = finalize(*a, **k)
    count["finished"] = out[1]
    return out

model.forward, model.model.encoder.forward = counted_forward, counted_encoder
model._denoising_step, model._finalize_canvas = counted_step, counted_finalize
g = model.generation_config
print(json.dumps(dict(transformers=transformers.__version__, torch=torch.__version__, threads=torch.get_num_threads(),
                      capability=torch.backends.cpu.get_cpu_capability(), eos=g.eos_token_id, pad=g.pad_token_id)),
      flush=True)
for line in sys.stdin:
    r = json.loads(line)
    s, ids = r["settings"], torch.tensor(r["prompts"])
    model.config.canvas_length = r["canvas"]
    count.update(canvases=[], rows=torch.zeros(len(ids), dtype=torch.long),
                 finished=torch.zeros(len(ids), dtype=torch.bool))
    torch.manual_seed(r["seed"])
    cpu, wall = time.process_time(), time.perf_counter()
    out = model.generate(ids, max_new_tokens=r["gen_length"], max_denoising_steps=s["steps"],
                         sampler_config=EntropyBoundSamplerConfig(entropy_bound=s["entropy_bound"]), t_min=s["t_min"],
                         t_max=s["t_max"], stability_threshold=s["stability_threshold"],
                         confidence_threshold=s["confidence_threshold"])
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(json.dumps(dict(cpu_s=cpu, wall_s=wall, calls=sum(count["canvases"]), row_calls=count["rows"].tolist(),
                          steps_per_canvas=count["canvases"], fingerprint=torch.randint(0, 2 ** 31 - 1, (1,)).item(),
                          ids=out.sequences.tolist())), flush=True)
'''


class Official:
    """The official side's process: started once, asked one decode at a time (so the two sides take turns)."""

    def __init__(self, python: str, model_dir: str, timeout: float):
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ValueError(f"--official-python {python}: not an executable file; pass the python of an "
                             f"environment with transformers 5.23.0 (or leave the flag out: our side only)")
        self.dir, self.timeout = tempfile.mkdtemp(prefix="dg_official_"), timeout    # outside the project
        with open(os.path.join(self.dir, "official_side.py"), "w") as f:
            f.write(CHILD)
        self.stderr = open(os.path.join(self.dir, "stderr.txt"), "w+")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.p = subprocess.Popen([python, "official_side.py", os.path.abspath(model_dir)], cwd=self.dir,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                  env=env, start_new_session=True)
        self.about = self.read()
        if "error" in self.about:
            self.close()
            raise ValueError(f"--official-python {python} cannot run the official DiffusionGemma ("
                             f"{self.about['error']}): it needs transformers 5.23.0 installed")

    def read(self) -> dict:
        got = []
        reader = threading.Thread(target=lambda: got.append(self.p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout)
        if not got or not got[0].strip():
            self.stderr.seek(0)
            last = ([s for s in self.stderr.read().splitlines() if s.strip()] or ["no output"])[-1]
            self.close()
            raise ValueError(f"the official side {'timed out' if not got else 'ended'}: {last.strip()}")
        return json.loads(got[0])

    def run(self, request: dict) -> dict:
        self.p.stdin.write(json.dumps(request) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def prompts(configs, length: int, batch: int, seed: int = 0):
    """(batch, length) ids every checkpoint of `configs` holds and none treats as special: id 2 (DiffusionGemma's
    <bos>) first, then random ids below the smallest vocabulary, skipping every mask, end, pad and bos id."""
    import torch
    special = {i for c in configs for i in (c.mask_id, c.pad_id, c.bos_id, *c.eos_ids) if i is not None}
    allowed = torch.tensor([i for i in range(3, min(c.vocab_size for c in configs)) if i not in special])
    g = torch.Generator().manual_seed(seed * 1000 + length)
    ids = allowed[torch.randint(0, len(allowed), (batch, length), generator=g)]
    ids[:, 0] = 2
    return ids


def steps_per_canvas(fed: list, canvas: int) -> list:
    """Steps per canvas from the widths each call fed (the prefix cache: a canvas's first call also commits what came
    before it, the prompt or the last canvas, so it is the only one wider than the canvas)."""
    steps = []
    for width in fed:
        if width > canvas or not steps:
            steps.append(0)
        steps[-1] += 1
    return steps


def ours(model, ids, gen: int, seed: int, settings: dict, canvas: int) -> dict:
    import torch
    from fastdllm import generate
    g = torch.Generator().manual_seed(seed)
    cpu, wall = time.process_time(), time.perf_counter()
    out, st = generate(model, ids, gen_length=gen, generator=g, cache="prefix", **settings)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return dict(cpu_s=cpu, wall_s=wall, calls=st["nfe"], row_calls=st["row_nfe"],
                steps_per_canvas=steps_per_canvas(st["fed"], canvas),
                fingerprint=torch.randint(0, 2 ** 31 - 1, (1,), generator=g).item(), ids=out.tolist(),
                answer_tokens=st["answer_tokens"])


def side_by_side(model, official, args, settings: dict, configs) -> list:
    """Table 1: every (prompt length, answer length, batch), the sides taking turns, best CPU time of --repeat."""
    import torch
    canvas = model.config.gemma.canvas
    rows = [dict(prompt_length=P, gen_length=G, batch=B, canvases=math.ceil(G / canvas),
                 prompts=prompts(configs, P, B).tolist())
            for P in args.prompt_lengths for G in args.gen_lengths for B in args.batches]
    request = lambda r: dict(prompts=r["prompts"], canvas=canvas, gen_length=r["gen_length"], seed=args.seed,  # noqa
                             settings=settings)
    first = min(rows, key=lambda r: (r["gen_length"], r["batch"], r["prompt_length"]))
    ours(model, torch.tensor(first["prompts"]), first["gen_length"], args.seed, settings, canvas)   # untimed: warm-up
    if official:
        official.run(request(first))
    runs = {i: dict(ours=[], official=[]) for i in range(len(rows))}
    for _ in range(args.repeat):
        for i, r in enumerate(rows):
            ids = torch.tensor(r["prompts"])
            runs[i]["ours"].append(ours(model, ids, r["gen_length"], args.seed, settings, canvas))
            if official:
                runs[i]["official"].append(official.run(request(r)))
            print(f"  P {r['prompt_length']} G {r['gen_length']} B {r['batch']}: ours "
                  f"{runs[i]['ours'][-1]['cpu_s']:.3f} s" + (f", official {runs[i]['official'][-1]['cpu_s']:.3f} s"
                                                             if official else ""), file=sys.stderr, flush=True)
    for i, r in enumerate(rows):
        for side in ("ours", "official"):
            done = runs[i][side]
            if not done:
                r[side] = None
                continue
            best = min(done, key=lambda d: d["cpu_s"])
            same = all({k: d[k] for k in ("calls", "row_calls", "fingerprint", "ids")} ==
                       {k: done[0][k] for k in ("calls", "row_calls", "fingerprint", "ids")} for d in done)
            r[side] = {k: v for k, v in best.items() if k != "ids"} | dict(
                cpu_s_runs=[round(d["cpu_s"], 4) for d in done], ms_per_call=1000 * best["cpu_s"] / best["calls"],
                repeatable=same)
        o, t = r["ours"], r["official"]
        r.update(ratio=o["cpu_s"] / t["cpu_s"] if t else None,
                 calls_agree=t and o["calls"] == t["calls"] and o["row_calls"] == t["row_calls"],
                 steps_agree=t and o["steps_per_canvas"] == t["steps_per_canvas"],
                 fingerprint_agree=t and o["fingerprint"] == t["fingerprint"],
                 ids_equal=t and runs[i]["ours"][0]["ids"] == runs[i]["official"][0]["ids"])
    return rows


def families(dg_rows, args, settings, canvas, llada, v2, configs) -> list:
    """Table 2: our DiffusionGemma's batch-1 rows beside LLaDA DualCache + threshold 0.9 (blocks of the canvas's
    length) and Fast-dLLM v2 (its block and sub-blocks, its sub-block cache, threshold 0.9) on the same prompt ids,
    one run each (the counts do not vary). Canvases: DiffusionGemma's as decoded (an end token ends the answer
    early); LLaDA's blocks after the prompt; Fast-dLLM v2's blocks sit on a grid from position 0, gen_length // block
    of them after the prompt's whole blocks, the first one finishing the prompt's (blockdiff.grid_length), so its
    answer is not gen_length tokens long."""
    import torch
    from fastdllm import generate
    out = []
    for r in dg_rows:
        if r["batch"] != 1:
            continue
        P, G, o = r["prompt_length"], r["gen_length"], r["ours"]
        rows = [dict(model=f"DiffusionGemma ({os.path.basename(os.path.normpath(args.model))})",
                     decode=f"up to {settings['steps']} steps a canvas, entropy bound {settings['entropy_bound']}, "
                     f"adaptive stop, prefix cache", canvas=canvas, calls=o["calls"],
                     canvases=len(o["steps_per_canvas"]), answer_tokens=o["answer_tokens"])]
        ids = torch.tensor(r["prompts"])
        if llada is not None:
            _, st = generate(llada, ids, gen_length=G, block_length=canvas, cache="dual", threshold=0.9)
            rows.append(dict(model=f"LLaDA ({os.path.basename(os.path.normpath(args.llada))})",
                             decode=f"DualCache, threshold 0.9, block {canvas}", canvas=canvas, calls=st["nfe"],
                             canvases=math.ceil(G / canvas), answer_tokens=st["answer_tokens"]))
        if v2 is not None:
            block = v2.config.block
            _, st = generate(v2, ids, gen_length=G, cache="dual", threshold=0.9)
            rows.append(dict(model=f"Fast-dLLM v2 ({os.path.basename(os.path.normpath(args.fastdllm_v2))})",
                             decode=f"sub-block cache, threshold 0.9, block {block}, sub-block 8", canvas=block,
                             calls=st["nfe"], canvases=max(G // block, 1), answer_tokens=st["answer_tokens"]))
        for row in rows:
            out.append(dict(prompt_length=P, gen_length=G, **row, calls_per_canvas=row["calls"] / row["canvases"],
                            tokens_per_call=row["answer_tokens"] / row["calls"]))
    return out


def v2_loadable(folder: str, scratch: str) -> str:
    """The golden Fast-dLLM v2 checkpoint names no mask id in config.json (the release's tokenizer's |<MASK>| is):
    a copy in `scratch` with the weights linked and a word-level tokenizer.json holding its special tokens at the ids
    tests/golden/fastdllm-v2-golden.json records."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return folder
    with open(os.path.join(GOLDEN, "fastdllm-v2-golden.json")) as f:
        ids = json.load(f)["ids"]
    out = os.path.join(scratch, "fastdllm-v2")
    os.makedirs(out)
    for name in os.listdir(folder):
        os.symlink(os.path.abspath(os.path.join(folder, name)), os.path.join(out, name))
    specials = {ids["mask_id"]: "|<MASK>|", ids["stop_token"]: "<|im_end|>", ids["pad_token_id"]: "<|endoftext|>"}
    tok = Tokenizer(models.WordLevel({specials.get(i, f"w{i}"): i for i in range(ids["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tok.add_special_tokens(list(specials.values()))
    tok.save(os.path.join(out, "tokenizer.json"))
    return out


def show(res: dict) -> str:
    yes = lambda v: "-" if v is None else "yes" if v else "NO"  # noqa: E731
    lines = ["| prompt | answer | batch | canvases | ours CPU s | official CPU s | ours / official | ours ms/call | "
             "official ms/call | decoder calls (ours, official) | steps per canvas | calls agree | steps agree | "
             "RNG agrees | ids equal |", "|" + "---|" * 15]
    for r in res["side_by_side"]:
        o, t = r["ours"], r["official"]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        f = lambda side, k, fmt: "-" if side is None else format(side[k], fmt)  # noqa: E731
        lines.append(f"| {r['prompt_length']} | {r['gen_length']} | {r['batch']} | {r['canvases']} | "
                     f"{o['cpu_s']:.3f} | {f(t, 'cpu_s', '.3f')} | {ratio} | "
                     f"{o['ms_per_call']:.2f} | {f(t, 'ms_per_call', '.2f')} | {o['calls']}, "
                     f"{'-' if t is None else t['calls']} | {'/'.join(map(str, o['steps_per_canvas']))} | "
                     f"{yes(r['calls_agree'])} | {yes(r['steps_agree'])} | {yes(r['fingerprint_agree'])} | "
                     f"{yes(r['ids_equal'])} |")
    if res["official"].get("not_run"):
        lines.append(f"\nofficial: not run ({res['official']['not_run']})")
    lines += ["", "| prompt | answer | model | decode | canvas (block) | decoder calls | calls per canvas | "
              "answer tokens | tokens per call |", "|" + "---|" * 9]
    for r in res["families"]:
        lines.append(f"| {r['prompt_length']} | {r['gen_length']} | {r['model']} | {r['decode']} | {r['canvas']} | "
                     f"{r['calls']} | {r['calls_per_canvas']:.2f} | {r['answer_tokens']} | "
                     f"{r['tokens_per_call']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    p = Parser(prog="tools/dg_vs_official.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--official-python", type=nonempty, default=None, help="the python of an environment with "
                   "transformers 5.23.0 (default: none, our side only)")
    p.add_argument("--model", type=nonempty, default=os.path.join(GOLDEN, "diffusiongemma", "tiny_dg_seed1234"),
                   help="a DiffusionGemma checkpoint (default: the tiny official one)")
    p.add_argument("--prompt-lengths", type=listing(integer(1), empty=False), default=[9, 40],
                   help="default: 9,40")
    p.add_argument("--gen-lengths", type=listing(integer(1), empty=False), default=[32, 64], help="default: 32,64")
    p.add_argument("--batches", type=listing(integer(1), empty=False), default=[1, 3], help="default: 1,3")
    p.add_argument("--steps", type=integer(1), default=None, help="denoising steps per canvas (default: the "
                   "checkpoint's generation_config.json, 48)")
    p.add_argument("--repeat", type=integer(1), default=3, help="best of this many runs a row (default: %(default)s)")
    p.add_argument("--seed", type=integer(0), default=1, help="default: %(default)s")
    p.add_argument("--llada", default=os.path.join(GOLDEN, "llada-tiny"), help="table 2's LLaDA checkpoint "
                   "(default: tests/golden/llada-tiny; '' leaves it out)")
    p.add_argument("--fastdllm-v2", default=os.path.join(GOLDEN, "fastdllm-v2-tiny"), help="table 2's Fast-dLLM v2 "
                   "checkpoint (default: tests/golden/fastdllm-v2-tiny; '' leaves it out)")
    p.add_argument("--timeout", type=integer(1), default=600, help="seconds the official side may take to answer "
                   "(default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    for flag, folder in (("--model", args.model), ("--llada", args.llada), ("--fastdllm-v2", args.fastdllm_v2)):
        if folder and not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"{flag} {folder}: no config.json there; pass a checkpoint folder")
    import torch
    from model import load_model
    torch.set_num_threads(1)
    model = load_model(args.model, device="cpu", dtype=torch.float32)
    if model.config.family != "diffusion_gemma":
        raise ValueError(f"--model {args.model} is a {model.config.family} checkpoint: pass a DiffusionGemma one")
    settings = dict(model.config.gemma.decode) | ({} if args.steps is None else dict(steps=args.steps))
    settings = {k: settings[k] for k in RELEASE}
    scratch = tempfile.mkdtemp(prefix="dg_vs_official_")
    official = None
    try:
        llada = load_model(args.llada, device="cpu", dtype=torch.float32) if args.llada else None
        v2 = load_model(v2_loadable(args.fastdllm_v2, scratch), device="cpu", dtype=torch.float32) \
            if args.fastdllm_v2 else None
        configs = [m.config for m in (model, llada, v2) if m is not None]
        official = Official(args.official_python, args.model, args.timeout) if args.official_python else None
        about = official.about | dict(python=args.official_python) if official else dict(
            not_run="pass --official-python, the python of an environment with transformers 5.23.0")
        table = side_by_side(model, official, args, settings, configs)
        res = dict(date=time.strftime("%Y-%m-%d"), machine=dict(
            platform=platform.platform(), processor=platform.processor() or platform.machine(),
            cpus=os.cpu_count(), torch=torch.__version__, capability=torch.backends.cpu.get_cpu_capability(),
            threads=torch.get_num_threads()), model=args.model, settings=settings, eos=list(model.config.eos_ids),
            seed=args.seed, repeat=args.repeat, official=about, side_by_side=table,
            families=families(table, args, settings, model.config.gemma.canvas, llada, v2, configs))
    finally:
        official.close() if official else None
        shutil.rmtree(scratch, ignore_errors=True)
    print(show(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    flags.run(main)
