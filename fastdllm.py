"""
fastdllm.py: fast inference for diffusion LLMs (LLaDA, Dream; block diffusion: Fast-dLLM v2, SDAR, LLaDA2;
DiffusionGemma): generate(), its plan and the one loop. A diffusion LM generates by denoising: the answer starts as
gen_length [MASK] tokens (DiffusionGemma's: random ones), and each model call ("step", counted as NFE) predicts every
open position and commits some. generate() decides once (`make_plan`, whose docstring lists what each family's plan
holds) four parts a fork can replace: the cache policy (cache.py: Fast-dLLM's prefix cache and DualCache, arXiv
2505.22618 section 3.2; FlashDLM's FreeCache, arXiv 2505.21467), the step rule, the selection rule (Fast-dLLM's
threshold and factor decoding, section 3.3) and the stop rule. Then one loop, each step feed -> propose -> select ->
commit -> stop, with one host read.
"""
import bisect
import itertools
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import checks
import sampler as S
from options import Settings, checked, settings  # noqa: F401  (fastdllm.Settings, fastdllm.settings)
from cache import CachePolicy, KVCache, Refresh
from family import Canvas, pad_prompts  # noqa: F401  (fastdllm.pad_prompts)
from graphs import Compiled, CudaGraphs, model_call  # noqa: F401  (fastdllm.Compiled, fastdllm.CudaGraphs)


# generate()'s stats, one entry per model call: positions fed; committed (taken), edited (a rule's rewrite of its
# block), renewed (a rule's `rest`: DiffusionGemma's renoise, its canvas's last argmax), filled (by the stop rule).
STATS_PER_CALL = ("fed", "committed", "edited", "renewed", "filled")


@dataclass(eq=False)
class Step:
    """Where a decoding step stands: what every hook receives ("at"). Made once per step by Plan.feed: the cache
    policy is asked what to feed from the first eleven fields, and the call then sets the last five, what it fed."""
    n: int                 # model calls so far in this generation (0 = the first: a hook's own state starts afresh)
    i: int                 # steps so far in the current block
    s: int                 # the block is canvas positions [s, e)
    e: int
    x: torch.Tensor        # (B, L) the canvas (hooks read it; the stop rule, and start_block, may fill its masks)
    masked: torch.Tensor   # (B, N) bool: the block's positions a step may still write: its masks (Plan.undecided)
    shift: int             # the family's logits shift: position p is predicted from hidden state p - shift
    mask_id: int           # the [MASK] token id (-1: a uniform-state model has none)
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
    """What a step's one host read saw, handed to the next step (Plan.read)."""
    cols: torch.Tensor        # the block's columns still open in some row (at a block's end: the next block's)
    masked_cols: list         # the same on the host
    canvas: torch.Tensor      # the canvas as this step left it (the next step may change only its open positions)
    calls: int = 0            # model calls so far in this generation
    answer_ended: bool = False
    block_ended: bool = False
    post: int = 0             # calls so far in this block that found no mask (an editing rule's post steps)


