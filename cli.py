"""
cli.py: the command line (`python fastdllm.py --prompt ...` runs `main` here) and what serve.py, bench.py and
harness.py share with it: the flags (parse_args) and their types, the device and dtype, the flags as generate()
keywords, batches of prompts, interactive turns and prompt files, and loading (the small files' checks first,
then the guide and the model, with progress on stderr). The method itself is in fastdllm.py.
"""
import argparse
import math
import os
import sys
import time
from types import SimpleNamespace

import torch

import options
from blockdiff import FAMILIES as BLOCK_FAMILIES, SDAR_BLOCK, SDAR_REMASKING
from cache import CACHE_POLICIES
from chat import Chat, load_tokenizer
from flags import checked, new_parser, optional_float, optional_int
from fastdllm import generate, pad_prompts
from forks import add_own, flag_name, fork_parts, own_flags, refuse_replaced  # noqa: F401  (cli.own_flags: compare.py)
from options import Settings, family_of, settings as settled
from graphs import Compiled, CudaGraphs
from guided import ACCEPT_RULES, OWN as GUIDED_OWN, check_accept, check_guided_settings
from loading import load, load_guide, pick_device_dtype
from model import check_readable, read_config, resolve_model_dir
from quant import QUANTIZE, int8_quantizer
from sampler import DREAM_REMASKING, LLADA_REMASKING
from terminal import check_text, read_prompts, read_turns, render_trace, streamer
from uniform import OWN as GEMMA_OWN


# The command line's defaults where they differ from generate()'s: the methods' headline setting (Fast-dLLM's
# DualCache with threshold 0.9) and early stop at the end of text. serve.py and harness.py read them too. A
# block-diffusion model's block and DiffusionGemma's canvas are the checkpoint's; DiffusionGemma accepts by its entropy
# bound, so no threshold (and its prefix cache is exact: "dual" is "prefix"). load_all decides them (GRID).
CLI_DEFAULTS = dict(gen_length=256, cache="dual", threshold=0.9, stop_at_eos=True)
GRID = (*BLOCK_FAMILIES, "diffusion_gemma")      # gen_length need not fill whole blocks; their own block or canvas
DEFAULT_MODEL = "GSAI-ML/LLaDA-8B-Instruct"


# Flags that only mean something beside another flag: given without it they are an error, never ignored.
# -> (the flag it needs, its default). They are absent after parsing unless given (argparse.SUPPRESS).
# A flag that means something only beside another: guided diffusion's (guided.OWN, less verify_chunk, which
# has no flag) need --guide, their defaults generate()'s own.
NEEDS = {**{k: ("guide", getattr(Settings, k)) for k in GUIDED_OWN if k != "verify_chunk"},
         "batch_size": ("prompt_file", 8)}
DESCRIPTION = ("Fast-dLLM inference for diffusion LLMs: LLaDA, LLaDA-MoE, Dream, the block-diffusion Fast-dLLM v2, "
               "SDAR, LLaDA2.0/2.1 and the uniform-state DiffusionGemma. The defaults are the method's headline "
               "setting; the plain baseline is --cache none --threshold none.")
# DiffusionGemma's own flags (uniform.OWN): absent unless given (its defaults are the checkpoint's
# generation_config.json); none turns its temperature schedule or adaptive stopping off.
GEMMA_FLAGS = {"entropy_bound": (float, "a step accepts its lowest-entropy samples while their entropies, summed less "
                                 "the largest, stay <= this (the release's: 0.1)"),
               "t_min": (optional_float, "each canvas samples at temperatures from --t-max down to this; none (with "
                         "--t-max none): no schedule (the release's: 0.4)"),
               "t_max": (optional_float, "see --t-min (the release's: 0.8)"),
               "stability_threshold": (optional_int, "a canvas ends once its argmax has not changed for this many "
                                       "steps and its mean entropy is below --confidence-threshold; none (with "
                                       "--confidence-threshold none): off (the release's: 1)"),
               "confidence_threshold": (optional_float, "see --stability-threshold (the release's: 0.005)")}


