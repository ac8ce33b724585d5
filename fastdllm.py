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
from model import Compiled, pad_prompts, padding  # noqa: F401  (pad_prompts: fastdllm's API)


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
    """Where a decoding step stands: what every hook receives ("at"). The cache policy reads the first eight; the
    rest say what this call fed."""
    n: int                 # model calls so far in this generation (0 = the first: a hook's own state starts afresh)
    i: int                 # steps so far in the current block
    s: int                 # the block is canvas positions [s, e)
    e: int
    x: torch.Tensor        # (B, L) the canvas (hooks read it; only the stop rule writes it, and only its masks)
    masked: torch.Tensor   # (B, N) bool: the block's positions still masked
    shift: int             # the family's logits shift: position p is predicted from hidden state p - shift
    cols: torch.Tensor     # (n,) long: the block columns the logits are at (those masked in some row)
    fed: torch.Tensor = None     # (T,) long: the canvas positions this call fed
    span: tuple = None           # (a, b) when those are the span [a, b); None for a fork's set of positions
    rows: torch.Tensor = None    # (n,) long: where the block columns are among the fed positions
    hidden: torch.Tensor = None  # (B, T, dim): the fed positions' hidden states
    head: Callable = None        # the model's LM head (model.Transformer.logits)
    seen: torch.Tensor = None    # (B, L): the canvas as the last host read saw it (no hook may overwrite a token)

    def logits(self, lo: int, hi: int) -> torch.Tensor:
        """The model's logits (B, hi - lo, V) at canvas positions [lo, hi), for a hook that needs more than the block's
        open columns (Prophet's answer window, KLASS's history): one more LM head, on positions this call fed."""
        a, b = self.span or (-1, -1)
        if not a + self.shift <= lo < hi <= b:
            raise ValueError(f"at.logits({lo}, {hi}): this call fed {self.span or 'a set of positions'} (the cache "
                             f"policy's choice): logits exist inside a fed span only (cache='none' feeds the canvas)")
        return self.head(self.hidden, torch.arange(lo - a, hi - a, device=self.hidden.device))


class Read(NamedTuple):
    """What the step's one host read tells the loop (Plan.read)."""
    seen: torch.Tensor           # (B, L) a copy of the canvas it read
    cols: torch.Tensor = None    # (n,) long, on the device: the block's columns still masked in some row
    first: int = 0               # the first and the last of them, on the host (the next span's checks)
    last: int = 0
    answer_ended: bool = False   # every row's answer has ended
    block_ended: bool = False    # the block has no mask left (or its step rule's exact steps are done)


class Values(NamedTuple):
    """The device values a step reads in one go, by name (Plan.read); the first five and the last are checks of the
    hooks (checks.refuse_step says what each means)."""
    nonfinite: int
    opened: int
    outside: int
    overwrote: int
    unfilled: int
    proposed: int        # the proposal opened some position
    all_ended: int       # every row's answer has ended
    committed: int       # tokens the selection committed (all rows)
    changed: int         # tokens that changed: the committed ones and the stop rule's fills
    uncovered: int = 0


