"""
sampler.py: the decoding policies, logits -> which masked tokens to commit this step, and when an answer has
ended. Randomness only through an explicit torch.Generator.

Shapes: logits (B, n, V) at the n open columns `cols` of the current block of N positions; boolean candidate
masks `cand` (B, N); confidences (B, N) hold -inf at non-candidates so they can never be chosen.

- LLaDA (ML-GSAI/LLaDA, Fast-dLLM `v1/llada/generate.py`): Gumbel-max sampling in float64, confidence =
  the un-tempered probability of the chosen token (`low_confidence`) or uniform noise (`random`), and a
  per-step token budget from `num_transfer_tokens` (spec/llada.md section 3).
- Dream (`diffusion_generate`): top-p/top-k/temperature sampling, confidence = max prob (`maskgit_plus`),
  top1-top2 margin (`topk_margin`) or negative entropy (`entropy`), a linear schedule in float32
  (`dream_num_transfer`), or MaskGIT-style random unmasking (`origin`) (spec/dream.md section 5).
- Fast-dLLM's parallel decoding (paper section 3.3): `select_threshold` (Theorem 1: unmask every token
  whose confidence clears tau, and always the most confident) and `select_factor`.
- FlashDLM's guided diffusion (arXiv 2505.21467; spec/flashdlm.md 2): `accept_drafts`, the guide's verdict on the
  diffusion model's drafts (five rules), and `guided_commit`, what a step then commits: the assisted variant's
  accepted drafts, or the speculative variant's accepted drafts and the guide's own token (`guide_token`).
- The parts generate() calls, each decided once per call: selection rules (`Schedule`, `Threshold`,
  `Factor`: which proposals a step commits), step rules (`LLaDAStep`, `DreamStep` and its FreeCache and
  whole-canvas clocks, `GuidedStep`: one family's propose-and-select with its state), and stop rules
  (`StopAtBlockEnd`, `StopAtFrontier`: the end of text).
"""
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------- LLaDA
def add_gumbel_noise(logits, temperature: float, generator=None):
    """Scores whose argmax is a sample from softmax(l/T): the official argmax(exp(l) / (-log u)^T), taken in
    log space as argmax(l - T log(-log u)) (== argmax(l/T + Gumbel)). The same choice wherever the official
    formula is finite; at large T (from a few tens up, over a 126k vocabulary) that one overflows float64 and
    then picks the lowest id, while this still samples (near-uniformly, as softmax(l/T) does). In float64 on
    purpose: low-precision Gumbel noise hurts generation quality (arXiv 2409.02908). T == 0 draws nothing."""
    if temperature == 0:
        return logits
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    return logits.double() - temperature * torch.log(-torch.log(u))


def num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """How many tokens each step of a block unmasks: (B,) masked counts -> (B, steps). LLaDA's schedule is
    linear in t, so the count is even; the remainder goes to the earliest steps (8 masks, 3 steps -> 3,3,2)."""
    base, rem = mask_count[:, None] // steps, mask_count[:, None] % steps
    return base + (torch.arange(steps, device=mask_count.device) < rem).long()


def argmax_except(scores, banned: int):
    """argmax over the last axis, never returning the id `banned` (the mask token: a proposal that is the
    mask itself would leave its position masked, and a loop that waits for the block to fill would never
    end). The plain argmax everywhere else (the same tie-breaking as the official code), the runner-up only
    where the mask wins."""
    x = scores.argmax(-1)
    hit = x == banned
    if hit.any():
        x = torch.where(hit, scores.topk(2, dim=-1).indices[..., 1], x)
    return x


def llada_predict(logits, temperature: float, remasking: str, generator=None, rand_span=None, mask_id=None):
    """-> (x0, conf): the proposed token and its confidence at every position, float64.
    rand_span=(offset, cols, width): `random` remasking draws its uniforms over the whole fed chunk (width), as
    the official code does, so a seeded run draws the same numbers; we keep the given columns of it.
    mask_id: never proposed (see argmax_except)."""
    noised = add_gumbel_noise(logits, temperature, generator)
    x0 = noised.argmax(-1) if mask_id is None else argmax_except(noised, mask_id)
    if remasking == "low_confidence":
        # The *un-tempered, noise-free* probability of the chosen token, even when sampling.
        p = F.softmax(logits.double(), dim=-1)
        conf = p.gather(-1, x0[..., None]).squeeze(-1)
    elif remasking == "random":
        B, N = x0.shape
        offset, cols, width = rand_span or (0, torch.arange(N, device=x0.device), N)
        conf = torch.rand((B, width), dtype=torch.float64, device=x0.device, generator=generator)[:, offset + cols]
    else:
        raise ValueError(f"unknown LLaDA remasking {remasking!r}: use 'low_confidence' or 'random'")
    return x0, conf


