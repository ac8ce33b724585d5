"""
sampler.py: the decoding policies, logits -> tokens: how each family proposes (step rules), which proposals a
step commits (selection rules), and when an answer has ended (stop rules). Randomness only through an explicit
torch.Generator. The KV cache and what each step feeds are cache.py's; guided diffusion is guided.py's.

Shapes: a step works on the current block of N positions at a fixed width. logits (B, n, V) at the block
columns `at.cols` (all N when compiled; the still-open ones in eager mode, see fastdllm.py), widened to a
`Proposal` of (B, N) tensors, with `open` (B, N) the positions this step may commit; confidences are -inf
elsewhere so they can never be chosen.

- LLaDA (ML-GSAI/LLaDA, Fast-dLLM `v1/llada/generate.py`): Gumbel-max sampling, confidence = the un-tempered
  probability of the chosen token (`low_confidence`) or uniform noise (`random`), and a per-step token budget
  from `num_transfer_tokens` (spec/llada.md section 3).
- Dream (`diffusion_generate`): top-p/top-k/temperature sampling, confidence = max prob (`maskgit_plus`),
  top1-top2 margin (`topk_margin`) or negative entropy (`entropy`), a linear schedule in float32
  (`dream_num_transfer`), or MaskGIT-style random unmasking (`origin`) (spec/dream.md section 5).
- Fast-dLLM's parallel decoding (paper section 3.3): `select_threshold` (Theorem 1: unmask every token
  whose confidence clears tau, and always the most confident) and `select_factor`.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


class Proposal(NamedTuple):
    """One step's proposals over the block's N positions: what a step rule hands to the selection rule."""
    x0: torch.Tensor       # (B, N) long: the proposed token at every position
    conf: torch.Tensor     # (B, N) float: its confidence (the family's), -inf where not open
    open: torch.Tensor     # (B, N) bool: the positions this step may commit (masked, and predicted by this call)
    k: torch.Tensor        # (B,) long: the family's schedule, tokens to commit now (rules with their own count ignore it)
    logits: torch.Tensor   # (B, n, V): the model's logits at the block columns at.cols


# ---------------------------------------------------------------------------------------- sampling
def add_gumbel_noise(logits, temperature: float, generator=None):
    """Scores whose argmax is a sample from softmax(l/T): the official argmax(exp(l) / (-log u)^T), taken in
    log space as argmax(l - T log(-log u)) (== argmax(l/T + Gumbel)), so it never overflows. float32, not the
    official float64: a (B, n, V) float64 tensor is ~1 GB per step at batch 16. The cost: float32 uniforms have
    24 bits, so no Gumbel draw exceeds ~16.6 (float64: ~36.7); a token whose draw would have is sampled with
    probability off by at most V * e^-16.6 (<1% at a 126k vocabulary, and only for near-flat distributions).
    T == 0 draws nothing."""
    if temperature == 0:
        return logits
    u = torch.rand(logits.shape, dtype=torch.float32, device=logits.device, generator=generator)
    return logits.float() - temperature * torch.log(-torch.log(u))


def num_transfer_tokens(mask_count: torch.Tensor, steps: int) -> torch.Tensor:
    """How many tokens each step of a block unmasks: (B,) masked counts -> (B, steps). LLaDA's schedule is
    linear in t, so the count is even; the remainder goes to the earliest steps (8 masks, 3 steps -> 3,3,2)."""
    base, rem = mask_count[:, None] // steps, mask_count[:, None] % steps
    return base + (torch.arange(steps, device=mask_count.device) < rem).long()


def argmax_except(scores, banned: int):
    """argmax over the last axis, never returning the id `banned` (the mask token: a proposal that is the mask
    itself would leave its position masked forever). The two halves around it are reduced as views (no copy,
    no host sync); the lower half wins ties, which is the plain argmax's first-index tie-breaking."""
    V = scores.shape[-1]
    if banned >= V - 1 or banned <= 0:     # one half is empty
        lo = scores[..., :banned] if banned > 0 else scores[..., 1:]
        return lo.argmax(-1) + (0 if banned > 0 else 1)
    lo, hi = scores[..., :banned].max(-1), scores[..., banned + 1:].max(-1)
    return torch.where(hi.values > lo.values, hi.indices + banned + 1, lo.indices)


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