@dataclass
class Plan:
    """What one generate() call decided before its loop: the blocks, and the parts the loop calls, by name."""
    blocks: list              # [(s, e)] the semi-autoregressive blocks of the answer
    cache: CachePolicy        # the cache policy: what each step feeds (cache.py)
    step_rule: S.StepRule     # proposes tokens and confidences (sampler.py, guided.py, or a fork's)
    select: Callable          # the selection rule: which proposals a step commits
    stop: Callable            # the stop rule: which rows' answers have ended
    model: torch.nn.Module
    hidden: Callable          # the model's layers, model.hidden or its compiled form (compile=True)
    kv: KVCache | None        # keys/values of the whole canvas (None: cache "none" attends over what it feeds)
    pos: torch.Tensor         # (B, L) RoPE positions (a left-padded row counts from its first token)
    mask: torch.Tensor | None # (B, 1, L, L) the attention mask of padded rows
    calls_per_block: int      # the fewest calls a block takes (for calls_saved)
    eos: torch.Tensor         # the end-of-text ids (answer_tokens)

    def __post_init__(self):
        cfg = self.model.config
        self.mask_id, self.shift, self.P = cfg.mask_id, int(cfg.shift_logits), self.blocks[0][0]
        self.ar = torch.arange(self.pos.shape[1], device=self.pos.device)   # spans and columns as views, no kernel

    def feed(self, x, n: int, i: int, s: int, e: int, last: Read) -> tuple[Step, torch.Tensor]:
        """1. feed: where this step stands, what the cache policy feeds, one model call -> (at, logits (B, n, V) at the
        block's open columns). A span from the first open position starts one earlier for Dream (p from p - 1)."""
        at = Step(n, i, s, e, x, x[:, s:e] == self.mask_id, self.shift, last.cols, seen=last.seen)
        span, L = self.cache.span(at), x.shape[1]
        if isinstance(span, torch.Tensor):          # a fork's sorted set of positions: its coverage is read later
            fed, span, chunk, rows = span, None, span, torch.searchsorted(span, s + last.cols)
        else:
            a, b = span if isinstance(span, (tuple, list)) and len(span) == 2 else (None, None)
            a = a - self.shift if a == s + last.first else a
            if not (type(a) is int and type(b) is int and 0 <= a < b <= L and a + self.shift <= s + last.first
                    and s + last.last < b and (n > 0 or not self.cache.keeps_cache or (a, b) == (0, L))):
                checks.refuse_span(self.cache, at, span, last.first, last.last)
            fed, span, chunk, rows = self.ar[a:b], (a, b), slice(a, b), last.cols + (s - a)
        keys = self.cache.keys and checks.key_mask(self.cache.keys(at), x.shape, self.cache)   # (B, L) bool, or None
        mask = self.mask        # padding (B, 1, L, L): the fed queries' rows; keys: the canvas (a KV cache), else the fed
        if mask is not None:
            mask = mask[:, :, chunk] if self.kv is not None else mask[:, :, chunk][..., chunk]
        if keys is not None:
            keys = (keys if self.kv is not None else keys[:, chunk])[:, None, None, :]
            mask = keys if mask is None else mask & keys
        slots = self.cache.slots and self.cache.slots(at, fed)
        h = self.hidden(x[:, chunk], self.pos[:, chunk], self.kv, fed if slots is None else slots, mask)
        return at._replace(fed=fed, span=span, rows=rows, hidden=h, head=self.model.logits), self.model.logits(h, rows)

    def check(self, at: Step, p: S.Proposal, take):
        """The proposal and the selection at the boundary, before the commit uses them: shapes and dtypes (host
        metadata; their values are checked in the step's read). A refusal is one line naming the hook."""
        B, N = at.masked.shape
        kinds = [(getattr(p, f, None), shape, dtype) for f, shape, dtype in (("x0", (B, N), "long"), ("conf", (B, N),
                 "float"), ("open", (B, N), "bool"), ("k", (B,), "long"))] + [(take, (B, N), "bool")]
        for v, shape, dtype in kinds:
            if not (isinstance(v, torch.Tensor) and v.shape == shape and checks.kind(v) == dtype):
                checks.refuse_answers(p, take, B, N, self.step_rule, self.select)

    def read(self, x, at: Step, p: S.Proposal, take, ended, stats: dict) -> Read:
        """The step's one host read: every value check of the hooks, the stats, the block's open columns for the next
        step; then the one decision: does the block, or the answer, end here?"""
        B, N = at.masked.shape
        if not (isinstance(ended, torch.Tensor) and ended.dtype == torch.bool and ended.shape == (B,)):
            checks.refuse_answer("stop=", self.stop, ended, f"a stop rule returns a ({B},) bool tensor, True = the "
                                 f"row's answer has ended")
        changed, answer = x != at.seen, x[:, self.P:] == self.mask_id      # (B, L), (B, gen_length)
        open_cols = answer[:, at.s - self.P:at.e - self.P].any(0)           # (N,) the block's columns still masked
        values = [~torch.isfinite(p.logits.sum(-1, dtype=torch.float32)).all(), (p.open & ~at.masked).any(),
                  (take & ~p.open).any(), (changed & (at.seen != self.mask_id)).any(), (ended[:, None] & answer).any(),
                  p.open.any(), ended.all(), take.sum(), changed.sum()]
        values += [checks.uncovered(at)] if at.span is None else []     # a fork's set of positions
        stats["row_nfe"] = stats["row_nfe"] + at.masked.any(-1)           # device tensors until the end
        stats["row_committed"] = stats["row_committed"] + take.sum(-1)
        got = torch.cat([torch.stack(values), open_cols]).tolist()        # the read
        v, n = Values(*got[:len(values)]), sum(got[len(values):])
        if v.nonfinite or v.opened or v.outside or v.overwrote or v.unfilled or v.uncovered:
                checks.refuse_step(v, at, self.cache, self.step_rule, self.select, self.stop)
        stats.update(nfe=stats["nfe"] + 1, guide_calls=getattr(self.step_rule, "guide_calls", 0))
        for key, value in (("fed", at.fed.shape[0]), ("committed", v.committed), ("filled", v.changed - v.committed)):
            stats[key].append(value)
        exact = self.step_rule.exact_steps                # Dream's own sampler takes exactly its steps
        block_ended = at.i + 1 == exact if exact else n == 0
        if not block_ended and at.i > self.step_rule.steps_per_block + N:
            checks.no_progress(v, at, self.step_rule, self.select)       # past any schedule, nothing committed
        cols = [c for c, m in enumerate(got[len(values):]) if m] or [0]
        return Read(x.clone(), open_cols.nonzero_static(size=n).squeeze(1), cols[0], cols[-1], bool(v.all_ended),
                    block_ended)

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
    st = dataclasses.replace(st, remasking=st.remasking or ("maskgit_plus" if parallel else "entropy") if dream else
                             st.remasking or "low_confidence", steps=st.gen_length if st.steps is None or guided else
                             st.steps, block_length=st.gen_length if guided else st.block_length or st.gen_length)
    whole_canvas = dream and options.get("block_length", Settings.block_length) is None and not guided
    checks.check_call(model, prompt, st, attention_mask, generator, on_step, whole_canvas, Settings(), options)
    return st, whole_canvas