# ---------------------------------------------------------------------------------------- Dream
def dream_sample(logits, temperature: float = 0.0, top_p=None, top_k=None, generator=None, mask_id=None):
    """Dream's `sample_tokens`: -> (conf, x0, probs). conf is the max prob, or at T > 0 the prob of the
    drawn token. Computed in float32 whatever the model dtype. mask_id is never proposed (argmax_except);
    probs, and so the entropy and margin scores, keep it, as the official code does."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        # nucleus: drop tokens once the cumulative prob exceeds top_p, always keeping the first
        sorted_logits, order = logits.sort(-1, descending=True)
        drop = sorted_logits.softmax(-1).cumsum(-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    probs = logits.softmax(-1)
    if temperature > 0:
        # what torch.distributions.Categorical(probs).sample() does, with our generator
        flat = probs.reshape(-1, probs.shape[-1])
        if mask_id is not None:
            flat = flat.clone()
            flat[:, mask_id] = 0
        x0 = torch.multinomial(flat / flat.sum(-1, keepdim=True), 1, True, generator=generator).view(probs.shape[:-1])
    else:
        x0 = probs.argmax(-1) if mask_id is None else argmax_except(probs, mask_id)
    conf = probs.gather(-1, x0[..., None]).squeeze(-1)
    return conf, x0, probs


def dream_confidence(alg: str, conf, probs, cols=None):
    """Rank score for Dream's confidence algorithms (higher = decode sooner). cols: each candidate's column
    in its block, for FlashDLM's `position_weighted` (max prob x (1 - col / the row's last masked col), so
    left positions go first). FlashDLM's own version crashes on its 2-D positions; this is what it meant."""
    if alg == "maskgit_plus":
        return conf
    if alg == "position_weighted":
        rows, col = cols
        last = torch.zeros(int(rows.max()) + 1 if rows.numel() else 1, device=conf.device).scatter_reduce_(
            0, rows, col.float(), "amax", include_self=False)                   # each row's last masked column
        return conf * (1 - col.float() / last[rows].clamp(min=1))
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1)[0]
        return top2[..., 0] - top2[..., 1]
    if alg == "entropy":
        return (probs * torch.log(probs + 1e-10)).sum(-1)       # negative entropy
    raise ValueError(f"unknown Dream remasking {alg!r}: use 'origin', 'maskgit_plus', 'topk_margin' or 'entropy'")


def dream_num_transfer(num_mask: torch.Tensor, t: torch.Tensor, s: torch.Tensor, last: bool, total=None):
    """(B,) tokens to unmask going from time t to s: the expected share (1 - s/t) of the masks left,
    everything at the last step. Kept in float32 tensors on purpose: the official floors come from float32
    rounding (64 masks, 64 steps: step 0 decodes 0 tokens since 64 * (1 - s/t) = 0.999...).
    total: the masks the share is taken of, when more than the block's (FlashDLM counts every later block)."""
    if last:
        return num_mask.long()
    total = num_mask if total is None else total
    return (total.float() * (1 - s / t)).long()


def dream_origin(logits, cand, p, temperature=0.0, top_p=None, top_k=None, generator=None, mask_id=None):
    """Dream's `origin` (MaskGIT-style) rule: each masked position is decoded with probability p = 1 - s/t,
    independently; one uniform per masked position, row-major over the batch. -> (x0, transfer)."""
    rows, cols = cand.nonzero(as_tuple=True)
    take = torch.rand(rows.numel(), device=cand.device, generator=generator) < p
    transfer = torch.zeros_like(cand)
    transfer[rows[take], cols[take]] = True
    x0 = torch.zeros(cand.shape, dtype=torch.long, device=cand.device)
    x0[transfer] = dream_sample(logits[rows[take], cols[take]], temperature, top_p, top_k, generator, mask_id)[1]
    return x0, transfer


