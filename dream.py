"""
dream.py: Dream's step rules (docs/official.md 5-7): its sampler (top-p / top-k / temperature, float32), the
confidences its `alg` ranks by, its float32 time-grid schedule, and the three clocks: Fast-dLLM's block sampler
(Dream), FlashDLM's FreeCache sampler (DreamFree) and Dream's own whole-canvas `diffusion_generate` (DreamCanvas);
then the parts one call uses and what a Dream call refuses. The generic pieces (Proposal, StepRule, the selection
rules) are sampler.py's.
"""
import struct

import torch
import torch.nn.functional as F

from sampler import (NEG_INF, Proposal, QuotaThreshold, SampledPositions, Schedule, StepRule, argmax_except,
                     is_parallel, parallel_rule)

# The remasking (`alg`) rules Dream's step rules implement (dream_confidence): checks.py and the command line read
# these, so a rule added here is accepted and listed everywhere.
DREAM_REMASKING = ("entropy", "maskgit_plus", "topk_margin", "origin", "position_weighted")


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
    conf = probs.gather(-1, x0[..., None]).squeeze(-1)
    return conf, x0, probs


def dream_confidence(alg: str, conf, probs, cols, open_):
    """Rank score for Dream's confidence algorithms (higher = decode sooner) at block columns cols (n,), open_
    (B, n). FlashDLM's `position_weighted`, max prob x (1 - col / the row's last open col), is what its crashing
    official version meant."""
    if alg in ("maskgit_plus", "origin"):      # origin draws its positions: the score is never read
        return conf
    if alg == "position_weighted":
        last = torch.where(open_, cols, 0).amax(-1, keepdim=True).clamp(min=1)       # each row's last open col
        return conf * (1 - cols / last)
    if alg == "topk_margin":
        top2 = probs.topk(2, dim=-1)[0]
        return top2[..., 0] - top2[..., 1]
    if alg == "entropy":
        return (probs * torch.log(probs + 1e-10)).sum(-1)       # negative entropy
    raise ValueError(f"unknown Dream remasking {alg!r}: use one of {', '.join(DREAM_REMASKING)}")


def dream_num_transfer(num_mask: torch.Tensor, t: torch.Tensor, s: torch.Tensor, last: bool, total=None):
    """(B,) tokens to unmask from time t to s: the share (1 - s/t) of `total` masks (the block's, or FlashDLM's
    count of every later block's too), all left at the last step. float32 on purpose: the official floors are
    float32 rounding (64 masks, 64 steps: step 0 decodes 0 tokens, 64 * (1 - s/t) = 0.999...)."""
    return num_mask.long() if last else ((num_mask if total is None else total).float() * (1 - s / t)).long()


