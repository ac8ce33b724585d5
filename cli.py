"""
cli.py: the command line (`python fastdllm.py --prompt ...` runs `main` here) and what serve.py, bench.py and
harness.py share with it: the flags (parse_args) and their types, the device and dtype, the flags as generate()
keywords, batches of prompts, interactive turns and prompt files, and loading (the small files' checks first,
then the guide and the model, with progress on stderr). The method itself is in fastdllm.py.
"""
import argparse
import inspect
import math
import os
import sys
import time
from types import SimpleNamespace

import torch

import checks
from chat import Chat, check_text, load_tokenizer, read_turns, streamer
from checks import CACHE_MODES
from fastdllm import Settings, generate, pad_prompts
from guided import ACCEPT_RULES, check_accept, check_guide, check_guided_settings
from model import Compiled, check_readable, load_model, read_config, resolve_model_dir
from quant import QUANTIZE, int8_quantizer


# The command line's defaults where they differ from generate()'s: the methods' headline setting (Fast-dLLM's
# DualCache with threshold 0.9) and early stop at the end of text. serve.py and harness.py read them too.
CLI_DEFAULTS = dict(gen_length=256, cache="dual", threshold=0.9, stop_at_eos=True)
DEFAULT_MODEL = "GSAI-ML/LLaDA-8B-Instruct"


# Flags that only mean something beside another flag: given without it they are an error, never ignored.
NEEDS = {"accept": "guide", "accept_k": "guide", "accept_ratio": "guide", "accept_threshold": "guide",
         "speculative": "guide", "batch_size": "prompt_file"}
NOT_GIVEN = object()   # what a NEEDS flag holds after parsing when it was not on the command line


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def settings(args, **override):
    """The CLI's flags as generate() keywords (--compile: the process's one Compiled, so graphs are reused)."""
    kw = dict(gen_length=args.gen_length, block_length=args.block_length or None, steps=args.steps,
              cache=args.cache, threshold=args.threshold, factor=args.factor, temperature=args.temperature,
              remasking=args.remasking, top_p=args.top_p, top_k=args.top_k, alg_temp=args.alg_temp,
              compile=getattr(args, "compiled", None) or args.compile)
    if args.guide:
        kw.update(accept=args.accept, accept_k=args.accept_k, accept_ratio=args.accept_ratio,
                  accept_threshold=args.accept_threshold, speculative=args.speculative)
    kw.update(getattr(args, "hooks", {}), **override)      # a fork's own parts (main(**hooks): examples/)
    return kw


def pick_device_dtype(device: str | None, dtype: str | None):
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available here: use --device cpu")
    if device not in ("cpu", "mps") and not device.startswith("cuda"):
        raise ValueError(f"unknown --device {device!r}: use cpu or cuda (cuda:N)")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in dtypes:
        raise ValueError(f"unknown --dtype {dtype!r}: use float32, bfloat16 or float16")
    if device == "cpu" and dtype == "float16":
        raise ValueError("--dtype float16 is not supported on CPU: use float32 (or bfloat16)")
    if device.startswith("cuda") and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU does not support bfloat16: use --dtype float16 or float32")
    return torch.device(device), dtypes[dtype]


def optional_float(text: str):
    try:
        return None if text.lower() in ("none", "off") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None


def checked(kind, ok, what: str):
    """An argparse type: kind(text), refused unless ok(value) (NaN fails every comparison), e.g.
    "argument --accept-k: expected an integer >= 1, got '0'"."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def fit_gen_length(args, n_prompt: int, max_seq_len: int) -> int:
    """An explicit --gen-length as given (generate() checks it); the default 256 cut to the largest multiple
    of --block-length that fits the model's positions (the demo model has 64), said on stderr."""
    block = args.block_length or 1
    fit = (max_seq_len - n_prompt) // block * block
    if not args.fit_gen_length or n_prompt + args.gen_length <= max_seq_len or fit < 1:
        return args.gen_length
    print(f"note: the prompt ({n_prompt} tokens) + gen-length {args.gen_length} exceed the model's {max_seq_len} "
          f"positions: generating {fit} tokens (pass --gen-length to choose)", file=sys.stderr)
    return fit


