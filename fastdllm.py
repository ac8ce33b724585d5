"""
fastdllm.py: fast inference for masked-diffusion LLMs (LLaDA, Dream; block diffusion: Fast-dLLM v2, SDAR, LLaDA2):
generate(), its plan and the one loop.

A diffusion LM generates by denoising: the answer starts as gen_length [MASK] tokens, and each model call ("step",
counted as NFE) predicts every masked position and commits some. generate() decides once (`make_plan`) four parts a
fork can replace: the cache policy (cache.py: Fast-dLLM's prefix and DualCache, arXiv 2505.22618 section 3.2;
FlashDLM's FreeCache, arXiv 2505.21467; a block-causal model's exact prefix cache), the step rule (sampler.py: how
LLaDA and Dream propose; blockdiff.py: Fast-dLLM v2 and SDAR; guided.py: FlashDLM's guided diffusion), the selection
rule (Fast-dLLM's threshold and factor decoding, section 3.3) and the stop rule. Then one loop, each step feed ->
propose -> select -> commit -> stop, with one host read. The CLI is cli.py.
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
from blockdiff import (FAMILIES as BLOCK_FAMILIES, SDAR_BLOCK, V2_SUB_BLOCK, block_causal, block_parts, check_block,
                       grid_canvas, grid_output)
from cache import CACHE_POLICIES, CachePolicy, KVCache, Refresh
from dream import dream_parts
from graphs import Compiled, CudaGraphs, model_call  # noqa: F401  (fastdllm.Compiled, fastdllm.CudaGraphs)
from guided import guided_parts
from llada2 import STEPS as LLADA2_STEPS


def pad_prompts(rows: list[list[int]], pad_id: int):
    """Prompts of different lengths -> (ids (B, P), attention_mask (B, P)), left-padded so that every answer
    starts at the same canvas position."""
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (P - len(r)) + list(r) for r in rows])
    return ids, (torch.arange(P) >= torch.tensor([[P - len(r)] for r in rows])).long()


@dataclass
class Settings:
    """Every setting of generate(model, prompt, **settings) and its default, decided here once (None: decided by
    `resolve` from the family and the other settings). The four hooks take a fork's own part (README "Fork it")."""
    gen_length: int = 128              # tokens to generate
    block_length: int | None = 32      # semi-autoregressive block; None = one block (Dream: its own sampler)
    sub_block: int | None = None       # Fast-dLLM v2: a block is decoded in sub-blocks of this many tokens (default 8)
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
    minimal_topk: int = 1              # LLaDA2: steps are capped at gen_length // minimal_topk (the official's)
    editing_threshold: float | None = None   # LLaDA2.1: edit a committed token whose new proposal is above this
    max_post_steps: int | None = None  # LLaDA2.1: a block's edit-only calls once it has no mask (default 16)
    num_to_transfer: int | None = None # LLaDA2.1: masks a call commits below the threshold (default 1)
    refresh_every_step: bool = False   # feed the whole canvas every step (checks the cache plumbing)
    stop_at_eos: bool | int = False    # True: stop after a finished block holding an end token; k: FlashDLM's rule
    eos_ids: list | None = None        # the end tokens (default the config's)
    compile: bool | object = False     # torch.compile the layers (CUDA graphs on CUDA); a Compiled keeps its graphs
    cuda_graphs: bool | object | None = None   # CUDA graphs of the layers (None: on CUDA); a CudaGraphs keeps them
    guide: torch.nn.Module | None = None   # FlashDLM guided diffusion: a causal LM with the same token ids
    speculative: bool = False          # guided: commit the guide's token at the first rejection
    accept: str = "deterministic"      # guided: the acceptance rule (guided.ACCEPT_RULES)
    accept_k: int = 5                  # guided top-k and topk_relative
    accept_ratio: float = 0.95         # guided topk_relative ratio
    accept_threshold: float = 0.1      # guided dynamic_threshold: p(draft) > this
    verify_chunk: int = 32             # guided: drafts verified per guide forward