def settings(args, **override):
    """The CLI's flags as generate() keywords (--compile: the process's one Compiled, so graphs are reused; the same
    for its one CudaGraphs on CUDA, unless --no-cuda-graphs)."""
    kw = dict(gen_length=args.gen_length, block_length=args.block_length or None, sub_block=args.sub_block,
              steps=args.steps,
              cache=args.cache, threshold=args.threshold, factor=args.factor, temperature=args.temperature,
              remasking=args.remasking, top_p=args.top_p, top_k=args.top_k, alg_temp=args.alg_temp,
              compile=getattr(args, "compiled", None) or args.compile,
              cuda_graphs=False if getattr(args, "no_cuda_graphs", False) else getattr(args, "graphs", None),
              **{k: getattr(args, k, None) for k in ("editing_threshold", "max_post_steps", "num_to_transfer")},
              **{k: getattr(args, k) for k in GEMMA_OWN if hasattr(args, k)})     # DiffusionGemma's, if given
    if args.guide:
        kw.update(accept=args.accept, accept_k=args.accept_k, accept_ratio=args.accept_ratio,
                  accept_threshold=args.accept_threshold, speculative=args.speculative)
    kw.update(getattr(args, "hooks", {}), **override)      # a fork's own parts (main(**hooks): examples/)
    return kw


def fit_gen_length(args, n_prompt: int, max_seq_len: int, note: bool = True) -> int:
    """An explicit --gen-length as given (generate() checks it); the default 256 cut to the largest multiple
    of --block-length that fits the model's positions (the demo model has 64), said on stderr (if note)."""
    block = args.block_length or 1
    fit = (max_seq_len - n_prompt) // block * block
    if not args.fit_gen_length or n_prompt + args.gen_length <= max_seq_len or fit < 1:
        return args.gen_length
    if note:
        print(f"note: the prompt ({n_prompt} tokens) + gen-length {args.gen_length} exceed the model's {max_seq_len} "
              f"positions: generating {fit} tokens (pass --gen-length to choose)", file=sys.stderr)
    return fit


def check_config(args, cfg, chat):
    """generate()'s checks that need config.json and the tokenizer but no weight, made before any is read (or
    downloaded): the family's options (named as flags), the end ids, and every prompt the command line holds
    (--prompt, --prompt-file's lines): ids outside the vocabulary, the mask token, the prompt + the answer beyond
    the model's positions. generate() makes them all again."""
    kw, grid = settings(args), cfg.family in GRID and not args.guide
    check_early(kw | {"guide": args.guide}, flag_name, grid)
    options.check_family(cfg, kw["remasking"], kw["top_p"], kw["top_k"], kw["alg_temp"], name=flag_name)
    off = {k: "none" for k in GEMMA_OWN if getattr(args, k, 0) is None}        # --t-min none: given, on any model
    options.check_readers(cfg, {k: v for k, v in kw.items() if v is not None} | off, Settings(), flag_name)
    options.check_stop(cfg, not args.no_early_stop, args.stop_ids)
    texts = enumerate(args.prompts, 1) if args.prompt_file else [(0, args.prompt)] if args.prompt else []
    rows = {line: chat.encode(chat.render([{"role": "user", "content": q}])) for line, q in texts if q}
    gen_length = fit_gen_length(args, max(map(len, rows.values()), default=0), cfg.max_seq_len, note=False)
    if grid:       # the family's own refusals (blockdiff.check_block, uniform.check_gemma), in the flags' words
        given = {k: v for k, v in kw.items() if (v is not None or k in GEMMA_OWN) and (k != "block_length" or
                                                                                         args.block_given)}
        st = settled(cfg, given)
        family_of(cfg, st).check(cfg, st, given, max(map(len, rows.values()), default=1), flag_name)
    for line, row in rows.items():     # a batch is as long as its longest prompt, whose own check covers it
        try:
            options.check_prompt(cfg, torch.tensor([row]), gen_length, None, kw["top_p"], kw["top_k"], kw["alg_temp"])
        except ValueError as e:
            raise ValueError(f"--prompt-file {args.prompt_file} line {line}: {e}" if line else str(e)) from None