def load(what: str, model_dir: str, device, dtype, quantize=None):
    """load_model, said on stderr (stdout holds only answers): on a terminal a live line (shard i of n, GB
    read), then one summary line, the only one when stderr is a file or a pipe."""
    start, tty, seen = time.perf_counter(), sys.stderr.isatty(), {"shown": 0.0, "total": 0}

    def progress(shard, n, done, total):
        seen["total"] = total
        if tty and time.perf_counter() - seen["shown"] > 0.1:
            seen["shown"] = time.perf_counter()
            print(f"\rloading {what}: shard {shard} of {n}, {done / 1e9:.1f} of {total / 1e9:.1f} GB", end="",
                  file=sys.stderr, flush=True)
    try:
        model = load_model(model_dir, device=device, dtype=dtype, progress=progress, quantize=quantize)
    finally:
        if seen["shown"]:
            print("\r\x1b[K", end="", file=sys.stderr)    # clear the live line
    size = f"{seen['total'] / 1e9:.1f} GB" if seen["total"] >= 1e8 else f"{seen['total'] / 1e6:.1f} MB"
    print(f"loaded {what} in {time.perf_counter() - start:.2f} s ({size})", file=sys.stderr)
    return model


def load_guide(guide_dir, args, cfg, chat, device, dtype):
    """--guide: check that it shares the model's token ids on its small files, then load it (or None)."""
    if not guide_dir:
        return None
    try:   # with both tokenizers every shared id is compared token by token; else the configs' ids
        guide_tok = load_tokenizer(guide_dir)
    except FileNotFoundError:
        guide_tok = None
    check_guide(cfg, read_config(guide_dir), chat.tok, guide_tok)
    try:
        return load(f"the guide {args.guide}", guide_dir, device, dtype, args.quantize)
    except ValueError as e:     # a truncated or corrupt file: say it is the guide's
        raise ValueError(f"the guide {args.guide}: {e}") from None


def read_prompts(path: str) -> list[str]:
    """--prompt-file's lines, each a prompt; a blank line stays in its place as "" (its answer is an empty line,
    so that answer N is on output line N), blank lines at the end are dropped. Read by parse_args: its errors
    come before any model."""
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path} is not valid UTF-8 text ({e.reason} at byte {e.start}): "
                         f"convert it (e.g. with iconv)") from None
    except OSError as e:   # missing, a folder, no permission
        raise ValueError(f"cannot read --prompt-file {path}: {e.strerror or e}") from None
    while prompts and not prompts[-1]:
        prompts.pop()
    if not prompts:
        raise ValueError(f"--prompt-file {path} has no prompt: write one prompt per line")
    return prompts


def load_all(args):
    """What every command line of the project loads (this CLI, serve.py, bench.py run): the checks of the small
    files first (config.json, tokenizer.json, the guide's), then the guide and the model. Sets args.stop_ids,
    args.guide_model and args.compiled (one Compiled for the process). -> (model, chat, cfg, device)."""
    device, dtype = pick_device_dtype(args.device, args.dtype)
    int8_quantizer(args.quantize)      # --quantize int8 without torchao: said before anything is read
    # The guide first: a typo in its path must not wait for the model's download.
    guide_dir = resolve_model_dir(args.guide, role="guide") if args.guide else None
    model_dir = resolve_model_dir(args.model)
    cfg = read_config(model_dir)
    if cfg.causal:
        raise ValueError(f"--model {args.model} is a causal LM (model_type qwen2), not a diffusion LM: it belongs to "
                         f"--guide; pass a LLaDA or Dream checkpoint as --model")
    if cfg.family == "dream" and not args.block_length and (args.cache != "none" or args.threshold is not None
                                                          or args.factor is not None):
        raise ValueError("--block-length 0 selects Dream's own whole-canvas sampler, which has no cache and no "
                         "parallel decoding: add --cache none --threshold none, or pass a --block-length")
    check_readable(os.path.join(model_dir, "tokenizer.json"))
    chat = Chat(model_dir, cfg, chat=not args.no_chat)
    # The mask id must be a special token: an ordinary word means config.json does not match the tokenizer
    # (blame the config, not a prompt that happens to use the word).
    word = chat.tok.id_to_token(cfg.mask_id)
    if word is not None and not getattr(chat.tok.get_added_tokens_decoder().get(cfg.mask_id), "special", False):
        raise ValueError(f"config.json's mask_token_id {cfg.mask_id} is the ordinary token {word!r} of "
                         f"tokenizer.json, not a special mask token: fix config.json or re-download the checkpoint")
    args.stop_ids = sorted(chat.stop_ids)     # the checkpoint's own end tokens (chat.Chat: which files say so)
    args.guide_model = load_guide(guide_dir, args, cfg, chat, device, dtype)
    model = load(args.model, model_dir, device, dtype, args.quantize)
    args.compiled = Compiled() if args.compile else None
    return model, chat, cfg, device


