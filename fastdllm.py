"""
fastdllm.py: fast inference for masked-diffusion LLMs (LLaDA-8B, Dream-7B): the one generation loop, the CLI.

A diffusion LM generates by denoising: the answer starts as gen_length [MASK] tokens, and each model call
("step", counted as NFE) predicts every masked position at once and commits some of them. generate() first
decides, once, everything that depends only on the call's settings (`make_plan`): a cache policy (cache.py:
none, Fast-dLLM's prefix cache and DualCache, arXiv 2505.22618 section 3.2, FlashDLM's FreeCache, arXiv
2505.21467), a step rule for the model's family with its selection rule (sampler.py: LLaDA's and Dream's
samplers, Fast-dLLM's threshold / factor decoding, section 3.3, FlashDLM's guided diffusion), and a stop
rule (end of text). Then one loop over blocks, each step: feed -> propose -> select -> commit -> stop.

    python fastdllm.py --prompt "What is 7 * 8?"                    # LLaDA-8B-Instruct, dual cache, tau 0.9
    python fastdllm.py --model demo/llada-arith --gen-length 32 --prompt "Tom has 23 apples and buys 45 more. How many apples does he have?"
"""
import argparse
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

import sampler as S
from cache import CacheMode, Feed, FreeCache, Guide, GuidedFreeCache, KVCache, Refresh, Step
from chat import (Chat, check_text, checked, fit_gen_length, load, load_guide, optional_float, pick_device_dtype,
                  read_prompts, read_turns, streamer)
from checks import CACHE_MODES, GUIDED_DEFAULTS, check_call, check_early
from model import check_readable, read_config, resolve_model_dir


def padding(attention_mask, gen_length: int, device):
    """Left-padded prompts: real tokens count positions from 0, pads neither attend nor are attended to, so
    every row decodes as it would alone. -> (pos (B, L), mask (B, 1, L, L)), or (None, None) without pads."""
    if attention_mask is None or not (attention_mask == 0).any():
        return None, None
    m = F.pad(attention_mask.to(device).bool(), (0, gen_length), value=True)
    return (m.long().cumsum(-1) - 1).masked_fill(~m, 1), m[:, None, None, :] & m[:, None, :, None]


def pad_prompts(rows: list[list[int]], pad_id: int):
    """Prompts of different lengths -> (ids (B, P), attention_mask (B, P)), left-padded so that every answer
    starts at the same canvas position."""
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (P - len(r)) + list(r) for r in rows])
    return ids, (torch.arange(P) >= torch.tensor([[P - len(r)] for r in rows])).long()


@dataclass
class Settings:
    """Every decoding setting of generate(), with its default (generate(model, prompt, **settings) takes
    them as keywords). None means "the family's or the method's default"."""
    gen_length: int = 128              # tokens to generate
    block_length: int | None = 32      # semi-autoregressive block; None = one block (Dream: its own sampler)
    steps: int | None = None           # denoising steps over the answer (default gen_length: 1 token/step)
    cache: str | Feed = "none"         # "none" | "prefix" | "dual" | "free", or a cache.Feed policy
    threshold: float | None = None     # Fast-dLLM 3.3: commit every token with confidence >= threshold
    factor: float | None = None        # Fast-dLLM 3.3: factor-based parallel decoding
    select: Callable | None = None     # a custom selection rule (sampler.py: rule(proposal, cand, k))
    temperature: float = 0.0           # 0 = greedy
    remasking: str | None = None       # LLaDA "low_confidence" | "random"; Dream's alg (default "entropy")
    top_p: float | None = None         # Dream's sampling options
    top_k: int | None = None
    alg_temp: float | None = None
    eps: float = 1e-3                  # Dream's time grid runs from 1 down to eps
    refresh_every_step: bool = False   # feed the whole canvas every step (checks the cache plumbing)
    stop_at_eos: bool | int = False    # True: stop after a finished block holding an end token; k: FlashDLM's rule
    eos_ids: list | None = None        # the end tokens (default the config's)
    guide: torch.nn.Module | None = None   # FlashDLM guided diffusion: a causal LM with the same token ids
    speculative: bool | None = None    # guided: commit the guide's token at the first rejection (default: no)
    accept: str | None = None          # guided: "deterministic" (default) | "topk" | "topk_relative" |
                                       #   "dynamic_threshold" | "aggressive"
    accept_k: int | None = None        # guided top-k (default 5)
    accept_ratio: float | None = None  # guided topk_relative ratio (default 0.95)
    accept_threshold: float | None = None  # guided dynamic_threshold: p(draft) > this (default 0.1)
    verify_chunk: int | None = None    # guided: drafts verified per guide forward (default 32)


