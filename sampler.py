"""
sampler.py: logits -> tokens. How each family proposes (step rules: LLaDA's Gumbel-max sampler and budget,
docs/official.md 2; Dream's sampler, confidences and float32 schedule, docs/official.md 5), which proposals a step
commits (selection rules: the schedule, Fast-dLLM's threshold and factor decoding, section 3.3), when an answer
has ended (stop rules). Randomness only through an explicit torch.Generator. Logits (B, n, V) at the block's open
columns `at.cols` become a `Proposal` of (B, N) tensors, -inf where it may not commit. Feeds: cache.py; guides: guided.py.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")
# The remasking rules LLaDA's step rule implements (LLaDA.propose; Dream's: dream.DREAM_REMASKING): checks.py and the
# command line read these, so a rule added here is accepted and listed everywhere.
LLADA_REMASKING = ("low_confidence", "random")


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
    busy: torch.Tensor | bool = False   # (B,) bool: rows this call works on though they have no mask (an editing
                                        #   rule's calls that check a block): counted in row_nfe, as alone


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


class QuotaThreshold(Threshold):
    """Fast-dLLM's Dream `confidence_threshold` without blocks (docs/official.md 6.1): offer the k + carry most
    confident; take the first, the others at confidence >= tau; offer the refused again (the carry)."""

    def __call__(self, p: Proposal, at):
        offered = Schedule()(p._replace(k=p.k + (self.carry if at.n else 0), k_host=None), at)   # at first no carry
        take = offered & super().__call__(p, at)
        self.carry = (offered & ~take).sum(-1)
        return take


class SampledPositions:
    """Dream's `alg_temp` > 0: draw the schedule's k positions without replacement from softmax(conf / alg_temp),
    over the official code's width (pad(at) -> (left, right) columns at -inf) so a seeded run picks the same
    positions; k read on the host (a drawn count is a shape). A block's first token is not drawn (first_token)."""
    parallel = False

    def __init__(self, alg_temp: float, generator, pad, first_token: bool):
        self.alg_temp, self.generator, self.pad, self.first_token = alg_temp, generator, pad, first_token

    def __call__(self, p: Proposal, at):
        k, (left, right) = int(p.k.max()), self.pad(at)
        if k == 0 or self.first_token and at.i == 0:
            return p.open & (k > 0)
        scores = F.pad(p.conf / self.alg_temp, (left, right), value=NEG_INF).softmax(-1)
        picked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        picked.scatter_(-1, torch.multinomial(scores, k, generator=self.generator), True)
        return p.open & picked[:, left:left + p.open.shape[-1]]


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
        # (B, n) at the logits' columns -> (B, N), the block's width: -inf where the step may not commit.
        x0 = torch.zeros_like(at.masked, dtype=x0.dtype).index_copy_(1, at.cols, x0)
        conf = torch.full_like(at.masked, NEG_INF, dtype=conf.dtype).index_copy_(1, at.cols, conf)
        i, spb, N = min(at.i, self.steps_per_block - 1), self.steps_per_block, at.e - at.s
        k = self.budget[:, i]                                        # the schedule's count (Schedule reads it)
        return Proposal(x0, conf.masked_fill_(~at.masked, NEG_INF), at.masked, k, logits, N // spb + (i < N % spb))


def parallel_rule(st):
    """A fork's select= as given, or the parallel rule the settings name (Fast-dLLM's threshold or factor, section
    3.3), or None: the family's schedule."""
    return st.select or (Threshold(st.threshold) if st.threshold is not None else
                         Factor(st.factor) if st.factor is not None else None)


def llada_parts(cfg, st, generator, device, whole_canvas: bool = False):
    """LLaDA's step rule and selection rule from the call's settings `st` (defaults already decided,
    fastdllm.resolve): its schedule ranked as the official call ranks at the official width around the block [s, e)
    (ties decide alike): FlashDLM's topk over the canvas, Fast-dLLM's sort of the fed chunk."""
    select = parallel_rule(st) or (Schedule(lambda at: (at.s, at.x.shape[1] - at.e), topk=True) if st.cache == "free"
                                   else Schedule(lambda at: (at.s - at.span[0], at.span[1] - at.e) if at.span else (0, 0)))
    return st.propose or LLaDA(steps_per_block=st.steps // (st.gen_length // st.block_length),
                               temperature=st.temperature, remasking=st.remasking, generator=generator,
                               mask_id=cfg.mask_id), select


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