def load_all(args):
    """What every command line of the project loads (this CLI, serve.py, bench.py run): the checks of the small
    files first (config.json, tokenizer.json, the guide's; a repo's weights are not even fetched before them),
    then the guide and the model. Sets args.stop_ids, args.guide_model, args.compiled and args.graphs (one Compiled,
    one CudaGraphs for the process). -> (model, chat, cfg, device)."""
    device, dtype = pick_device_dtype(args.device, args.dtype)
    int8_quantizer(args.quantize)      # --quantize int8 without torchao: said before anything is read
    # The guide first: a typo in its path must not wait for the model's download.
    guide_dir = resolve_model_dir(args.guide, role="guide", weights=False) if args.guide else None
    model_dir = resolve_model_dir(args.model, weights=False)
    cfg = read_config(model_dir)
    if cfg.causal:
        raise ValueError(f"--model {args.model} is a causal LM (model_type qwen2), not a diffusion LM: it belongs to "
                         f"--guide; pass a LLaDA or Dream checkpoint as --model")
    if cfg.family in GRID and not args.block_given:      # the block it was trained with (SDAR's releases: 4)
        args.block_length = cfg.gemma.canvas if cfg.gemma else cfg.block or SDAR_BLOCK
    if cfg.family == "diffusion_gemma" and not args.threshold_given:
        args.threshold = None                            # it accepts by its entropy bound (uniform.py)
    if cfg.family == "dream" and not args.block_length and (args.cache != "none" or args.threshold is not None
                                                          or args.factor is not None):
        raise ValueError("--block-length 0 selects Dream's own whole-canvas sampler, which has no cache and no "
                         "parallel decoding: add --cache none --threshold none, or pass a --block-length")
    check_readable(os.path.join(model_dir, "tokenizer.json"))
    chat = Chat(model_dir, cfg, chat=not args.no_chat)
    # The mask id must be an added token (SDAR's <|MASK|> is one not flagged special): an ordinary word means
    # config.json does not match the tokenizer (blame the config, not a prompt that happens to use the word).
    word = chat.tok.id_to_token(cfg.mask_id) if cfg.mask_id >= 0 else None      # (DiffusionGemma has none)
    if word is not None and chat.tok.get_added_tokens_decoder().get(cfg.mask_id) is None:
        raise ValueError(f"config.json's mask_token_id {cfg.mask_id} is the ordinary token {word!r} of "
                         f"tokenizer.json, not a special mask token: fix config.json or re-download the checkpoint")
    args.stop_ids = sorted(chat.stop_ids)     # the checkpoint's own end tokens (chat.Chat: which files say so)
    check_config(args, cfg, chat)
    args.guide_model = load_guide(guide_dir, args, cfg, chat, device, dtype)
    model = load(args.model, resolve_model_dir(args.model), device, dtype, args.quantize)
    args.compiled = Compiled() if args.compile else None
    args.graphs = CudaGraphs() if device.type == "cuda" and not getattr(args, "no_cuda_graphs", False) else None
    return model, chat, cfg, device


# ----------------------------------------------------------------------------------------------------------
# The command line

# What serve.py leaves out (its prompts come in requests) and bench.py run has its own of or refuses.
PROMPT_FLAGS = ("--prompt", "--prompt-file", "--interactive", "--batch-size", "--no-stream", "--trace")