def answer_tokens(answers: torch.Tensor, eos: torch.Tensor) -> int:
    """Generated tokens before each row's first end token, summed over rows: what tokens/s counts everywhere
    (the CLI, the server, the harness, bench.py), so that end-of-text filler is never counted as speed."""
    end = torch.isin(answers, eos)
    first = torch.where(end.any(-1), end.long().argmax(-1), answers.shape[1])
    return int(first.sum())


@dataclass
class Plan:
    """What one generate() call decided before its loop: the blocks and the parts the loop calls."""
    blocks: list              # [(s, e)] the semi-autoregressive blocks of the answer
    feed: Feed                # cache.py: which span each step feeds
    rule: object              # sampler.py: one family's propose + select, with its state
    stop: S.StopRule          # sampler.py: when an answer has ended
    forward: Callable         # (x, at, span, cols) -> logits at the block columns `cols`
    calls_per_block: int      # the fewest calls a block takes (for calls_saved)
    eos: torch.Tensor         # the end-of-text ids


def settings_of(options: dict) -> Settings:
    names = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}: generate() takes {', '.join(sorted(names))}")
    return Settings(**options)


def resolve(model, prompt, st: Settings, attention_mask, generator):
    """The settings with the family's and the method's defaults filled in, every check passed; -> (settings,
    whether this is Dream's own whole-canvas sampler)."""
    dream, guided = model.config.family == "dream", st.guide is not None
    whole_canvas = dream and st.block_length is None and not guided     # Dream's own diffusion_generate
    st = dataclasses.replace(
        st, remasking=st.remasking or ("entropy" if dream else "low_confidence"),
        block_length=st.gen_length if guided else st.block_length or st.gen_length,   # guided: one block
        steps=st.gen_length if st.steps is None or guided else st.steps,
        **({k: v if getattr(st, k) is None else getattr(st, k) for k, v in GUIDED_DEFAULTS.items()} if guided else {}))
    check_call(model, prompt, st, attention_mask, generator, whole_canvas)
    return st, whole_canvas


