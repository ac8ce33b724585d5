"""
sampler.py: logits -> tokens. How LLaDA and Dream propose (step rules: LLaDA's Gumbel-max sampler and budget,
docs/official.md 2; Dream's sampler, its `alg` scores and float32 schedule as Fast-dLLM's block sampler runs them,
docs/official.md 5 and 6.2), which proposals a step commits (selection rules: the schedule, Fast-dLLM's threshold
and factor decoding, section 3.3), when an answer has ended (stop rules). Randomness only through an explicit
torch.Generator. Logits (B, n, V) at the block's open columns `at.cols` become a `Proposal` of (B, N) tensors, -inf
where it may not commit. Each family's set-up and refusals: family.llada_parts (LLaDA's), dream.py (with Dream's other
clocks: FreeCache's, its whole-canvas sampler's), blockdiff.py, llada2.py, guided.py. Feeds: cache.py.
"""
import struct
from typing import NamedTuple

import torch
import torch.nn.functional as F


NEG_INF = float("-inf")
# The remasking rules each step rule implements (LLaDA.propose; dream_sample and Dream.propose, Dream's `alg`):
# options.py and the command line read these, so a rule added here is accepted and listed everywhere.
LLADA_REMASKING = ("low_confidence", "random")
DREAM_REMASKING = ("entropy", "maskgit_plus", "topk_margin", "origin", "position_weighted")


class Proposal(NamedTuple):
    """One step's proposals over the block's N positions: what a step rule hands to the selection rule."""
    x0: torch.Tensor       # (B, N) long: the proposed token at every position
    conf: torch.Tensor     # (B, N) float: its confidence, -inf where not open. LLaDA: the token's probability
                           #   (float64, as official); Dream: its `alg` score (a parallel rule's: the max probability)
    open: torch.Tensor     # (B, N) bool: the positions this step may commit (masked, and predicted by this call)
    k: torch.Tensor        # (B,) long: tokens the family's schedule commits now (Dream under a parallel rule: the open count)
    logits: torch.Tensor   # (B, n, V): the model's logits at the block columns at.cols
    k_host: int | None = None   # k as one host int where the rule knows it without a read (rows with a mask left)
    edit: torch.Tensor | bool = False   # (B, N) bool: committed tokens of the block (never the prompt) the step
                                        #   rewrites with x0, whatever the selection (LLaDA2.1's T2T editing)
    busy: torch.Tensor | None = None    # (B,) bool: the rows this call works on, each as it would alone (row_nfe
                                        #   counts them; None: the rows with a mask in the block)
    rest: torch.Tensor | None = None    # (B, N) long: what the positions the step does not commit become (None: as
                                        #   they are; DiffusionGemma: fresh random tokens, its renoising)

    def committed(self, take, block):
        """The block after the commit (take: the selection's (B, N) bool): x0 where taken or edited, the rest as they
        are, or as the rule renews them."""
        return torch.where(take | self.edit, self.x0, block if self.rest is None else self.rest)


# ---------------------------------------------------------------------------------------- sampling
def add_gumbel_noise(logits, temperature: float, generator=None):
    """Scores whose argmax samples softmax(l/T): the official argmax(exp(l) / (-log u)^T) in log space, l - T log(-log u),
    which never overflows. float32, not the official float64 ((B, n, V) float64 is ~1 GB a step at batch 16): no
    float32 Gumbel draw exceeds ~16.6 (float64: ~36.7), which moves a sample's probability by at most V e^-16.6
    (<1% at a 126k vocabulary, near-flat distributions only). T == 0 draws nothing."""
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


def widen(x0, conf, cols, open_):
    """A step rule's (B, n) tokens and confidences at block columns cols (n,) -> the block's width (B, N), as open_:
    -inf where the step may not commit."""
    x0 = torch.zeros_like(open_, dtype=x0.dtype).index_copy_(1, cols, x0)
    conf = torch.full_like(open_, NEG_INF, dtype=conf.dtype).index_copy_(1, cols, conf)
    return x0, conf.masked_fill_(~open_, NEG_INF)