# ---------------------------------------------------------------------------------------- selection
def select_topk(conf, cand, k: torch.Tensor):
    """The k[b] most confident candidates of each row b. Vectorised: rank every position by confidence."""
    order = conf.argsort(-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order))
    return cand & (rank < k[:, None])


def select_sampled(conf, cand, k: int, alg_temp: float, generator=None, pad=(0, 0)):
    """Dream's `alg_temp` > 0: draw k positions without replacement from softmax(conf / alg_temp).
    pad=(left, right): the official code draws over a wider tensor (Dream's sampler: the whole canvas;
    Fast-dLLM's prefix mode: the fed chunk), the extra columns at -inf. Drawing over the same width makes
    the same generator state pick the same positions."""
    if k == 0:
        return torch.zeros_like(cand)
    scores = F.pad(conf / alg_temp, pad, value=NEG_INF).softmax(-1)
    picked = torch.zeros(scores.shape, dtype=torch.bool, device=cand.device)
    picked.scatter_(-1, torch.multinomial(scores, k, generator=generator), True)
    return cand & picked[:, pad[0]:pad[0] + cand.shape[-1]]


def select_threshold(conf, cand, threshold: float):
    """Fast-dLLM threshold decoding (Theorem 1): every candidate with confidence >= tau, plus always the
    single most confident one, so each step unmasks at least one token and decoding terminates.
    A tau above 1 can never be reached, which makes it plain one-token-per-step decoding."""
    best = torch.zeros_like(cand).scatter_(-1, conf.argmax(-1, keepdim=True), True)
    return cand & ((conf >= threshold) | best)


def select_quota_threshold(conf, cand, offer: torch.Tensor, threshold: float):
    """Fast-dLLM's Dream `confidence_threshold` without blocks (spec/dream.md 7.2): offer the offer[b] most
    confident candidates; the first is always taken, the others only if confidence >= tau. -> (transfer,
    rejected count (B,)): what was offered and refused is offered again at the next step (the carry)."""
    offered = select_topk(conf, cand, offer)
    transfer = offered & select_threshold(conf, cand, threshold)
    return transfer, (offered & ~transfer).sum(-1)


def select_factor(conf, cand, factor: float):
    """Fast-dLLM factor decoding: sort the N candidates by confidence c(1) >= ... >= c(N) and take the top
    n-1, where n is the first rank with c(n) < 1 - f/(n+1), i.e. (n+1)(1-c(n)) >= f (paper section 3.3);
    rank 1 always passes, and all N if none fails. Official quirk kept for parity: a first failure at the
    very last candidate still takes all N."""
    N = cand.sum(-1, keepdim=True)                                         # (B, 1)
    sorted_conf, order = conf.sort(-1, descending=True)
    n = torch.arange(1, conf.shape[-1] + 1, device=conf.device)             # 1-based rank
    bar = (1 - factor / (n + 1)).to(torch.float64)
    bar[0] = -1.0
    fail = (sorted_conf.double() < bar) & (n <= N)
    first = torch.where(fail.any(-1, keepdim=True), fail.long().argmax(-1, keepdim=True), N)  # 0-based index
    count = torch.where(first == N - 1, N, first)
    rank = torch.empty_like(order).scatter_(-1, order, (n - 1).expand_as(order))
    return cand & (rank < count)


# ---------------------------------------------------------------------------------------- guided diffusion
ACCEPT_RULES = ("deterministic", "topk", "topk_relative", "dynamic_threshold", "aggressive")