def make_plan(model, prompt, st: Settings, attention_mask, generator) -> Plan:
    """Turn (family, cache, rule, stop) into parts, once: everything here depends only on the call's settings."""
    cfg, device = model.config, model.lm_head.weight.device
    st, whole_canvas = resolve(model, prompt, st, attention_mask, generator)
    dream, guided = cfg.family == "dream", st.guide is not None
    B, P = prompt.shape
    L = P + st.gen_length
    n_blocks = st.gen_length // st.block_length
    generator = generator or torch.Generator(device).manual_seed(0)
    eos = torch.tensor(sorted(set(st.eos_ids or cfg.eos_ids or [cfg.eos_id]) - {None}), dtype=torch.long, device=device)
    rule = S.selection_rule(st.threshold, st.factor, st.select)
    shift = int(cfg.shift_logits)      # Dream predicts position i from hidden state i - 1
    feed = (st.cache if isinstance(st.cache, Feed) else GuidedFreeCache() if guided and st.cache == "free"
            else FreeCache(shift) if st.cache == "free" else CacheMode(st.cache, shift))
    feed = Refresh(feed) if st.refresh_every_step else feed
    pos, mask = padding(attention_mask, st.gen_length, device)
    if guided:                         # one block over the answer: "dual" is "prefix" here
        real = None if pos is None else F.pad(attention_mask.to(device).bool(), (0, st.gen_length), value=True)
        accept = partial(S.accept_drafts, rule=st.accept, k=st.accept_k, ratio=st.accept_ratio,
                         threshold=st.accept_threshold)
        step_rule = S.GuidedStep(Guide(st.guide, B, L, pos, real), accept, st.verify_chunk, eos, cfg.mask_id,
                                 st.speculative, prompt.to(device))
    elif dream:
        family = S.DreamCanvasStep if whole_canvas else S.DreamFreeStep if st.cache == "free" else S.DreamStep
        step_rule = family(rule, st.steps, n_blocks, st.block_length, st.temperature, st.remasking, st.top_p, st.top_k,
                           st.alg_temp, st.eps, generator, cfg.mask_id, device)
    else:
        step_rule = S.LLaDAStep(rule, st.steps // n_blocks, st.temperature, st.remasking, generator, cfg.mask_id)
    stop = S.stop_rule(1 if guided else st.stop_at_eos, P, eos, cfg.mask_id)   # guided: a committed end token ends
    kv = KVCache.for_model(model, B, L) if feed.keeps_cache else None
    return Plan([(s, s + st.block_length) for s in range(P, L, st.block_length)], feed, step_rule, stop,
                model_call(model, kv, feed, pos, mask),
                1 if getattr(rule, "parallel", True) or guided else st.steps // n_blocks, eos)


def model_call(model, kv, feed: Feed, pos, mask):
    """One model call over the fed span [a, b) of the canvas, logits only at the block's open columns. The
    NaN/inf check reads the logits' row sums (one reduction, into which any NaN/inf propagates): checking
    every value was ~7% of a DualCache step on a 126k vocabulary."""
    def forward(x, at: Step, span, cols):
        a, b = span
        if kv is not None:
            kv.write_rows, kv.write_from = feed.rows(at), feed.write_from(at)
        logits = model(x[:, a:b], None if pos is None else pos[:, a:b], kv, a,
                       None if mask is None else mask[:, :, a:b], at.s + cols - a)
        if not torch.isfinite(logits.sum(-1, dtype=torch.float32)).all():
            raise ValueError(f"the model produced NaN/inf logits at step {at.n + 1}: the weights hold NaN/inf, "
                             f"or the activations overflowed {logits.dtype} (try --dtype float32)")
        return logits
    return forward


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, on_step=None, **settings):
    """
    Decode gen_length tokens after `prompt` (B, P). Returns (ids (B, P + gen_length), stats) with stats
    {"nfe": model calls, "row_nfe": the calls that served each row (a row's NFE alone, whatever the batch),
    "fed": tokens fed per call, "committed": tokens committed per call (all rows), "calls_saved",
    "guide_calls", "seconds", "answer_tokens": generated tokens before each row's first end token, summed,
    "tokens_per_s": answer_tokens per second}.

    settings: the keywords of `Settings` (gen_length, block_length, steps, cache, threshold, factor, select,
        temperature, remasking, top_p, top_k, alg_temp, eps, refresh_every_step, stop_at_eos, eos_ids, guide,
        speculative, accept, accept_k, accept_ratio, accept_threshold, verify_chunk); see its field comments
        and the README's API table.
    attention_mask: (B, P) 1/0 for left-padded prompts, both families: each row decodes as it would alone.
    generator: the only source of randomness (default: a fresh one seeded 0). on_step(x, stats) is called
        after every step with the live canvas.
    """
    st = settings_of(settings)
    p = make_plan(model, prompt, st, attention_mask, generator)
    mask_id, on_step = model.config.mask_id, on_step or (lambda x, stats: None)
    x = F.pad(prompt.to(model.lm_head.weight.device), (0, st.gen_length), value=mask_id)
    stats = {"nfe": 0, "fed": [], "committed": [], "calls_saved": 0, "guide_calls": 0}
    row_nfe = torch.zeros(prompt.shape[0], dtype=torch.long, device=x.device)
    t0 = time.perf_counter()
    for bi, (s, e) in enumerate(p.blocks):
        p.rule.start_block(x[:, s:e] == mask_id, bi)
        step = 0
        while p.rule.more(cand := x[:, s:e] == mask_id, step):
            at = Step(stats["nfe"], step, s, e, cand, x)
            span = p.feed.span(at)                                       # 1. feed: what the cache policy asks
            cols = cand.any(0).nonzero().squeeze(1)                      # LM head only where a token is open
            logits = p.forward(x, at, span, cols)
            row_nfe += cand.any(-1)
            x0, transfer = p.rule.select(logits, cols, at, span)         # 2. propose and 3. select
            x[:, s:e] = torch.where(transfer, x0, x[:, s:e])             # 4. commit
            p.stop.step(x)                                               # 5. stop at the end of text
            step += 1
            stats["nfe"] += 1
            stats["fed"].append(span[1] - span[0])
            stats["committed"].append(int(transfer.sum()))
            stats["guide_calls"] = getattr(p.rule, "guide_calls", 0)
            on_step(x, stats)
        if p.stop.block(x, e):                                           # every row's answer has ended
            stats["calls_saved"] = (len(p.blocks) - bi - 1) * p.calls_per_block
            break
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    stats["seconds"] = time.perf_counter() - t0
    stats["row_nfe"] = row_nfe.tolist()
    stats["answer_tokens"] = answer_tokens(x[:, prompt.shape[1]:], p.eos)
    stats["tokens_per_s"] = stats["answer_tokens"] / max(stats["seconds"], 1e-9)
    return x, stats


# ----------------------------------------------------------------------------------------------------------
# Command line (its helpers: chat.py)

# Flags that only mean something beside another flag: given without it they are an error, never ignored.
NEEDS = {"accept": "guide", "accept_k": "guide", "accept_ratio": "guide", "accept_threshold": "guide",
         "speculative": "guide", "batch_size": "prompt_file"}
NOT_GIVEN = object()   # what a NEEDS flag holds after parsing when it was not on the command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Fast-dLLM inference for LLaDA and Dream. The defaults are the "
                                "method's headline setting; the plain baseline is --cache none --threshold none.")

    def error(message):   # argparse would print its usage too: our errors are one line (see __main__)
        raise ValueError(f"{message} (see --help)")
    p.error = error
    # SUPPRESS: --gen-length and --threshold are absent unless given, so we can tell a default from a choice.
    p.add_argument("--model", default="GSAI-ML/LLaDA-8B-Instruct", help="Hugging Face repo id or local folder "
                   "(default: %(default)s)")
    p.add_argument("--prompt", help="the user message (required unless --prompt-file; with --interactive: the "
                   "first turn)")
    p.add_argument("--gen-length", type=int, default=argparse.SUPPRESS, help="tokens to generate (default: 256, "
                   "or the largest multiple of --block-length that fits the model's positions)")
    p.add_argument("--block-length", type=int, default=32, help="semi-autoregressive block size; 0 = one block "
                   "(for Dream: Dream's own whole-canvas sampler) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: gen-length)")
    p.add_argument("--cache", default="dual", help=f"KV cache: {' | '.join(CACHE_MODES)} (default: %(default)s)")
    p.add_argument("--threshold", type=optional_float, default=argparse.SUPPRESS, help="parallel decoding: "
                   "unmask every token with confidence >= this; none = off (default: 0.9; none with --factor)")
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
    p.add_argument("--no-chat", action="store_true", help="raw prompt, no chat template (base models)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat on stdin, until exit, quit or its "
                   "end (a model without a chat template, like the demo, answers each question alone)")
    p.add_argument("--prompt-file", help="one prompt per line, decoded in batches (answers in input order)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch with --prompt-file "
                   "(default: %(default)s)")
    p.add_argument("--no-early-stop", action="store_true", help="decode every block even after the answer "
                   "ended (default: stop once a finished block holds an end token)")
    p.add_argument("--no-stream", action="store_true", help="print the answer at the end, not block by block")
    p.add_argument("--trace", action="store_true", help="print which tokens each step unmasked")
    p.add_argument("--guide", help="a causal LM sharing the model's tokenizer (Qwen2 format, repo id or folder): "
                   "FlashDLM's guided diffusion (default: off)")
    p.add_argument("--accept", default="deterministic", choices=S.ACCEPT_RULES, metavar="RULE",
                   help="guided: deterministic | topk | topk_relative | dynamic_threshold | aggressive "
                   "(default: %(default)s)")
    p.add_argument("--accept-k", type=checked(int, lambda k: k >= 1, "an integer >= 1"), default=5,
                   help="guided top-k (default: %(default)s)")
    p.add_argument("--accept-ratio", type=checked(float, lambda r: 0 < r <= 1, "a number in (0, 1]"),
                   default=0.95, help="guided topk_relative ratio (default: %(default)s)")
    p.add_argument("--accept-threshold", type=checked(float, lambda t: 0 <= t < 1, "a number in [0, 1)"),
                   default=0.1, help="guided dynamic_threshold: accept a draft whose guide probability exceeds "
                   "this (default: %(default)s)")
    p.add_argument("--speculative", action="store_true", default=False, help="guided: commit the guide's token "
                   "in place of the first rejected draft, i.e. the guide's quality (default: the diffusion "
                   "model's first draft)")
    args = p.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(NEEDS, NOT_GIVEN)))
    for flag, need in NEEDS.items():
        if getattr(args, flag) is NOT_GIVEN:
            setattr(args, flag, p.get_default(flag))
        elif not getattr(args, need):
            flag, need = flag.replace("_", "-"), need.replace("_", "-")
            raise ValueError(f"--{flag} only applies with --{need}: add --{need}, or drop --{flag}")
    for flag in ("model", "guide", "prompt_file"):
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise ValueError(f"--{flag.replace('_', '-')} is empty: pass a path (or leave the flag out)")
    args.fit_gen_length = "gen_length" not in vars(args)
    args.gen_length = getattr(args, "gen_length", 256)
    if "threshold" not in vars(args):   # --factor or --guide replaces the default; both given is an error
        args.threshold = None if args.factor is not None or args.guide else 0.9
    if not args.prompt and not args.interactive and not args.prompt_file:
        raise ValueError("no prompt: pass --prompt \"...\" (or --prompt-file, --interactive)")
    if args.prompt_file and (args.prompt or args.interactive):
        raise ValueError("pass one of --prompt, --prompt-file, --interactive")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (got {args.batch_size})")
    # generate() refuses these with a guide too, but only once both models are loaded.
    clash = next((f for f, v in (("threshold", args.threshold), ("factor", args.factor),
                                 ("temperature", args.temperature)) if v), None)
    if args.guide and clash:
        raise ValueError(f"--{clash} does not apply with --guide: the guide decides how many drafts each step "
                         f"commits, and drafts are the argmax; drop --{clash}")
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


