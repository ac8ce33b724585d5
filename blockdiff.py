"""
blockdiff.py: block diffusion, the family of Fast-dLLM v2 (arXiv 2509.26328; NVlabs/Fast-dLLM v2/) and SDAR
(arXiv 2510.06303; JetAstra/SDAR): an autoregressive LM made to denoise a block at a time. Attention is
block-causal on a grid anchored at position 0 (query q sees key k iff q // G >= k // G: bidirectional inside a
block, causal across blocks), so the keys/values of a finished block never change again: the prefix cache of this
family is exact, not an approximation (cache.py's BlockPrefix).

Here are the family's parts for fastdllm.py's one loop (docs/blockdiff.md tells the method):
- `grid_canvas` / `grid_output`: a batch on one grid. Each row's prompt starts at position 0 and its answer right
  after it (right padding with masks, as Fast-dLLM v2's batch_sample): the grid, the RoPE positions and every
  block's keys are then the ones the row has alone. Each row's answer runs to its own grid block edge, as each
  official decode counts it for that row alone (never to the longest prompt's: a row decodes, stops and is counted
  as alone). generate() hands back the usual layout, answers after a common prompt width.
- `FastDLLMv2`, `SDAR`: the step rules. A block's first call stores the block before it, clean (the prefill
  for the first block); for Fast-dLLM v2 (the AR token shift: position p is predicted from p - 1) that call's last
  row also gives the block's first token, by arg-max. Then sub-blocks (v2) or the whole block (SDAR) are denoised.
- `DynamicThreshold`, `FirstMasks`: SDAR's `low_confidence_dynamic` and `sequential` selections (v2's strict
  threshold is sampler.Threshold(strict=True); SDAR's `low_confidence_static` is sampler.Schedule).
- `block_parts`: the call's step rule and selection from its settings; `check_block`: what this family refuses.
"""
import re
from functools import partial

import torch
import torch.nn.functional as F

from cache import BLOCK_CACHE_POLICIES, LLADA2_CACHE_POLICIES, CachePolicy
from llada2 import STEPS as LLADA2_STEPS, check_llada2, llada2_parts
from family import Canvas, Family, Parts
from sampler import NEG_INF, Proposal, Schedule, StepRule, Threshold, argmax_except, stop_rule, widen

FAMILIES = ("fastdllm_v2", "sdar", "llada2")   # the block-diffusion families (model.ModelConfig.family; llada2.py)
SDAR_REMASKING = ("low_confidence_dynamic", "low_confidence_static", "sequential")
SDAR_BLOCK = 4     # SDAR's released configs name no block: its models were trained with 4 (the -b8 .. -b64 others)
V2_SUB_BLOCK = 8   # Fast-dLLM v2's sub-block (its small_block_size), or the block when smaller