# ----------------------------------------------------------------------------------------------------------
# The command line

def parse_args(argv=None, hooks=()):
    p = argparse.ArgumentParser(description="Fast-dLLM inference for LLaDA and Dream. The defaults are the "
                                "method's headline setting; the plain baseline is --cache none --threshold none.")

    def error(message):   # argparse would print its usage too: our errors are one line (see __main__)
        raise ValueError(f"{message} (see --help)")
    p.error = error
    # SUPPRESS: --gen-length and --threshold are absent unless given, so we can tell a default from a choice.
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face repo id or local folder "
                   "(default: %(default)s)")
    p.add_argument("--prompt", help="the user message (required unless --prompt-file; with --interactive: the "
                   "first turn)")
    p.add_argument("--gen-length", type=int, default=argparse.SUPPRESS, help=f"tokens to generate (default: "
                   f"{CLI_DEFAULTS['gen_length']}, or the largest multiple of --block-length that fits the model)")
    p.add_argument("--block-length", type=int, default=Settings.block_length, help="semi-autoregressive block "
                   "size; 0 = one block (for Dream: Dream's own whole-canvas sampler) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: gen-length)")
    p.add_argument("--cache", default=argparse.SUPPRESS, help=f"KV cache: {' | '.join(CACHE_MODES)} "
                   f"(default: {CLI_DEFAULTS['cache']})")
    p.add_argument("--threshold", type=optional_float, default=argparse.SUPPRESS, help="parallel decoding: "
                   f"unmask every token with confidence >= this; none = off (default: {CLI_DEFAULTS['threshold']}; "
                   f"none with --factor)")
    p.add_argument("--factor", type=float, default=None, help="factor-based parallel decoding (default: off)")
    p.add_argument("--temperature", type=checked(float, math.isfinite, "a finite number"), default=0.0,
                   help="0 = greedy (default: %(default)s)")
    p.add_argument("--remasking", default=None, help="LLaDA: low_confidence (default) | random; Dream: entropy "
                   "(default) | maskgit_plus | topk_margin | origin")
    p.add_argument("--top-p", type=float, default=None, help="Dream only (default: off)")
    p.add_argument("--top-k", type=int, default=None, help="Dream only (default: off)")
    p.add_argument("--alg-temp", type=float, default=None, help="Dream only: randomness of the position choice")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's layers, one graph per shape fed")
    p.add_argument("--quantize", choices=QUANTIZE, help="int8: weight-only int8 layers, model and guide (torchao)")
    p.add_argument("--no-chat", action="store_true", help="raw prompt, no chat template (base models)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat on stdin, until exit, quit or its "
                   "end (a model without a chat template, like the demo, answers each question alone)")
    p.add_argument("--prompt-file", help="one prompt per line, decoded in batches: one answer line per input line "
                   "(a blank line's answer is an empty line, so line N answers line N)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch with --prompt-file "
                   "(default: %(default)s)")
    p.add_argument("--no-early-stop", action="store_true", help="decode every block even after the answer "
                   "ended (default: stop once a finished block holds an end token)")
    p.add_argument("--no-stream", action="store_true", help="print the answer at the end, not block by block")
    p.add_argument("--trace", action="store_true", help="print which tokens each step unmasked")
    p.add_argument("--guide", help="a causal LM sharing the model's tokenizer (Qwen2 format, repo id or folder): "
                   "FlashDLM's guided diffusion (default: off)")
    p.add_argument("--accept", default=Settings.accept, choices=ACCEPT_RULES, metavar="RULE",
                   help="guided: deterministic | topk | topk_relative | dynamic_threshold | aggressive "
                   "(default: %(default)s)")
    p.add_argument("--accept-k", type=checked(int, lambda k: k >= 1, "an integer >= 1"), default=Settings.accept_k,
                   help="guided topk and topk_relative: the guide's top k (default: %(default)s)")
    p.add_argument("--accept-ratio", type=checked(float, lambda r: 0 < r <= 1, "a number in (0, 1]"),
                   default=Settings.accept_ratio, help="guided topk_relative ratio (default: %(default)s)")
    p.add_argument("--accept-threshold", type=checked(float, lambda t: 0 <= t < 1, "a number in [0, 1)"),
                   default=Settings.accept_threshold, help="guided dynamic_threshold: accept a draft whose guide "
                   "probability exceeds this (default: %(default)s)")
    p.add_argument("--speculative", action="store_true", default=False, help="guided: commit the guide's token "
                   "in place of the first rejected draft, i.e. the guide's quality (default: the diffusion "
                   "model's first draft)")
    args = p.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(NEEDS, NOT_GIVEN)))
    given = {flag for flag in NEEDS if getattr(args, flag) is not NOT_GIVEN}
    for flag, need in NEEDS.items():
        if flag not in given:
            setattr(args, flag, p.get_default(flag))
        elif not getattr(args, need):
            flag, need = flag.replace("_", "-"), need.replace("_", "-")
            raise ValueError(f"--{flag} only applies with --{need}: add --{need}, or drop --{flag}")
    check_accept(args.accept, given, flag_name)
    for flag in ("model", "guide", "prompt_file"):
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise ValueError(f"--{flag.replace('_', '-')} is empty: pass a path (or leave the flag out)")
    args.fit_gen_length = "gen_length" not in vars(args)
    args.gen_length = getattr(args, "gen_length", CLI_DEFAULTS["gen_length"])
    if "threshold" not in vars(args):   # --factor, --guide or a fork's select= replaces the default
        args.threshold = None if args.factor is not None or args.guide or "select" in hooks else CLI_DEFAULTS["threshold"]
    if "cache" in hooks and "cache" in vars(args):
        raise ValueError(f"--cache {args.cache} does not apply: this program feeds the model with its own cache "
                         f"policy; drop --cache")
    args.cache = getattr(args, "cache", CLI_DEFAULTS["cache"])
    if not args.prompt and not args.interactive and not args.prompt_file:
        raise ValueError("no prompt: pass --prompt \"...\" (or --prompt-file, --interactive)")
    if args.prompt_file and (args.prompt or args.interactive):
        raise ValueError("pass one of --prompt, --prompt-file, --interactive")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (got {args.batch_size})")
    unused = next((f for f in ("steps", "remasking", "top_p", "top_k", "alg_temp") if getattr(args, f) is not None),
                  "no_early_stop" if args.no_early_stop else None)
    if args.guide and unused:   # accepted and without effect would be a silent lie: refuse
        raise ValueError(f"--{unused.replace('_', '-')} does not apply with --guide: a guided answer is one block "
                         f"of argmax drafts, decoded until a committed end token or no mask is left; drop it")
    if args.trace and args.prompt_file:
        raise ValueError("--trace shows the steps of one answer: use it with --prompt or --interactive, "
                         "not --prompt-file")
    args.prompts = read_prompts(args.prompt_file) if args.prompt_file else None
    check_text(args.prompt or "")
    if not -2**63 <= args.seed < 2**64:   # torch's seed is 64-bit: say so before loading, not after
        raise ValueError(f"--seed {args.seed} does not fit in 64 bits: use a seed between 0 and 2**64 - 1")
    return args