def settings(args, **override):
    kw = dict(gen_length=args.gen_length, block_length=args.block_length or None, steps=args.steps,
              cache=args.cache, threshold=args.threshold, factor=args.factor, temperature=args.temperature,
              remasking=args.remasking, top_p=args.top_p, top_k=args.top_k, alg_temp=args.alg_temp)
    if args.guide:
        kw.update(accept=args.accept, accept_k=args.accept_k, accept_ratio=args.accept_ratio,
                  accept_threshold=args.accept_threshold, speculative=args.speculative)
    kw.update(override)
    return kw


def run_batch(model, rows, args, device, on_step=None, **override):
    """generate() on prompts of any lengths (left-padded), with the CLI's settings -> (prompt + answer ids per
    row, pads dropped; stats). Early stop at the end of text is on unless --no-early-stop."""
    ids, am = pad_prompts(rows, model.config.pad_id if model.config.pad_id is not None else model.config.eos_id)
    gen = torch.Generator(device).manual_seed(args.seed)
    kw = dict(stop_at_eos=not args.no_early_stop, eos_ids=getattr(args, "stop_ids", None), guide=args.guide_model)
    x, stats = generate(model, ids.to(device), attention_mask=am.to(device), generator=gen, on_step=on_step,
                        **kw | settings(args, **override))
    return [row[ids.shape[1] - len(r):] for row, r in zip(x.tolist(), rows)], stats