def add_flags(p, omit=()):
    """fastdllm.py's flags onto p (a parser or a group of one), but for `omit`: a flag left out holds its default.
    SUPPRESS: --gen-length, --cache, --threshold and the NEEDS flags are absent unless given, so that a default
    can be told from a choice."""
    def add(flag, **kw):
        if flag not in omit:
            return p.add_argument(flag, **kw)
        default = kw.get("default", False if kw.get("action") == "store_true" else None)
        if default is not argparse.SUPPRESS:
            p.set_defaults(**{flag[2:].replace("-", "_"): default})
    add("--model", default=DEFAULT_MODEL, help="Hugging Face repo id or local folder (default: %(default)s)")
    add("--prompt", help="the user message (required unless --prompt-file; with --interactive: the first turn)")
    add("--gen-length", type=int, default=argparse.SUPPRESS, help=f"tokens to generate (default: "
        f"{CLI_DEFAULTS['gen_length']}, or the largest multiple of --block-length that fits the model). Block "
        f"diffusion answers to a block edge: SDAR to prompt + this rounded up to a block; Fast-dLLM v2 this // "
        f"block blocks (at least one) after the prompt's last whole block, plus one token (fewer than this by the "
        f"prompt's part of its last block); LLaDA2 exactly this")
    add("--block-length", type=int, default=argparse.SUPPRESS, help="semi-autoregressive block size; 0 = one "
        f"block (for Dream: Dream's own whole-canvas sampler) (default: {Settings.block_length}; block diffusion: the "
        f"checkpoint's own block; DiffusionGemma: its canvas, the only one it takes)")
    add("--sub-block", type=int, default=None, help="Fast-dLLM v2: decode a block in sub-blocks of this many tokens "
        "(default: 8)")
    add("--steps", type=int, default=None, help="denoising steps (default: gen-length; SDAR: per block, default "
        "the block length; DiffusionGemma: the most per canvas, default the checkpoint's)")
    add("--cache", default=argparse.SUPPRESS, help=f"KV cache: {' | '.join(CACHE_POLICIES)} (default: "
        f"{CLI_DEFAULTS['cache']})")
    add("--threshold", type=optional_float, default=argparse.SUPPRESS, help="parallel decoding: unmask every token "
        f"with confidence >= this; none = off (default: {CLI_DEFAULTS['threshold']}; none with --factor, and on "
        "DiffusionGemma, which accepts by --entropy-bound)")
    add("--factor", type=float, default=None, help="factor-based parallel decoding (default: off)")
    add("--temperature", type=checked(float, math.isfinite, "a finite number"), default=0.0,
        help="0 = greedy (default: %(default)s)")
    add("--remasking", default=None, help=f"LLaDA: {' | '.join(LLADA_REMASKING)}; Dream: "
        f"{' | '.join(DREAM_REMASKING)}; SDAR: {' | '.join(SDAR_REMASKING)} (default: the first of each; "
        f"with a threshold: Dream's maskgit_plus, SDAR's low_confidence_dynamic)")
    add("--top-p", type=float, default=None, help="Dream only (default: off)")
    add("--top-k", type=int, default=None, help="Dream only (default: off)")
    add("--alg-temp", type=float, default=None, help="Dream only: randomness of the position choice")
    add("--editing-threshold", type=float, default=None, help="LLaDA2.1: edit a committed token of the block whose "
        "new proposal is more likely than this (T2T; the card's quality mode: --threshold 0.7 --editing-threshold "
        "0.5, speed: 0.5 and 0) (default: off, LLaDA2.0's decode)")
    add("--max-post-steps", type=int, default=None, help="LLaDA2.1: edit-only calls a block may take once it has no "
        "mask (default: 16)")
    add("--num-to-transfer", type=int, default=None, help="LLaDA2.1: masks a call commits when fewer pass the "
        "threshold (default: 1)")
    for key, (kind, text) in GEMMA_FLAGS.items():
        add(flag_name(key), type=kind, default=argparse.SUPPRESS, help=f"DiffusionGemma: {text} (default: the "
            "checkpoint's generation_config.json)")
    add("--device", default=None, help="cpu | cuda (default: cuda if available)")
    add("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    add("--seed", type=int, default=0, help="seed of the sampling generator; a negative one is taken modulo 2**64, "
        "as torch does (default: %(default)s)")
    add("--compile", action="store_true", help="torch.compile the model's layers, one graph per shape fed")
    add("--no-cuda-graphs", action="store_true", help="on CUDA, run the layers eager instead of replaying each feed "
        "width's call from a CUDA graph (the default there)")
    add("--quantize", choices=QUANTIZE, help="int8: weight-only int8 layers, model and guide (torchao)")
    add("--no-chat", action="store_true", help="raw prompt, no chat template (base models)")
    add("--interactive", action="store_true", help="multi-turn chat on stdin, until exit, quit or its end (a model "
        "without a chat template, like the demo, answers each question alone)")
    add("--prompt-file", help="one prompt per line, decoded in batches: one answer line per input line (a blank "
        "line's answer is an empty line, so line N answers line N)")
    add("--batch-size", type=int, default=argparse.SUPPRESS, help="prompts per batch with --prompt-file "
        f"(default: {NEEDS['batch_size'][1]})")
    add("--no-early-stop", action="store_true", help="decode every block even after the answer ended (default: "
        "stop once a finished block holds an end token)")
    add("--no-stream", action="store_true", help="print the answer at the end, not block by block")
    add("--trace", action="store_true", help="print which tokens each step unmasked")
    add("--guide", help="a causal LM sharing the model's tokenizer (Qwen2 format, repo id or folder): FlashDLM's "
        "guided diffusion (default: off)")
    add("--accept", default=argparse.SUPPRESS, choices=ACCEPT_RULES, metavar="RULE", help="guided: deterministic | "
        f"topk | topk_relative | dynamic_threshold | aggressive (default: {Settings.accept})")
    add("--accept-k", type=checked(int, lambda k: k >= 1, "an integer >= 1"), default=argparse.SUPPRESS,
        help=f"guided topk and topk_relative: the guide's top k (default: {Settings.accept_k})")
    add("--accept-ratio", type=checked(float, lambda r: 0 < r <= 1, "a number in (0, 1]"), default=argparse.SUPPRESS,
        help=f"guided topk_relative ratio (default: {Settings.accept_ratio})")
    add("--accept-threshold", type=checked(float, lambda t: 0 <= t < 1, "a number in [0, 1)"),
        default=argparse.SUPPRESS, help="guided dynamic_threshold: accept a draft whose guide probability exceeds "
        f"this (default: {Settings.accept_threshold})")
    add("--speculative", action="store_true", default=argparse.SUPPRESS, help="guided: commit the guide's token in "
        "place of the first rejected draft, i.e. the guide's quality (default: the diffusion model's first draft)")


