"""
fastdllm.py: fast inference for masked-diffusion LLMs (LLaDA-8B, Dream-7B), the one generation loop and
its command line.

A diffusion LM generates by denoising: the answer starts as gen_length [MASK] tokens, and each model call
("step", counted as NFE) predicts every masked position at once and commits some of them. This file runs:
- semi-autoregressive *blocks* (LLaDA): the canvas is filled block by block, left to right;
- Fast-dLLM (arXiv 2505.22618): the block-wise approximate KV cache, `cache="prefix"` / `"dual"` (section
  3.2, cache.py) and confidence-aware parallel decoding, `threshold=` / `factor=` (section 3.3, sampler.py);
- Dream's own whole-canvas sampler (`block_length=None`) and Fast-dLLM's Dream block sampler.

    python fastdllm.py --prompt "What is 7 * 8?"                    # LLaDA-8B-Instruct, dual cache, tau 0.9
    python fastdllm.py --model demo/llada-arith --prompt "..."      # the tiny model we ship, on a CPU
"""
import argparse
import os
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

import sampler as S
from cache import KVCache
from chat import Chat
from model import load_model, resolve_model_dir

CACHE_MODES = ("none", "prefix", "dual", "free")
LLADA_REMASKING = ("low_confidence", "random")
DREAM_REMASKING = ("origin", "maskgit_plus", "topk_margin", "entropy", "position_weighted")
ACCEPT_RULES = ("deterministic", "topk", "topk_relative")


def check_settings(gen_length, block_length, steps, cache, threshold, factor, temperature, top_p=None,
                   top_k=None, alg_temp=None):
    """The checks that need no model (the CLI runs them before loading gigabytes of weights). Every
    impossible request fails in one line that names the fix, never deep inside torch."""
    def bad(msg):
        raise ValueError(msg)
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


def check_prompt(cfg, prompt, gen_length, remasking, top_p, top_k, alg_temp):
    """The checks that depend on the model: the prompt's ids and length, and the family's options."""
    def bad(msg):
        raise ValueError(msg)
    if prompt.ndim == 2 and prompt.shape[1] == 0:
        bad("the prompt is empty: pass at least one token")
    if prompt.ndim != 2 or prompt.is_floating_point() or prompt.dtype == torch.bool:
        bad(f"the prompt must be a (batch, length) tensor of integer token ids, not {prompt.dtype} of shape "
            f"{tuple(prompt.shape)}")
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


def feed_span(cache: str, first: bool, block_step: int, s: int, e: int, L: int, shift: int):
    """Which canvas positions [a, b) a step feeds. Everything outside is read from the KV cache as the last
    forward that fed it left it (cache.py); that choice *is* the difference between the caches:
    - none: the whole canvas every step (the exact reference);
    - prefix / dual (Fast-dLLM section 3.2): a block's first step refreshes the whole canvas, its later steps
      feed the block and everything after it [s, L) (prefix) or the block alone [s, e) (dual);
    - free (FlashDLM's FreeCache, arXiv 2505.21467 section 3): only the generation's first call is full;
      every later step feeds [s - shift, L), the block and the masked suffix, from one position earlier
      for Dream (its logits shift predicts s from s - 1). Nothing left of that is ever recomputed: a block's
      keys/values stay frozen as its last step computed them, while some of its tokens were still masks."""
    if cache == "none" or first:
        return 0, L
    if cache == "free":
        return s - shift, L
    if block_step == 0:
        return 0, L
    return s, L if cache == "prefix" else e


def padding(attention_mask, gen_length: int, device):
    """Left-padded prompts: real tokens count positions from 0, pads neither attend nor are attended to, so
    every row decodes as it would alone. -> (pos (B, L), mask (B, 1, L, L)), or (None, None) without pads."""
    if attention_mask is None or not (attention_mask == 0).any():
        return None, None
    m = F.pad(attention_mask.to(device).bool(), (0, gen_length), value=True)
    return (m.long().cumsum(-1) - 1).masked_fill(~m, 1), m[:, None, None, :] & m[:, None, :, None]