# ---------------------------------------------------------------------------------------- the canvas
def grid_length(family: str, prompt: int, gen_length: int, G: int) -> int:
    """The canvas length of one row whose prompt has `prompt` tokens, as each official decode counts it for it alone.
    Fast-dLLM v2 (batch_sample): gen_length // G blocks after the prompt's whole blocks, plus the first token of the
    next block (the last store call's); below one block the official decodes nothing, ours one block (docs/parity.md).
    SDAR (block_diffusion_generate), LLaDA2: prompt + answer rounded up to a block."""
    if family == "fastdllm_v2":
        return (prompt // G + max(gen_length // G, 1)) * G + 1
    return -(-(prompt + gen_length) // G) * G


def grid_canvas(prompt, attention_mask, gen_length: int, G: int, family: str, mask_id: int, fill: int):
    """A (left-padded) prompt batch -> (canvas (B, L), the rows' prompt lengths (B,), where each row's answer ends on
    the canvas (B,), the blocks [(s, e)]). Each row is the canvas it has alone: its prompt from position 0, masks to
    its own grid_length, then `fill` up to the longest row's (positions it never decodes, after its last grid
    block; Fast-dLLM v2's extra token shares a grid block with them but is predicted from the block before). The
    official batch_sample gives every row the longest prompt's canvas, so that a row's answer depends on its
    neighbours: not copied (docs/parity.md). LLaDA2's answer is gen_length tokens, the rest of its last block decoded
    but not returned."""
    B, P = prompt.shape
    lengths = (attention_mask.long().sum(-1) if attention_mask is not None else torch.full((B,), P)).to(prompt.device)
    ends = torch.tensor([grid_length(family, n, gen_length, G) for n in lengths.tolist()], device=prompt.device)
    L = int(ends.max())
    ar = torch.arange(L, device=prompt.device)
    src = (ar + P - lengths[:, None]).clamp(max=P - 1)                    # row r's token j sits at P - len_r + j
    x = torch.where(ar < lengths[:, None], prompt.gather(1, src), torch.where(ar < ends[:, None], mask_id, fill))
    first = int(lengths.min()) // G * G                                  # the grid block of the shortest prompt's end
    blocks = [(s, min(s + G, L)) for s in range(first, L, G)]            # Fast-dLLM v2: [L - 1, L) the extra token
    return x, lengths, lengths + gen_length if family == "llada2" else ends, blocks


def grid_output(x, lengths, ends, shortest: int, P: int, fill: int, eos=None):
    """The canvas -> generate()'s layout (B, P + L - shortest): row r is its prompt right-aligned at P, then its
    answer up to its end on the canvas (ends (B,)), then `fill`. eos (Fast-dLLM v2's batch_sample, LLaDA2's
    generate): a row whose answer ended has `fill` after its end token. shortest: the shortest prompt's length, read
    once before the loop (each step's streamed canvas reads nothing)."""
    B, L = x.shape
    width = P + L - shortest
    j = torch.arange(width, device=x.device) - (P - lengths[:, None])    # (B, width): canvas position of each slot
    out = torch.where((j >= 0) & (j < ends[:, None]), x.gather(1, j.clamp(0, L - 1)), fill)
    if eos is not None:
        end = torch.isin(out, eos) & (torch.arange(width, device=x.device) >= P)
        out = out.masked_fill(end.long().cumsum(-1) - end.long() > 0, fill)   # after the first end token
    return out


def block_causal(L: int, G: int, device) -> torch.Tensor:
    """(1, 1, L, L) bool: position q attends to k iff k // G <= q // G (the grid anchored at position 0)."""
    block = torch.arange(L, device=device) // G
    return (block[None, :] <= block[:, None])[None, None]


# ---------------------------------------------------------------------------------------- sampling
def top_p_sample(logits, temperature: float, top_p, generator, mask_id: int):
    """Fast-dLLM v2's sample_with_top_p -> (tokens (B, n), their probabilities): at temperature 0 the arg-max of the
    softmax (never the mask id), else a draw from the nucleus (the smallest set above top_p, renormalised), one
    torch.multinomial per row over its n positions: row by row, a row draws the numbers the official draws for its
    one row (whose batch_sample fails at temperature > 0 for a batch)."""
    probs = logits.float().softmax(-1)
    if temperature == 0:
        x0 = argmax_except(probs, mask_id)
        return x0, probs.gather(-1, x0[..., None]).squeeze(-1)
    probs = (logits.float() / temperature).softmax(-1)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = F.pad((sorted_p.cumsum(-1) > top_p)[..., :-1], (1, 0), value=False)
        probs = probs.masked_fill(drop.scatter(-1, order, drop), 0)
        probs = probs / probs.sum(-1, keepdim=True)
    x0 = torch.stack([torch.multinomial(row, 1, generator=generator).squeeze(-1) for row in probs])
    return x0, probs.gather(-1, x0[..., None]).squeeze(-1)


def sdar_sample(logits, temperature: float, top_k, top_p, generator, mask_id: int):
    """SDAR's sample_with_temperature_topk_topp -> (tokens (B, n), probabilities): one draw for every position of the
    block from softmax(logits / T) after top-k and top-p (the official draws over the flattened (B * n, V) block, so
    a seeded run draws the same numbers). Temperature 0 (the official divides by it): the arg-max, and its
    probability under the model's own softmax as the confidence."""
    if temperature == 0:
        probs = logits.float().softmax(-1)
        x0 = argmax_except(probs, mask_id)
        return x0, probs.gather(-1, x0[..., None]).squeeze(-1)
    scaled = logits.float() / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k)[0][..., -1:], NEG_INF)
    if top_p is not None and top_p < 1:
        sorted_l, order = scaled.sort(-1, descending=True)
        drop = F.pad((sorted_l.softmax(-1).cumsum(-1) > top_p)[..., :-1], (1, 0), value=False)
        scaled = scaled.masked_fill(drop.scatter(-1, order, drop), NEG_INF)
    probs = scaled.softmax(-1)
    x0 = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])
    return x0, probs.gather(-1, x0[..., None]).squeeze(-1)