class Dream(StepRule):
    """Dream, Fast-dLLM's block sampler (docs/official.md 6.2): Dream's sampler proposes (top-p/top-k/temperature,
    float32), ranked by `alg` (the schedule's default: entropy; a parallel rule's: maskgit_plus, the max
    probability). schedule=True: Dream's schedule counts each step's tokens (a parallel rule needs no count).
    first_token: a block's first step opens only its first position, decoded whatever its confidence (docs/official.md
    6.2). Subclasses change only the clock."""
    first_token = True

    def __init__(self, *, steps: int, n_blocks: int, block_length: int, temperature: float = 0.0,
                 alg: str = "entropy", top_p=None, top_k=None, eps: float = 1e-3, generator=None, mask_id: int,
                 device=None, schedule: bool = True, first_token: bool | None = None):
        self.steps, self.steps_per_block = steps, steps // n_blocks
        self.n_blocks, self.block_length, self.schedule = n_blocks, block_length, schedule
        self.temperature, self.alg, self.generator, self.mask_id = temperature, alg, generator, mask_id
        self.opts = dict(temperature=temperature, top_p=top_p, top_k=top_k, generator=generator, mask_id=mask_id)
        self.timesteps = torch.linspace(1, eps, self.grid_steps() + 1, device=device)
        self.grid = self.timesteps.tolist()     # read once: the host count (k_host) replays the device's float32
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
        if self.temperature > 0:
            # One draw per open position in the official row-major order, so a seeded run draws the same numbers:
            # a gather, one host sync, only when sampling.
            conf, x0, probs = dream_sample(logits[narrow], **self.opts)
            conf, x0 = (torch.zeros(narrow.shape, dtype=v.dtype, device=v.device).masked_scatter_(narrow, v)
                        for v in (conf, x0))
            probs = torch.zeros(*narrow.shape, probs.shape[-1], device=probs.device).masked_scatter_(
                narrow[..., None], probs) if self.alg in ("topk_margin", "entropy") else None
        else:
            conf, x0, probs = dream_sample(logits, **self.opts)
        score = dream_confidence(self.alg, conf, probs, at.cols, narrow)
        if first or not self.schedule:          # the first token alone, or a parallel rule: no count to compute
            k, k_host = open_.sum(-1), 1 if first else None
        else:
            i, last, later = self.clock(at)
            k = dream_num_transfer(n := at.masked.sum(-1), self.timesteps[i], self.timesteps[i + 1], last, n + later)
            f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]    # noqa: E731  one float32 rounding
            g = self.grid                       # the official count is one host int: the same float32 arithmetic
            k_host = self.left if last else int(f32(f32(self.left + later) * f32(1 - f32(g[i + 1] / g[i]))))
        self.left -= k_host or 0
        # (B, n) at the logits' columns -> (B, N), the block's width: -inf where the step may not commit.
        x0 = torch.zeros_like(open_, dtype=x0.dtype).index_copy_(1, at.cols, x0)
        score = torch.full_like(open_, NEG_INF, dtype=score.dtype).index_copy_(1, at.cols, score)
        return Proposal(x0, score.masked_fill_(~open_, NEG_INF), open_, k, logits, k_host)


class DreamFree(Dream):
    """FlashDLM's FreeCache sampler for Dream (docs/official.md 7.1): no first-token rule; one time grid over all
    steps, indexed by the global step; the count is taken of the block's masks *and every later block's*."""
    first_token = False

    def grid_steps(self) -> int:
        return self.steps

    def clock(self, at):
        i = min(self.block * self.steps_per_block + at.i, self.steps - 1)
        later = (self.n_blocks - self.block - 1) * self.block_length
        return i, at.i == self.steps_per_block - 1, later


