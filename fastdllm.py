"""
fastdllm.py: fast inference for masked-diffusion LLMs (LLaDA-8B, Dream-7B), the one generation loop and
its command line.

A diffusion LM generates by denoising: the answer starts as gen_length [MASK] tokens, and each model call
("step", counted as NFE) predicts every masked position at once and commits some of them. generate() runs
every method as one loop over semi-autoregressive blocks, each step reading feed -> propose -> select ->
commit:
- feed: what the KV cache reuses (cache.py `feed_span`): none, Fast-dLLM's prefix cache and DualCache
  (arXiv 2505.22618 section 3.2), FlashDLM's FreeCache (arXiv 2505.21467);
- propose / select (sampler.py): LLaDA's and Dream's samplers, Fast-dLLM's confidence-aware parallel
  decoding (threshold / factor, section 3.3), FlashDLM's guided diffusion (a causal guide verifies drafts);
- commit, and stop at the end of text.

    python fastdllm.py --prompt "What is 7 * 8?"                    # LLaDA-8B-Instruct, dual cache, tau 0.9
    python fastdllm.py --model demo/llada-arith --gen-length 32 --prompt "Tom has 23 apples and buys 45 more. How many apples does he have?"
"""
import argparse
import numbers
import os
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

import sampler as S
from cache import Guide, KVCache, feed_span
from chat import Chat, check_text, read_turn, streamer
from model import check_guide, check_readable, load_model, read_config, resolve_model_dir

CACHE_MODES = ("none", "prefix", "dual", "free")
LLADA_REMASKING = ("low_confidence", "random")
DREAM_REMASKING = ("origin", "maskgit_plus", "topk_margin", "entropy", "position_weighted")


