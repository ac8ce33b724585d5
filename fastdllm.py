"""
fastdllm.py: fast inference for masked-diffusion LLMs (LLaDA, Dream): generate(), its plan and the one loop.

A diffusion LM generates by denoising: the answer starts as gen_length [MASK] tokens, and each model call ("step",
counted as NFE) predicts every masked position and commits some. generate() decides once (`make_plan`) four parts a
fork can replace: the cache policy (cache.py: Fast-dLLM's prefix and DualCache, arXiv 2505.22618 section 3.2;
FlashDLM's FreeCache, arXiv 2505.21467), the step rule (sampler.py: how LLaDA and Dream propose; guided.py: FlashDLM's
guided diffusion), the selection rule (Fast-dLLM's threshold and factor decoding, section 3.3) and the stop rule.
Then one loop, each step feed -> propose -> select -> commit -> stop, with one host read. The CLI is cli.py.
"""
import dataclasses
import itertools
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import checks
import sampler as S
from cache import CACHE_POLICIES, CachePolicy, KVCache, Refresh
from guided import guided_parts
from model import Compiled, pad_prompts  # noqa: F401  (pad_prompts: fastdllm's API)


@dataclass
class Settings:
    """Every setting of generate(model, prompt, **settings) and its default, decided here once (None: decided by
    `resolve` from the family and the other settings). The four hooks take a fork's own part (README "Fork it")."""
    gen_length: int = 128              # tokens to generate
    block_length: int | None = 32      # semi-autoregressive block; None = one block (Dream: its own sampler)
    steps: int | None = None           # denoising steps over the answer (None: gen_length, 1 token/step)
    cache: str | CachePolicy = "none"  # "none" | "prefix" | "dual" | "free", or a cache.CachePolicy
    threshold: float | None = None     # Fast-dLLM 3.3: commit every token with confidence >= threshold
    factor: float | None = None        # Fast-dLLM 3.3: factor-based parallel decoding
    select: Callable | None = None     # a selection rule: rule(proposal, at) -> (B, N) bool (sampler.py)
    propose: object | None = None      # a step rule: .propose(logits, at) -> sampler.Proposal (sampler.StepRule)
    stop: Callable | None = None       # a stop rule: rule(x, at, proposal) -> (B,) bool rows ended (sampler.py)
    temperature: float = 0.0           # 0 = greedy
    remasking: str | None = None       # LLaDA: low_confidence | random; Dream: entropy (maskgit_plus if parallel)
    top_p: float | None = None         # Dream's sampling options
    top_k: int | None = None
    alg_temp: float | None = None
    eps: float = 1e-3                  # Dream's time grid runs from 1 down to eps
    refresh_every_step: bool = False   # feed the whole canvas every step (checks the cache plumbing)
    stop_at_eos: bool | int = False    # True: stop after a finished block holding an end token; k: FlashDLM's rule
    eos_ids: list | None = None        # the end tokens (default the config's)
    compile: bool | object = False     # torch.compile the layers (CUDA graphs on CUDA); a Compiled keeps its graphs
    guide: torch.nn.Module | None = None   # FlashDLM guided diffusion: a causal LM with the same token ids
    speculative: bool = False          # guided: commit the guide's token at the first rejection
    accept: str = "deterministic"      # guided: the acceptance rule (guided.ACCEPT_RULES)
    accept_k: int = 5                  # guided top-k and topk_relative
    accept_ratio: float = 0.95         # guided topk_relative ratio
    accept_threshold: float = 0.1      # guided dynamic_threshold: p(draft) > this
    verify_chunk: int = 32             # guided: drafts verified per guide forward


class Step(NamedTuple):
    """Where a decoding step stands: what every hook receives ("at"). The cache policy reads the first nine; the
    rest say what this call fed."""
    n: int                 # model calls so far in this generation (0 = the first: a hook's own state starts afresh)
    i: int                 # steps so far in the current block
    s: int                 # the block is canvas positions [s, e)
    e: int
    x: torch.Tensor        # (B, L) the canvas (hooks read it; the stop rule, and start_block, may fill its masks)
    masked: torch.Tensor   # (B, N) bool: the block's positions still masked
    shift: int             # the family's logits shift: position p is predicted from hidden state p - shift
    mask_id: int           # the [MASK] token id
    cols: torch.Tensor     # (n,) long: the block columns the logits are at (those masked in some row)
    fed: torch.Tensor = None     # (T,) long: the canvas positions this call fed
    span: tuple = None           # (a, b) when those are the span [a, b); None for a fork's set of positions
    rows: torch.Tensor = None    # (n,) long: where the block columns are among the fed positions
    hidden: torch.Tensor = None  # (B, T, dim): the fed positions' hidden states
    head: Callable = None        # the model's LM head (model.Transformer.logits)

    def logits(self, lo: int, hi: int) -> torch.Tensor:
        """The model's logits (B, hi - lo, V) at canvas positions [lo, hi), for a hook that needs more than the block's
        open columns (Prophet's answer window, KLASS's history): one more LM head, on positions this call fed."""
        a, b = self.span or (-1, -1)
        if not a + self.shift <= lo < hi <= b:
            raise ValueError(f"at.logits({lo}, {hi}): this call fed {self.span or 'a set of positions'} (the cache "
                             f"policy's choice): logits exist inside a fed span only (cache='none' feeds the canvas)")
        return self.head(self.hidden, torch.arange(lo - a, hi - a, device=self.hidden.device))