def accept_drafts(logits, drafts, rule: str = "deterministic", k: int = 5, ratio: float = 0.95,
                  threshold: float = 0.1):
    """
    FlashDLM's verification (arXiv 2505.21467; spec/flashdlm.md 2): does the causal guide agree with each draft?
    logits (..., V): the guide's next-token logits at each draft's position; drafts (...) -> bool (...).
    - deterministic: the draft is the guide's argmax (the token greedy decoding with the guide would write).
    - topk: the draft is among the guide's k most likely tokens (the official default k = 5).
    - topk_relative: among the top k *and* p(draft) >= ratio * p(top-1), so a flat top-k does not let an
      unlikely token through (their evaluator: k = 5, ratio = 0.95).
    - dynamic_threshold: p(draft) > threshold (the official `confidence_threshold`, default 0.1).
    - aggressive: in the guide's top 5, or p(draft) > 0.05, or inside its top-p 0.95 set (ids sorted by p,
      kept while their cumulative probability is <= 0.95); the official constants.
    Decided on float32 probabilities, as the official code decides (softmax, then argmax / topk / sort), so
    that ties and underflow to 0 fall the same way. The loop commits the accepted *run* from the first draft;
    this function only gives the verdicts.
    """
    if rule not in ACCEPT_RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}: use one of {', '.join(ACCEPT_RULES)}")
    p = logits.float().softmax(-1)                                            # (..., V)
    p_draft = p.gather(-1, drafts[..., None]).squeeze(-1)                     # (...)
    if rule == "deterministic":
        return p.argmax(-1) == drafts
    if rule == "dynamic_threshold":
        return p_draft > threshold
    if rule == "aggressive":
        top5 = (p.topk(min(5, p.shape[-1]), dim=-1).indices == drafts[..., None]).any(-1)
        sorted_p, order = p.sort(-1, descending=True)
        nucleus = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, sorted_p.cumsum(-1) <= 0.95)
        return top5 | (p_draft > 0.05) | nucleus.gather(-1, drafts[..., None]).squeeze(-1)
    if not k >= 1:
        raise ValueError(f"acceptance top-k must be >= 1 (got {k})")
    top_p, top_ids = p.topk(min(k, p.shape[-1]), dim=-1)                      # (..., k)
    ok = (top_ids == drafts[..., None]).any(-1)
    if rule == "topk_relative":
        ok &= p_draft >= ratio * top_p[..., 0]
    return ok


# ---------------------------------------------------------------------------------------- guided commit
def guide_token(logits, mask_id: int):
    """The guide's own choice where it rejected a draft: the argmax of its float32 probabilities (the token the
    official code writes for deterministic, topk and topk_relative; for dynamic_threshold and aggressive it
    samples one instead, which we do not replay). Never the diffusion model's mask id (the tiny test guide
    has that row; a committed mask would leave its position open)."""
    return argmax_except(logits.float().softmax(-1), mask_id)


def guided_commit(drafts, cand, n, fix, speculative: bool, eos):
    """
    What a guided step commits, per row. drafts (B, N): the diffusion model's argmax at the open columns cand
    (B, N), which run to the block's end (guided commits go left to right); n (B,): the accepted run from the
    first draft (Guide.verify); fix (B,): the guide's own token at the first rejected draft (guide_token).
    - assisted (FlashDLM's default): the accepted run, and at least the first draft (the diffusion model's
      own token), so the output is the diffusion model's text wherever the guide agrees.
    - speculative (speculative decoding with the diffusion model as the drafter): the accepted run, then the
      guide's token in place of the rejected draft. Every committed token is one the rule lets the guide
      write; with `deterministic` the answer is the guide's own greedy text.
    Cut after the first end token (eos ids). -> (x0 (B, N), transfer (B, N), ended (B,)).
    """
    N = cand.shape[1]
    col = torch.arange(N, device=cand.device)
    rank = col - (N - cand.sum(-1, keepdim=True))           # 0 at each row's first open column
    if speculative:
        x0 = torch.where(rank == n[:, None], fix[:, None], drafts)
        take = cand & (rank <= n[:, None])
    else:
        x0, take = drafts, cand & (rank < n.clamp(min=1)[:, None])
    end = take & torch.isin(x0, eos)
    cut = torch.where(end, col, N).min(-1, keepdim=True).values
    return x0, take & (col <= cut), end.any(-1)


# ---------------------------------------------------------------------------------------- selection rules
# A selection rule answers "which of the proposed tokens does this step commit?": rule(proposal, cand, k) ->
# (B, N) bool, k (B,) being the schedule's count for this step. A rule that decides the count itself
# (`parallel`, the default for a rule without the attribute: Fast-dLLM 3.3) takes as many steps per block as
# it needs. A fork's rule is one more small class like these, passed as generate(select=...).
class Proposal(NamedTuple):
    """One step's proposals over the block's N positions."""
    x0: torch.Tensor       # (B, N) the proposed token at every position (0 where nothing is open)
    conf: torch.Tensor     # (B, N) its confidence (the family's), -inf at positions that are not candidates
    logits: torch.Tensor   # (B, len(cols), V) the model's logits at the open columns
    cols: torch.Tensor     # the block columns the logits belong to