def check_settings(gen_length, block_length, steps, cache, threshold, factor, temperature, top_p=None,
                   top_k=None, alg_temp=None, eps=None, generator=None):
    """The checks that need no model (the CLI runs them before loading gigabytes of weights). Every
    impossible request fails in one line that names the fix, never deep inside torch."""
    def bad(msg):
        raise ValueError(msg)
    # A wrong type gets the same one line as a wrong value, not a TypeError from deep inside torch.
    for name, v, kind in (("gen_length", gen_length, int), ("block_length", block_length, int), ("steps", steps, int),
                          ("temperature", temperature, float), ("top_k", top_k, int), ("threshold", threshold, float),
                          ("factor", factor, float), ("top_p", top_p, float), ("alg_temp", alg_temp, float),
                          ("eps", eps, float)):
        optional = name not in ("gen_length", "block_length", "steps", "temperature")
        if not (optional and v is None or isinstance(v, numbers.Integral if kind is int else numbers.Real)
                and not isinstance(v, bool)):
            bad(f"{name} must be {'an integer' if kind is int else 'a number'}{' or None' * optional} (got {v!r})")
    if generator is not None and not isinstance(generator, torch.Generator):
        bad(f"generator must be a torch.Generator, not {generator!r}: e.g. torch.Generator('cpu').manual_seed(0)")
    if eps is not None and not 0 < eps < 1:
        bad(f"eps must be in (0, 1) (got {eps}): Dream's time runs from 1 down to eps (default 1e-3)")
    if gen_length < 1 or block_length < 1:
        bad(f"gen_length ({gen_length}) and block_length ({block_length}) must be positive")
    if gen_length % block_length:
        bad(f"gen_length {gen_length} is not a multiple of block_length {block_length}: "
            f"pick a block_length that divides it, e.g. {next(b for b in range(block_length, 0, -1) if gen_length % b == 0)}")
    if steps < 1:
        bad(f"steps must be >= 1 (got {steps})")
    if steps % (gen_length // block_length):
        bad(f"steps {steps} is not divisible by the number of blocks {gen_length // block_length} "
            f"(gen_length / block_length): use a multiple, e.g. steps={gen_length}")
    if cache not in CACHE_MODES:
        bad(f"unknown cache mode {cache!r}: use one of {', '.join(CACHE_MODES)}")
    if threshold is not None and not threshold > 0:      # `not >` also catches NaN
        bad(f"threshold must be in (0, 1] (got {threshold}); above 1 means one token per step, None turns it off")
    if factor is not None and not factor > 0:
        bad(f"factor must be > 0 (got {factor})")
    if threshold is not None and factor is not None:
        bad("pass threshold or factor, not both: they are two parallel-decoding rules")
    if not temperature >= 0:
        bad(f"temperature must be >= 0 (got {temperature}); 0 is greedy")
    if top_p is not None and not 0 < top_p <= 1:
        bad(f"top_p must be in (0, 1] (got {top_p})")
    if top_k is not None and top_k < 1:
        bad(f"top_k must be >= 1 (got {top_k})")
    if alg_temp is not None and not alg_temp >= 0:
        bad(f"alg_temp must be >= 0 (got {alg_temp})")


def check_prompt(cfg, prompt, gen_length, remasking, top_p, top_k, alg_temp, attention_mask=None):
    """The checks that depend on the model: the prompt's ids and length, and the family's options."""
    def bad(msg):
        raise ValueError(msg)
    if not isinstance(prompt, torch.Tensor):
        bad(f"the prompt must be a torch.Tensor of token ids, not a {type(prompt).__name__}: e.g. torch.tensor([ids])")
    if prompt.ndim == 2 and prompt.shape[0] == 0:
        bad("the prompt batch has 0 rows: pass at least one prompt")
    if prompt.ndim == 2 and prompt.shape[1] == 0:      # (torch.tensor([[]]) is float: say "empty" first)
        bad("the prompt is empty: pass at least one token")
    # torch.long only, as the official code: int32 fails late inside Dream's sampler, uint8 wraps around.
    if prompt.ndim != 2 or prompt.dtype != torch.long:
        bad(f"the prompt must be a (batch, length) tensor of integer token ids of dtype torch.long, not "
            f"{prompt.dtype} of shape {tuple(prompt.shape)}: e.g. torch.tensor([ids]), or prompt.long()")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != prompt.shape:
            bad(f"attention_mask must be a tensor of the prompt's shape {tuple(prompt.shape)} (1 = token, 0 = pad), "
                f"not {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        if not attention_mask.bool().any(-1).all():
            bad("attention_mask has a row of zeros: every prompt needs at least one real token (a 1)")
    if prompt.min() < 0 or prompt.max() >= cfg.vocab_size:
        bad(f"the prompt has token id {prompt.min() if prompt.min() < 0 else prompt.max()} outside the vocabulary "
            f"[0, {cfg.vocab_size}): tokenize it with this model's tokenizer")
    if (prompt == cfg.mask_id).any():
        bad(f"the prompt contains the mask token id {cfg.mask_id}: masks are reserved for the answer; "
            f"remove them (infilling inside the prompt is not supported)")
    if prompt.shape[1] + gen_length > cfg.max_seq_len:
        bad(f"prompt ({prompt.shape[1]} tokens) + gen_length ({gen_length}) exceeds the model's "
            f"{cfg.max_seq_len} positions: shorten the prompt or lower gen_length")
    names = LLADA_REMASKING if cfg.family == "llada" else DREAM_REMASKING
    if remasking not in names:
        bad(f"unknown remasking {remasking!r} for {cfg.family}: use one of {', '.join(names)}")
    if cfg.family == "llada" and (top_p is not None or top_k is not None or alg_temp):
        bad("top_p, top_k and alg_temp are Dream options; LLaDA samples with temperature only")


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


def eos_reached(x, P: int, e: int, eos: torch.Tensor, mask_id: int, run: int | bool):
    """(B,) rows whose answer has ended, so the rest can be filled with eos without another model call.
    run=True (at a block's end): the finished answer [P, e) holds an end token. run=k (FlashDLM's
    `_check_early_stop`, any step): the right-most decoded token r and the k-1 canvas tokens before it are end
    tokens (prompt tokens included, as FlashDLM counts them) and no mask lies before r."""
    ans = x[:, P:e]
    if run is True:
        return torch.isin(ans, eos).any(-1) & (ans != mask_id).all(-1)
    idx = torch.arange(x.shape[1], device=x.device)
    decoded = (x != mask_id) & (idx >= P)
    r = torch.where(decoded, idx, -1).max(-1).values                      # right-most decoded, -1 if none
    no_gap = torch.where(x == mask_id, idx, x.shape[1]).min(-1).values > r
    window = (idx <= r[:, None]) & (idx > r[:, None] - run)
    tail = torch.where(window, torch.isin(x, eos), True).all(-1)
    return (r >= 0) & (r + 1 >= run) & no_gap & tail


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, gen_length: int = 128, block_length: int | None = 32,
             steps: int | None = None, cache: str = "none", threshold: float | None = None,
             factor: float | None = None, temperature: float = 0.0, remasking: str | None = None,
             top_p: float | None = None, top_k: int | None = None, alg_temp: float | None = None,
             eps: float = 1e-3, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, refresh_every_step: bool = False,
             stop_at_eos: bool | int = False, eos_ids=None, guide=None, accept: str = "deterministic",
             accept_k: int = 5, accept_ratio: float = 0.95, verify_chunk: int = 32, speculative: bool = False,
             accept_threshold: float = 0.1, on_step=None):
    """
    Decode gen_length tokens after `prompt` (B, P). Returns (ids (B, P + gen_length), stats) with stats
    {"nfe": model calls, "fed": tokens fed per call, "committed": tokens committed per call (all rows),
    "calls_saved", "guide_calls", "seconds", "tokens_per_s"}.

    block_length: semi-autoregressive block size. None = one block over the whole answer; for Dream it
        selects Dream's own `diffusion_generate` rules instead of Fast-dLLM's block sampler.
    steps: denoising steps over the whole answer (default gen_length: one token per step); with a
        threshold or factor the step count is decided by confidence and steps is only checked.
    cache: "none" | "prefix" | "dual" (Fast-dLLM section 3.2) | "free" (FlashDLM's FreeCache); see
        feed_span. refresh_every_step=True feeds the whole canvas at every step (a check of the cache
        plumbing: the decode then equals cache="none").
    threshold / factor: confidence-aware parallel decoding (Fast-dLLM section 3.3).
    remasking: LLaDA "low_confidence" (default) | "random"; Dream "entropy" (default) | "maskgit_plus" |
        "topk_margin" | "origin" | "position_weighted" (Dream's `alg`).
    top_p, top_k, alg_temp, eps: Dream's sampling options. attention_mask: (B, P) 1/0 for left-padded
        prompts, both families: each row decodes as it would alone.
    stop_at_eos: False | True (once a block is complete and holds an end token, fill the rest with eos and
        stop) | k (FlashDLM's rule: k end tokens in a row at the decoded frontier). eos_ids: the end tokens
        (default the config's eos id).
    guide: a causal LM (model_type qwen2, sharing the model's token ids) that verifies the drafts (FlashDLM
        guided diffusion): one block over the answer (so "dual" is "prefix" here), accept "deterministic" |
        "topk" (accept_k) | "topk_relative" (accept_k, accept_ratio) | "dynamic_threshold" (accept_threshold)
        | "aggressive", verified in chunks of verify_chunk tokens; a committed end token always ends the
        answer. speculative=True commits the guide's token in place of the first rejected draft (FlashDLM's
        speculative variant) instead of the diffusion model's first draft (the assisted variant). A batch is
        decoded together, each row exactly as alone.
    generator: the only source of randomness (default: a fresh one seeded 0). on_step(x, stats) is called
        after every step with the live canvas.
    """
    cfg = model.config
    if cfg.causal:
        raise ValueError("this is a causal LM (model_type qwen2), not a diffusion LM: pass it as guide= and a "
                         "LLaDA or Dream checkpoint as the model")
    dream = cfg.family == "dream"
    guided = guide is not None
    whole_canvas = dream and block_length is None and not guided     # Dream's own diffusion_generate
    remasking = remasking or ("entropy" if dream else "low_confidence")
    block_length = gen_length if guided else block_length or gen_length
    steps = gen_length if steps is None or guided else steps
    check_settings(gen_length, block_length, steps, cache, threshold, factor, temperature, top_p, top_k, alg_temp,
                   eps, generator)
    check_prompt(cfg, prompt, gen_length, remasking, top_p, top_k, alg_temp, attention_mask)
    parallel = threshold is not None or factor is not None
    if guided:
        check_guided(model, guide, threshold, factor, temperature, accept, accept_k, accept_ratio, verify_chunk,
                     speculative, accept_threshold)
    n_blocks = gen_length // block_length
    spb = steps // n_blocks                                        # steps per block
    if dream and not guided:
        check_dream_modes(whole_canvas, cache, remasking, threshold, factor, gen_length, steps, spb, n_blocks)

    device = model.lm_head.weight.device
    prompt = prompt.to(device)
    B, P = prompt.shape
    L = P + gen_length
    generator = generator or torch.Generator(device).manual_seed(0)
    if generator.device.type != device.type:
        raise ValueError(f"the generator is on {generator.device.type} but the model on {device.type}: "
                         f"create it with torch.Generator({device.type!r})")
    eos = torch.tensor(sorted(set(eos_ids or cfg.eos_ids or [cfg.eos_id]) - {None}), dtype=torch.long, device=device)
    rules = S.Rules(cfg.mask_id, remasking, temperature, top_p, top_k, alg_temp, threshold, factor,
                  whole_canvas and threshold is not None, generator)
    x = F.pad(prompt, (0, gen_length), value=cfg.mask_id)
    pos, mask = padding(attention_mask, gen_length, device)
    kv = KVCache.for_model(model, B, L) if cache != "none" else None
    # Dream's time grid, t from 1 down to eps: per block for Fast-dLLM's sampler, over all steps for Dream's
    # own and for FlashDLM's FreeCache sampler (which indexes it by the global step).
    timesteps = torch.linspace(1, eps, (steps if whole_canvas or cache == "free" else spb) + 1, device=device)
    stats = {"nfe": 0, "fed": [], "committed": [], "calls_saved": 0, "guide_calls": 0}
    if guided:   # the guide's KV cache of the committed text: the prompts, less their last token (fed with drafts)
        real = None if pos is None else F.pad(attention_mask.to(device).bool(), (0, gen_length), value=True)
        verifier = Guide(guide, B, L, pos, real)
        stats["guide_calls"] += verifier.prefill(prompt)
        accept_fn = partial(S.accept_drafts, rule=accept, k=accept_k, ratio=accept_ratio, threshold=accept_threshold)
    carry = torch.zeros(B, dtype=torch.long, device=device)      # whole-canvas threshold: offered, refused
    t0 = time.perf_counter()

    for bi, s in enumerate(range(P, L, block_length)):
        e = s + block_length
        budget = S.num_transfer_tokens((x[:, s:e] == cfg.mask_id).sum(-1), spb)
        step = 0
        # Dream's own sampler runs exactly `steps` calls; everything else stops when the block is full.
        while step < steps if whole_canvas and threshold is None else (x[:, s:e] == cfg.mask_id).any():
            if step > max(spb, block_length) and not whole_canvas:
                raise RuntimeError("decoding made no progress: every step commits at least one token, so this is a bug")
            cand = x[:, s:e] == cfg.mask_id                                 # (B, N) open positions
            # 1. feed: one model call over the span the cache mode asks for
            first = stats["nfe"] == 0
            # Guided FreeCache (FlashDLM's aggressive caching): the block starts at the first mask, and the feed
            # one earlier, at the last committed token, for both families: each committed token is frozen with
            # keys computed while it held its token, not while it was a mask.
            head, shift = s, int(cfg.shift_logits)
            if guided and cache == "free":   # fed from the leftmost row's; each row writes from its own (cache.py)
                last = torch.where(cand.any(-1), s + cand.long().argmax(-1) - 1, L)   # (B,) last committed position
                head, shift = int(last.min()) + 1, 1
                ragged = not (first or refresh_every_step) and bool((last > last.min()).any())
                kv.write_from = last if ragged else None
            a, b = (0, L) if refresh_every_step else feed_span(cache, first, step, head, e, L, shift)
            cols = cand.any(0).nonzero().squeeze(1)                        # LM head only where a token is open
            if cache == "free" and B > 1:           # a row whose block is full stays frozen (cache.py)
                active = cand.any(-1)
                kv.write_rows = None if active.all() else active
            stats["nfe"] += 1
            stats["fed"].append(b - a)
            logits = model(x[:, a:b], None if pos is None else pos[:, a:b], kv, a,
                           None if mask is None else mask[:, :, a:b], s + cols - a)
            if not torch.isfinite(logits).all():
                raise ValueError(f"the model produced NaN/inf logits at step {stats['nfe']}: the weights hold NaN/inf, "
                                 f"or the activations overflowed {logits.dtype} (try --dtype float32)")
            # 2. propose and 3. select: the tokens x0 (B, N) and which of them this step commits
            if guided:
                x0, transfer, calls, ended = S.guided_select(logits, cand, cols, x, verifier, accept_fn, verify_chunk,
                                                             eos, cfg.mask_id, speculative)
                stats["guide_calls"] += calls
            elif not dream:
                k = budget[:, min(step, spb - 1)]          # threshold/factor steps past the schedule never read it
                x0, transfer = S.llada_select(logits, cand, cols, rules, k, (s - a, cols, b - a))
            else:
                i = bi * spb + step if cache == "free" else step      # FreeCache's time grid spans all steps
                i = min(i, len(timesteps) - 2)    # threshold/factor steps past the schedule never read the clock
                clock = S.DreamClock(
                    refresh_token=not whole_canvas and cache != "free" and step == 0,
                    t=timesteps[i], t_next=timesteps[i + 1], last=step == (steps if whole_canvas else spb) - 1,
                    later=(n_blocks - bi - 1) * block_length if cache == "free" else 0,
                    pad=(P, 0) if whole_canvas else (0, L - e if cache in ("prefix", "none") else 0),
                    offer=(gen_length // steps if step < steps else 0) + carry)
                x0, transfer, carry = S.dream_select(logits, cand, cols, rules, clock)
            # 4. commit
            x[:, s:e] = torch.where(transfer, x0, x[:, s:e])
            stats["committed"].append(int(transfer.sum()))
            step += 1
            if guided:                            # a committed end of text fills the rest and ends the answer
                x[ended] = x[ended].masked_fill(x[ended] == cfg.mask_id, eos[0])
                verifier.commit(transfer.sum(-1), ~(x == cfg.mask_id).any(-1))
            elif stop_at_eos is not True and stop_at_eos:
                done = eos_reached(x, P, L, eos, cfg.mask_id, stop_at_eos)
                x[done] = x[done].masked_fill(x[done] == cfg.mask_id, eos[0])
            if on_step is not None:
                on_step(x, stats)
        if stop_at_eos is True and e < L:
            done = eos_reached(x, P, e, eos, cfg.mask_id, True)
            x[done] = x[done].masked_fill(x[done] == cfg.mask_id, eos[0])
            if done.all():
                stats["calls_saved"] = (n_blocks - bi - 1) * (1 if parallel else spb)
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats["seconds"] = time.perf_counter() - t0
    stats["tokens_per_s"] = B * gen_length / max(stats["seconds"], 1e-9)
    return x, stats


def check_dream_modes(whole_canvas, cache, remasking, threshold, factor, gen_length, steps, spb, n_blocks):
    """Dream's samplers each implement some of the rules: say which one does what was asked."""
    parallel = threshold is not None or factor is not None
    if whole_canvas and (cache != "none" or factor is not None):
        raise ValueError("Dream's whole-canvas sampler (block_length=None) has no cache or factor rule: pass a "
                         "block_length to use Fast-dLLM's block sampler")
    if whole_canvas and threshold is not None and gen_length % steps:
        raise ValueError(f"Dream's whole-canvas threshold rule spreads the {gen_length} masks evenly over the "
                         f"steps: steps ({steps}) must divide gen_length")
    if not whole_canvas and cache != "free" and remasking != "entropy" and not parallel:
        raise ValueError(f"Fast-dLLM's Dream block sampler ranks tokens by entropy; remasking={remasking!r} "
                         f"needs Dream's whole-canvas sampler (block_length=None) or cache='free'")
    if not whole_canvas and cache != "free" and not parallel and spb < 2:
        raise ValueError(f"Fast-dLLM's Dream block sampler needs >= 2 steps per block (got {spb}): "
                         f"raise steps to at least {2 * n_blocks}, or use threshold/factor or cache='free'")


def check_guided(model, guide, threshold, factor, temperature, accept, accept_k, accept_ratio, verify_chunk,
                 speculative=False, accept_threshold=0.1):
    """Guided diffusion's own settings (FlashDLM, spec/flashdlm.md 2): the guide decides how many drafts to commit,
    so no other parallel rule applies, and drafts are the argmax (no sampling)."""
    check_guide(model.config, guide.config)
    if threshold is not None or factor is not None:
        raise ValueError("pass a guide or threshold/factor, not both: with a guide the guide decides how many "
                         "drafts each step commits")
    if temperature:
        raise ValueError(f"guided drafts are the diffusion model's argmax: temperature must be 0 (got {temperature})")
    if accept not in S.ACCEPT_RULES:
        raise ValueError(f"unknown accept rule {accept!r}: use one of {', '.join(S.ACCEPT_RULES)}")
    if type(accept_k) is not int or accept_k < 1:
        raise ValueError(f"accept_k must be an integer >= 1 (got {accept_k!r})")
    if not 0 < accept_ratio <= 1:
        raise ValueError(f"accept_ratio must be in (0, 1] (got {accept_ratio!r})")
    if type(verify_chunk) is not int or verify_chunk < 1:
        raise ValueError(f"verify_chunk must be an integer >= 1 (got {verify_chunk!r})")
    if type(speculative) is not bool:
        raise ValueError(f"speculative must be True or False (got {speculative!r})")
    if isinstance(accept_threshold, bool) or not isinstance(accept_threshold, numbers.Real) \
            or not 0 <= accept_threshold < 1:
        raise ValueError(f"accept_threshold must be a number in [0, 1) (got {accept_threshold!r}): the guide "
                         f"accepts a draft whose probability exceeds it")


# ----------------------------------------------------------------------------------------------------------
# Command line

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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Fast-dLLM inference for LLaDA and Dream. The defaults are the "
                                "method's headline setting; the plain baseline is --cache none --threshold none.")

    def error(message):   # argparse would print its usage too: our errors are one line (see __main__)
        raise ValueError(f"{message} (see --help)")
    p.error = error
    # SUPPRESS: --gen-length and --threshold are absent unless given, so we can tell a default from a choice.
    p.add_argument("--model", default="GSAI-ML/LLaDA-8B-Instruct", help="Hugging Face repo id or local folder "
                   "(default: %(default)s)")
    p.add_argument("--prompt", help="the user message (required unless --interactive; --bench has a default)")
    p.add_argument("--gen-length", type=int, default=argparse.SUPPRESS, help="tokens to generate (default: 256, "
                   "or the largest multiple of --block-length that fits the model's positions)")
    p.add_argument("--block-length", type=int, default=32, help="semi-autoregressive block size; 0 = one block "
                   "(for Dream: Dream's own whole-canvas sampler) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: gen-length)")
    p.add_argument("--cache", default="dual", help=f"KV cache: {' | '.join(CACHE_MODES)} (default: %(default)s)")
    p.add_argument("--threshold", type=optional_float, default=argparse.SUPPRESS, help="parallel decoding: "
                   "unmask every token with confidence >= this; none = off (default: 0.9; none with --factor)")
    p.add_argument("--factor", type=float, default=None, help="factor-based parallel decoding (default: off)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--remasking", default=None, help="LLaDA: low_confidence (default) | random; Dream: entropy "
                   "(default) | maskgit_plus | topk_margin | origin")
    p.add_argument("--top-p", type=float, default=None, help="Dream only (default: off)")
    p.add_argument("--top-k", type=int, default=None, help="Dream only (default: off)")
    p.add_argument("--alg-temp", type=float, default=None, help="Dream only: randomness of the position choice")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default: %(default)s)")
    p.add_argument("--no-chat", action="store_true", help="raw prompt, no chat template (base models)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat on stdin (a model without a chat "
                   "template, like the demo, answers each question alone)")
    p.add_argument("--prompt-file", help="one prompt per line, decoded in batches (answers in input order)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch with --prompt-file "
                   "(default: %(default)s)")
    p.add_argument("--no-early-stop", action="store_true", help="decode every block even after the answer "
                   "ended (default: stop once a finished block holds an end token)")
    p.add_argument("--no-stream", action="store_true", help="print the answer at the end, not block by block")
    p.add_argument("--trace", action="store_true", help="print which tokens each step unmasked")
    p.add_argument("--guide", help="a causal LM sharing the model's tokenizer (Qwen2 format, repo id or folder): "
                   "FlashDLM's guided diffusion (default: off)")
    p.add_argument("--accept", default="deterministic", help="guided: deterministic | topk | topk_relative | "
                   "dynamic_threshold | aggressive (default: %(default)s)")
    p.add_argument("--accept-k", type=int, default=5, help="guided top-k (default: %(default)s)")
    p.add_argument("--accept-ratio", type=float, default=0.95, help="guided topk_relative ratio (default: "
                   "%(default)s)")
    p.add_argument("--accept-threshold", type=float, default=0.1, help="guided dynamic_threshold: accept a draft "
                   "whose guide probability exceeds this (default: %(default)s)")
    p.add_argument("--speculative", action="store_true", help="guided: commit the guide's token in place of the "
                   "first rejected draft, i.e. the guide's quality (default: the diffusion model's first draft)")
    import bench   # its flags live with it (bench.py imports this file's generate(), so not at the top)
    bench.add_arguments(p)
    args = p.parse_args(argv)
    args.fit_gen_length = "gen_length" not in vars(args)
    args.gen_length = getattr(args, "gen_length", 256)
    if "threshold" not in vars(args):   # --factor or --guide replaces the default; both given is an error
        args.threshold = None if args.factor is not None or args.guide else 0.9
    if not args.prompt and not args.interactive and not args.bench and not args.prompt_file:
        raise ValueError("no prompt: pass --prompt \"...\" (or --prompt-file, --interactive)")
    if args.prompt_file and (args.prompt or args.interactive):
        raise ValueError("pass one of --prompt, --prompt-file, --interactive")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (got {args.batch_size})")
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


def bench(model, ids, args, device, eos_ids=None):
    """--bench: every decoding mode side by side on the same prompt, with its cost and its agreement with
    the exact decode (bench.py does the work; see its docstring for what each column means)."""
    import bench as B      # here, not at the top: bench.py imports this file's generate()
    guide = getattr(args, "guide_model", None)    # loaded and checked by main() when --guide is given
    prompt = torch.tensor([ids] * args.bench_batch, device=device)     # the one prompt, bench-batch times
    B.cli_bench(model, prompt, args, settings(args), eos_ids, guide)


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


def load_guide(args, cfg, chat, device, dtype):
    """--guide: check that it shares the model's token ids on its small files, then load it (or None)."""
    if not args.guide:
        return None
    from chat import load_tokenizer
    guide_dir = resolve_model_dir(args.guide)
    try:   # with both tokenizers every shared id is compared token by token; else the configs' ids
        guide_tok = load_tokenizer(guide_dir)
    except FileNotFoundError:
        guide_tok = None
    check_guide(cfg, read_config(guide_dir), chat.tok, guide_tok)
    return load_model(guide_dir, device=device, dtype=dtype)


def answer_prompts(model, chat, args, device):
    """--prompt-file: every line a prompt, decoded in batches of --batch-size; answers in input order."""
    with open(args.prompt_file, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"{args.prompt_file} has no prompt: write one prompt per line")
    rows = [chat.encode(chat.render([{"role": "user", "content": q}])) for q in prompts]
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
    check_settings(**{k: v for k, v in kw.items() if k not in ("remasking", "accept", "accept_k", "accept_ratio",
                                                               "accept_threshold", "speculative")} |
                   {"block_length": kw["block_length"] or kw["gen_length"],
                    "steps": kw["gen_length"] if kw["steps"] is None else kw["steps"]})
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
    args.guide_model = load_guide(args, cfg, chat, device, dtype)
    model = load_model(model_dir, device=device, dtype=dtype)
    if args.bench:
        prompt = args.prompt or "Tom has 23 apples and buys 45 more. How many apples does he have?"
        ids = chat.encode(chat.render([{"role": "user", "content": prompt}]))
        args.gen_length = fit_gen_length(args, len(ids), cfg.max_seq_len)
        return bench(model, ids, args, device, args.stop_ids)
    if args.prompt_file:
        return answer_prompts(model, chat, args, device)
    messages, ids = [], []
    while True:
        text = args.prompt if not args.interactive else read_turn()
        if args.interactive and text in (None, "", "exit", "quit"):
            return
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
        if not args.interactive:
            return
        messages.append({"role": "assistant", "content": answer})
        ids = out


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, OSError) as e:   # OSError: FileNotFoundError and any file error we did not foresee
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