# ---------------------------------------------------------------------------------------- step rules
class BlockStep(StepRule):
    """What both step rules share: a block's first call (s > 0) stores the block before it (`storing`: cache.py's
    BlockPrefix.store feeds it); the others denoise."""

    def storing(self, at) -> bool:
        return at.i == 0 and at.s > 0


class FastDLLMv2(BlockStep):
    """Fast-dLLM v2's batch_sample (v2/generation_functions.py): the block in sub-blocks of `sub_block` tokens, left to
    right; a step proposes the masks of the first sub-block that still has one (in any row: the batch moves together,
    a row with none there waits, and the call is not counted as its), sampled by sample_with_top_p. The store call's
    token is the arg-max, as official: the stored block's last row predicts the block's first position (the AR token
    shift)."""

    def __init__(self, *, sub_block: int, temperature: float = 0.0, top_p=None, generator=None, mask_id: int):
        self.sub_block, self.temperature, self.top_p = sub_block, temperature, top_p
        self.generator, self.mask_id = generator, mask_id

    def propose(self, logits, at) -> Proposal:
        N = at.masked.shape[1]
        if self.storing(at):                      # the block's first token, from the stored block's last row
            open_ = at.masked & (torch.arange(N, device=at.masked.device) == 0)
            x0, conf = top_p_sample(logits, 0.0, None, None, self.mask_id)           # the arg-max, as official
            x0, conf = widen(x0, conf, at.cols, open_)
        else:
            first = at.masked_cols[0] // self.sub_block * self.sub_block      # the sub-block [first, first + sb)
            sub = torch.arange(first, min(first + self.sub_block, N), device=at.masked.device)
            open_ = torch.zeros_like(at.masked).index_copy_(1, sub, at.masked[:, sub])
            # The official samples every position of the sub-block, masked or not (the same random numbers a step
            # draws, whatever the tokens): a position without logits here is drawn from another's, then not opened.
            rows = torch.searchsorted(at.cols, sub).clamp(max=max(len(at.masked_cols) - 1, 0))
            x0, conf = top_p_sample(logits[:, rows], self.temperature, self.top_p, self.generator, self.mask_id)
            x0, conf = widen(x0, conf, sub, open_)
            # A row with no mask in the sub-block waits for the others: alone it would not make this call.
            return Proposal(x0, conf, open_, open_.sum(-1), logits, busy=open_.any(-1))
        return Proposal(x0, conf, open_, open_.sum(-1), logits)


class SDAR(BlockStep):
    """SDAR's block_diffusion_generate (JetAstra/SDAR generate.py): every position of the block sampled at each step;
    a step's count k is get_num_transfer_tokens(block, steps), an even split of the block over its steps (the
    selection takes at least k, never more masks than are left: the official can pick a prompt position there)."""

    def __init__(self, *, steps_per_block: int, block_length: int, temperature: float = 0.0, top_k=None, top_p=None,
                 generator=None, mask_id: int):
        self.steps_per_block, self.temperature, self.top_k, self.top_p = steps_per_block, temperature, top_k, top_p
        self.generator, self.mask_id = generator, mask_id
        base, rem = divmod(block_length, steps_per_block)
        self.counts = [base + (i < rem) for i in range(steps_per_block)]

    def start_block(self, x, s: int, e: int):
        self.step = 0                           # denoising steps so far in this block (the store call is none)

    def propose(self, logits, at) -> Proposal:
        if self.storing(at):                      # SDAR has no shift: storing the last block predicts nothing here
            nothing = torch.zeros_like(at.masked)
            return Proposal(torch.zeros_like(at.masked, dtype=torch.long), torch.full_like(at.masked, NEG_INF,
                            dtype=torch.float32), nothing, nothing.sum(-1), logits)
        # The official samples every position of the block, masked or not (the random numbers a step draws): a
        # position without logits here (not masked) is drawn from another's, then not opened.
        block = torch.arange(at.masked.shape[1], device=at.masked.device)
        rows = torch.searchsorted(at.cols, block).clamp(max=max(len(at.masked_cols) - 1, 0))
        x0, conf = sdar_sample(logits[:, rows], self.temperature, self.top_k, self.top_p, self.generator, self.mask_id)
        count = self.counts[min(self.step, len(self.counts) - 1)]
        k = torch.full((at.masked.shape[0],), count, device=at.masked.device)
        self.step += 1          # k_host: the official top-k (its tie order) is called with this count
        return Proposal(x0, conf.masked_fill(~at.masked, NEG_INF), at.masked, k, logits, k_host=count)