def make_plan(model, prompt, options: dict, attention_mask, generator, on_step=None) -> Plan:
    """Turn the settings into the parts the loop calls, once: everything here depends only on the call's settings,
    so the loop has no branch on a setting."""
    st, whole_canvas = resolve(model, prompt, options, attention_mask, generator, on_step)
    cfg, device = model.config, model.lm_head.weight.device
    (B, P), generator = prompt.shape, generator or torch.Generator(device).manual_seed(0)
    L = P + st.gen_length
    eos = torch.tensor(sorted(set(st.eos_ids or cfg.eos_ids or [cfg.eos_id]) - {None}), dtype=torch.long, device=device)
    pos, mask = padding(attention_mask, st.gen_length, device)
    if st.guide is not None:    # FlashDLM's guided diffusion: one block; a committed end token ends the answer
        (step_rule, select, cache), stop_run = guided_parts(model, st, Settings(), prompt.to(device), attention_mask, pos, eos), 1
    else:
        step_rule, select = S.family_rules(cfg, st, whole_canvas, generator, device)
        cache, stop_run = st.cache if isinstance(st.cache, CachePolicy) else CACHE_POLICIES[st.cache](), st.stop_at_eos
    cache = Refresh(cache) if st.refresh_every_step else cache
    stop = st.stop or (S.EndOfText(P, eos, cfg.mask_id, stop_run) if stop_run else S.NoStop())
    compiled = st.compile and cache.fixed_width and (st.compile if isinstance(st.compile, Compiled) else Compiled())
    kv = (compiled.cache if compiled else KVCache.for_model)(model, B, L, cache.spare) if cache.keeps_cache else None
    calls_per_block = 1 if getattr(select, "parallel", True) else max(getattr(step_rule, "steps_per_block", 0), 1)
    return Plan([(s, s + st.block_length) for s in range(P, L, st.block_length)], cache, step_rule, select, stop,
                model, partial(compiled, model) if compiled else model.hidden, kv,
                torch.arange(L, device=device).expand(B, L) if pos is None else pos, mask, calls_per_block, eos)


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, on_step=None, **settings):
    """Decode gen_length tokens after `prompt` (B, P) -> (ids (B, P + gen_length), stats: "nfe" (model calls),
    "row_nfe", "row_committed" (per row), "fed", "committed", "filled" (per call), "calls_saved", "guide_calls",
    "seconds", "answer_tokens", "tokens_per_s": README "Python API"). settings: the fields of `Settings`.
    attention_mask: (B, P) 1/0 for left-padded prompts: each row decodes as it would alone. generator: the only
    source of randomness (default: one seeded 0). on_step(x, stats): called after every step, the canvas live."""
    plan = make_plan(model, prompt, settings, attention_mask, generator, on_step)
    on_step = on_step or (lambda x, stats: None)
    x = F.pad(prompt.to(plan.ar.device), (0, len(plan.ar) - prompt.shape[1]), value=plan.mask_id)
    stats = dict(nfe=0, row_nfe=0, row_committed=0, fed=[], committed=[], filled=[], calls_saved=0, guide_calls=0)
    read, t0 = Read(x.clone()), time.perf_counter()
    for b, (s, e) in enumerate(plan.blocks):
        plan.step_rule.start_block(x, s, e)
        read = read._replace(cols=plan.ar[:e - s], first=0, last=e - s - 1)    # a block starts with every column open
        for i in itertools.count():
            at, logits = plan.feed(x, stats["nfe"], i, s, e, read)   # 1. feed: the cache policy's span, one model call
            p = plan.step_rule.propose(logits, at)                   # 2. propose
            take = plan.select(p, at)                                # 3. select
            plan.check(at, p, take)                                  #    (their shapes, before the commit uses them)
            x[:, s:e] = torch.where(take, p.x0, x[:, s:e])           # 4. commit
            ended = plan.stop(x, at, p)                              # 5. stop
            read = plan.read(x, at, p, take, ended, stats)           # the step's one host read and the decision
            on_step(x, stats)
            if read.answer_ended or read.block_ended:
                break
        if read.answer_ended:                                        # every row's answer has ended
            stats["calls_saved"] = (len(plan.blocks) - b - 1) * plan.calls_per_block
            break
    return x, plan.finish(x, stats, t0)


if __name__ == "__main__":   # `python fastdllm.py --prompt ...` runs the command line, cli.py, as the main program
    import runpy
    runpy.run_module("cli", run_name="__main__")
