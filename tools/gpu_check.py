"""
tools/gpu_check.py: the prepared GPU check, in one command. It writes an 8B-shaped random LLaDA checkpoint and
a Dream-7B-shaped one (tools/checkpoint.py; one at a time, the weights drawn on the GPU), loads each (host RSS
before and peak, GPU memory), runs every mode of bench.py's table at batch 1 and 16 with steps/s and the
fraction of the memory-bandwidth roofline, then every golden run of the official code on this device in
float32 (must be exact) and bf16 (agreement reported). JSON is rewritten after every row, so a run cut short
keeps what it measured.

    python tools/gpu_check.py --out gpu.json                  # both models, batch 1 and 16, golden parity
    python tools/gpu_check.py --families llada --batches 1 --compile --no-golden --out gpu-compile.json
    python tools/gpu_check.py --shape tiny --device cpu --out /tmp/gpu.json   # the whole path in seconds (tested)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run as a script from anywhere

import torch  # noqa: E402

from bench import PeakMemory, environment, modes, run_modes, run_row, sync, table, write_json  # noqa: E402
from checks import CACHE_MODES, check_settings  # noqa: E402
from fastdllm import pick_device_dtype  # noqa: E402
from model import ModelConfig, checkpoint_names, load_model  # noqa: E402
from tools.checkpoint import SHAPES, hf_config, make_checkpoint, random_prompts  # noqa: E402
from tools.flags import Parser, integer, listing, nonempty, out_file, positive  # noqa: E402

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def rss() -> int:
    """The process's resident memory now, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
    except OSError:
        return 0


GOLDEN_CHILD = """
import json, sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
import test_golden as G, test_flashdlm as F, test_guided as GD
from fastdllm import generate
from model import load_model
dev, dtype = torch.device({device!r}), getattr(torch, {dtype!r})
models = {{f: load_model(f"{{G.GOLDEN}}/{{f}}-tiny", device=dev, dtype=dtype) for f in ("llada", "dream")}}
prompts = json.load(open(f"{{G.GOLDEN}}/llada-golden.json"))["prompts"]
cases = [("llada", r["fn"], prompts[r["batch"]], G.llada_call(r), r["output"], r["nfe"], None) for r in G.LLADA_RUNS]
cases += [("dream", r["name"], r["input_ids"], G.dream_call(r), r["sequences"], r["nfe"], None) for r in G.DREAM_RUNS]
cases += [("dream", r["name"], [F.FLASH["prompts"][r["prompt"]]], F.freecache_call(r["settings"]), [r["output"]],
           r["nfe"], r["settings"].get("eos_bias", {{}}).get("dream")) for r in F.FREECACHE_RUNS]
guide = load_model(f"{{G.GOLDEN}}/qwen2-tiny", device=dev, dtype=dtype)
cases += [("dream", r["name"], [F.FLASH["prompts"][r["prompt"]]], dict(GD.guided_call(r["settings"]), guide=guide),
           [r["output"]], r["nfe"], r["settings"].get("eos_bias", {{}}).get("dream")) for r in GD.GUIDED_RUNS]

def eos_bias(bias, eos):   # the golden EOS runs add `bias` to the eos logit at every forward
    def hook(module, inputs, out):
        return out.index_add(-1, torch.tensor([eos], device=out.device),
                             torch.full((*out.shape[:-1], 1), float(bias), device=out.device, dtype=out.dtype))
    return hook

runs = []
for family, name, prompt, kw, want, nfe, bias in cases:
    model = models[family]
    prompt, want = torch.tensor(prompt, device=dev), torch.tensor(want, device=dev)
    hook = model.lm_head.register_forward_hook(eos_bias(bias, model.config.eos_id)) if bias else None
    out, st = generate(model, prompt, **kw)
    if hook:
        hook.remove()
    gen, ref = out[:, prompt.shape[1]:], want[:, prompt.shape[1]:]
    runs.append(dict(family=family, name=name, exact=bool(torch.equal(out, want)) and st["nfe"] == nfe,
                     agreement=(gen == ref).float().mean().item(), nfe=st["nfe"], golden_nfe=nfe))
print(json.dumps(runs))
"""