def parse_args(argv=None, hooks=(), fork=None, own=None):
    """fastdllm.py's command line -> its flags, checked (finish_args). A fork's program (run: fork, own) adds its
    own flags and titles --help with the first sentence of its file's docstring."""
    if fork is None:
        p = new_parser(description=DESCRIPTION)
    else:
        doc = " ".join((getattr(fork, "__globals__", {}).get("__doc__") or "").split())
        p = new_parser(description=doc.split(". ")[0].rstrip(".") + ". Decoded as fastdllm.py decodes, with its "
                       "flags; this method's own are listed last.", conflict_handler="resolve")
    add_flags(p)
    if own:     # a flag of the CLI's name (prophet's --cache) is the fork's: conflict_handler="resolve"
        add_own(p.add_argument_group("this method's own flags"), own)
    return finish_args(p, p.parse_args(argv), hooks, fork, own)


def finish_args(p, args, hooks=(), fork=None, own=None):
    """The checks of the parsed flags that need no model (serve.py and bench.py run parse with their own parsers
    and call this): then a fork's parts are made (fork_parts), and the flags they replace refused."""
    values = {key: vars(args).pop(key) for key in own or {}}
    given = {flag for flag in NEEDS if flag in vars(args)}
    for flag, (need, default) in NEEDS.items():
        if flag not in given:
            setattr(args, flag, default)
        elif not getattr(args, need):
            flag, need = flag.replace("_", "-"), need.replace("_", "-")
            raise ValueError(f"--{flag} only applies with --{need}: add --{need}, or drop --{flag}")
    check_accept(args.accept, given, flag_name)
    for flag in ("model", "guide", "prompt_file"):
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise ValueError(f"--{flag.replace('_', '-')} is empty: pass a path (or leave the flag out)")
    args.block_given = "block_length" in vars(args)        # block diffusion: else the checkpoint's own block
    args.block_length = getattr(args, "block_length", Settings.block_length)
    args.fit_gen_length = "gen_length" not in vars(args)
    args.gen_length = getattr(args, "gen_length", CLI_DEFAULTS["gen_length"])
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
    hooks = fork_parts(fork, values, args.model) if fork is not None else dict(hooks)
    refuse_replaced(p, args, hooks)
    args.threshold_given = "threshold" in vars(args)
    if not args.threshold_given:   # --factor, --guide or a fork's select= replaces the default
        args.threshold = None if args.factor is not None or args.guide or "select" in hooks else CLI_DEFAULTS["threshold"]
    args.cache = getattr(args, "cache", CLI_DEFAULTS["cache"])
    args.hooks = hooks
    return args