def dream_sample(logits, alg: str = "maskgit_plus", temperature: float = 0.0, top_p=None, top_k=None, generator=None,
                 mask_id=None):
    """Dream's `sample_tokens` -> (score, x0): x0 the arg-max token (at T > 0 a draw), score what `alg` ranks it by
    (higher = decoded sooner): its probability (maskgit_plus; origin and position_weighted start from it), the top-2
    margin (topk_margin) or the negative entropy (entropy). float32 whatever the model dtype. mask_id is never
    proposed (argmax_except); the probabilities, and so the margin and the entropy, keep it, as officially."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        # nucleus: drop tokens once the cumulative prob exceeds top_p, always keeping the first
        sorted_logits, order = logits.sort(-1, descending=True)
        drop = F.pad((sorted_logits.softmax(-1).cumsum(-1) > top_p)[..., :-1], (1, 0), value=False)
        logits = logits.masked_fill(drop.scatter(-1, order, drop), torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    probs = logits.softmax(-1)
    if temperature > 0:    # what torch.distributions.Categorical(probs).sample() does, with our generator
        flat = probs.reshape(-1, probs.shape[-1]).index_fill(-1, torch.tensor([mask_id], device=probs.device), 0)
        x0 = torch.multinomial(flat / flat.sum(-1, keepdim=True), 1, True, generator=generator).view(probs.shape[:-1])
    else:
        x0 = probs.argmax(-1) if mask_id is None else argmax_except(probs, mask_id)
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1)[0]
        return top2[..., 0] - top2[..., 1], x0
    if alg == "entropy":
        return (probs * torch.log(probs + 1e-10)).sum(-1), x0       # the negative entropy
    return probs.gather(-1, x0[..., None]).squeeze(-1), x0


def position_weighted(score, cols, open_):
    """FlashDLM's `position_weighted` (its official version crashes; this is what it meant): the max probability
    score (B, n) at block columns cols (n,) x (1 - col / the row's last open col), open_ (B, n)."""
    last = torch.where(open_, cols, 0).amax(-1, keepdim=True).clamp(min=1)
    return score * (1 - cols / last)


def dream_num_transfer(num_mask: torch.Tensor, t: torch.Tensor, s: torch.Tensor, last: bool, total=None):
    """(B,) tokens to unmask from time t to s: the share (1 - s/t) of `total` masks (the block's, or FlashDLM's
    count of every later block's too), all left at the last step. float32 on purpose: the official floors are
    float32 rounding (64 masks, 64 steps: step 0 decodes 0 tokens, 64 * (1 - s/t) = 0.999...)."""
    return num_mask.long() if last else ((num_mask if total is None else total).float() * (1 - s / t)).long()


# ---------------------------------------------------------------------------------------- selection
# A selection rule answers "which proposals does this step commit?": rule(p: Proposal, at) -> (B, N) bool inside
# p.open. parallel (True without the attribute): the rule decides how many itself, so a block takes the steps it
# needs; False: it commits the family's schedule p.k, and the family ranks by its remasking score.
def is_parallel(select, threshold=None, factor=None) -> bool:
    """The one answer to "does this call's selection decide how many tokens a step commits?": a rule's own
    `parallel` (True without the attribute), else Fast-dLLM's threshold or factor (section 3.3). False: the family's
    schedule counts them (p.k), and Dream ranks by its remasking score."""
    if select is not None:
        return getattr(select, "parallel", True)
    return threshold is not None or factor is not None


class Schedule:
    """The k[b] most confident open positions of each row b: LLaDA's and Dream's fixed step schedules. Equal
    confidences (saturated: exactly 1.0) are broken as the official code breaks them, by its call at its width
    (docs/official.md 2, 5): pad(at) -> (left, right) positions at -inf around the block, then a descending sort
    (Fast-dLLM's LLaDA), or with topk=True `topk(k)` in the rows whose count is the rule's host int p.k_host."""
    parallel = False

    def __init__(self, pad=None, topk: bool = False):
        self.pad, self.topk = pad, topk

    def __call__(self, p: Proposal, at):
        (left, right), N = self.pad(at) if self.pad else (0, 0), p.conf.shape[-1]
        left, right = max(left, 0), max(right, 0)       # a fork's span inside the block: read() refuses it, named
        conf = F.pad(p.conf, (left, right), value=NEG_INF) if left or right else p.conf
        order = conf.argsort(-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
        take = rank[:, left:left + N] < p.k[:, None]    # rank: each position's place by confidence
        if self.topk and p.k_host:                       # a row of another count (a fork's, none left) keeps the rank
            top = torch.zeros_like(conf, dtype=torch.bool).scatter_(-1, conf.topk(p.k_host).indices, True)
            take = torch.where((p.k == p.k_host)[:, None], top[:, left:left + N], take)
        return p.open & take


class Threshold:
    """Fast-dLLM threshold decoding (section 3.3, Theorem 1): every open position with confidence >= tau, and always
    the most confident one, so each step commits a token and decoding ends. A tau above 1 is one token per step.
    strict: confidence > tau, as Fast-dLLM v2 compares (tau 1 is then one token per step)."""
    parallel = True

    def __init__(self, tau: float, strict: bool = False):
        self.tau, self.strict = tau, strict

    def __call__(self, p: Proposal, at):
        best = torch.zeros_like(p.open).scatter_(-1, p.conf.argmax(-1, keepdim=True), True)
        return p.open & ((p.conf > self.tau if self.strict else p.conf >= self.tau) | best)


class Factor:
    """Fast-dLLM factor decoding (section 3.3): by confidence c(1) >= ... >= c(N) over the N open positions, the
    top n-1, n the first rank with c(n) < 1 - f/(n+1) (rank 1 always passes; all N if none fails; a first failure
    at the very last candidate still takes all N, an official quirk kept). Compared in float64, as there."""
    parallel = True

    def __init__(self, f: float):
        self.f = f

    def __call__(self, p: Proposal, at):
        N = p.open.sum(-1, keepdim=True)                                        # (B, 1)
        sorted_conf, order = p.conf.sort(-1, descending=True)
        n = torch.arange(1, order.shape[-1] + 1, device=order.device)           # 1-based rank
        bar = (1 - self.f / (n + 1)).to(torch.float64)
        bar[0] = -1.0
        fail = (sorted_conf.double() < bar) & (n <= N)
        first = torch.where(fail.any(-1, keepdim=True), fail.long().argmax(-1, keepdim=True), N)   # 0-based index
        count = torch.where(first == N - 1, N, first)
        rank = torch.empty_like(order).scatter_(-1, order, (n - 1).expand_as(order))
        return p.open & (rank < count)


def entropy(logits):
    """(B, n, V) logits -> (B, n) entropies in nats, in the logits' dtype, as torch.distributions.Categorical computes
    them (DiffusionGemma's acceptance reads these very bits: a near-tie decides alike)."""
    logp = logits - logits.logsumexp(-1, keepdim=True)
    return -(logp.clamp(min=torch.finfo(logp.dtype).min) * logp.softmax(-1)).sum(-1)


class EntropyBound:
    """The entropy bound (EB-Sampler, arXiv 2505.24857; DiffusionGemma's acceptance): in the proposal's order (most
    confident first), the longest run of open positions whose entropies, summed less the largest, stay <= bound; the
    first always passes. Entropies of p.logits in `dtype` (EB-Sampler's fork: float64; DiffusionGemma: float32, whose
    confidence is the negative entropy, so its order is lowest entropy first, as the official sort)."""
    parallel = True

    def __init__(self, bound: float, dtype=torch.float64):
        self.bound, self.dtype = bound, dtype

    def __call__(self, p: Proposal, at):
        h = torch.zeros(p.conf.shape, dtype=self.dtype, device=p.conf.device)
        h[:, at.cols] = entropy(p.logits.to(self.dtype))                   # (B, N) at the block columns at.cols
        order = p.conf.argsort(dim=-1, descending=True, stable=True)
        h = h.gather(-1, order).masked_fill(~p.open.gather(-1, order), 0)   # closed positions (conf -inf) sort last
        count = (h.cumsum(-1) - h.cummax(-1).values <= self.bound).sum(-1, keepdim=True)   # the run's length
        take = torch.arange(order.shape[-1], device=order.device) < count   # (B, N) in that order
        return p.open & torch.zeros_like(take).scatter_(-1, order, take)


# ---------------------------------------------------------------------------------------- step rules
class StepRule:
    """A family's way to propose, with its state (the schedule, Dream's clock): start_block(x, s, e) at a block's
    start, before its first call (it may fill masks of x, e.g. forced tokens; nothing else); propose(logits, at)
    -> Proposal for the step `at` (fastdllm.Step), logits (B, n, V) at the block columns at.cols.
    steps_per_block: the block's scheduled steps (0: none); exact_steps: a block takes exactly that many calls
    (Dream's own sampler), else a block ends once it has no mask left and its last call changed nothing (a rule that
    edits, Proposal.edit), or after max_post_steps calls without a mask. edits: the rule may rewrite committed tokens
    of the block, so a stream shows a block once it has ended (stats["final"]); reads_block: propose's logits are at
    every column of the block (at.cols), not only the masked ones."""
    steps_per_block = 0
    exact_steps = None
    max_post_steps = 0
    edits = False
    reads_block = False

    def start_block(self, x, s: int, e: int):
        pass


class LLaDA(StepRule):
    """LLaDA (Fast-dLLM v1/llada/generate.py): Gumbel-max proposals, confidence = the chosen token's probability
    (`random`: uniform noise); the schedule spreads a block's masks evenly over its steps (num_transfer_tokens)."""

    def __init__(self, *, steps_per_block: int, temperature: float = 0.0, remasking: str = "low_confidence",
                 generator=None, mask_id: int):
        self.steps_per_block, self.temperature, self.remasking = steps_per_block, temperature, remasking
        self.generator, self.mask_id = generator, mask_id

    def start_block(self, x, s: int, e: int):
        self.budget = num_transfer_tokens((x[:, s:e] == self.mask_id).sum(-1), self.steps_per_block)   # (B, spb)

    def propose(self, logits, at) -> Proposal:
        scores = logits if self.temperature == 0 else add_gumbel_noise(logits, self.temperature, self.generator)
        x0 = argmax_except(scores, self.mask_id)                             # (B, n): never the mask itself
        if self.remasking == "low_confidence":
            # The chosen token's probability as the official float64 softmax has it, with no (B, n, V) float64: p =
            # 1 / (1 + r), r the other tokens' float32 probabilities over its own, added in float64 (a float32 p is
            # off by ~1e-6 near a threshold, and rounds p > 1 - 6e-8 to 1.0, where threshold 1.0 would pass).
            probs, chosen = logits.float().softmax(-1), x0[..., None]
            p_chosen = probs.gather(-1, chosen)                      # before the scatter_ below zeroes it in probs
            r = probs.scatter_(-1, chosen, 0.0).sum(-1, keepdim=True) / p_chosen
            conf = r.squeeze(-1).double().add_(1).reciprocal_()
        else:   # `random`: uniforms over the whole fed chunk, as the official code draws them (same seeded stream)
            conf = torch.rand((x0.shape[0], at.fed.shape[0]), dtype=torch.float64, device=x0.device,
                              generator=self.generator)[:, at.rows]
        x0, conf = widen(x0, conf, at.cols, at.masked)             # (B, n) at the columns -> (B, N)
        i, spb, N = min(at.i, self.steps_per_block - 1), self.steps_per_block, at.e - at.s
        k = self.budget[:, i]                                        # the schedule's count (Schedule reads it)
        return Proposal(x0, conf, at.masked, k, logits, N // spb + (i < N % spb))


class Dream(StepRule):
    """Dream, Fast-dLLM's block sampler (docs/official.md 6.2): Dream's sampler proposes (top-p/top-k/temperature,
    float32), ranked by `alg` (the schedule's default: entropy; a parallel rule's: maskgit_plus, the max
    probability). schedule=True: Dream's schedule counts each step's tokens (a parallel rule needs no count).
    first_token: a block's first step opens only its first position, decoded whatever its confidence (docs/official.md
    6.2). Subclasses (dream.py: FreeCache's, the whole canvas's) change only the clock."""
    first_token = True

    def __init__(self, *, steps: int, n_blocks: int, block_length: int, temperature: float = 0.0,
                 alg: str = "entropy", top_p=None, top_k=None, eps: float = 1e-3, generator=None, mask_id: int,
                 device=None, schedule: bool = True, first_token: bool | None = None):
        if alg not in DREAM_REMASKING:
            raise ValueError(f"unknown Dream remasking {alg!r}: use one of {', '.join(DREAM_REMASKING)}")
        self.steps, self.steps_per_block = steps, steps // n_blocks
        self.n_blocks, self.block_length, self.schedule = n_blocks, block_length, schedule
        self.temperature, self.top_p, self.top_k, self.alg = temperature, top_p, top_k, alg
        self.generator, self.mask_id = generator, mask_id
        self.timesteps = torch.linspace(1, eps, self.grid_steps() + 1, device=device)
        self.times = self.timesteps.tolist()    # read once: the host count (k_host) replays the device's float32
        self.first_token = self.first_token if first_token is None else first_token

    def grid_steps(self) -> int:
        return self.steps_per_block             # the time grid runs over one block's steps

    def clock(self, at):
        """Where the step stands on the schedule (docs/official.md 5, 6.2 and 7.1) -> (i: the step goes from
        timesteps[i] to timesteps[i + 1] on the float32 grid; last: the block's last scheduled step takes every mask
        left; later: masks of later blocks counted in, for FreeCache). Parallel steps past it never read it."""
        i = min(at.i, self.steps_per_block - 1)
        return i, at.i == self.steps_per_block - 1, 0

    def start_block(self, x, s: int, e: int):
        self.block = (s - (x.shape[1] - self.n_blocks * self.block_length)) // self.block_length
        self.left = e - s                       # the host's count of a row's masks (each row commits k_host a step)

    def propose(self, logits, at, open_=None) -> Proposal:
        first = self.first_token and at.i == 0
        if open_ is None:                                               # (B, N) the positions this step may commit
            open_ = at.masked & (torch.arange(at.masked.shape[1], device=at.masked.device) == 0) if first else at.masked
        narrow = open_[:, at.cols]                                      # (B, n) at the logits' columns
        # Dream's sample_tokens -> (B, n) the arg-max token and its score under alg (maskgit_plus, a parallel rule's:
        # its probability). At T > 0 one draw per open position, in the official row-major order so that a seeded run
        # draws the same numbers: a gather, one host sync.
        drawn = self.temperature > 0
        score, x0 = dream_sample(logits[narrow] if drawn else logits, self.alg, self.temperature, self.top_p,
                                 self.top_k, self.generator, self.mask_id)
        if drawn:
            score, x0 = (torch.zeros(narrow.shape, dtype=v.dtype, device=v.device).masked_scatter_(narrow, v)
                         for v in (score, x0))
        if self.alg == "position_weighted":
            score = position_weighted(score, at.cols, narrow)
        if first or not self.schedule:          # the first token alone, or a parallel rule: no count to compute
            k, k_host = open_.sum(-1), 1 if first else None
        else:
            i, last, later = self.clock(at)
            k = dream_num_transfer(n := at.masked.sum(-1), self.timesteps[i], self.timesteps[i + 1], last, n + later)
            f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]    # noqa: E731  one float32 rounding
            g = self.times                      # the official count is one host int: the same float32 arithmetic
            k_host = self.left if last else int(f32(f32(self.left + later) * f32(1 - f32(g[i + 1] / g[i]))))
        self.left -= k_host or 0
        x0, score = widen(x0, score, at.cols, open_)                 # (B, n) at the columns -> (B, N)
        return Proposal(x0, score, open_, k, logits, k_host)


def parallel_rule(st):
    """A fork's select= as given, or the parallel rule the settings name (Fast-dLLM's threshold or factor, section
    3.3), or None: the family's schedule."""
    return st.select or (Threshold(st.threshold) if st.threshold is not None else
                         Factor(st.factor) if st.factor is not None else None)


# ---------------------------------------------------------------------------------------- stop rules
def stop_rule(st, c, eos, mask_id: int, run=None, kind=None):
    """A fork's stop= as given, or the end-of-text rule the settings ask for (stop_at_eos; run: a family's own),
    or none."""
    run = st.stop_at_eos if run is None else run
    return st.stop or ((kind or EndOfText)(c.prompt[:, 1:], eos, mask_id, run, c.fill) if run else NoStop())


def eos_reached(x, P, e: int, eos: torch.Tensor, mask_id: int, run: int | bool):
    """(B,) rows whose answer has ended; P: where the answers start, an int or (B, 1) per row. run=True: the finished
    answer [P, e) holds an end token. run=k (FlashDLM's `_check_early_stop`): the right-most decoded token r and the
    k-1 canvas tokens before it (prompt included, as FlashDLM counts) are end tokens and no mask lies before r."""
    idx = torch.arange(x.shape[1], device=x.device)
    if run is True:
        answer = (idx >= P) & (idx < e)
        return (torch.isin(x, eos) & answer).any(-1) & ~((x == mask_id) & answer).any(-1)
    decoded = (x != mask_id) & (idx >= P)
    r = torch.where(decoded, idx, -1).max(-1).values                      # right-most decoded, -1 if none
    no_gap = torch.where(x == mask_id, idx, x.shape[1]).min(-1).values > r
    window = (idx <= r[:, None]) & (idx > r[:, None] - run)
    tail = torch.where(window, torch.isin(x, eos), True).all(-1)
    return (r >= 0) & (r + 1 >= run) & no_gap & tail


# A stop rule decides after every step which rows' answers have ended: rule(x, at, p) -> (B,) bool; it may fill
# masks of x in place (stats["filled"], not "committed"). When every row has ended, generation stops.
class NoStop:                    # decode every block

    def __call__(self, x, at, p):
        return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)


class EndOfText:
    """An ended answer's masks become `fill` (default the first end token). run=True (stop_at_eos=True): once the
    finished answer up to the block's end holds an end token; run=k (FlashDLM's rule; guided, k = 1): k at the
    frontier. start: where the answers start, an int or (B, 1) per row."""

    def __init__(self, start, eos, mask_id: int, run: int | bool, fill: int | None = None):
        self.P, self.eos, self.mask_id, self.run = start, eos, mask_id, run
        self.fill = int(eos[0]) if fill is None else fill

    def __call__(self, x, at, p):
        if self.run is True and at.e == x.shape[1]:    # the last block: nothing left to save (and Dream's own
            return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)   # sampler keeps its `steps` calls)
        done = eos_reached(x, self.P, at.e if self.run is True else x.shape[1], self.eos, self.mask_id, self.run)
        x.masked_fill_(done[:, None] & (x == self.mask_id), self.fill)
        return done