def golden_parity(device: str, dtype: str) -> dict:
    """Every golden run of the official code (tests/golden) on this device and dtype, in a fresh process (it
    imports the test modules, which pin the CPU to one thread). float32 must be exact; bf16 is reported."""
    code = GOLDEN_CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), device=device, dtype=dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        return dict(error=out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed")
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(runs=runs, exact=sum(r["exact"] for r in runs), total=len(runs),
                agreement=sum(r["agreement"] for r in runs) / len(runs))


def step_bytes(model) -> int:
    """Weight bytes one step must read: every parameter except the embedding table, of which a step reads
    only the rows of the tokens it feeds. The LM head is read whole, whatever the number of open positions."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed"))


def selected_shapes(args) -> list[dict]:
    shapes = ([SHAPES["llada-8b"], SHAPES["dream-7b"]] if args.shape == "8b" else
              [SHAPES["llada-tiny"], SHAPES["dream-tiny"]])
    return [s for s in shapes if s["family"] in args.families]


def gpu_check(args):
    device, dtype = pick_device_dtype(args.device, args.dtype)
    if args.dir is not None and not os.path.isdir(args.dir):
        raise ValueError(f"--dir {args.dir} is not a folder: pass an existing folder (or none, for a temp folder)")
    shapes = selected_shapes(args)
    work = tempfile.mkdtemp(prefix="fastdllm_gpu_check_", dir=args.dir)
    result = dict(environment=environment(device, dtype), settings=vars(args), load={}, rows=[], golden={})
    mode_list = modes(args.caches, args.thresholds, args.factors)
    kw = dict(gen_length=args.gen_length, block_length=args.block_length)
    t_start = time.perf_counter()
    try:
        for shape in shapes:
            family = shape["family"]
            folder = os.path.join(work, family)
            t0 = time.perf_counter()
            size = make_checkpoint(folder, **shape, shards=args.shards, device=device if device.type == "cuda" else "cpu")
            write_s = time.perf_counter() - t0
            before, host, t0 = rss(), PeakMemory("cpu"), time.perf_counter()
            model = load_model(folder, device=device, dtype=dtype)   # from the page cache: it was just written
            sync(device)
            load = dict(checkpoint_gb=size / 1e9, write_s=write_s, load_s=time.perf_counter() - t0,
                        host_rss_before_gb=before / 1e9, host_rss_peak_gb=host.read() / 1e9, host_rss_what=host.what,
                        gpu_allocated_gb=torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None)
            result["load"][family] = load
            print(f"{family}: {load}", file=sys.stderr, flush=True)
            bytes_per_step = step_bytes(model)
            prompts = random_prompts(model.config, max(args.batches), args.prompt_length).to(device)
            variants = [("eager", model)]
            if args.compile:   # one model, compiled: same weights, same generate(); dynamic shapes, as the fed
                # span and the number of open positions change from step to step
                variants.append(("compiled", torch.compile(model, dynamic=True, mode=args.compile)))
            for batch in args.batches:
                ref = None
                for name, m in variants:
                    todo = mode_list if name == "eager" else [x for x in mode_list if x["cache"] != "none"]
                    t0 = time.perf_counter()
                    if name == "compiled":   # compile for every mode's shapes first: reported, not timed
                        for x in todo:
                            run_row(m, prompts[:batch], x, kw)
                    warm = time.perf_counter() - t0
                    # compiled rows: agreement and speed-up against the *eager* exact decode
                    rows, ref = run_modes(m, prompts[:batch], todo, kw, warmup=name == "eager", ref=ref)
                    eager = {(r["cache"], r["rule"]): r.get("ids_sha1") for r in result["rows"]
                             if r["family"] == family and r["batch"] == batch}
                    for r in rows:
                        r.update(family=family, variant=name)
                        if "error" not in r:
                            r.update(steps_per_s=r["nfe"] / r["seconds"],
                                     roofline=bytes_per_step * r["nfe"] / r["seconds"] / args.peak_bandwidth)
                        if name == "compiled":
                            r.update(compile_s=warm, same_ids_as_eager=eager.get((r["cache"], r["rule"])) == r.get("ids_sha1"))
                    result["rows"] += rows
                    write_json(args.out, **result)
            del model, variants, m      # `m` too: the loop variable would keep the weights alive
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)   # 16 GB each: the disk holds one at a time
        if not args.no_golden:
            for dt in ("float32", "bfloat16"):
                result["golden"][dt] = golden_parity(str(device), dt)
                write_json(args.out, **result)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["total_s"] = time.perf_counter() - t_start
    write_json(args.out, **result)
    print(gpu_report(result, args))
    return result


GPU_COLUMNS = [
    ("model", lambda r: r["family"]), ("batch", lambda r: str(r["batch"])),
    ("run", lambda r: r["variant"] if "same_ids_as_eager" not in r else
     f"compiled ({'same ids as eager' if r['same_ids_as_eager'] else 'ids differ from eager'})"),
    ("cache", lambda r: r["cache"]), ("rule", lambda r: r["rule"]), ("NFE", lambda r: str(r["nfe"])),
    ("NFE/problem", lambda r: f"{r['calls_per_problem']:.2f}"),
    ("tokens/call", lambda r: f"{r['tokens_per_call']:.2f}"), ("fed/call", lambda r: f"{r['fed_per_call']:.0f}"),
    ("wall s", lambda r: f"{r['seconds']:.2f}"), ("steps/s", lambda r: f"{r['steps_per_s']:.1f}"),
    ("roofline", lambda r: f"{100 * r['roofline']:.0f}%"),
    ("answer tok/s", lambda r: f"{r['answer_tokens_per_s']:.0f}"),
    ("all tok/s", lambda r: f"{r['all_tokens_per_s']:.0f}"),
    ("peak GiB", lambda r: f"{r['peak_mib'] / 1024:.1f}"), ("agreement", lambda r: f"{r['agreement']:.3f}"),
]


def gpu_report(result, args) -> str:
    env = result["environment"]
    lines = [f"{env['gpu'] or env['cpu']}, torch {env['torch']}, {env['dtype']}, {env['date']}; prompt "
             f"{args.prompt_length}, gen {args.gen_length}, block {args.block_length}; roofline = weight bytes "
             f"(all but the embedding) x steps/s / {args.peak_bandwidth / 1e12:g} TB/s"]
    for family, ld in result["load"].items():
        gpu = f", GPU memory {ld['gpu_allocated_gb']:.1f} GB" if ld["gpu_allocated_gb"] is not None else ""
        lines.append(f"{family}: checkpoint {ld['checkpoint_gb']:.3g} GB, written in {ld['write_s']:.0f} s, "
                     f"loaded in {ld['load_s']:.1f} s, host RSS {ld['host_rss_before_gb']:.2f} GB before the load, "
                     f"peak {ld['host_rss_peak_gb']:.2f} GB{gpu}")
    warmups = {(r["family"], r["batch"]): r["compile_s"] for r in result["rows"] if "compile_s" in r}
    for (family, batch), s in warmups.items():
        lines.append(f"{family} batch {batch}: torch.compile warm-up (compiling, then one run of each cached mode) "
                     f"{s:.0f} s, not in the timings")
    for dt, g in result["golden"].items():
        lines.append(f"golden runs in {dt}: " + (g["error"] if "error" in g else
                     f"{g['exact']}/{g['total']} exact, token agreement {g['agreement']:.4f}"))
    return "\n".join(lines) + "\n\n" + table(result["rows"], GPU_COLUMNS)


def main(argv=None):
    p = Parser(prog="tools/gpu_check.py", description="The prepared GPU check (8B-shaped checkpoints).")
    p.add_argument("--out", required=True, type=out_file, help="JSON results (rewritten after every row)")
    p.add_argument("--shape", default="8b", choices=("8b", "tiny"), help="8b (LLaDA-8B and Dream-7B shapes) | tiny "
                   "(the CPU test) (default: %(default)s)")
    p.add_argument("--families", type=listing(("llada", "dream"), empty=False), default="llada,dream",
                   help="default: %(default)s")
    p.add_argument("--batches", type=listing(integer(1), empty=False), default="1,16", help="default: %(default)s")
    p.add_argument("--caches", type=listing(CACHE_MODES, empty=False), default="none,prefix,dual,free",
                   help="default: %(default)s")
    p.add_argument("--thresholds", type=listing(positive), default="0.9", help="default: %(default)s")
    p.add_argument("--factors", type=listing(positive), default="1.0", help="default: %(default)s")
    p.add_argument("--prompt-length", type=integer(1), default=64, help="default: %(default)s")
    p.add_argument("--gen-length", type=integer(1), default=256, help="default: %(default)s")
    p.add_argument("--block-length", type=integer(1), default=32, help="default: %(default)s")
    p.add_argument("--shards", type=integer(1), default=4, help="default: %(default)s")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--peak-bandwidth", type=positive, default=4.8e12, help="bytes/s (default: H200, 4.8 TB/s)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   help="also run the cached modes through torch.compile(model) (optional mode, e.g. max-autotune)")
    p.add_argument("--no-golden", action="store_true", help="skip the golden parity runs")
    p.add_argument("--dir", type=nonempty, default=None, help="where to write the checkpoints (default: a temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = p.parse_args(argv)
    if args.shape == "8b" and pick_device_dtype(args.device, args.dtype)[0].type != "cuda":
        raise ValueError("--shape 8b writes and loads 16 GB checkpoints, made for a GPU: pass --device cuda on a "
                         "CUDA machine, or --shape tiny to run the whole path on this CPU")
    check_settings(gen_length=args.gen_length, block_length=args.block_length, steps=args.gen_length, cache="none",
                   threshold=None, factor=None, temperature=0.0)
    for shape in selected_shapes(args):
        family, cfg = shape["family"], ModelConfig.from_hf(hf_config(**shape))
        n = len(checkpoint_names(cfg))
        if args.shards > n:
            raise ValueError(f"--shards {args.shards} exceeds the {family} checkpoint's {n} tensors")
        if args.prompt_length + args.gen_length > cfg.max_seq_len:
            raise ValueError(f"--prompt-length + --gen-length exceed the {family} checkpoint's {cfg.max_seq_len} "
                             "positions")
    return gpu_check(args)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