def check_early(kw: dict, name=lambda key: key, grid=False):
    """Every check of generate() keywords that needs no model, with Settings' defaults (a `guide` of any value,
    a path say, means a guide is coming: guided diffusion's own checks); grid: a block-diffusion model's."""
    options.check_early(kw, Settings(), name, grid)
    if kw.get("guide") is not None:
        check_guided_settings(SimpleNamespace(**vars(Settings()) | kw), Settings(), name)


def check_flags(args, whole_blocks: bool = False):
    """The decoding flags' checks that need no model, before one is loaded (main(), serve.py). whole_blocks: a
    default gen_length rounded up to whole blocks first, as serve.py's requests without max_tokens use it."""
    kw = settings(args, **({} if getattr(args, "block_given", True) else dict(block_length=None)))  # the model's
    if whole_blocks and args.fit_gen_length and args.block_length:
        kw["gen_length"] = -(-args.gen_length // args.block_length) * args.block_length
    check_early(kw | {"guide": args.guide}, flag_name)


def run_batch(model, rows, args, device, on_step=None, seeds=None, **override):
    """generate() on prompts of any lengths (left-padded), with the CLI's settings (early stop on unless
    --no-early-stop) -> (prompt + answer ids per row, pads dropped and each answer its own length: a block-diffusion
    row's, as it has it alone; stats). seeds: each row's (default --seed): DiffusionGemma's rows each draw from a
    generator of their own, so that each decodes as it would alone (uniform.py); the others' batch shares the first."""
    ids, am = pad_prompts(rows, model.config.pad_id if model.config.pad_id is not None else model.config.eos_id)
    hooks = getattr(args, "hooks", {})     # a fork's stop rule replaces early stop; its step rule draws its own noise
    gens = [torch.Generator(device).manual_seed(s) for s in seeds or [args.seed] * len(rows)]
    gen = None if "propose" in hooks else gens if model.config.family == "diffusion_gemma" and len(rows) > 1 else gens[0]
    kw = dict(stop_at_eos=not args.no_early_stop and "stop" not in hooks, eos_ids=getattr(args, "stop_ids", None),
              guide=args.guide_model)
    x, stats = generate(model, ids.to(device), attention_mask=am.to(device), generator=gen, on_step=on_step,
                        **kw | settings(args, **override))
    return [row[ids.shape[1] - len(r):][:len(r) + n] for row, r, n in zip(x.tolist(), rows, stats["row_length"])], stats


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


def main(argv=None, fork=None, own=None, **hooks):
    """The command line. hooks: a fork's own parts (cache=, select=, stop=, propose=; examples/), given to every
    generate() call: each replaces the CLI's default of its kind (a select= the threshold 0.9, a stop= the early
    stop); or fork, own: a fork's program (run), its parts made from its own flags."""
    args = parse_args(argv, hooks, fork, own)
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
            print("\n".join(render_trace(steps, chat.tok, cfg.mask_id, chat.stop_ids)))
        print("" if stream else answer)
        peak = f" | peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
        guided = f" | guide calls {stats['guide_calls']}" if args.guide else ""
        print(f"NFE {stats['nfe']} | {stats['tokens_per_s']:.1f} tokens/s | {stats['seconds']:.2f} s{guided}{peak}")
        messages.append({"role": "assistant", "content": answer})
        ids = out


def run(fork=None, **own):
    """`python fastdllm.py ...`: main() with one-line errors and Unix exit statuses. A fork's program (examples/)
    passes fork(**its flags) -> its hooks, and its flags, name=(default, help), listed by --help after the CLI's;
    fork(config=, tokenizer=) also gets the checkpoint's (read after every check that needs no model)."""
    if sys.stdout is None:   # started with stdout closed (`>&-`): the answers would go nowhere
        print("error: standard output is closed: the answer has nowhere to go (drop `>&-`, or redirect to a "
              "file or /dev/null)", file=sys.stderr)
        sys.exit(2)
    try:
        status = main(sys.argv[1:], fork, own)
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