def eos_reached(x, P: int, e: int, eos: torch.Tensor, mask_id: int, run: int | bool):
    """(B,) rows whose answer has ended, so the rest can be filled with eos without another model call.
    run=True (at a block's end): the finished answer [P, e) holds an end token. run=k (FlashDLM's
    `_check_early_stop`, any step): the right-most decoded token and the k-1 before it are end tokens and no
    mask lies before it."""
    ans = x[:, P:e]
    is_eos = torch.isin(ans, eos)
    if run is True:
        return is_eos.any(-1) & (ans != mask_id).all(-1)
    idx = torch.arange(ans.shape[1], device=x.device)
    decoded = ans != mask_id
    r = torch.where(decoded, idx, -1).max(-1).values                     # right-most decoded, -1 if none
    no_gap = (torch.where(~decoded, idx, ans.shape[1]).min(-1).values > r)
    tail = torch.where((idx <= r[:, None]) & (idx > r[:, None] - run), is_eos, True).all(-1)
    return (r >= 0) & (r + P + 1 >= run) & no_gap & tail


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, gen_length: int = 128, block_length: int | None = 32,
             steps: int | None = None, cache: str = "none", threshold: float | None = None,
             factor: float | None = None, temperature: float = 0.0, remasking: str | None = None,
             top_p: float | None = None, top_k: int | None = None, alg_temp: float | None = None,
             eps: float = 1e-3, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, refresh_every_step: bool = False,
             stop_at_eos: bool | int = False, eos_ids=None, guide=None, accept: str = "deterministic",
             accept_k: int = 5, accept_ratio: float = 0.95, verify_chunk: int = 32, on_step=None):
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
    guide: a causal model (model.Guide) that verifies the drafts (FlashDLM guided diffusion): one block
        over the answer, accept "deterministic" | "topk" (accept_k) | "topk_relative" (accept_k,
        accept_ratio), verified in chunks of verify_chunk tokens.
    generator: the only source of randomness (default: a fresh one seeded 0). on_step(x, stats) is called
        after every step with the live canvas.
    """
    cfg = model.config
    dream = cfg.family == "dream"
    guided = guide is not None
    whole_canvas = dream and block_length is None and not guided     # Dream's own diffusion_generate
    remasking = remasking or ("entropy" if dream else "low_confidence")
    block_length = gen_length if guided else block_length or gen_length
    steps = gen_length if steps is None or guided else steps
    check_settings(gen_length, block_length, steps, cache, threshold, factor, temperature, top_p, top_k, alg_temp)
    check_prompt(cfg, prompt, gen_length, remasking, top_p, top_k, alg_temp)
    parallel = threshold is not None or factor is not None
    if guided:
        check_guided(model, guide, threshold, factor, temperature, accept, accept_k, accept_ratio, verify_chunk)
        if prompt.shape[0] > 1:
            return generate_rows(model, prompt, attention_mask, gen_length=gen_length, cache=cache,
                                 guide=guide, accept=accept, accept_k=accept_k, accept_ratio=accept_ratio,
                                 verify_chunk=verify_chunk, eos_ids=eos_ids, on_step=on_step)
    if whole_canvas and (cache != "none" or factor is not None):
        raise ValueError("Dream's whole-canvas sampler (block_length=None) has no cache or factor rule: pass a "
                         "block_length to use Fast-dLLM's block sampler")
    if whole_canvas and threshold is not None and gen_length % steps:
        raise ValueError(f"Dream's whole-canvas threshold rule spreads the {gen_length} masks evenly over the steps: "
                         f"steps ({steps}) must divide gen_length")
    if dream and not whole_canvas and cache != "free" and remasking != "entropy" and not parallel and not guided:
        raise ValueError(f"Fast-dLLM's Dream block sampler ranks tokens by entropy; remasking={remasking!r} "
                         f"needs Dream's whole-canvas sampler (block_length=None) or cache='free'")
    n_blocks = gen_length // block_length
    spb = steps // n_blocks                                        # steps per block
    if dream and not whole_canvas and cache != "free" and not parallel and not guided and spb < 2:
        raise ValueError(f"Fast-dLLM's Dream block sampler needs >= 2 steps per block (got {spb}): "
                         f"raise steps to at least {2 * n_blocks}, or use threshold/factor or cache='free'")

    device = model.lm_head.weight.device
    prompt = prompt.to(device)
    B, P = prompt.shape
    L = P + gen_length
    generator = generator or torch.Generator(device).manual_seed(0)
    if generator.device.type != device.type:
        raise ValueError(f"the generator is on {generator.device.type} but the model on {device.type}: "
                         f"create it with torch.Generator({device.type!r})")
    eos = torch.tensor(sorted(set(eos_ids or [cfg.eos_id]) - {None}), dtype=torch.long, device=device)
    x = F.pad(prompt, (0, gen_length), value=cfg.mask_id)
    pos, mask = padding(attention_mask, gen_length, device)
    kv = KVCache.for_model(model, B, L) if cache != "none" else None
    # Dream's time grid, t from 1 down to eps: per block for Fast-dLLM's sampler, over all steps for Dream's
    # own and for FlashDLM's FreeCache sampler (which indexes it by the global step).
    timesteps = torch.linspace(1, eps, (steps if whole_canvas or cache == "free" else spb) + 1, device=device)
    stats = {"nfe": 0, "fed": [], "committed": [], "calls_saved": 0, "guide_calls": 0}
    if guided:   # the guide's KV cache of the committed text: the prompt, less its last token (fed with drafts)
        from model import Guide
        verifier = Guide(guide, L)
        stats["guide_calls"] += verifier.prefill(prompt[0, :-1])
        accept_fn = partial(S.accept_drafts, rule=accept, k=accept_k, ratio=accept_ratio)
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
            head = (cand.argmax(-1).min().item() + s) if guided and cache == "free" else s   # guided: block = first mask on
            a, b = (0, L) if refresh_every_step else feed_span(cache, first, step, head, e, L, int(cfg.shift_logits))
            cols = cand.any(0).nonzero().squeeze(1)                        # LM head only where a token is open
            if cache == "free" and B > 1:
                kv.write_rows = cand.any(-1)        # a row whose block is full stays frozen (cache.py)
            stats["nfe"] += 1
            stats["fed"].append(b - a)
            logits = model(x[:, a:b], None if pos is None else pos[:, a:b], kv, a,
                           None if mask is None else mask[:, :, a:b], s + cols - a)
            if not torch.isfinite(logits).all():
                raise ValueError(f"the model produced NaN/inf logits at step {stats['nfe']}: the weights hold NaN/inf, "
                                 f"or the activations overflowed {logits.dtype} (try --dtype float32)")
            # 2. propose and 3. select: the tokens x0 (B, N) and which of them this step commits
            last = step == (steps if whole_canvas else spb) - 1
            if guided:
                x0 = torch.zeros_like(cand, dtype=torch.long)
                x0[:, cols] = S.argmax_except(logits, cfg.mask_id)
                drafts = x0[0, cols]
                n, calls = verifier.verify(x[0, s + cols[0] - 1], drafts, accept_fn, verify_chunk)
                n = max(n, 1)     # the first draft is rejected: commit the diffusion model's own token
                stats["guide_calls"] += calls
                transfer = cand & (torch.arange(block_length, device=device) < cols[0] + n)
            elif not dream:
                x0, conf = S.llada_predict(logits, temperature, remasking, generator, (s - a, cols, b - a), cfg.mask_id)
                x0, conf = widen(x0, cols, block_length, 0), widen(conf, cols, block_length, S.NEG_INF)
                conf = conf.masked_fill(~cand, S.NEG_INF)
                transfer = (S.select_threshold(conf, cand, threshold) if threshold is not None else
                            S.select_factor(conf, cand, factor) if factor is not None else
                            S.select_topk(conf, cand, budget[:, step]))
            elif not whole_canvas and cache != "free" and step == 0:
                # Fast-dLLM's Dream block sampler decodes the block's first token at the refresh, whatever
                # its confidence (spec/dream.md 7.3); the shifted logits of cached chunks never serve it.
                x0 = widen(S.dream_sample(logits[:, :1], temperature, top_p, top_k, generator, cfg.mask_id)[1],
                           cols[:1], block_length, 0)
                transfer = cand & (torch.arange(block_length, device=device) == 0)
            elif remasking == "origin" and not parallel:
                p = 1 if last else 1 - timesteps[step + 1] / timesteps[step]
                x0, transfer = S.dream_origin(logits, cand[:, cols], p, temperature, top_p, top_k, generator,
                                              cfg.mask_id)
                x0, transfer = widen(x0, cols, block_length, 0), widen(transfer, cols, block_length, False)
            else:
                cc = cand[:, cols]
                conf, x0, probs = S.dream_sample(logits[cc], temperature, top_p, top_k, generator, cfg.mask_id)
                alg = remasking if not parallel else "maskgit_plus"
                score = S.dream_confidence(alg, conf, probs, cand.nonzero(as_tuple=True))
                x0 = torch.zeros_like(x[:, s:e]).masked_scatter_(cand, x0)
                score = torch.full(cand.shape, S.NEG_INF, device=device).masked_scatter_(cand, score)
                if whole_canvas and threshold is not None:   # Fast-dLLM's confidence_threshold, no blocks
                    quota = gen_length // steps if step < steps else 0
                    transfer, carry = S.select_quota_threshold(score, cand, quota + carry, threshold)
                elif threshold is not None:
                    transfer = S.select_threshold(score, cand, threshold)
                elif factor is not None:
                    transfer = S.select_factor(score, cand, factor)
                else:   # Dream's schedule; FreeCache counts every later block's masks too (FlashDLM)
                    i = bi * spb + step if cache == "free" else step
                    later = (n_blocks - bi - 1) * block_length if cache == "free" else 0
                    k = S.dream_num_transfer(cand.sum(-1), timesteps[i], timesteps[i + 1], last, cand.sum(-1) + later)
                    if alg_temp:   # same draw width as the official code: canvas, fed chunk (prefix) or block
                        pad = (P, 0) if whole_canvas else (0, L - e if cache in ("prefix", "none") else 0)
                        transfer = S.select_sampled(score, cand, k, alg_temp, generator, pad)
                    else:
                        transfer = S.select_topk(score, cand, k)
            # 4. commit
            x[:, s:e] = torch.where(transfer, x0, x[:, s:e])
            stats["committed"].append(int(transfer.sum()))
            step += 1
            if guided:
                verifier.commit(n)
                if torch.isin(x0[0][transfer[0]], eos).any():      # a committed end of text ends the answer
                    x[x == cfg.mask_id] = eos[0]
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


def widen(values, cols, width: int, fill):
    """(B, n) values at block columns `cols` -> (B, width), `fill` elsewhere."""
    out = torch.full((values.shape[0], width), fill, dtype=values.dtype, device=values.device)
    out[:, cols] = values
    return out


def check_guided(model, guide, threshold, factor, temperature, accept, accept_k, accept_ratio, verify_chunk):
    """Guided diffusion's own settings (FlashDLM section 2): the guide decides how many drafts to commit,
    so no other parallel rule applies, and drafts are the argmax (no sampling)."""
    from model import check_guide
    check_guide(model.config, guide.config)
    if threshold is not None or factor is not None:
        raise ValueError("pass a guide or threshold/factor, not both: with a guide the guide decides how many "
                         "drafts each step commits")
    if temperature:
        raise ValueError(f"guided drafts are the diffusion model's argmax: temperature must be 0 (got {temperature})")
    if accept not in ACCEPT_RULES:
        raise ValueError(f"unknown accept rule {accept!r}: use one of {', '.join(ACCEPT_RULES)}")
    if type(accept_k) is not int or accept_k < 1:
        raise ValueError(f"accept_k must be an integer >= 1 (got {accept_k!r})")
    if not 0 < accept_ratio <= 1:
        raise ValueError(f"accept_ratio must be in (0, 1] (got {accept_ratio!r})")
    if type(verify_chunk) is not int or verify_chunk < 1:
        raise ValueError(f"verify_chunk must be an integer >= 1 (got {verify_chunk!r})")


def generate_rows(model, prompt, attention_mask, **kw):
    """Guided decoding of a batch: each row alone (its pads stripped), then put back in place. Rows of one
    batch commit different numbers of tokens per step, so the guide's committed text differs per row;
    decoding them one by one is the simplest way to keep every row exactly as it would be alone."""
    rows, stats = [], {"nfe": 0, "fed": [], "committed": [], "calls_saved": 0, "guide_calls": 0, "seconds": 0.0}
    for b in range(prompt.shape[0]):
        real = prompt[b] if attention_mask is None else prompt[b][attention_mask[b].bool().to(prompt.device)]
        out, st = generate(model, real[None], **kw)
        rows.append(torch.cat([prompt[b, :prompt.shape[1] - real.numel()].to(out.device), out[0]]))
        for key in ("nfe", "calls_saved", "guide_calls", "seconds"):
            stats[key] += st[key]
        stats["fed"] += st["fed"]
        stats["committed"] += st["committed"]
    stats["tokens_per_s"] = prompt.shape[0] * kw["gen_length"] / max(stats["seconds"], 1e-9)
    return torch.stack(rows), stats


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
    return None if text.lower() in ("none", "off") else float(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Fast-dLLM inference for LLaDA and Dream. Defaults are the method's headline setting: "
                    "--cache dual --threshold 0.9 --block-length 32 --gen-length 256. The plain baseline is "
                    "--cache none --threshold none.")
    p.add_argument("--model", default="GSAI-ML/LLaDA-8B-Instruct", help="Hugging Face repo id or local folder")
    p.add_argument("--prompt", help="the user message (omit with --interactive or --bench uses a default)")
    p.add_argument("--gen-length", type=int, default=256, help="tokens to generate")
    p.add_argument("--block-length", type=int, default=32, help="semi-autoregressive block size; 0 = one block "
                   "(for Dream: Dream's own whole-canvas sampler)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: gen-length)")
    p.add_argument("--cache", default="dual", help="KV cache: none | prefix | dual")
    p.add_argument("--threshold", type=optional_float, default=0.9,
                   help="parallel decoding: unmask every token with confidence >= this (none = off)")
    p.add_argument("--factor", type=float, default=None, help="factor-based parallel decoding (replaces threshold)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--remasking", default=None, help="LLaDA: low_confidence|random; Dream: entropy|maskgit_plus|"
                   "topk_margin|origin")
    p.add_argument("--top-p", type=float, default=None, help="Dream only")
    p.add_argument("--top-k", type=int, default=None, help="Dream only")
    p.add_argument("--alg-temp", type=float, default=None, help="Dream only: randomness of the position choice")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--no-chat", action="store_true", help="raw prompt, no chat template (base models)")
    p.add_argument("--interactive", action="store_true", help="multi-turn chat on stdin")
    p.add_argument("--bench", action="store_true", help="every decoding mode side by side: calls, tokens fed, "
                   "time, tokens/s, memory and agreement with the exact decode (bench.py)")
    p.add_argument("--bench-caches", default="none,prefix,dual,free", help="--bench: cache modes, comma-separated")
    p.add_argument("--bench-thresholds", default="0.9", help="--bench: threshold values, comma-separated")
    p.add_argument("--bench-factors", default="1.0", help="--bench: factor values, comma-separated ('' = none)")
    p.add_argument("--bench-stop", default="off,on", help="--bench: early stop values: off, on (at a block's end), "
                   "k (k end tokens in a row)")
    p.add_argument("--bench-batch", type=int, default=1, help="--bench: batch size (the prompt repeated)")
    p.add_argument("--bench-repeat", type=int, default=1, help="--bench: best wall time of this many runs per row")
    p.add_argument("--bench-json", default=None, help="--bench: also write every row, the settings and the "
                   "environment to this JSON file")
    args = p.parse_args(argv)
    if args.factor is not None:
        args.threshold = None      # --factor replaces the default threshold
    return args


def settings(args, **override):
    kw = dict(gen_length=args.gen_length, block_length=args.block_length or None, steps=args.steps,
              cache=args.cache, threshold=args.threshold, factor=args.factor, temperature=args.temperature,
              remasking=args.remasking, top_p=args.top_p, top_k=args.top_k, alg_temp=args.alg_temp)
    kw.update(override)
    return kw


def run_once(model, ids, args, device, on_step=None, **override):
    """One generate() call on one prompt with the CLI's settings, seeded from --seed."""
    gen = torch.Generator(device).manual_seed(args.seed)
    x, stats = generate(model, torch.tensor([ids], device=device), generator=gen, on_step=on_step,
                        **settings(args, **override))
    return x[0].tolist(), stats