# ---------------------------------------------------------------------------------------- selection
class DynamicThreshold:
    """SDAR's low_confidence_dynamic: every mask above the threshold (strict) if they are at least the step's count
    k, else the k most confident."""
    parallel = True

    def __init__(self, tau: float):
        self.tau = tau

    def __call__(self, p: Proposal, at):
        high = p.open & (p.conf > self.tau)
        return torch.where((high.sum(-1) >= p.k)[:, None], high, Schedule(topk=True)(p, at))


class FirstMasks:
    """SDAR's sequential: the step's count k of masks, left to right."""
    parallel = False

    def __call__(self, p: Proposal, at):
        return p.open & (p.open.long().cumsum(-1) <= p.k[:, None])


# ---------------------------------------------------------------------------------------- the family's set-up
def block_defaults(cfg, st, given) -> dict:
    """The family's own defaults: its trained block (Fast-dLLM v2's bd_size; SDAR's 4), SDAR's steps per block (one
    token a step) and remasking, LLaDA2's 32 steps, Fast-dLLM v2's sub-block of 8."""
    block = (cfg.block or SDAR_BLOCK) if given.get("block_length") is None else st.block_length
    steps = block if cfg.family == "sdar" else LLADA2_STEPS if cfg.family == "llada2" else st.gen_length
    return dict(block_length=block, steps=steps if st.steps is None else st.steps,
                sub_block=min(V2_SUB_BLOCK, block) if cfg.family == "fastdllm_v2" and st.sub_block is None else
                st.sub_block,
                remasking=st.remasking or (("low_confidence_dynamic" if st.threshold is not None else
                                            "low_confidence_static") if cfg.family == "sdar" else None))