def dream_confidence(alg: str, conf, probs, cols, open_):
    """Rank score for Dream's confidence algorithms (higher = decode sooner), at the block columns `cols`
    (n,) of the open mask open_ (B, n). FlashDLM's `position_weighted`: max prob x (1 - col / the row's last
    open col), so left positions go first (FlashDLM's own version crashes on its 2-D positions; this is what
    it meant)."""
    if alg == "maskgit_plus":
        return conf
    if alg == "position_weighted":
        last = torch.where(open_, cols, 0).amax(-1, keepdim=True).clamp(min=1)       # each row's last open col
        return conf * (1 - cols / last)
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


def widen(values, cols, width: int, fill):
    """(B, n) values at block columns `cols` -> (B, width), `fill` elsewhere."""
    return torch.full((values.shape[0], width), fill, dtype=values.dtype, device=values.device).index_copy_(
        1, cols, values)


# ---------------------------------------------------------------------------------------- selection
def select_topk(conf, open_, k: torch.Tensor):
    """The k[b] most confident open positions of each row b. Vectorised: rank every position by confidence."""
    order = conf.argsort(-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order))
    return open_ & (rank < k[:, None])


def select_threshold(conf, open_, threshold: float):
    """Fast-dLLM threshold decoding (Theorem 1): every open position with confidence >= tau, plus always the
    single most confident one, so each step unmasks at least one token and decoding terminates.
    A tau above 1 can never be reached, which makes it plain one-token-per-step decoding."""
    best = torch.zeros_like(open_).scatter_(-1, conf.argmax(-1, keepdim=True), True)
    return open_ & ((conf >= threshold) | best)


def select_factor(conf, open_, factor: float):
    """Fast-dLLM factor decoding: sort the N open positions by confidence c(1) >= ... >= c(N) and take the top
    n-1, where n is the first rank with c(n) < 1 - f/(n+1), i.e. (n+1)(1-c(n)) >= f (paper section 3.3);
    rank 1 always passes, and all N if none fails. Official quirk kept for parity: a first failure at the
    very last candidate still takes all N. The bar is compared in float64, as the official code compares."""
    N = open_.sum(-1, keepdim=True)                                         # (B, 1)
    sorted_conf, order = conf.sort(-1, descending=True)
    n = torch.arange(1, conf.shape[-1] + 1, device=conf.device)             # 1-based rank
    bar = (1 - factor / (n + 1)).to(torch.float64)
    bar[0] = -1.0
    fail = (sorted_conf.double() < bar) & (n <= N)
    first = torch.where(fail.any(-1, keepdim=True), fail.long().argmax(-1, keepdim=True), N)  # 0-based index
    count = torch.where(first == N - 1, N, first)
    rank = torch.empty_like(order).scatter_(-1, order, (n - 1).expand_as(order))
    return open_ & (rank < count)


# A selection rule answers "which of the proposed tokens does this step commit?": rule(p: Proposal, at) ->
# (B, N) bool, inside p.open (fastdllm.py checks both at every step). `parallel` (default True for a rule
# without the attribute): the rule decides the count itself (Fast-dLLM 3.3), so a block takes as many steps
# as it needs; False: it follows the family's schedule p.k. A fork's rule is one more small class like these.
class Schedule:
    """The k[b] most confident open positions: LLaDA's and Dream's fixed step schedules."""
    parallel = False

    def __call__(self, p: Proposal, at):
        return select_topk(p.conf, p.open, p.k)


class Threshold:
    """Fast-dLLM threshold decoding (Theorem 1): confidence >= tau, always at least the most confident."""
    parallel = True

    def __init__(self, tau: float):
        self.tau = tau

    def __call__(self, p: Proposal, at):
        return select_threshold(p.conf, p.open, self.tau)


class Factor:
    """Fast-dLLM factor decoding: the top n-1 by confidence, n the first rank with (n+1)(1-c(n)) >= f."""
    parallel = True

    def __init__(self, f: float):
        self.f = f

    def __call__(self, p: Proposal, at):
        return select_factor(p.conf, p.open, self.f)


class QuotaThreshold(Threshold):
    """Fast-dLLM's Dream `confidence_threshold` without blocks (spec/dream.md 7.2): offer the k[b] + carry[b]
    most confident open positions; the first is always taken, the others only if confidence >= tau; what was
    offered and refused is offered again at the next step (the carry). One instance per generate() call."""

    def __call__(self, p: Proposal, at):
        carry = getattr(self, "carry", 0) if at.n else 0
        offered = select_topk(p.conf, p.open, p.k + carry)
        take = offered & select_threshold(p.conf, p.open, self.tau)
        self.carry = (offered & ~take).sum(-1)
        return take