class Step(NamedTuple):
    """Where a decoding step stands: what every hook receives ("at"). The cache policy reads the first eleven; the
    rest say what this call fed."""
    n: int                 # model calls so far in this generation (0 = the first: a hook's own state starts afresh)
    i: int                 # steps so far in the current block
    s: int                 # the block is canvas positions [s, e)
    e: int
    x: torch.Tensor        # (B, L) the canvas (hooks read it; the stop rule, and start_block, may fill its masks)
    masked: torch.Tensor   # (B, N) bool: the block's positions still masked
    shift: int             # the family's logits shift: position p is predicted from hidden state p - shift
    mask_id: int           # the [MASK] token id
    prompt: torch.Tensor   # (B, 2) long: each row's prompt [begin, end) on the canvas (its answer starts at end)
    cols: torch.Tensor     # (n,) long: the block columns the logits are at (masked in some row, or every column for a
                           #   rule that reads the whole block: StepRule.reads_block; predicted by the feed)
    masked_cols: list      # the block columns masked in some row, on the host (as the last step's read saw them)
    fed: torch.Tensor = None     # (T,) long: the canvas positions this call fed
    span: tuple = None           # (a, b) when those are the span [a, b); None for a fork's set of positions
    rows: torch.Tensor = None    # (n,) long: where the block columns' predicting positions are among the fed ones
    hidden: torch.Tensor = None  # (B, T, dim): the fed positions' hidden states
    head: Callable = None        # the model's LM head (model.Transformer.logits)

    def logits(self, lo: int, hi: int) -> torch.Tensor:
        """The model's logits (B, hi - lo, V) for canvas positions [lo, hi), for a hook that needs more than the block's
        open columns (Prophet's answer window, KLASS's history): one more LM head, on positions this call fed."""
        a, b = self.span or (-1, -1)
        if not a <= lo - self.shift < hi - self.shift <= b:
            raise ValueError(f"at.logits({lo}, {hi}): this call fed {self.span or 'a set of positions'} (the cache "
                             f"policy's choice), and position p is predicted from p - {self.shift}: logits exist for "
                             f"[{a + self.shift}, {b + self.shift}) only (cache='none' feeds the canvas)")
        return self.head(self.hidden, torch.arange(lo - a - self.shift, hi - a - self.shift, device=self.hidden.device))


class Seen(NamedTuple):
    """What a step's one host read saw, for the next step's feed (Plan.read): the block's columns still masked in some
    row, on the device and on the host (at a block's end: the next block's), the canvas (no hook may overwrite one of
    its tokens but a mask), the frontier of keys/values written so far, and the two decisions."""
    cols: torch.Tensor
    masked_cols: list
    canvas: torch.Tensor
    written: int              # keys/values [0, written) hold some call's (a KV cache's first call must reach the rest)
    calls: int = 0            # model calls so far in this generation
    answer_ended: bool = False
    block_ended: bool = False
    post: int = 0             # calls so far in this block that found no mask (an editing rule's post steps)


def predicting(a: int, b: int, s: int, cols: torch.Tensor, listed: list, shift: int):
    """The logits shift, where a span meets it: position p is predicted from hidden state p - shift. A cache policy's
    span [a, b) and the block columns that want logits (cols (n,), and the same sorted on the host: listed) -> (a:
    where the fed span starts, one position earlier for a shifted family when it starts at the first wanted column,
    which is predicted from the one before it; the columns whose predicting positions the fed span holds; those
    positions' rows among the fed ones)."""
    a -= shift if listed and a == s + listed[0] else 0
    first = next((k for k, c in enumerate(listed) if s + c - shift >= a), len(listed))
    last = next((k for k, c in enumerate(listed) if s + c - shift >= b), len(listed))
    cols = cols[first:max(first, last)]
    return a, cols, cols + (s - shift - a)