@dataclass
class Plan:
    """What one generate() call decided before its loop, by name: the blocks, the parts the loop calls and what the
    model call needs. The last three fields are what the last host read saw, for the next step (Plan.read)."""
    blocks: list              # [(s, e)] the semi-autoregressive blocks of the answer
    cache: CachePolicy        # the cache policy: what each step feeds (cache.py)
    keys: Callable | None     # its keys(at) -> (B, L) bool, the keys a step may attend to (None for the built-ins)
    slots: Callable | None    # its slots(at, fed) -> (B, T) per-row KV slots (FreeCache in a batch; else None)
    step_rule: S.StepRule     # proposes tokens and confidences (sampler.py, guided.py, or a fork's)
    select: Callable          # the selection rule: which proposals a step commits
    stop: Callable            # the stop rule: which rows' answers have ended
    model: torch.nn.Module
    layers: Callable          # the model's layers: model.hidden, or its compiled form (compile=True)
    kv: KVCache | None        # keys/values of the whole canvas (None: cache "none" attends over what it feeds)
    pos: torch.Tensor         # (B, L) RoPE positions (a left-padded row counts from its first token)
    mask: torch.Tensor | None # (B, 1, L, L) the attention mask of padded rows, or None
    mask_id: int
    shift: int                # the family's logits shift (Dream: position p is predicted from hidden state p - 1)
    P: int                    # the prompt's length: the answer is [P, L)
    exact_steps: int | None   # a block takes exactly these calls (DreamCanvas: diffusion_generate); None: until no mask
    patience: int             # calls after which a block still open is a rule that commits nothing
    calls_per_block: int      # the fewest calls a block takes (for calls_saved)
    eos: torch.Tensor         # the end-of-text ids (answer_tokens)
    ar: torch.Tensor          # arange(L): spans and columns as views, no kernel
    seen: torch.Tensor        # (B, L) the canvas the last read saw: no hook may overwrite one of its tokens
    cols: torch.Tensor = None # (n,) long, on the device: the block's columns still masked in some row...
    masked_cols: list = None  # ... and on the host (the span's checks)

    def feed(self, x, n: int, i: int, s: int, e: int) -> tuple[Step, torch.Tensor]:
        """1. feed: where this step stands, what the cache policy feeds, one model call -> (at, logits (B, n, V) at the
        block's open columns). A span from the first open position starts one earlier for Dream (p from p - 1)."""
        cols, masked_cols = (self.ar[:e - s], list(range(e - s))) if i == 0 else (self.cols, self.masked_cols)  # a block: all
        at = Step(n, i, s, e, x, x[:, s:e] == self.mask_id, self.shift, self.mask_id, cols)
        wanted, L = self.cache.span(at), x.shape[1]
        if isinstance(wanted, torch.Tensor):       # a fork's set of positions: checked with one more host read
            fed, span, chunk, rows = wanted, None, wanted, checks.positions(wanted, at, cols, self.kv is not None, self.cache)
        else:
            a, b = wanted if isinstance(wanted, (tuple, list)) and len(wanted) == 2 else (None, None)
            a = a - self.shift if a == s + masked_cols[0] else a
            if not (type(a) is int and type(b) is int and 0 <= a < b <= L and a + self.shift <= s + masked_cols[0]
                    and s + masked_cols[-1] < b and (n > 0 or self.kv is None or (a, b) == (0, L))):
                checks.refuse_span(self.cache, at, wanted, masked_cols[0], masked_cols[-1])
            fed, span, chunk, rows = self.ar[a:b], (a, b), slice(a, b), cols + (s - a)
        keys = self.keys and checks.key_mask(self.keys(at), x.shape, self.cache)   # (B, L) bool, or None
        mask = self.mask        # padding (B, 1, L, L): the fed queries' rows; keys: the canvas (a KV cache), else the fed
        if mask is not None:
            mask = mask[:, :, chunk] if self.kv is not None else mask[:, :, chunk][..., chunk]
        if keys is not None:
            keys = (keys if self.kv is not None else keys[:, chunk])[:, None, None, :]
            mask = keys if mask is None else mask & keys
        slots = self.slots and checks.slots(self.slots(at, fed), x.shape[0], fed, self.cache)
        h = self.layers(x[:, chunk], self.pos[:, chunk], self.kv, fed if slots is None else slots, mask)
        return at._replace(fed=fed, span=span, rows=rows, hidden=h, head=self.model.logits), self.model.logits(h, rows)

    def read(self, x, at: Step, p: S.Proposal, take, ended, stats: dict) -> tuple[bool, bool]:
        """The step's one host read: the hooks' answers checked (shapes and dtypes on the host; values in the read),
        the stats, the block's open columns for the next step; then the one decision -> (every row's answer has
        ended, the block has)."""
        checks.shapes(p, take, ended, at.masked.shape, self.step_rule, self.select, self.stop)  # else one line naming the hook
        diff, answer = x != self.seen, x[:, self.P:] == self.mask_id         # (B, L), (B, gen_length)
        open_cols = answer[:, at.s - self.P:at.e - self.P].any(0)           # (N,) the block's columns still masked
        flags = [~torch.isfinite(p.logits.sum(-1, dtype=torch.float32)).all(), (p.open & ~at.masked).any(),
                 (take & ~p.open).any(), (diff & (self.seen != self.mask_id)).any(), (ended[:, None] & answer).any()]
        stats["row_nfe"] = stats["row_nfe"] + at.masked.any(-1)           # device tensors until the end
        stats["row_committed"] = stats["row_committed"] + take.sum(-1)
        values = torch.stack([*flags, p.open.any(), ended.all(), take.sum(), diff.sum()])
        got = torch.cat([values, open_cols]).tolist()                     # the read
        if any(got[:len(flags)]):                                         # a hook broke a rule, or the model NaN
            checks.refuse_step(*got[:len(flags)], at, self.step_rule, self.select, self.stop)
        proposed, answer_ended, committed, changed = got[len(flags):len(values)]
        still = [c for c, m in enumerate(got[len(values):]) if m]          # the block's columns still masked
        self.cols, self.seen = open_cols.nonzero_static(size=len(still)).squeeze(1), x.clone()
        self.masked_cols = still or [0]       # the span's checks (a block with no mask left: its first column)
        stats.update(nfe=stats["nfe"] + 1, guide_calls=getattr(self.step_rule, "guide_calls", 0))
        for key, value in (("fed", at.fed.shape[0]), ("committed", committed), ("filled", changed - committed)):
            stats[key].append(value)
        block_ended = at.i + 1 == self.exact_steps if self.exact_steps else not still
        if not block_ended and at.i > self.patience:              # past any schedule, and one step a position
            checks.no_progress(proposed, at, self.step_rule, self.select)
        return bool(answer_ended), block_ended

    def finish(self, x, stats: dict, t0: float) -> dict:
        torch.cuda.synchronize(x.device) if x.is_cuda else None
        seconds, end = time.perf_counter() - t0, torch.isin(x[:, self.P:], self.eos)   # tokens/s: answers, not filler
        tokens = int(torch.where(end.any(-1), end.long().argmax(-1), end.shape[1]).sum())
        return stats | dict(seconds=seconds, answer_tokens=tokens, tokens_per_s=tokens / max(seconds, 1e-9),
                            row_nfe=stats["row_nfe"].tolist(), row_committed=stats["row_committed"].tolist())