def answer_prompts(model, chat, args, device):
    """--prompt-file: every line a prompt, decoded in batches of --batch-size; answers in input order."""
    rows = [chat.encode(chat.render([{"role": "user", "content": q}])) for q in args.prompts]
    args.gen_length = fit_gen_length(args, max(map(len, rows)), model.config.max_seq_len)
    nfe, seconds = 0, 0.0
    for i in range(0, len(rows), args.batch_size):
        batch = rows[i:i + args.batch_size]
        outs, stats = run_batch(model, batch, args, device)
        for ids, out in zip(batch, outs):
            print(chat.answer(out[len(ids):]))
        nfe, seconds = nfe + stats["nfe"], seconds + stats["seconds"]
    print(f"{len(rows)} prompts | NFE {nfe} | {len(rows) * args.gen_length / max(seconds, 1e-9):.1f} tokens/s | "
          f"{seconds:.2f} s")


def main(argv=None):
    args = parse_args(argv)
    device, dtype = pick_device_dtype(args.device, args.dtype)
    kw = settings(args)
    check_early(kw)
    # The guide first: a typo in its path must not wait for the model's download.
    guide_dir = resolve_model_dir(args.guide, role="guide") if args.guide else None
    model_dir = resolve_model_dir(args.model)
    # config.json and tokenizer.json are small: their checks come before gigabytes of weights are read.
    cfg = read_config(model_dir)
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


if __name__ == "__main__":
    try:
        status = main()
        sys.stdout.flush()     # here, so that a closed pipe is caught below, not at the interpreter's exit
        sys.exit(status)
    except BrokenPipeError:
        # The reader stopped reading (`| head -1`): quiet, as Unix tools are (they die of SIGPIPE, which the
        # shell reports as 128 + 13). stdout goes to devnull so the final flush does not fail again (the
        # Python docs' recipe, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except (ValueError, OSError) as e:   # OSError: FileNotFoundError and any file error we did not foresee
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