@dataclass
class Plan:
    """What one generate() call decided before its loop, by name: the blocks, the parts the loop calls and what the
    model call needs. The step-to-step state is not here: each step's read hands it to the next step (Seen)."""
    canvas: Canvas            # where the rows sit (a family's canvas(), family.Canvas): the blocks; each row's prompt
                              #   span; RoPE positions; the attention mask (None: every key, LLaDA's unpadded canvas);
                              #   sees(b), where the keys of a span ending at b end (L; a block-causal grid block's end)
    cache: CachePolicy        # the cache policy: what each step feeds (cache.py); its optional hooks, keys and slots,
                              #   are None for the built-in policies but FreeCache's and the sub-block cache's slots
    step_rule: S.StepRule     # proposes tokens and confidences (sampler.py, blockdiff.py, guided.py, or a fork's)
    propose: Callable         # step_rule.propose. The three hooks the loop calls, a fork's wrapped once so that its
    select: Callable          #   answers' shapes are checked as they come back (checks.guarded); the selection rule:
    stop: Callable            #   which proposals a step commits; the stop rule: which rows' answers have ended
    model: torch.nn.Module
    layers: Callable          # layers(ids, pos, kv, slots, mask) -> the fed positions' hidden states (Plan.feed):
                              #   model.hidden, eager, replayed from CUDA graphs or compiled (graphs.py); a family's
                              #   own call where it has one (DiffusionGemma's: uniform.GemmaCall)
    kv: KVCache | None        # keys/values of the whole canvas (None: cache "none" attends over what it feeds)
    undecided: Callable       # x -> (B, L) bool: the positions a step may still write: x == mask_id (a step rule's own
                              #   `undecided` where it has one: DiffusionGemma's canvas while it denoises)
    mask_id: int
    shift: int                # the logits shift: Dream, Fast-dLLM v2 1 (p is predicted from p - 1), the others 0
    exact_steps: int | None   # a block takes exactly these calls (DreamCanvas: diffusion_generate); None: until no mask
    patience: int             # calls after which a block still open is a rule that commits nothing
    calls_per_block: int      # the fewest calls a block takes (for calls_saved)
    eos: torch.Tensor         # the end-of-text ids (answer_tokens)
    ar: torch.Tensor          # arange(L): spans and columns as views, no kernel
    next_end: dict            # block start -> the next block's end (a read reports the next block's open columns)
    answer_at: list           # each row's answer start on the canvas, on the host (stats["final"])
    reads_block: bool         # the step rule reads logits at every block column (LLaDA2.1's, DiffusionGemma's)
    edits: bool               # the step rule may rewrite its block until it ends (LLaDA2.1's, DiffusionGemma's)
    max_post_steps: int       # calls a block may take once it has no mask (LLaDA2.1's; the others 0)

    def __str__(self):        # what this call runs, by name: print(plan) (make_plan's table, for one call)
        runs = lambda part: checks.name(getattr(part, "func", part))    # noqa: E731  (a CUDA graph's: partial)
        return (f"cache {runs(self.cache)}, step rule {runs(self.step_rule)}, select {runs(self.select)}, stop "
                f"{runs(self.stop)}, layers {runs(self.layers)}, KV cache {self.kv is not None}, shift {self.shift}, "
                f"blocks {self.canvas.blocks}")

    def feed(self, x, seen: Seen, i: int, s: int, e: int) -> tuple[Step, torch.Tensor]:
        """1. feed: where this step stands, what the cache policy feeds, one model call -> (at, logits (B, n, V) at the
        block columns at.cols: those the step wants whose predicting positions were fed)."""
        at = Step(seen.calls, i, s, e, x, self.undecided(x)[:, s:e], self.shift, self.mask_id, self.canvas.prompt,
                  seen.cols, seen.masked_cols)
        cols, listed = (self.ar[:e - s], range(e - s)) if self.reads_block else (seen.cols, seen.masked_cols)
        wanted = self.cache.span(at)               # (a fork's policy: checked as it comes back, checks.CheckedPolicy)
        if isinstance(wanted, torch.Tensor):       # a fork's set of positions: checked with one more host read
            fed, span, chunk = wanted, None, wanted
            rows = checks.positions(wanted, at, cols, self.kv is not None, self.cache)
        else:
            a, b = wanted
            # The logits shift: block column c is predicted from position s + c - shift (shift 0: LLaDA's, SDAR's,
            # DiffusionGemma's). A shifted family's span that starts at the first wanted column starts one earlier; the
            # wanted columns whose predicting position the span holds get logits, at their rows among the fed
            # positions. With shift 0 and a span covering the block (every built-in policy's), that is every wanted
            # column, at row c + s - a. E.g. LLaDA, DualCache, block [18, 26) at step 1 with columns 0, 1, 3, 4 still
            # masked: span (18, 26), cols = rows = [0, 1, 3, 4]; Dream there, columns 1, 3, 4 masked: rows = cols - 1.
            a -= self.shift if listed and a == s + listed[0] else 0
            lo, hi = bisect.bisect_left(listed, a - s + self.shift), bisect.bisect_left(listed, b - s + self.shift)
            cols = cols[lo:max(lo, hi)]
            rows = cols + (s - self.shift - a)
            fed, span, chunk = self.ar[a:b], (a, b), slice(a, b)
        # The attention mask: the fed queries' rows of the plan's (padding, a grid; None: LLaDA's and Dream's unpadded
        # canvas) and the policy's key mask (keys: None for every built-in policy; a fork's, DPad's); the keys are the
        # canvas when a KV cache holds it, else the fed positions alone.
        mask, keys = self.canvas.mask, self.cache.keys and self.cache.keys(at)
        if mask is not None:
            mask = mask[:, :, chunk] if self.kv is not None else mask[:, :, chunk][..., chunk]
        if keys is not None:
            keys = (keys if self.kv is not None else keys[:, chunk])[:, None, None, :]
            mask = keys if mask is None else mask & keys
        # slots: where each row writes the fed keys/values: at the fed positions (a policy's own slots, per row: those
        # of FreeCache and the sub-block cache in a batch, where a row that must keep its keys writes to a discard slot)
        slots = self.cache.slots and self.cache.slots(at, fed)
        # The model call (model.hidden, or its CUDA graph): every layer writes the fed positions' keys/values into
        # self.kv at `slots` (cache.KVCache.update: index_copy_ on the slot axis) and attends over all the cache holds.
        at.hidden = self.layers(x[:, chunk], self.canvas.pos[:, chunk], self.kv, fed if slots is None else slots, mask)
        at.cols, at.fed, at.span, at.rows, at.head = cols, fed, span, rows, self.model.logits
        return at, self.model.logits(at.hidden, rows)          # the final norm and the LM head, at those rows only

    def start(self, x) -> tuple[Seen, dict]:
        """Before the first step: the first block's columns past the shortest prompt, and the stats, empty."""
        s, e = self.canvas.blocks[0]
        lo = max(int(self.canvas.prompt[:, 1].min()) - s, 0)          # the first column any row leaves open
        return Seen(cols=self.ar[lo:e - s], masked_cols=list(range(lo, e - s)), canvas=x.clone()), dict(
            nfe=0, row_nfe=0, row_committed=0, calls_saved=0, guide_calls=0, **{k: [] for k in STATS_PER_CALL})

    def read(self, x, at: Step, p: S.Proposal, take, ended, seen: Seen, stats: dict) -> Seen:
        """The step's one host read: the hooks' answers checked (checks.step_rules), the stats, the open columns of the
        block (at its end: of the next block) for the next feed; then the decisions: has the block ended, has every
        row's answer."""
        s, e = at.s, at.e
        open_ = self.undecided(x)                                            # (B, L) after this step
        # (7,) bool, a rule a hook broke: non-finite logits; a proposal opening a decided position, or one without
        # logits; a selection outside it; a change to a decided position; an ended row open; a token outside the vocab.
        broken = checks.step_rules(x, at, p, take, ended, seen.canvas, open_, self)
        stats["row_nfe"] = stats["row_nfe"] + (at.masked.any(-1) if p.busy is None else p.busy)  # on the device
        stats["row_committed"] = stats["row_committed"] + take.sum(-1)
        changed, mine = x != seen.canvas, take | p.edit                      # (B, L); (B, N) the rule's writes
        renewed = (changed[:, s:e] & ~mine).sum() * (p.rest is not None)    # the rule's rest (a renoise)
        filled = (changed & ~F.pad(mine | (p.rest is not None), (s, x.shape[1] - e))).sum()   # the stop rule's
        counts = torch.stack([p.open.any(), ended.all(), take.sum(), (mine & ~take).sum(), renewed, filled])
        open_cols = open_[:, s:self.next_end[s]].any(0)                    # (N + N',) the block's columns, the next's
        got = torch.cat([broken, counts, open_cols]).tolist()              # the one host read
        broken, got = got[:len(broken)], got[len(broken):]
        if any(broken):
            checks.refuse_step(*broken, at, self.step_rule, self.select, self.stop, self.cache)
        (proposed, answer_ended, committed, edits, renewed, filled), got = got[:len(counts)], got[len(counts):]
        here, after = got[:e - s], got[e - s:]                              # open columns: the block's, the next's
        for key, value in zip(STATS_PER_CALL, (at.fed.shape[0], committed, edits, renewed, filled)):
            stats[key].append(value)
        stats.update(nfe=stats["nfe"] + 1, guide_calls=getattr(self.step_rule, "guide_calls", 0))
        # A block ends once none of it is open: `not still` (LLaDA, Dream, v2, SDAR, LLaDA2.0: no edits, no exact steps,
        # max_post_steps 0; DiffusionGemma: once GemmaStep.undecided empties, its canvas no longer denoising). A rule
        # that edits (LLaDA2.1's T2T): also once its last call changed nothing, or after its max_post_steps calls that
        # found it all decided. Dream's own sampler: after exactly exact_steps calls.
        still = [c for c, m in enumerate(here) if m]
        post = (seen.post if at.i else 0) + (not at.masked_cols)
        block_ended = at.i + 1 == self.exact_steps if self.exact_steps else not still and (
            committed + edits == 0 or post >= self.max_post_steps)
        if not block_ended and at.i > self.patience:              # past any schedule, and one step a position
            checks.no_progress(proposed, at, self.step_rule, self.select)
        if block_ended:                                  # the next block's open columns (its first feed's logits)
            still, open_cols = [c for c, m in enumerate(after) if m], open_cols[e - s:]
        cols = open_cols[:len(open_cols) if block_ended else e - s].nonzero_static(size=len(still)).squeeze(1)
        # Each row's answer tokens no later call changes: a rule that edits may still rewrite the block's (a stream
        # shows them at its end).
        final = (at.e if block_ended else at.s) if self.edits else x.shape[1]
        stats["final"] = [max(final - a, 0) for a in self.answer_at]
        return Seen(cols=cols, masked_cols=still, canvas=x.clone(), calls=seen.calls + 1,
                    answer_ended=bool(answer_ended), block_ended=block_ended, post=0 if block_ended else post)

    def finish(self, x, stats: dict, t0: float) -> tuple[torch.Tensor, dict]:
        torch.cuda.synchronize(x.device) if x.is_cuda else None
        c, (seconds, out) = self.canvas, (time.perf_counter() - t0, self.canvas.output(x))
        P = out.shape[1] - x.shape[1] + int(c.prompt[:, 1].min())          # the answers start at P in the output
        n = c.ends - c.prompt[:, 1]                                        # each row's answer length (its own)
        end = torch.isin(out[:, P:], self.eos)                              # tokens/s: answers, not filler
        tokens = int(torch.where(end.any(-1), end.long().argmax(-1), n).clamp(max=n).sum())
        return out, stats | dict(seconds=seconds, answer_tokens=tokens, tokens_per_s=tokens / max(seconds, 1e-9),
                                 row_nfe=stats["row_nfe"].tolist(), row_committed=stats["row_committed"].tolist(),
                                 row_length=n.tolist())


