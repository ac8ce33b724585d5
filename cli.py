"""
cli.py: the command line's helpers, shared by fastdllm.py's CLI, serve.py, bench.py and harness.py: flag types,
the device and dtype, the CLI's flags as generate() keywords, left-padded batches, interactive turns and prompt
files, and loading (the small files' checks first, then the guide and the model, with progress on stderr).
The CLI itself (parse_args, main) is in fastdllm.py, after generate().
"""
import argparse
import os
import sys
import time

import torch

from chat import Chat, check_text, load_tokenizer
from guided import check_guide
from model import Compiled, check_readable, load_model, read_config, resolve_model_dir


# The command line's defaults where they differ from generate()'s: the methods' headline setting (Fast-dLLM's
# DualCache with threshold 0.9) and early stop at the end of text. serve.py and harness.py read them too.
CLI_DEFAULTS = dict(gen_length=256, cache="dual", threshold=0.9, stop_at_eos=True)


# Flags that only mean something beside another flag: given without it they are an error, never ignored.
NEEDS = {"accept": "guide", "accept_k": "guide", "accept_ratio": "guide", "accept_threshold": "guide",
         "speculative": "guide", "batch_size": "prompt_file"}
NOT_GIVEN = object()   # what a NEEDS flag holds after parsing when it was not on the command line


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def pad_prompts(rows: list[list[int]], pad_id: int):
    """Prompts of different lengths -> (ids (B, P), attention_mask (B, P)), left-padded so that every answer
    starts at the same canvas position."""
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (P - len(r)) + list(r) for r in rows])
    return ids, (torch.arange(P) >= torch.tensor([[P - len(r)] for r in rows])).long()


def settings(args, **override):
    """The CLI's flags as generate() keywords. --compile: the Compiled that main() (or serve.py) made once, so
    every call of the process reuses its graphs."""
    kw = dict(gen_length=args.gen_length, block_length=args.block_length or None, steps=args.steps,
              cache=args.cache, threshold=args.threshold, factor=args.factor, temperature=args.temperature,
              remasking=args.remasking, top_p=args.top_p, top_k=args.top_k, alg_temp=args.alg_temp,
              compile=getattr(args, "compiled", None) or args.compile)
    if args.guide:
        kw.update(accept=args.accept, accept_k=args.accept_k, accept_ratio=args.accept_ratio,
                  accept_threshold=args.accept_threshold, speculative=args.speculative)
    kw.update(override)
    return kw


def read_turns(first: str | None = None):
    """--interactive's questions: `first` (--prompt) if given, then stdin's until its end (Ctrl-D) or exit /
    quit; an empty line asks again."""
    if first:
        print(f"user> {first}")
        yield first
    while (text := read_turn()) not in (None, "exit", "quit"):
        if text:
            yield text


def read_turn() -> str | None:
    """One --interactive question from stdin; None at its end (Ctrl-D, or the end of piped input). From a
    pipe nothing echoes the line, so it is printed here: "assistant> " then starts a line of its own."""
    try:
        text = input("user> ").strip()
    except EOFError:
        print()
        return None
    except UnicodeDecodeError:   # a strict UTF-8 stdin (a lenient one gives surrogates: check_text)
        raise ValueError("the input is not valid UTF-8 text: pass UTF-8 (convert it with e.g. iconv)") from None
    except BrokenPipeError:   # stdout closed while "user> " was written: fastdllm.py's __main__ ends quietly
        raise
    except (OSError, RuntimeError):   # stdin closed (`<&-`): "input(): lost sys.stdin", or EBADF
        raise ValueError("--interactive reads questions from stdin, which is closed: run it in a terminal or "
                         "pipe the questions in") from None
    check_text(text, "the input")
    if not sys.stdin.isatty():
        print(text)
    return text


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


def load(what: str, model_dir: str, device, dtype):
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
        model = load_model(model_dir, device=device, dtype=dtype, progress=progress)
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
        return load(f"the guide {args.guide}", guide_dir, device, dtype)
    except ValueError as e:     # a truncated or corrupt file: say it is the guide's
        raise ValueError(f"the guide {args.guide}: {e}") from None


def read_prompts(path: str) -> list[str]:
    """--prompt-file's prompts, one per non-empty line (read by parse_args: its errors come before any model)."""
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path} is not valid UTF-8 text ({e.reason} at byte {e.start}): "
                         f"convert it (e.g. with iconv)") from None
    except OSError as e:   # missing, a folder, no permission
        raise ValueError(f"cannot read --prompt-file {path}: {e.strerror or e}") from None
    if not prompts:
        raise ValueError(f"--prompt-file {path} has no prompt: write one prompt per line")
    return prompts


def load_all(args):
    """What every command line of the project loads (this CLI, serve.py, bench.py run): the checks of the small
    files first (config.json, tokenizer.json, the guide's), then the guide and the model. Sets args.stop_ids,
    args.guide_model and args.compiled (one Compiled for the process). -> (model, chat, cfg, device)."""
    device, dtype = pick_device_dtype(args.device, args.dtype)
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
    chat.stop_ids |= set(cfg.eos_ids)     # config.json may list several end-of-text ids
    args.stop_ids = sorted(chat.stop_ids)
    args.guide_model = load_guide(guide_dir, args, cfg, chat, device, dtype)
    model = load(args.model, model_dir, device, dtype)
    args.compiled = Compiled() if args.compile else None
    return model, chat, cfg, device