class DreamCanvas(Dream):
    """Dream's own `diffusion_generate` (docs/official.md 5): one block, exactly `steps` calls on one grid (with
    QuotaThreshold, Fast-dLLM's variant, 6.1: gen/steps offered a step until no mask is left). `origin`: each mask
    committed with probability 1 - s/t, one uniform per mask drawn row-major before any token, as officially."""
    first_token = False

    def __init__(self, *, until_done: bool = False, origin: bool = False, **kw):
        super().__init__(**kw)
        self.until_done, self.origin = until_done, origin
        self.exact_steps = None if until_done else self.steps

    def grid_steps(self) -> int:
        return self.steps

    def clock(self, at):
        i = min(at.i, self.steps - 1)
        return i, at.i == self.steps - 1, 0

    def propose(self, logits, at) -> Proposal:
        if self.origin:      # draw the positions first (one host sync: one uniform per masked position)
            i, last, _ = self.clock(at)
            t, t_next = self.timesteps[i], self.timesteps[i + 1]
            rows, cols = at.masked.nonzero(as_tuple=True)
            take = torch.rand(rows.numel(), device=rows.device, generator=self.generator) < (1 if last else 1 - t_next / t)
            drawn = torch.zeros_like(at.masked)
            drawn[rows[take], cols[take]] = True
            return super().propose(logits, at, drawn)._replace(k=drawn.sum(-1))   # every drawn one is committed
        p = super().propose(logits, at)
        if self.until_done:                             # gen/steps offered a step (QuotaThreshold adds the carry)
            return p._replace(k=torch.full_like(p.k, self.block_length // self.steps if at.i < self.steps else 0),
                              k_host=None)
        return p


def dream_parts(cfg, st, generator, device, whole_canvas: bool):
    """Dream's step rule and selection rule from the call's settings `st` (defaults already decided,
    fastdllm.resolve). Its schedule ranks as the official call does at the official width (ties decide alike):
    Dream's own sampler a topk over the canvas, Fast-dLLM's a topk over [s, the fed chunk's end); FlashDLM's takes
    the block's masks alone."""
    select = parallel_rule(st) or (Schedule(lambda at: (at.s, 0), topk=True) if whole_canvas else Schedule()
                                   if st.cache == "free" else
                                   Schedule(lambda at: (0, at.span[1] - at.e) if at.span else (0, 0), topk=True))
    if st.propose is not None:
        return st.propose, select
    schedule = not is_parallel(select)
    origin = st.remasking == "origin" and schedule
    kw = dict(steps=st.steps, n_blocks=st.gen_length // st.block_length, block_length=st.block_length,
              temperature=st.temperature, alg=st.remasking, top_p=st.top_p, top_k=st.top_k, eps=st.eps,
              generator=generator, mask_id=cfg.mask_id, device=device, schedule=schedule and not origin)
    rule = (DreamCanvas(until_done=st.threshold is not None, origin=origin, **kw) if whole_canvas else
            (DreamFree if st.cache == "free" else Dream)(**kw))
    if whole_canvas and st.threshold is not None:
        select = QuotaThreshold(st.threshold)
    if st.alg_temp and schedule and not origin:    # the official widths: the canvas, the fed chunk, the block
        pad = ((lambda at: (at.s, 0)) if whole_canvas else (lambda at: (0, 0)) if st.cache == "free"
               else (lambda at: (0, (at.span[1] if at.span else int(at.fed[-1]) + 1) - at.e)))
        select = SampledPositions(st.alg_temp, generator, pad, rule.first_token)
    return rule, select


def check_dream(st, given: dict, whole_canvas: bool, bad):
    """What a Dream call refuses: each of Dream's samplers implements some of the rules, so say which one does what
    was asked (bad(msg) raises)."""
    if st.select is None and (st.threshold is not None or st.factor is not None) and given.get("remasking") not in (
            None, "maskgit_plus"):
        bad(f"remasking={given['remasking']!r} does not apply with threshold/factor on Dream: Fast-dLLM's parallel "
            f"rules compare the max probability (maskgit_plus); drop remasking, or drop threshold/factor")
    if st.guide is not None or st.propose is not None:
        return
    free, custom, threshold = st.cache == "free", st.select is not None, st.threshold
    parallel = is_parallel(st.select, threshold, st.factor)
    n_blocks = st.gen_length // st.block_length
    if whole_canvas and (st.cache != "none" or parallel and threshold is None and not custom):
        bad("Dream's whole-canvas sampler (block_length=None) has no cache or factor rule: pass a "
            "block_length to use Fast-dLLM's block sampler")
    if whole_canvas and custom:
        bad("Dream's whole-canvas sampler (block_length=None) has its own rules: a custom select rule needs a "
            "block_length (Fast-dLLM's block sampler)")
    if whole_canvas and threshold is not None and st.gen_length % st.steps:
        bad(f"Dream's whole-canvas threshold rule spreads the {st.gen_length} masks evenly over the "
            f"steps: steps ({st.steps}) must divide gen_length")
    if not whole_canvas and not free and st.remasking != "entropy" and not parallel:
        bad(f"Fast-dLLM's Dream block sampler ranks tokens by entropy; remasking={st.remasking!r} "
            f"needs Dream's whole-canvas sampler (block_length=None) or cache='free'")
    if not whole_canvas and not free and not parallel and st.steps // n_blocks < 2:
        bad(f"Fast-dLLM's Dream block sampler needs >= 2 steps per block (got {st.steps // n_blocks}): "
            f"raise steps to at least {2 * n_blocks}, or use threshold/factor or cache='free'")
    if custom and free:
        bad("FlashDLM's FreeCache sampler for Dream has its own schedule: a custom select rule needs "
            "cache 'none', 'prefix' or 'dual'")