def check_early(kw: dict, name=lambda key: key):
    """Every check of generate() keywords that needs no model, with Settings' defaults (a `guide` of any value,
    a path say, means a guide is coming: guided diffusion's own checks)."""
    checks.check_early(kw, Settings(), name)
    if kw.get("guide") is not None:
        check_guided_settings(SimpleNamespace(**vars(Settings()) | kw), Settings(), name)


def check_flags(args, whole_blocks: bool = False):
    """The decoding flags' checks that need no model, before one is loaded (main(), serve.py). whole_blocks: a
    default gen_length rounded up to whole blocks first, as serve.py's requests without max_tokens use it."""
    kw = settings(args)
    if whole_blocks and args.fit_gen_length and args.block_length:
        kw["gen_length"] = -(-args.gen_length // args.block_length) * args.block_length
    check_early(kw | {"guide": args.guide}, flag_name)


def run_batch(model, rows, args, device, on_step=None, **override):
    """generate() on prompts of any lengths (left-padded), with the CLI's settings (early stop on unless
    --no-early-stop) -> (prompt + answer ids per row, pads dropped; stats)."""
    ids, am = pad_prompts(rows, model.config.pad_id if model.config.pad_id is not None else model.config.eos_id)
    hooks = getattr(args, "hooks", {})     # a fork's stop rule replaces early stop; its step rule draws its own noise
    gen = None if "propose" in hooks else torch.Generator(device).manual_seed(args.seed)
    kw = dict(stop_at_eos=not args.no_early_stop and "stop" not in hooks, eos_ids=getattr(args, "stop_ids", None),
              guide=args.guide_model)
    x, stats = generate(model, ids.to(device), attention_mask=am.to(device), generator=gen, on_step=on_step,
                        **kw | settings(args, **override))
    return [row[ids.shape[1] - len(r):] for row, r in zip(x.tolist(), rows)], stats


def answer_prompts(model, chat, args, device):
    """--prompt-file: every line a prompt, decoded in batches of --batch-size; one answer line per input line,
    in input order (a blank line's answer is an empty line, so the lines of both stay aligned)."""
    lines = [i for i, q in enumerate(args.prompts) if q]          # the lines that hold a prompt
    rows = [chat.encode(chat.render([{"role": "user", "content": args.prompts[i]}])) for i in lines]
    args.gen_length = fit_gen_length(args, max(map(len, rows)), model.config.max_seq_len)
    nfe, seconds, tokens, printed = 0, 0.0, 0, 0
    for b in range(0, len(rows), args.batch_size):
        batch = rows[b:b + args.batch_size]
        outs, stats = run_batch(model, batch, args, device)
        for line, ids, out in zip(lines[b:], batch, outs):
            print("\n" * (line - printed) + chat.answer(out[len(ids):]))     # the blank lines before it first
            printed = line + 1
        nfe, seconds, tokens = nfe + stats["nfe"], seconds + stats["seconds"], tokens + stats["answer_tokens"]
    blank = len(args.prompts) - len(rows)
    note = f" ({blank} blank line{'s' * (blank > 1)}: empty answers)" if blank else ""
    print(f"{len(rows)} prompts{note} | NFE {nfe} | {tokens / max(seconds, 1e-9):.1f} tokens/s | {seconds:.2f} s")


def main(argv=None, **hooks):
    """The command line. hooks: a fork's own parts (cache=, select=, stop=, propose=; examples/), given to every
    generate() call: each replaces the CLI's default of its kind (a select= the threshold 0.9, a stop= the early
    stop)."""
    args = parse_args(argv, hooks)
    args.hooks = hooks
    check_flags(args)
    model, chat, cfg, device = load_all(args)
    if args.prompt_file:
        return answer_prompts(model, chat, args, device)
    messages, ids = [], []
    if args.interactive and sys.stdin is not None and sys.stdin.isatty():   # no banner for piped questions
        print("interactive chat: type a question and press Enter; exit, quit or Ctrl-D ends it", file=sys.stderr)
    for text in read_turns(args.prompt) if args.interactive else [args.prompt]:
        # Without a chat template there are no turns to keep (the demo model was trained on one question
        # each, and earlier questions would only fill its 64 positions): each question is a new prompt.
        messages = (messages if chat.chat else []) + [{"role": "user", "content": text}]
        if ids and chat.chat and chat.family == "llada":
            # LLaDA's chat.py keeps the previous turns as ids, with every <|endoftext|> filler removed, and
            # appends the new turn without its bos.
            ids = [t for t in ids if t != cfg.eos_id] + chat.encode(chat.render(messages[-1:]))[1:]
        else:
            ids = chat.encode(chat.render(messages))
        gen_length = fit_gen_length(args, len(ids), cfg.max_seq_len)
        live, steps = {}, []
        stream = None if args.no_stream or args.trace else streamer(chat, len(ids), cfg.mask_id)

        def on_step(x, st):
            live.update(x=x, nfe=st["nfe"])
            if args.trace:
                steps.append(x[0, len(ids):].tolist())
            if stream:
                stream(x, st)
        if args.compiled and not args.compiled.fn:    # gpt-fast: the compile warm-up is not timed
            t0 = time.perf_counter()
            run_batch(model, [ids], args, device, gen_length=gen_length)
            print(f"compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if args.interactive:
            print("assistant> ", end="", flush=True)
        try:
            (out,), stats = run_batch(model, [ids], args, device, on_step, gen_length=gen_length)
        except KeyboardInterrupt:
            partial = live["x"][0, len(ids):].tolist() if "x" in live else []
            partial = [t for t in partial if t != cfg.mask_id]
            print(f"\n[interrupted after {live.get('nfe', 0)} steps] {chat.answer(partial)}")
            return 130
        answer = chat.answer(out[len(ids):])
        if args.trace:
            from chat import render_trace
            print("\n".join(render_trace(steps, chat.tok, cfg.mask_id, chat.stop_ids)))
        print("" if stream else answer)
        peak = f" | peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
        guided = f" | guide calls {stats['guide_calls']}" if args.guide else ""
        print(f"NFE {stats['nfe']} | {stats['tokens_per_s']:.1f} tokens/s | {stats['seconds']:.2f} s{guided}{peak}")
        messages.append({"role": "assistant", "content": answer})
        ids = out


def own_flags(argv: list, **defaults) -> tuple[dict, list]:
    """A fork's own flags (examples/): `--name value`, typed as its default -> ({name: value}, the CLI's argv)."""
    values, rest, argv = dict(defaults), [], list(argv)
    while argv:
        arg = argv.pop(0)
        key = arg[2:].split("=")[0].replace("-", "_")
        if not (arg.startswith("--") and key in defaults):
            rest.append(arg)
            continue
        text = arg.split("=", 1)[1] if "=" in arg else argv.pop(0) if argv else ""
        try:
            values[key] = type(defaults[key])(text)
        except ValueError:
            raise ValueError(f"--{key.replace('_', '-')} expects a {type(defaults[key]).__name__}, got {text!r}") from None
    return values, rest


def run(fork=None, **own):
    """`python fastdllm.py ...`: main() with one-line errors and Unix exit statuses. A fork's program (examples/)
    passes fork(**its flags) -> its hooks, and the flags' defaults (fork(config=, tokenizer=): the checkpoint's)."""
    if sys.stdout is None:   # started with stdout closed (`>&-`): the answers would go nowhere
        print("error: standard output is closed: the answer has nowhere to go (drop `>&-`, or redirect to a "
              "file or /dev/null)", file=sys.stderr)
        sys.exit(2)
    try:
        values, argv = own_flags(sys.argv[1:], **own)
        needs = inspect.signature(fork).parameters if fork else {}
        if "config" in needs or "tokenizer" in needs:      # the fork's parts depend on the checkpoint
            folder = resolve_model_dir(own_flags(argv, model=DEFAULT_MODEL)[0]["model"])
            values |= {k: v() for k, v in dict(config=lambda: read_config(folder),
                                               tokenizer=lambda: load_tokenizer(folder)).items() if k in needs}
        status = main(argv, **(fork(**values) if fork else {}))
        sys.stdout.flush()     # here, so that a closed pipe is caught below, not at the interpreter's exit
        sys.exit(status)
    except BrokenPipeError:
        # The reader stopped reading (`| head -1`): quiet, as Unix tools are (128 + SIGPIPE); stdout goes to
        # devnull so the final flush does not fail again (the Python docs' "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except (ValueError, OSError) as e:   # OSError: FileNotFoundError and any file error we did not foresee
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run()