def resolve(model, prompt, options: dict, attention_mask, generator, on_step) -> tuple[Settings, bool]:
    """The call's settings with every default decided (the family's and the method's) and every check passed ->
    (settings, whether this is Dream's own whole-canvas sampler)."""
    st = Settings(**checks.known(options, Settings))
    dream, guided = model.config.family == "dream", st.guide is not None
    parallel = st.threshold is not None or st.factor is not None or getattr(st.select, "parallel", st.select is not None)
    remasking = ("maskgit_plus" if parallel else "entropy") if dream else "low_confidence"
    st = dataclasses.replace(st, remasking=st.remasking or remasking, steps=st.gen_length if st.steps is None or guided
                             else st.steps, block_length=st.gen_length if guided else st.block_length or st.gen_length)
    whole_canvas = dream and options.get("block_length", Settings.block_length) is None and not guided
    checks.check_call(model, prompt, st, attention_mask, generator, on_step, whole_canvas, Settings(), options)
    return st, whole_canvas


def make_plan(model, prompt, options: dict, attention_mask, generator, on_step=None):
    """Turn the settings into the parts the loop calls, once: everything here depends only on the call's settings,
    so the loop has no branch on a setting. -> (the plan, the canvas it starts from: [prompt, MASK x gen_length])."""
    st, whole_canvas = resolve(model, prompt, options, attention_mask, generator, on_step)
    cfg, device = model.config, model.lm_head.weight.device
    (B, P), generator = prompt.shape, generator or torch.Generator(device).manual_seed(0)
    x = F.pad(prompt.to(device), (0, st.gen_length), value=cfg.mask_id)
    eos = torch.tensor(sorted(set(st.eos_ids or cfg.eos_ids or [cfg.eos_id]) - {None}), dtype=torch.long, device=device)
    pos = mask = None           # left-padded rows: real tokens count from 0, pads neither attend nor are attended to
    if attention_mask is not None and (attention_mask == 0).any():
        m = F.pad(attention_mask.to(device).bool(), (0, st.gen_length), value=True)
        pos, mask = (m.long().cumsum(-1) - 1).masked_fill(~m, 1), m[:, None, None, :] & m[:, None, :, None]
    if st.guide is not None:    # FlashDLM's guided diffusion: one block; a committed end token ends the answer
        (step_rule, select, cache), stop_run = guided_parts(model, st, Settings(), x[:, :P], attention_mask, pos, eos), 1
    else:
        step_rule, select = S.family_rules(cfg, st, whole_canvas, generator, device)
        cache, stop_run = st.cache if isinstance(st.cache, CachePolicy) else CACHE_POLICIES[st.cache](), st.stop_at_eos
    cache = Refresh(cache) if st.refresh_every_step else cache
    stop = st.stop or (S.EndOfText(P, eos, cfg.mask_id, stop_run) if stop_run else S.NoStop())
    compiled = st.compile and cache.fixed_width and (st.compile if isinstance(st.compile, Compiled) else Compiled())
    kv = (compiled.cache if compiled else KVCache.for_model)(model, B, x.shape[1], cache.spare) if cache.keeps_cache else None
    spb, L = getattr(step_rule, "steps_per_block", 0), x.shape[1]
    ar = torch.arange(L, device=device)
    plan = Plan(blocks=[(s, s + st.block_length) for s in range(P, L, st.block_length)], cache=cache, keys=cache.keys,
                slots=cache.slots, step_rule=step_rule, select=select, stop=stop, model=model,
                layers=partial(compiled, model) if compiled else model.hidden, kv=kv,
                pos=ar.expand(B, L) if pos is None else pos, mask=mask, mask_id=cfg.mask_id,
                shift=int(cfg.shift_logits), P=P, exact_steps=getattr(step_rule, "exact_steps", None),
                patience=spb + st.block_length, calls_per_block=1 if getattr(select, "parallel", True) else max(spb, 1),
                eos=eos, ar=ar, seen=x.clone())
    return plan, x


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, on_step=None, **settings):
    """Decode gen_length tokens after `prompt` (B, P) -> (ids (B, P + gen_length), stats: "nfe" (model calls),
    "row_nfe", "row_committed" (per row), "fed", "committed", "filled" (per call), "calls_saved", "guide_calls",
    "seconds", "answer_tokens", "tokens_per_s": README "Python API"). settings: the fields of `Settings`.
    attention_mask: (B, P) 1/0 for left-padded prompts: each row decodes as it would alone. generator: the only
    source of randomness (default: one seeded 0). on_step(x, stats): called after every step, the canvas live."""
    plan, x = make_plan(model, prompt, settings, attention_mask, generator, on_step)
    on_step = on_step or (lambda x, stats: None)
    stats = dict(nfe=0, row_nfe=0, row_committed=0, fed=[], committed=[], filled=[], calls_saved=0, guide_calls=0)
    t0, p, take = time.perf_counter(), None, None
    try:
        for b, (s, e) in enumerate(plan.blocks):
            plan.step_rule.start_block(x, s, e)
            for i in itertools.count():
                at, logits = plan.feed(x, stats["nfe"], i, s, e)         # 1. feed: what the cache policy names
                p = plan.step_rule.propose(logits, at)                   # 2. propose
                take = plan.select(p, at)                                # 3. select
                x[:, s:e] = torch.where(take, p.x0, x[:, s:e])           # 4. commit
                ended = plan.stop(x, at, p)                              # 5. stop
                answer_ended, block_ended = plan.read(x, at, p, take, ended, stats)   # the one host read
                on_step(x, stats)
                if answer_ended or block_ended:
                    break
            if answer_ended:                                             # every row's answer has ended
                stats["calls_saved"] = (len(plan.blocks) - b - 1) * plan.calls_per_block
                break
    except (TypeError, RuntimeError, AttributeError):    # a proposal or selection the commit could not use: name it
        if p is not None:
            checks.shapes(p, take, None, x[:, s:e].shape, plan.step_rule, plan.select, plan.stop)
        raise
    return x, plan.finish(x, stats, t0)


if __name__ == "__main__":   # `python fastdllm.py --prompt ...` runs the command line, cli.py, as the main program
    import runpy
    runpy.run_module("cli", run_name="__main__")