class SampledPositions:
    """Dream's `alg_temp` > 0: draw the schedule's k positions without replacement from softmax(conf / alg_temp).
    pad(at) -> (left, right): the official code draws over a wider tensor (Dream's sampler: the whole canvas;
    Fast-dLLM's prefix mode: the fed chunk), the extra columns at -inf; drawing over the same width makes the
    same generator state pick the same positions. Reads k on the host (one sync: a drawn count is a shape)."""
    parallel = False

    def __init__(self, alg_temp: float, generator, pad):
        self.alg_temp, self.generator, self.pad = alg_temp, generator, pad

    def __call__(self, p: Proposal, at):
        k = int(p.k.max())
        if k == 0:
            return torch.zeros_like(p.open)
        left, right = self.pad(at)
        scores = F.pad(p.conf / self.alg_temp, (left, right), value=NEG_INF).softmax(-1)
        picked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        picked.scatter_(-1, torch.multinomial(scores, k, generator=self.generator), True)
        return p.open & picked[:, left:left + p.open.shape[-1]]


class FirstToken:
    """Fast-dLLM's Dream block sampler (spec/dream.md 7.3) decodes a block's first position at the block's first
    step, whatever its confidence, then lets `rule` choose."""

    def __init__(self, rule):
        self.rule, self.parallel = rule, getattr(rule, "parallel", True)

    def __call__(self, p: Proposal, at):
        if at.i == 0:
            return p.open & (torch.arange(p.open.shape[1], device=p.open.device) == 0)
        return self.rule(p, at)


# ---------------------------------------------------------------------------------------- step rules
# A step rule is one family's way to propose, with its state (the schedule, Dream's clock):
# start_block(x, s, e) at a block's start; propose(logits, at) -> Proposal for the step `at` (fastdllm.Step:
# what this call fed); more(masks_left, at) -> does the block need another step (masks_left: does it still
# hold masks, read once per step on the host).
class StepRule:
    def start_block(self, x, s: int, e: int):
        pass

    def more(self, masks_left: bool, at) -> bool:
        """A block is decoded until no mask is left. Past its schedule (steps per block) every built-in rule commits
        at least one token a step, so a block of N positions never needs more than spb + N steps: more is a bug,
        not slowness."""
        if at.i > getattr(self, "spb", 0) + at.cand.shape[1]:
            raise RuntimeError(f"{type(self).__name__}: the block [{at.s}, {at.e}) made no progress in {at.i + 1} "
                               f"steps: a step rule or selection rule that commits nothing never ends a block")
        return masks_left


class LLaDA(StepRule):
    """LLaDA (Fast-dLLM v1/llada/generate.py): Gumbel-max proposals, confidence = the chosen token's
    probability (or uniform noise for `random`); the schedule spreads each block's masks evenly over its
    steps_per_block steps (num_transfer_tokens)."""

    def __init__(self, steps_per_block: int, temperature: float, remasking: str, generator, mask_id: int):
        self.spb, self.temperature, self.remasking = steps_per_block, temperature, remasking
        self.generator, self.mask_id = generator, mask_id

    def start_block(self, x, s: int, e: int):
        self.budget = num_transfer_tokens((x[:, s:e] == self.mask_id).sum(-1), self.spb)     # (B, spb)

    def propose(self, logits, at) -> Proposal:
        x0 = argmax_except(add_gumbel_noise(logits, self.temperature, self.generator), self.mask_id)
        if self.remasking == "low_confidence":
            # The *un-tempered, noise-free* probability of the chosen token, even when sampling. float32 over the
            # vocabulary (the official float64 softmax is a (B, n, V) float64 tensor); the golden ids are equal.
            conf = F.log_softmax(logits.float(), -1).gather(-1, x0[..., None]).squeeze(-1).exp()
        else:   # `random`: uniforms over the whole fed chunk, as the official code draws them (same seeded stream)
            a, b = at.span
            conf = torch.rand((x0.shape[0], b - a), dtype=torch.float64, device=x0.device,
                              generator=self.generator)[:, at.s - a + at.cols]
        N = at.cand.shape[1]
        conf = widen(conf, at.cols, N, NEG_INF).masked_fill(~at.cand, NEG_INF)
        k = self.budget[:, min(at.i, self.spb - 1)]   # parallel steps past the schedule never read it
        return Proposal(widen(x0, at.cols, N, 0), conf, at.cand, k, logits)


class DreamClock(NamedTuple):
    """Where a Dream step stands on its schedule (spec/dream.md 5 and 7, spec/flashdlm.md 1)."""
    t: torch.Tensor           # the step goes from time t to t_next on Dream's float32 grid
    t_next: torch.Tensor
    last: bool                # the block's (or canvas's) last scheduled step takes every mask left
    later: int                # masks of later blocks counted into the schedule (FreeCache)