class Schedule:
    """The k[b] most confident candidates: LLaDA's and Dream's fixed step schedules."""
    parallel = False

    def __call__(self, p: Proposal, cand, k):
        return select_topk(p.conf, cand, k)


class Threshold:
    """Fast-dLLM threshold decoding (Theorem 1): confidence >= tau, always at least the most confident."""
    parallel = True

    def __init__(self, tau: float):
        self.tau = tau

    def __call__(self, p: Proposal, cand, k):
        return select_threshold(p.conf, cand, self.tau)


class Factor:
    """Fast-dLLM factor decoding: the top n-1 by confidence, n the first rank with (n+1)(1-c(n)) >= f."""
    parallel = True

    def __init__(self, f: float):
        self.f = f

    def __call__(self, p: Proposal, cand, k):
        return select_factor(p.conf, cand, self.f)


def selection_rule(threshold=None, factor=None, select=None):
    """The call's rule, decided once: a custom one, threshold, factor, or the fixed schedule."""
    return select or (Threshold(threshold) if threshold is not None else Factor(factor) if factor is not None
                      else Schedule())


# ---------------------------------------------------------------------------------------- step rules
# A step rule is one family's propose-and-select with its own state (the schedule, Dream's clock, the guide):
# start_block(cand, block) at a block's start; more(cand, step): does the block need another step;
# select(logits, cols, at, span) -> (x0, transfer), both (B, N), for the step `at` (cache.Step) that fed span.
def block_open(cand, step: int, limit: int) -> bool:
    """A block is decoded until no mask is left. Every step commits at least one token, so a block of N
    positions never needs more than max(steps per block, N) steps: more would be a bug, not slowness."""
    if step > limit:
        raise RuntimeError("decoding made no progress: every step commits at least one token, so this is a bug")
    return bool(cand.any())


class LLaDAStep:
    """LLaDA (Fast-dLLM v1/llada/generate.py): Gumbel-max proposals at the open columns, confidence = the
    chosen token's probability (or uniform noise for `random`); the schedule spreads each block's masks evenly
    over its steps_per_block steps (num_transfer_tokens)."""

    def __init__(self, rule, steps_per_block: int, temperature: float, remasking: str, generator, mask_id: int):
        self.rule, self.spb, self.temperature, self.remasking = rule, steps_per_block, temperature, remasking
        self.generator, self.mask_id = generator, mask_id

    def start_block(self, cand, block: int):
        self.budget = num_transfer_tokens(cand.sum(-1), self.spb)     # (B, spb)

    def more(self, cand, step: int) -> bool:
        return block_open(cand, step, max(self.spb, cand.shape[1]))

    def select(self, logits, cols, at, span):
        a, b = span           # `random` draws its uniforms over the whole fed chunk, as the official code
        x0, conf = llada_predict(logits, self.temperature, self.remasking, self.generator, (at.s - a, cols, b - a),
                                 self.mask_id)
        N = at.cand.shape[1]
        x0, conf = widen(x0, cols, N, 0), widen(conf, cols, N, NEG_INF).masked_fill(~at.cand, NEG_INF)
        k = self.budget[:, min(at.step, self.spb - 1)]   # parallel steps past the schedule never read it
        return x0, self.rule(Proposal(x0, conf, logits, cols), at.cand, k)


class DreamClock(NamedTuple):
    """Where a Dream step stands on its schedule (spec/dream.md 5 and 7, spec/flashdlm.md 1)."""
    t: torch.Tensor           # the step goes from time t to t_next on Dream's float32 grid
    t_next: torch.Tensor
    last: bool                # the block's (or canvas's) last scheduled step takes every mask left
    later: int                # masks of later blocks counted into the schedule (FreeCache)
    pad: tuple                # alg_temp draws over the official width (fed chunk, canvas or block)