@dataclass
class Plan:
    """What one generate() call decided before its loop, by name: the blocks, the parts the loop calls and what the
    model call needs. The step-to-step state is not here: each step's read hands it to the next step (Seen)."""
    blocks: list              # [(s, e)] the semi-autoregressive blocks of the answer
    cache: CachePolicy        # the cache policy: what each step feeds (cache.py); its optional hooks, keys and slots,
                              #   are None for the built-in policies but FreeCache's and the sub-block cache's slots
    step_rule: S.StepRule     # proposes tokens and confidences (sampler.py, blockdiff.py, guided.py, or a fork's)
    select: Callable          # the selection rule: which proposals a step commits
    stop: Callable            # the stop rule: which rows' answers have ended
    model: torch.nn.Module
    layers: Callable          # the model's layers: model.hidden, replayed from CUDA graphs or compiled (graphs.py)
    kv: KVCache | None        # keys/values of the whole canvas (None: cache "none" attends over what it feeds)
    pos: torch.Tensor         # (B, L) RoPE positions (a left-padded row counts from its first token)
    mask: torch.Tensor | None # (B or 1, 1, L, L) the attention mask (padded rows; a block-causal model's grid), or None
    mask_id: int
    shift: int                # the family's logits shift (Dream, Fast-dLLM v2: position p is predicted from p - 1)
    prompt: torch.Tensor      # (B, 2) each row's prompt [begin, end) on the canvas
    grid: int                 # a block-causal model's grid (a query sees its own grid block and those before); 0: none
    exact_steps: int | None   # a block takes exactly these calls (DreamCanvas: diffusion_generate); None: until no mask
    patience: int             # calls after which a block still open is a rule that commits nothing
    calls_per_block: int      # the fewest calls a block takes (for calls_saved)
    eos: torch.Tensor         # the end-of-text ids (answer_tokens)
    ar: torch.Tensor          # arange(L): spans and columns as views, no kernel
    output: Callable          # the canvas -> generate()'s ids (a block-diffusion batch's layout; else as is)
    after: dict               # block start -> the next block's end (a read reports the next block's masked columns)
    answer_at: list           # each row's answer start on the canvas, on the host (stats["final"])
    reads_block: bool         # the step rule reads logits at every block column, not only the masked (LLaDA2.1's)
    edits: bool               # the step rule may rewrite committed tokens of its block (LLaDA2.1's; the others not)
    max_post_steps: int       # calls a block may take once it has no mask (LLaDA2.1's; the others 0)

    def feed(self, x, seen: Seen, i: int, s: int, e: int) -> tuple[Step, torch.Tensor]:
        """1. feed: where this step stands, what the cache policy feeds, one model call -> (at, logits (B, n, V) for
        the block's masked columns whose predicting positions were fed: `predicting`)."""
        n, L = seen.calls, x.shape[1]
        at = Step(n, i, s, e, x, x[:, s:e] == self.mask_id, self.shift, self.mask_id, self.prompt, seen.cols,
                  seen.masked_cols)
        wanted = self.cache.span(at)
        cols, listed = (self.ar[:e - s], range(e - s)) if self.reads_block else (seen.cols, seen.masked_cols)
        if isinstance(wanted, torch.Tensor):       # a fork's set of positions: checked with one more host read
            fed, span, chunk = wanted, None, wanted
            rows = checks.positions(wanted, at, cols, self.kv is not None, self.cache)
        else:
            a, b = wanted if isinstance(wanted, (tuple, list)) and len(wanted) == 2 else (None, None)
            if not (type(a) is int and type(b) is int and 0 <= a < b <= L):
                checks.refuse_span(self.cache, at, wanted)
            a, cols, rows = predicting(a, b, s, cols, listed, self.shift)
            # Keys a fed query sees must all have been written: the whole canvas, or a block-causal grid up to the
            # end of the fed span's block (a KV cache starts empty).
            seen_to = L if not self.grid else min(L, -(-b // self.grid) * self.grid)
            if self.kv is not None and not (a <= seen.written and max(seen.written, b) >= seen_to):
                checks.refuse_unwritten(self.cache, at, (a, b), seen.written, seen_to)
            fed, span, chunk = self.ar[a:b], (a, b), slice(a, b)
        # keys: (B, L) bool, what this step may attend to, or None: every key (then the mask alone)
        keys = self.cache.keys and checks.key_mask(self.cache.keys(at), x.shape, self.cache)
        mask = self.mask        # (B, 1, L, L): the fed queries' rows; keys: the canvas (a KV cache), else the fed
        if mask is not None:
            mask = mask[:, :, chunk] if self.kv is not None else mask[:, :, chunk][..., chunk]
        if keys is not None:
            keys = (keys if self.kv is not None else keys[:, chunk])[:, None, None, :]
            mask = keys if mask is None else mask & keys
        # slots: (B, T) where each row writes the fed keys/values, or None: at the fed positions, in every row
        slots = self.cache.slots and checks.slots(self.cache.slots(at, fed), x.shape[0], fed, self.cache)
        h = self.layers(x[:, chunk], self.pos[:, chunk], self.kv, fed if slots is None else slots, mask)
        at = at._replace(cols=cols, fed=fed, span=span, rows=rows, hidden=h, head=self.model.logits)
        return at, self.model.logits(h, rows)

    def start(self, x) -> Seen:
        """The state before the first step: the first block's masked columns, read off the prompts (on the host)."""
        s, e = self.blocks[0]
        lo = int(self.prompt[:, 1].min())                       # the first position any row leaves masked
        cols = list(range(max(lo - s, 0), e - s))
        return Seen(cols=self.ar[max(lo - s, 0):e - s], masked_cols=cols, canvas=x.clone(), written=0)

    def read(self, x, at: Step, p: S.Proposal, take, ended, seen: Seen, stats: dict) -> Seen:
        """The step's one host read: the hooks' answers checked (shapes and dtypes on the host; values in the read),
        the stats, the block's (and the next block's) masked columns for the next step; then the one decision: has
        every row's answer ended, has the block."""
        checks.shapes(p, take, ended, at.masked.shape, self.step_rule, self.select, self.stop)  # else one line naming the hook
        s, e = at.s, at.e
        diff, masked = x != seen.canvas, x == self.mask_id                 # (B, L): no prompt position is a mask
        with_logits = torch.zeros_like(at.masked[0]).index_fill_(0, at.cols, True)       # (N,)
        edit = torch.zeros_like(take) | p.edit                               # (B, N): the step rule's edits (T2T)
        answer = self.ar[s:e] >= at.prompt[:, 1:]                           # (B, N): not the row's prompt
        edited = F.pad(edit & answer, (s, x.shape[1] - e))                  # (B, L): the edits it may make
        flags = [~torch.isfinite(p.logits.sum(-1, dtype=torch.float32)).all(),
                 (p.open & ~at.masked).any() | (edit & at.masked).any(), (p.open & ~with_logits).any(),
                 (take & ~p.open).any(), (diff & (seen.canvas != self.mask_id) & ~edited).any(),
                 (ended[:, None] & masked).any()]
        stats["row_nfe"] = stats["row_nfe"] + (at.masked.any(-1) | p.busy)  # device tensors until the end
        stats["row_committed"] = stats["row_committed"] + take.sum(-1)
        values = torch.stack([*flags, p.open.any(), ended.all(), take.sum(), diff.sum(), edit.sum()])
        open_cols = masked[:, s:self.after[s]].any(0)                     # (N + N',) this block's columns, the next's
        got = torch.cat([values, open_cols]).tolist()                     # the read
        if any(got[:len(flags)]):                                         # a hook broke a rule, or the model NaN
            checks.refuse_step(*got[:len(flags)], at, self.step_rule, self.select, self.stop, self.cache)
        proposed, answer_ended, committed, changed, edits = got[len(flags):len(values)]
        still = [c for c, m in enumerate(got[len(values):len(values) + e - s]) if m]   # the block's columns still masked
        stats.update(nfe=stats["nfe"] + 1, guide_calls=getattr(self.step_rule, "guide_calls", 0))
        for key, value in (("fed", at.fed.shape[0]), ("committed", committed), ("edited", edits),
                           ("filled", changed - committed - edits)):
            stats[key].append(value)
        # A block ends once no mask is left and its last call changed nothing (a rule that edits: LLaDA2.1's T2T),
        # or after the rule's max_post_steps calls that found no mask (for a rule that does not edit: 0).
        post = (seen.post if at.i else 0) + (not at.masked_cols)
        block_ended = at.i + 1 == self.exact_steps if self.exact_steps else not still and (
            committed + edits == 0 or post >= self.max_post_steps)
        if not block_ended and at.i > self.patience:              # past any schedule, and one step a position
            checks.no_progress(proposed, at, self.step_rule, self.select)
        # The keys/values written so far reach `written`: a span extends it if it starts inside; a fork's set of
        # positions counts only when it is the whole canvas.
        a, b = at.span or (0, x.shape[1] if at.fed.shape[0] == x.shape[1] else 0)
        written = max(seen.written, b) if a <= seen.written else seen.written
        if block_ended:                # the next block's masked columns (and so its first feed's logits)
            still, open_cols = [c for c, m in enumerate(got[len(values) + e - s:]) if m], open_cols[e - s:]
        cols = open_cols[:len(open_cols) if block_ended else e - s].nonzero_static(size=len(still)).squeeze(1)
        # Each row's answer tokens that no later call changes once unmasked: a rule that edits may still rewrite the
        # block's (a stream shows them at its end).
        final = (e if block_ended else s) if self.edits else x.shape[1]
        stats["final"] = [max(final - a, 0) for a in self.answer_at]
        return Seen(cols=cols, masked_cols=still, canvas=x.clone(), written=written, calls=seen.calls + 1,
                    answer_ended=bool(answer_ended), block_ended=block_ended, post=0 if block_ended else post)

    def finish(self, x, stats: dict, t0: float) -> tuple[torch.Tensor, dict]:
        torch.cuda.synchronize(x.device) if x.is_cuda else None
        seconds, out = time.perf_counter() - t0, self.output(x)
        P = out.shape[1] - x.shape[1] + int(self.prompt[:, 1].min())      # the answers start at P in the output
        end = torch.isin(out[:, P:], self.eos)                              # tokens/s: answers, not filler
        tokens = int(torch.where(end.any(-1), end.long().argmax(-1), end.shape[1]).sum())
        return out, stats | dict(seconds=seconds, answer_tokens=tokens, tokens_per_s=tokens / max(seconds, 1e-9),
                                 row_nfe=stats["row_nfe"].tolist(), row_committed=stats["row_committed"].tolist())


def decided(cfg, options: dict) -> Settings:
    """The call's settings with every default decided: the method's (Settings) and the family's (its remasking, its
    block and sub-block, one token a step)."""
    st = Settings(**checks.known(options, Settings))
    guided = st.guide is not None
    dream, block = cfg.family == "dream", cfg.family in BLOCK_FAMILIES and not guided
    parallel = S.is_parallel(st.select, st.threshold, st.factor)
    remasking = (("maskgit_plus" if parallel else "entropy") if dream else "low_confidence" if cfg.family == "llada"
                 else ("low_confidence_dynamic" if st.threshold is not None else "low_confidence_static")
                 if cfg.family == "sdar" else None)
    block_length = ((cfg.block or SDAR_BLOCK) if block and options.get("block_length") is None   # its trained block
                    else st.block_length)
    steps = (block_length if block and cfg.family == "sdar" else LLADA2_STEPS if block and cfg.family == "llada2"
             else st.gen_length)                                                       # one token a step
    sub_block = min(V2_SUB_BLOCK, block_length) if block and cfg.family == "fastdllm_v2" else None
    return dataclasses.replace(st, remasking=st.remasking or remasking, steps=steps if st.steps is None or guided
                               else st.steps, block_length=st.gen_length if guided else block_length or st.gen_length,
                               sub_block=sub_block if st.sub_block is None else st.sub_block)


def resolve(model, prompt, options: dict, attention_mask, generator, on_step) -> tuple[Settings, bool]:
    """The call's settings decided and every check passed -> (settings, whether this is Dream's own whole-canvas
    sampler)."""
    cfg, st = model.config, decided(model.config, options)
    whole_canvas = cfg.family == "dream" and options.get("block_length", Settings.block_length) is None and not st.guide
    checks.check_call(model, prompt, st, attention_mask, generator, on_step, whole_canvas, Settings(), options)
    if cfg.family in BLOCK_FAMILIES and st.guide is None:
        check_block(cfg, st, options, prompt.shape[1])
    return st, whole_canvas


def make_plan(model, prompt, options: dict, attention_mask, generator, on_step=None):
    """Turn the settings into the parts the loop calls, once: everything here depends only on the call's settings,
    so the loop has no branch on a setting. -> (the plan, the canvas it starts from: [prompt, MASK x gen_length])."""
    st, whole_canvas = resolve(model, prompt, options, attention_mask, generator, on_step)
    cfg, device = model.config, model.lm_head.weight.device
    (B, P), generator = prompt.shape, generator or torch.Generator(device).manual_seed(0)
    eos = torch.tensor(sorted(set(st.eos_ids or cfg.eos_ids or [cfg.eos_id]) - {None}), dtype=torch.long, device=device)
    block = cfg.family in BLOCK_FAMILIES and st.guide is None
    if block:       # block diffusion: each row on one grid from position 0, its answer right after its prompt
        x, lengths, blocks = grid_canvas(prompt.to(device), attention_mask, st.gen_length, st.block_length, cfg.family,
                                         cfg.mask_id)
        spans, pos, mask = torch.stack([torch.zeros_like(lengths), lengths], -1), None, block_causal(
            x.shape[1], st.block_length, device)
    else:           # the answer after a common prompt width; left-padded rows: real tokens count from 0
        x = F.pad(prompt.to(device), (0, st.gen_length), value=cfg.mask_id)
        blocks = [(s, s + st.block_length) for s in range(P, x.shape[1], st.block_length)]
        lengths = (attention_mask.to(device).long().sum(-1) if attention_mask is not None else
                   torch.full((B,), P, device=device))
        spans, pos, mask = torch.stack([P - lengths, torch.full_like(lengths, P)], -1), None, None
        if attention_mask is not None and (attention_mask == 0).any():   # pads neither attend nor are attended to
            m = F.pad(attention_mask.to(device).bool(), (0, st.gen_length), value=True)
            pos, mask = (m.long().cumsum(-1) - 1).masked_fill(~m, 1), m[:, None, None, :] & m[:, None, :, None]
    fill = cfg.pad_id if block and cfg.pad_id is not None else int(eos[0])    # what an ended answer is filled with
    if st.guide is not None:    # FlashDLM's guided diffusion: one block; a committed end token ends the answer
        (step_rule, select, cache), stop_run = guided_parts(model, st, Settings(), x[:, :P], attention_mask, pos, eos), 1
    elif block:
        (step_rule, select, cache), stop_run = block_parts(cfg, st, generator), st.stop_at_eos
    else:
        step_rule, select = (dream_parts if cfg.family == "dream" else S.llada_parts)(cfg, st, generator, device,
                                                                                      whole_canvas)
        cache, stop_run = st.cache if isinstance(st.cache, CachePolicy) else CACHE_POLICIES[st.cache](), st.stop_at_eos
    cache = Refresh(cache) if st.refresh_every_step else cache
    end_of_text = getattr(step_rule, "end_of_text", S.EndOfText)     # LLaDA2: once its block is final
    stop = st.stop or (end_of_text(spans[:, 1:], eos, cfg.mask_id, stop_run, fill) if stop_run else S.NoStop())
    cut = cfg.family == "llada2" or stop_run and cfg.family == "fastdllm_v2"     # as the official answers end
    output = (partial(grid_output, lengths=lengths, shortest=int(lengths.min()), P=P, fill=fill,
                      eos=eos if cut else None, gen=st.gen_length if cfg.family == "llada2" else None)
              if block else lambda x: x)
    layers, kv = model_call(model, st.compile, st.cuda_graphs, cache, B, x.shape[1])   # eager, CUDA graphs or compiled
    rule = lambda name: getattr(step_rule, name, getattr(S.StepRule, name))   # noqa: E731  a fork's may not subclass it
    spb, post, L = rule("steps_per_block"), rule("max_post_steps"), x.shape[1]
    ar = torch.arange(L, device=device)
    plan = Plan(blocks=blocks, cache=cache, step_rule=step_rule, select=select, stop=stop, model=model,
                layers=layers, kv=kv,
                pos=ar.expand(B, L) if pos is None else pos, mask=mask, mask_id=cfg.mask_id, shift=cfg.shift,
                prompt=spans, grid=st.block_length if block else 0, exact_steps=rule("exact_steps"),
                patience=spb + st.block_length + post,
                calls_per_block=1 if S.is_parallel(select) else max(spb, 1),
                eos=eos, ar=ar, output=output,
                after={s: (blocks[k + 1][1] if k + 1 < len(blocks) else e) for k, (s, e) in enumerate(blocks)},
                answer_at=spans[:, 1].tolist(), reads_block=rule("reads_block"), edits=rule("edits"),
                max_post_steps=post)
    return plan, x


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, on_step=None, **settings):
    """Decode gen_length tokens after `prompt` (B, P) -> (ids (B, P + gen_length), stats: "nfe" (model calls),
    "row_nfe", "row_committed" (per row), "fed", "committed", "filled" (per call), "final" (per row: its answer's
    tokens no later call changes once unmasked, for a stream), "calls_saved", "guide_calls",
    "seconds", "answer_tokens", "tokens_per_s": README "Python API"). settings: the fields of `Settings`.
    attention_mask: (B, P) 1/0 for left-padded prompts: each row decodes as it would alone. generator: the only
    source of randomness (default: one seeded 0). on_step(x, stats): called after every step, the canvas live (in the
    layout of the ids it returns).
    A block-diffusion model (blockdiff.py) answers to a grid block's edge: ids (B, P + answer), shorter answers
    filled with its pad id."""
    plan, x = make_plan(model, prompt, settings, attention_mask, generator, on_step)
    show = (lambda x, stats: on_step(plan.output(x), stats)) if on_step else (lambda x, stats: None)
    stats = dict(nfe=0, row_nfe=0, row_committed=0, fed=[], committed=[], edited=[], filled=[], calls_saved=0,
                 guide_calls=0)
    t0, p, take, seen = time.perf_counter(), None, None, plan.start(x)
    try:
        for b, (s, e) in enumerate(plan.blocks):
            plan.step_rule.start_block(x, s, e)
            for i in itertools.count():
                at, logits = plan.feed(x, seen, i, s, e)                 # 1. feed: what the cache policy names
                p = plan.step_rule.propose(logits, at)                   # 2. propose
                take = plan.select(p, at)                                # 3. select
                x[:, s:e] = torch.where(take | p.edit, p.x0, x[:, s:e])  # 4. commit (and a rule's edits)
                ended = plan.stop(x, at, p)                              # 5. stop
                seen = plan.read(x, at, p, take, ended, seen, stats)     # the one host read
                show(x, stats)                                           # on_step(the canvas, in the ids' layout)
                if seen.answer_ended or seen.block_ended:
                    break
            if seen.answer_ended:                                        # every row's answer has ended
                stats["calls_saved"] = (len(plan.blocks) - b - 1) * plan.calls_per_block
                break
    except (TypeError, RuntimeError, AttributeError):    # a proposal or selection the commit could not use: name it
        if p is not None:
            checks.shapes(p, take, None, x[:, s:e].shape, plan.step_rule, plan.select, plan.stop)
        raise
    return plan.finish(x, stats, t0)


if __name__ == "__main__":   # `python fastdllm.py --prompt ...` runs the command line, cli.py, as the main program
    import runpy
    runpy.run_module("cli", run_name="__main__")