def make_plan(model, prompt, options: dict, attention_mask, generator, on_step=None):
    """Turn the settings into the parts the loop calls, once: everything here depends only on the call's settings,
    so the loop has no branch on a setting. -> (the plan, the canvas it starts from: [prompt, MASK x gen_length]).
    What a built-in call's plan holds (each family's `parts`; cache "none", generate()'s default, is NoCache, Window
    for LLaDA2, Recompute for DiffusionGemma; stop: NoStop, or with stop_at_eos sampler.EndOfText or the family's):
      family, shift      step rule             select: threshold | factor | none   cache: prefix | dual | free
      LLaDA, 0           sampler.LLaDA         Threshold | Factor | Schedule       PrefixCache | DualCache | FreeCache
      Dream, 1           sampler.Dream         the same                            the same (dream.py: other clocks)
      Fast-dLLM v2, 1    blockdiff.FastDLLMv2  Threshold(t or 1.0, strict)         BlockPrefix | SubBlockCache
      SDAR, 0            blockdiff.SDAR        its remasking's (Schedule)          BlockPrefix | SubBlockCache
      LLaDA2.x, 0        llada2.LLaDA2         DynamicThreshold(t or 0.95)         BlockWindow
      DiffusionGemma, 0  uniform.GemmaStep     EntropyBound(0.1), stop CanvasEnd   BlockWindow
      guided             guided.Guided         Schedule (the guide's verdict)      PrefixCache | GuidedFreeCache
    layers: model.hidden (on CUDA replayed from its CUDA graphs, graphs.py; DiffusionGemma's via uniform.GemmaCall).
    A fork's hook is wrapped so that its answers are checked (checks.guarded); a built-in's is not. One call's, by
    name: print(make_plan(model, prompt, dict(cache="dual", threshold=0.9), None, None)[0])."""
    cfg, device = model.config, model.lm_head.weight.device
    st, family = checked(model, prompt, options, attention_mask, generator, on_step)    # options.py
    generator = generator or torch.Generator(device).manual_seed(0)
    eos = torch.tensor(sorted(set(st.eos_ids or cfg.eos_ids or [cfg.eos_id]) - {None}), dtype=torch.long, device=device)
    c = family.canvas(prompt.to(device), attention_mask, st, cfg, eos)
    step_rule, select, cache, stop, wrap, view = family.parts(model, st, options, generator, c, eos)
    # The step rule's protocol: sampler.StepRule's attributes (a fork's rule may not subclass it: theirs by default).
    spb, exact, post, reads_block, edits = (getattr(step_rule, k, getattr(S.StepRule, k)) for k in (
        "steps_per_block", "exact_steps", "max_post_steps", "reads_block", "edits"))
    propose, checked_select, checked_stop, cache = checks.guarded(step_rule, select, stop, cache, c.sees, reads_block)
    cache = Refresh(cache) if st.refresh_every_step else cache
    (B, L), blocks = c.x.shape, c.blocks
    layers, kv = model_call(model, st.compile, st.cuda_graphs, cache, B, L, wrap)   # eager, CUDA graphs or compiled
    # A block still open past its schedule, one step a position and the rule's post steps has a rule that commits
    # nothing (patience): the read refuses it rather than loop for ever.
    ar = torch.arange(L, device=device)
    plan = Plan(canvas=c._replace(pos=ar.expand(B, L) if c.pos is None else c.pos, view=view or c.view), cache=cache,
                step_rule=step_rule, propose=propose, select=checked_select, stop=checked_stop, model=model,
                layers=layers, kv=kv,
                undecided=getattr(step_rule, "undecided", None) or (lambda x: x == cfg.mask_id), mask_id=cfg.mask_id,
                shift=cfg.shift, exact_steps=exact, patience=spb + st.block_length + post,
                calls_per_block=1 if S.is_parallel(select) else max(spb, 1), eos=eos, ar=ar,
                next_end={s: (blocks[k + 1][1] if k + 1 < len(blocks) else e) for k, (s, e) in enumerate(blocks)},
                answer_at=c.prompt[:, 1].tolist(), reads_block=reads_block, edits=edits, max_post_steps=post)
    return plan, c.x


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, on_step=None, **options):
    """Decode gen_length tokens after `prompt` (B, P) -> (ids (B, P + gen_length), stats: "nfe" (model calls),
    "row_nfe", "row_committed", "row_length" (per row), STATS_PER_CALL, "final" (per row: its answer's tokens no later
    call changes once unmasked, for a stream), "calls_saved", "guide_calls", "seconds", "answer_tokens",
    "tokens_per_s": README "Python API"). options: the fields of `Settings`.
    attention_mask: (B, P) 1/0 for left-padded prompts: each row decodes as it would alone. generator: the only
    source of randomness (default: one seeded 0; DiffusionGemma: or one per row). on_step(x, stats): called after every
    step, the canvas in the layout of the ids it returns, not cut at an end token (Canvas.view; DiffusionGemma's:
    the step's argmax where a canvas denoises, Parts.view).
    A block-diffusion model (blockdiff.py) answers to a grid block's edge: ids (B, P + answer), each row's answer
    its own length (row_length, as alone), the rest its pad id."""
    plan, x = make_plan(model, prompt, options, attention_mask, generator, on_step)
    show = (lambda x, stats: on_step(plan.canvas.view(x), stats)) if on_step else (lambda x, stats: None)
    t0, (seen, stats) = time.perf_counter(), plan.start(x)
    for b, (s, e) in enumerate(plan.canvas.blocks):
        plan.step_rule.start_block(x, s, e)
        for i in itertools.count():
            at, logits = plan.feed(x, seen, i, s, e)                 # 1. feed: what the cache policy names
            p = plan.propose(logits, at)                             # 2. propose
            take = plan.select(p, at)                                # 3. select
            x[:, s:e] = p.committed(take, x[:, s:e])                 # 4. commit (and a rule's edits)
            ended = plan.stop(x, at, p)                              # 5. stop
            seen = plan.read(x, at, p, take, ended, seen, stats)     # the one host read
            show(x, stats)                                           # on_step(the canvas, in the ids' layout)
            if seen.answer_ended or seen.block_ended:
                break
        if seen.answer_ended:                                    # every row's answer has ended
            stats["calls_saved"] = (len(plan.canvas.blocks) - b - 1) * plan.calls_per_block
            break
    return plan.finish(x, stats, t0)


if __name__ == "__main__":   # `python fastdllm.py --prompt ...` runs the command line, cli.py, as the main program
    import runpy
    runpy.run_module("cli", run_name="__main__")