def bench(model, ids, args, device, eos_ids=None):
    """--bench: every decoding mode side by side on the same prompt, with its cost and its agreement with
    the exact decode (bench.py does the work; see its docstring for what each column means)."""
    import bench as B      # here, not at the top: bench.py imports this file's generate()
    guide = None
    if getattr(args, "guide", None):   # the --guide flag of guided decoding, when the CLI has it
        guide = load_model(resolve_model_dir(args.guide), device=device, dtype=model.lm_head.weight.dtype)
    prompt = torch.tensor([ids] * args.bench_batch, device=device)     # the one prompt, bench-batch times
    B.cli_bench(model, prompt, args, settings(args), eos_ids, guide)


def main(argv=None):
    args = parse_args(argv)
    device, dtype = pick_device_dtype(args.device, args.dtype)
    kw = settings(args)
    check_settings(**{k: v for k, v in kw.items() if k != "remasking"} |
                   {"block_length": kw["block_length"] or kw["gen_length"], "steps": kw["steps"] or kw["gen_length"]})
    model_dir = resolve_model_dir(args.model)
    model = load_model(model_dir, device=device, dtype=dtype)
    chat = Chat(model_dir, model.config, chat=not args.no_chat)
    if args.bench:
        prompt = args.prompt or "Tom has 23 apples and buys 45 more. How many apples does he have?"
        return bench(model, chat.encode(chat.render([{"role": "user", "content": prompt}])), args, device,
                     chat.stop_ids)
    if not args.interactive and not args.prompt:
        raise ValueError("no prompt: pass --prompt \"...\" (or --interactive)")
    messages, ids = [], []
    while True:
        try:
            text = args.prompt if not args.interactive else input("user> ").strip()
        except EOFError:   # Ctrl-D (or the end of piped input) ends the chat, like "exit"
            print()
            return
        if args.interactive and text in ("", "exit", "quit"):
            return
        messages.append({"role": "user", "content": text})
        if ids and chat.chat and chat.family == "llada":
            # LLaDA's chat.py keeps the previous turns as ids, with every <|endoftext|> filler removed, and
            # appends the new turn without its bos.
            ids = [t for t in ids if t != model.config.eos_id] + chat.encode(chat.render(messages[-1:]))[1:]
        else:
            ids = chat.encode(chat.render(messages))
        live = {}
        try:
            out, stats = run_once(model, ids, args, device, on_step=lambda x, st: live.update(x=x, nfe=st["nfe"]))
        except KeyboardInterrupt:
            partial = live["x"][0, len(ids):].tolist() if "x" in live else []
            partial = [t for t in partial if t != model.config.mask_id]
            print(f"\n[interrupted after {live.get('nfe', 0)} steps] {chat.answer(partial)}")
            return 130
        answer = chat.answer(out[len(ids):])
        print(answer if not args.interactive else f"assistant> {answer}")
        peak = f" | peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
        print(f"NFE {stats['nfe']} | {stats['tokens_per_s']:.1f} tokens/s | {stats['seconds']:.2f} s{peak}")
        if not args.interactive:
            return
        messages.append({"role": "assistant", "content": answer})
        ids = out


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
