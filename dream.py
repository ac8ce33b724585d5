"""
dream.py: Dream's other clocks and its set-up. Its block sampler, the step rule of Fast-dLLM's Dream (sampler.Dream,
beside LLaDA's), runs a time grid per block; here are the two that run one grid otherwise: FlashDLM's FreeCache
sampler (DreamFree) and Dream's own whole-canvas `diffusion_generate` (DreamCanvas), with the two selection rules only
Dream's settings ask for (QuotaThreshold, SampledPositions); then the parts one Dream call uses and what it refuses
(docs/official.md 5-7).
"""
import torch
import torch.nn.functional as F

from cache import CACHE_POLICIES, CachePolicy
from family import Canvas, Family, Parts, answer_canvas
from sampler import NEG_INF, Dream, Proposal, Schedule, Threshold, is_parallel, parallel_rule, stop_rule


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


def whole_canvas(st, given: dict) -> bool:
    """Dream's own whole-canvas sampler (`diffusion_generate`, docs/official.md 5) is asked for by block_length=None."""
    return "block_length" in given and given["block_length"] is None and st.guide is None


def dream_defaults(cfg, st, given) -> dict:
    """Dream ranks by entropy, and by the max probability under a parallel rule (maskgit_plus, as Fast-dLLM's)."""
    return dict(remasking=st.remasking or ("maskgit_plus" if is_parallel(st.select, st.threshold, st.factor) else
                                           "entropy"))


def dream_parts(model, st, given, generator, c: Canvas, eos):
    """Dream's step rule, selection rule, cache policy and stop rule from the call's settings `st` (defaults already
    decided). Its schedule ranks as the official call does at the official width (ties decide alike): Dream's own
    sampler a topk over the canvas, Fast-dLLM's a topk over [s, the fed chunk's end); FlashDLM's takes the block's
    masks alone."""
    whole, mask_id = whole_canvas(st, given), model.config.mask_id
    cache = st.cache if isinstance(st.cache, CachePolicy) else CACHE_POLICIES[st.cache]()
    select = parallel_rule(st) or (Schedule(lambda at: (at.s, 0), topk=True) if whole else Schedule()
                                   if st.cache == "free" else
                                   Schedule(lambda at: (0, at.span[1] - at.e) if at.span else (0, 0), topk=True))
    if st.propose is not None:
        return Parts(st.propose, select, cache, stop_rule(st, c, eos, mask_id))
    schedule = not is_parallel(select)
    origin = st.remasking == "origin" and schedule
    kw = dict(steps=st.steps, n_blocks=st.gen_length // st.block_length, block_length=st.block_length,
              temperature=st.temperature, alg=st.remasking, top_p=st.top_p, top_k=st.top_k, eps=st.eps,
              generator=generator, mask_id=mask_id, device=c.x.device, schedule=schedule and not origin)
    rule = (DreamCanvas(until_done=st.threshold is not None, origin=origin, **kw) if whole else
            (DreamFree if st.cache == "free" else Dream)(**kw))
    if whole and st.threshold is not None:
        select = QuotaThreshold(st.threshold)
    if st.alg_temp and schedule and not origin:    # the official widths: the canvas, the fed chunk, the block
        pad = ((lambda at: (at.s, 0)) if whole else (lambda at: (0, 0)) if st.cache == "free"
               else (lambda at: (0, (at.span[1] if at.span else int(at.fed[-1]) + 1) - at.e)))
        select = SampledPositions(st.alg_temp, generator, pad, rule.first_token)
    return Parts(rule, select, cache, stop_rule(st, c, eos, mask_id))


def check_dream(cfg, st, given: dict, longest: int, name=lambda key: key):
    """What a Dream call refuses: each of Dream's samplers implements some of the rules, so say which one does what
    was asked."""
    def bad(msg):
        raise ValueError(msg)
    whole = whole_canvas(st, given)
    if st.select is None and (st.threshold is not None or st.factor is not None) and given.get("remasking") not in (
            None, "maskgit_plus"):
        bad(f"remasking={given['remasking']!r} does not apply with threshold/factor on Dream: Fast-dLLM's parallel "
            f"rules compare the max probability (maskgit_plus); drop remasking, or drop threshold/factor")
    if st.guide is not None or st.propose is not None:
        return
    free, custom, threshold = st.cache == "free", st.select is not None, st.threshold
    parallel = is_parallel(st.select, threshold, st.factor)
    n_blocks = st.gen_length // st.block_length
    if whole and (st.cache != "none" or parallel and threshold is None and not custom):
        bad("Dream's whole-canvas sampler (block_length=None) has no cache or factor rule: pass a "
            "block_length to use Fast-dLLM's block sampler")
    if whole and custom:
        bad("Dream's whole-canvas sampler (block_length=None) has its own rules: a custom select rule needs a "
            "block_length (Fast-dLLM's block sampler)")
    if whole and threshold is not None and st.gen_length % st.steps:
        bad(f"Dream's whole-canvas threshold rule spreads the {st.gen_length} masks evenly over the "
            f"steps: steps ({st.steps}) must divide gen_length")
    if not whole and not free and st.remasking != "entropy" and not parallel:
        bad(f"Fast-dLLM's Dream block sampler ranks tokens by entropy; remasking={st.remasking!r} "
            f"needs Dream's whole-canvas sampler (block_length=None) or cache='free'")
    if not whole and not free and not parallel and st.steps // n_blocks < 2:
        bad(f"Fast-dLLM's Dream block sampler needs >= 2 steps per block (got {st.steps // n_blocks}): "
            f"raise steps to at least {2 * n_blocks}, or use threshold/factor or cache='free'")
    if custom and free:
        bad("FlashDLM's FreeCache sampler for Dream has its own schedule: a custom select rule needs "
            "cache 'none', 'prefix' or 'dual'")


DREAM = Family(defaults=dream_defaults, check=check_dream, canvas=answer_canvas, parts=dream_parts)