def block_canvas(prompt, attention_mask, st, cfg, eos) -> Canvas:
    """Each row on one grid from position 0, its answer right after its prompt (grid_canvas); generate()'s ids in
    the usual layout (grid_output), the answers cut at their end as the official's end (LLaDA2's always, Fast-dLLM v2's
    when it stops at end tokens)."""
    # What an ended answer is filled with, and a row's canvas past its own end:
    fill = cfg.pad_id if cfg.pad_id is not None else int(eos[0]) if len(eos) else cfg.mask_id
    x, lengths, ends, blocks = grid_canvas(prompt, attention_mask, st.gen_length, st.block_length, cfg.family,
                                           cfg.mask_id, fill)
    cut = cfg.family == "llada2" or st.stop_at_eos and cfg.family == "fastdllm_v2"
    view = partial(grid_output, lengths=lengths, ends=ends, shortest=int(lengths.min()), P=prompt.shape[1], fill=fill)
    L, G = x.shape[1], st.block_length
    return Canvas(x=x, blocks=blocks, prompt=torch.stack([torch.zeros_like(lengths), lengths], -1), pos=None,
                  mask=block_causal(L, G, x.device), sees=lambda b: min(L, -(-b // G) * G), ends=ends, fill=fill,
                  output=partial(view, eos=eos) if cut else view, view=view)


def block_parts(model, st, given, generator, c: Canvas, eos):
    """The call's step rule, selection rule, cache policy and stop rule for a block-diffusion model."""
    cfg = model.config
    policies = LLADA2_CACHE_POLICIES if cfg.family == "llada2" else BLOCK_CACHE_POLICIES

    def policy(rule):          # the cache mode's policy; "dual" is the sub-block cache (SDAR's sub-block: the block)
        return st.cache if isinstance(st.cache, CachePolicy) else policies[st.cache](getattr(rule, "sub_block",
                                                                                             st.block_length))
    if cfg.family == "llada2":
        rule, select = llada2_parts(cfg, st, generator, sdar_sample, DynamicThreshold)
        return Parts(rule, select, policy(rule), stop_rule(st, c, eos, cfg.mask_id, kind=rule.end_of_text))
    if cfg.family == "fastdllm_v2":
        rule = FastDLLMv2(sub_block=st.sub_block, temperature=st.temperature,
                          top_p=st.top_p, generator=generator, mask_id=cfg.mask_id)
        select = Threshold(1.0 if st.threshold is None else st.threshold, strict=True)
    else:
        rule = SDAR(steps_per_block=st.steps, block_length=st.block_length, temperature=st.temperature,
                    top_k=st.top_k, top_p=st.top_p, generator=generator, mask_id=cfg.mask_id)
        select = (DynamicThreshold(st.threshold) if st.remasking == "low_confidence_dynamic" else
                  FirstMasks() if st.remasking == "sequential" else Schedule(topk=True))
    return Parts(rule, st.select or select, policy(rule), stop_rule(st, c, eos, cfg.mask_id))


def check_block(cfg, st, given: dict, longest: int, name=lambda key: key):
    """What a block-diffusion call refuses, in one line naming the setting (as its caller words it: name) and the
    fix; longest: the longest prompt."""
    def bad(msg):
        for key in ("block_length", "sub_block", "threshold", "steps", "top_k", "remasking", "alg_temp", "cache",
                    "gen_length", "editing_threshold", "max_post_steps", "num_to_transfer", "minimal_topk"):
            msg = re.sub(rf"\b{key}\b(?= |$)", name(key), msg)      # the setting's own word, not within another
        raise ValueError(msg)
    G, trained = st.block_length, cfg.block
    # Fast-dLLM v2's bd_size is its training grid (the official mask is built on it: a larger block would see only
    # part of itself). SDAR decodes with any block (its releases name none; block_size, where given, is the default).
    if cfg.family == "fastdllm_v2" and trained % G:
        bad(f"block_length {G}: this checkpoint was trained with blocks of {trained} (config.json bd_size); use "
            f"{trained} or a divisor of it")
    if grid_length(cfg.family, longest, st.gen_length, G) > cfg.max_seq_len:
        bad(f"prompt ({longest} tokens) + gen_length ({st.gen_length}), to the grid block's edge, exceeds the model's "
            f"{cfg.max_seq_len} positions: shorten the prompt or lower gen_length")
    if st.threshold is not None and not 0 < st.threshold <= 1:
        bad(f"threshold {st.threshold} is outside (0, 1]: a block-diffusion step commits the masks whose probability "
            f"is above it (and always the most likely one); 0.9 is Fast-dLLM v2's, 1 is one token per step")
    if st.cache not in ("none", "prefix", "dual") and isinstance(st.cache, str):
        bad(f"cache {st.cache!r} does not apply to a block-diffusion model: its prefix cache is exact; use 'prefix', "
            f"'dual' (Fast-dLLM v2's sub-block cache) or 'none'")
    if cfg.family == "llada2":
        check_llada2(st, given, bad)
    elif cfg.family == "fastdllm_v2":
        if st.sub_block < 1 or G % st.sub_block:
            bad(f"sub_block {st.sub_block} does not divide block_length {G}: pick a divisor, e.g. "
                f"{min(V2_SUB_BLOCK, G)}")
        for key in ("steps", "top_k", "remasking", "alg_temp"):
            if given.get(key) is not None:
                bad(f"{key} does not apply to Fast-dLLM v2: it decodes each sub-block until no mask is left, by its "
                    f"threshold; drop {key}")
    else:
        if given.get("sub_block") is not None:
            bad("sub_block is Fast-dLLM v2's: SDAR denoises the whole block at each step; drop sub_block")
        if st.remasking not in SDAR_REMASKING:
            bad(f"remasking {st.remasking!r} is not one of SDAR's: use {', '.join(SDAR_REMASKING)}")
        if st.remasking == "low_confidence_dynamic" and st.threshold is None:
            bad("SDAR's low_confidence_dynamic needs a threshold (0.85 is SDAR's): pass threshold, or "
                "remasking='low_confidence_static'")
        if st.steps < 1:
            bad(f"steps {st.steps}: SDAR's steps are per block (its denoising_steps): use at least 1")


BLOCK = Family(defaults=block_defaults, check=check_block, canvas=block_canvas, parts=block_parts)