class DreamStep:
    """Dream, Fast-dLLM's block sampler (spec/dream.md 7.3): Dream's sampler proposes (top-p/top-k/temperature,
    float32), the block's first token is decoded at the block's first (refresh) step whatever its confidence,
    then tokens are ranked by `alg` (entropy) and counted by Dream's schedule over the block's steps, or chosen
    by a parallel rule on the max probability. The clock is the one thing the subclasses change."""
    refresh_token = True

    def __init__(self, rule, steps: int, n_blocks: int, block_length: int, temperature, remasking, top_p, top_k,
                 alg_temp, eps, generator, mask_id: int, device):
        self.rule, self.steps, self.spb = rule, steps, steps // n_blocks
        self.n_blocks, self.block_length = n_blocks, block_length
        self.remasking, self.alg_temp, self.generator = remasking, alg_temp, generator
        self.opts = dict(temperature=temperature, top_p=top_p, top_k=top_k, generator=generator, mask_id=mask_id)
        self.sample = partial(dream_sample, **self.opts)
        self.parallel = getattr(rule, "parallel", True)   # a rule that decides its own count
        self.origin = remasking == "origin" and not self.parallel
        self.timesteps = torch.linspace(1, eps, self.grid_steps() + 1, device=device)

    def grid_steps(self) -> int:
        return self.spb                         # the time grid runs over one block's steps

    def clock(self, at, span) -> DreamClock:
        i = min(at.step, self.spb - 1)          # parallel steps past the schedule never read the clock
        return DreamClock(self.timesteps[i], self.timesteps[i + 1], at.step == self.spb - 1, 0, (0, span[1] - at.e))

    def start_block(self, cand, block: int):
        self.block = block

    def more(self, cand, step: int) -> bool:
        return block_open(cand, step, max(self.spb, cand.shape[1]))

    def select(self, logits, cols, at, span):
        cand, N = at.cand, at.cand.shape[1]
        if self.refresh_token and at.step == 0:   # the shifted logits of later, cached chunks never serve it
            x0 = widen(self.sample(logits[:, :1])[1], cols[:1], N, 0)
            return x0, cand & (torch.arange(N, device=cand.device) == 0)
        c = self.clock(at, span)
        if self.origin:                         # MaskGIT-style: each mask decoded with probability 1 - s/t
            x0, transfer = dream_origin(logits, cand[:, cols], 1 if c.last else 1 - c.t_next / c.t, **self.opts)
            return widen(x0, cols, N, 0), widen(transfer, cols, N, False)
        conf, x0, probs = self.sample(logits[cand[:, cols]])
        score = dream_confidence("maskgit_plus" if self.parallel else self.remasking, conf, probs,
                                 cand.nonzero(as_tuple=True))
        x0 = torch.zeros(cand.shape, dtype=torch.long, device=cand.device).masked_scatter_(cand, x0)
        score = torch.full(cand.shape, NEG_INF, device=cand.device).masked_scatter_(cand, score)
        return x0, self.choose(Proposal(x0, score, logits, cols), cand, c)

    def choose(self, p: Proposal, cand, c: DreamClock):
        n = cand.sum(-1)
        k = dream_num_transfer(n, c.t, c.t_next, c.last, n + c.later)
        if self.alg_temp and not self.parallel:
            return select_sampled(p.conf, cand, k, self.alg_temp, self.generator, c.pad)
        return self.rule(p, cand, k)


class DreamFreeStep(DreamStep):
    """FlashDLM's FreeCache sampler for Dream (spec/flashdlm.md 1): no first-token rule; the time grid spans
    all steps and is indexed by the global step; the count is taken of the block's masks *and every later
    block's*."""
    refresh_token = False

    def grid_steps(self) -> int:
        return self.steps

    def clock(self, at, span) -> DreamClock:
        i = min(self.block * self.spb + at.step, self.steps - 1)
        later = (self.n_blocks - self.block - 1) * self.block_length
        return DreamClock(self.timesteps[i], self.timesteps[i + 1], at.step == self.spb - 1, later, (0, 0))