class Dream(StepRule):
    """Dream, Fast-dLLM's block sampler (spec/dream.md 7.3): Dream's sampler proposes (top-p/top-k/temperature,
    float32); tokens are ranked by `alg` (entropy) and counted by Dream's schedule over the block's steps, or
    chosen by a parallel rule on the max probability (the block's first token at its first step: FirstToken).
    The clock is the one thing the subclasses change."""
    first_token = True

    def __init__(self, steps: int, n_blocks: int, block_length: int, temperature, remasking, top_p, top_k,
                 eps, generator, mask_id: int, device, parallel: bool):
        self.steps, self.spb, self.n_blocks, self.block_length = steps, steps // n_blocks, n_blocks, block_length
        self.temperature, self.generator, self.mask_id = temperature, generator, mask_id
        self.opts = dict(temperature=temperature, top_p=top_p, top_k=top_k, generator=generator, mask_id=mask_id)
        self.alg = "maskgit_plus" if parallel or remasking == "origin" else remasking   # origin ranks nothing
        self.timesteps = torch.linspace(1, eps, self.grid_steps() + 1, device=device)

    def grid_steps(self) -> int:
        return self.spb                         # the time grid runs over one block's steps

    def clock(self, at) -> DreamClock:
        i = min(at.i, self.spb - 1)             # parallel steps past the schedule never read the clock
        return DreamClock(self.timesteps[i], self.timesteps[i + 1], at.i == self.spb - 1, 0)

    def start_block(self, x, s: int, e: int):
        self.block = (s - (x.shape[1] - self.n_blocks * self.block_length)) // self.block_length

    def propose(self, logits, at, open_=None) -> Proposal:
        open_ = at.cand if open_ is None else open_                     # (B, N) the positions this step may commit
        N, narrow = open_.shape[1], open_[:, at.cols]                   # (B, n) at the logits' columns
        if self.temperature > 0:
            # Sampling draws one token per open position in the official row-major order (the block's first
            # position alone at its first step), so a seeded run draws the same numbers; the gather reads
            # the count on the host (one sync: only when sampling).
            if self.first_token and at.i == 0:
                narrow = narrow & (at.cols == 0)
            conf, x0, probs = dream_sample(logits[narrow], **self.opts)
            conf, x0 = (torch.zeros(narrow.shape, dtype=v.dtype, device=v.device).masked_scatter_(narrow, v)
                        for v in (conf, x0))
            probs = torch.zeros(*narrow.shape, probs.shape[-1], device=probs.device).masked_scatter_(
                narrow[..., None], probs) if self.alg in ("topk_margin", "entropy") else None
        else:
            conf, x0, probs = dream_sample(logits, **self.opts)
        score = widen(dream_confidence(self.alg, conf, probs, at.cols, narrow), at.cols, N, NEG_INF)
        c = self.clock(at)
        n = at.cand.sum(-1)
        k = dream_num_transfer(n, c.t, c.t_next, c.last, n + c.later)
        return Proposal(widen(x0, at.cols, N, 0), score.masked_fill(~open_, NEG_INF), open_, k, logits)


class DreamFree(Dream):
    """FlashDLM's FreeCache sampler for Dream (spec/flashdlm.md 1): no first-token rule; the time grid spans
    all steps and is indexed by the global step; the count is taken of the block's masks *and every later
    block's*."""
    first_token = False

    def grid_steps(self) -> int:
        return self.steps

    def clock(self, at) -> DreamClock:
        i = min(self.block * self.spb + at.i, self.steps - 1)
        later = (self.n_blocks - self.block - 1) * self.block_length
        return DreamClock(self.timesteps[i], self.timesteps[i + 1], at.i == self.spb - 1, later)