class DreamCanvasStep(DreamStep):
    """Dream's own `diffusion_generate` (spec/dream.md 5): one block over the whole answer, exactly `steps`
    calls on a grid over all of them; with a threshold, Fast-dLLM's variant (spec/dream.md 7.2): offer gen/steps
    tokens a step, take the first always and the others at confidence >= tau, offer the refused ones again."""
    refresh_token = False

    def __init__(self, rule, *args):
        super().__init__(rule, *args)
        self.quota = isinstance(rule, Threshold)

    def start_block(self, cand, block: int):
        self.block = block
        self.carry = torch.zeros(cand.shape[0], dtype=torch.long, device=cand.device)   # offered, refused

    def grid_steps(self) -> int:
        return self.steps

    def more(self, cand, step: int) -> bool:
        return bool(cand.any()) if self.quota else step < self.steps

    def clock(self, at, span) -> DreamClock:
        i = min(at.step, self.steps - 1)
        self.offer = (self.block_length // self.steps if at.step < self.steps else 0) + self.carry
        return DreamClock(self.timesteps[i], self.timesteps[i + 1], at.step == self.steps - 1, 0, (at.s, 0))

    def choose(self, p: Proposal, cand, c: DreamClock):
        if not self.quota:
            return super().choose(p, cand, c)
        transfer, self.carry = select_quota_threshold(p.conf, cand, self.offer, self.rule.tau)
        return transfer


# ---------------------------------------------------------------------------------------- guided step
class GuidedStep:
    """FlashDLM guided diffusion (spec/flashdlm.md 2), the whole batch: the drafts are the argmax at every open
    position; the guide verifies each row's drafts (one guide forward per verification chunk for the whole
    batch, cache.Guide); guided_commit picks what to commit. Drafts are limited to the ids the guide has
    (Dream-7B's 152064 rows vs Qwen2.5's 151936: the rows past the tokenizer are padding, never text). A
    committed end token ends its row's answer (the stop rule); a finished row leaves the guide's batch."""

    def __init__(self, verifier, accept, chunk: int, eos, mask_id: int, speculative: bool, prompt):
        self.verifier, self.accept, self.chunk, self.eos, self.mask_id = verifier, accept, chunk, eos, mask_id
        self.speculative = speculative
        self.guide_calls = verifier.prefill(prompt)

    def start_block(self, cand, block: int):
        pass

    def more(self, cand, step: int) -> bool:
        return block_open(cand, step, cand.shape[1])

    def select(self, logits, cols, at, span):
        cand, N = at.cand, at.cand.shape[1]
        drafts = widen(argmax_except(logits[..., :self.verifier.model.config.vocab_size], self.mask_id), cols, N, 0)
        drafted = torch.cat([at.x[:, :at.s], torch.where(cand, drafts, at.x[:, at.s:])], 1)   # every mask drafted
        n, rejected, calls = self.verifier.verify(drafted, self.accept, self.chunk)
        x0, transfer, ended = guided_commit(drafts, cand, n, guide_token(rejected, self.mask_id), self.speculative,
                                            self.eos)
        self.verifier.commit(transfer.sum(-1), ended | ~(cand & ~transfer).any(-1))   # finished rows leave
        self.guide_calls += calls
        return x0, transfer


# ---------------------------------------------------------------------------------------- end of text
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


class StopRule:
    """When an answer has ended: its rows' remaining masks become end tokens, without more model calls.
    step(x) after every step; block(x, e) -> True when every row has ended (the loop stops)."""

    def __init__(self, prompt_length: int, eos, mask_id: int, run: int | bool = False):
        self.P, self.eos, self.mask_id, self.run = prompt_length, eos, mask_id, run

    def fill(self, x, e: int, run):
        done = eos_reached(x, self.P, e, self.eos, self.mask_id, run)
        x[done] = x[done].masked_fill(x[done] == self.mask_id, self.eos[0])
        return done

    def step(self, x):
        pass

    def block(self, x, e: int) -> bool:
        return False


class StopAtBlockEnd(StopRule):
    """stop_at_eos=True: once a block is complete and the answer so far holds an end token."""

    def block(self, x, e: int) -> bool:
        return e < x.shape[1] and bool(self.fill(x, e, True).all())


class StopAtFrontier(StopRule):
    """stop_at_eos=k (FlashDLM's rule), and guided diffusion's committed end token (k = 1): after any step."""

    def step(self, x):
        self.fill(x, x.shape[1], self.run)


def stop_rule(stop_at_eos, prompt_length: int, eos, mask_id: int) -> StopRule:
    cls = StopAtBlockEnd if stop_at_eos is True else StopAtFrontier if stop_at_eos else StopRule
    return cls(prompt_length, eos, mask_id, stop_at_eos)


def widen(values, cols, width: int, fill):
    """(B, n) values at block columns `cols` -> (B, width), `fill` elsewhere."""
    out = torch.full((values.shape[0], width), fill, dtype=values.dtype, device=values.device)
    out[:, cols] = values
    return out