class DreamCanvas(Dream):
    """Dream's own `diffusion_generate` (spec/dream.md 5): one block over the whole answer, exactly `steps`
    calls on a grid over all of them (k = the schedule's count; with QuotaThreshold, Fast-dLLM's variant,
    spec/dream.md 7.2: gen/steps tokens offered a step until no mask is left). `origin` (MaskGIT-style):
    each open position may be committed with probability 1 - s/t, one uniform per masked position drawn
    row-major before any token, as the official code draws them."""
    first_token = False

    def __init__(self, *args, until_done: bool = False, origin: bool = False):
        super().__init__(*args)
        self.until_done, self.origin = until_done, origin

    def grid_steps(self) -> int:
        return self.steps

    def clock(self, at) -> DreamClock:
        i = min(at.i, self.steps - 1)
        return DreamClock(self.timesteps[i], self.timesteps[i + 1], at.i == self.steps - 1, 0)

    def more(self, masks_left: bool, at) -> bool:
        return super().more(masks_left, at) if self.until_done else at.i + 1 < self.steps

    def propose(self, logits, at) -> Proposal:
        if self.origin:      # draw the positions first (one host sync: one uniform per masked position)
            c = self.clock(at)
            rows, cols = at.cand.nonzero(as_tuple=True)
            take = torch.rand(rows.numel(), device=rows.device, generator=self.generator) < (
                1 if c.last else 1 - c.t_next / c.t)
            drawn = torch.zeros_like(at.cand)
            drawn[rows[take], cols[take]] = True
            return super().propose(logits, at, drawn)._replace(k=drawn.sum(-1))   # every drawn one is committed
        p = super().propose(logits, at)
        if self.until_done:                             # gen/steps offered a step (QuotaThreshold adds the carry)
            return p._replace(k=torch.full_like(p.k, self.block_length // self.steps if at.i < self.steps else 0))
        return p


def family_rules(cfg, st, whole_canvas: bool, n_blocks: int, generator, device):
    """The family's step rule and the call's selection rule, decided once (fastdllm.make_plan): a fork's own
    propose= / select=, or LLaDA's and Dream's samplers with the schedule, threshold or factor."""
    select = st.select or (Threshold(st.threshold) if st.threshold is not None else
                           Factor(st.factor) if st.factor is not None else Schedule())
    parallel = getattr(select, "parallel", True)
    if st.propose is not None:
        return st.propose, select
    if cfg.family == "llada":
        return LLaDA(st.steps // n_blocks, st.temperature, st.remasking, generator, cfg.mask_id), select
    args = (st.steps, n_blocks, st.block_length, st.temperature, st.remasking, st.top_p, st.top_k, st.eps,
            generator, cfg.mask_id, device, parallel)
    origin = st.remasking == "origin" and not parallel
    if whole_canvas:
        rule = DreamCanvas(*args, until_done=st.threshold is not None, origin=origin)
        select = QuotaThreshold(st.threshold) if st.threshold is not None else select
    else:
        rule = (DreamFree if st.cache == "free" else Dream)(*args)
    if st.alg_temp and not parallel and not origin:    # the official widths: the canvas, the fed chunk, the block
        pad = ((lambda at: (at.s, 0)) if whole_canvas else (lambda at: (0, 0)) if st.cache == "free"
               else (lambda at: (0, at.span[1] - at.e)))
        select = SampledPositions(st.alg_temp, generator, pad)
    return rule, FirstToken(select) if rule.first_token else select


# ---------------------------------------------------------------------------------------- end of text
def answer_tokens(answers: torch.Tensor, eos: torch.Tensor) -> int:
    """Generated tokens before each row's first end token, summed over rows: what tokens/s counts everywhere
    (the CLI, the server, the harness, bench.py), so that end-of-text filler is never counted as speed."""
    end = torch.isin(answers, eos)
    first = torch.where(end.any(-1), end.long().argmax(-1), answers.shape[1])
    return int(first.sum())


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


# A stop rule decides after every step which rows' answers have ended: rule(x, at, p) -> (B,) bool; it may
# fill masks of x in place (the filled tokens are counted in stats["filled"], not "committed"). When every
# row has ended, generation stops (stats["calls_saved"]).
class NoStop:
    """Decode every block."""

    def __call__(self, x, at, p):
        return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)


class EndOfText:
    """A row whose answer has ended gets its remaining masks filled with the first end token. run=True
    (stop_at_eos=True): once its finished answer up to the current block's end holds an end token. run=k
    (FlashDLM's rule, and guided diffusion's committed end token with k = 1): k end tokens in a row at the
    decoding frontier, after any step."""

    def __init__(self, prompt_length: int, eos, mask_id: int, run: int | bool):
        self.P, self.eos, self.mask_id, self.run = prompt_length, eos, mask_id, run

    def __call__(self, x, at, p):
        if self.run is True and at.e == x.shape[1]:    # the last block: nothing left to save (and Dream's own
            return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)   # sampler keeps its `steps` calls)
        done = eos_reached(x, self.P, at.e if self.run is True else x.shape[1], self.eos, self.mask_id, self.run)
        x.masked_fill_(done[:, None] & (x == self.mask_id), self.eos[0])
        return done
