"""
checks.py: the rules a step's hooks keep, checked at the loop's boundary. As they come back, the shapes of a proposal
(`proposal`), a selection (`selection`) and a stop rule's answer (`stopped`); their values in the step's one read
(`step_rules`, fastdllm.Plan.read); a cache policy's span, positions, key mask and slots before the call. A broken
rule is one line naming the hook (`refuse_*`, `no_progress`), never an error deep inside torch. What a call refuses
before the loop is options.py's.
"""
import inspect

import torch
import torch.nn.functional as F


def bad(msg):
    raise ValueError(msg)


def name(hook) -> str:
    """A hook as its author wrote it: `Margin`, `<lambda>`, `LeftToRight.propose`."""
    hook = getattr(hook, "__wrapped__", hook)          # a fork's hook as the loop calls it (Checked)
    if inspect.ismethod(hook):
        return f"{type(hook.__self__).__name__}.{hook.__name__}"
    return hook.__name__ if inspect.isfunction(hook) or isinstance(hook, type) else type(hook).__name__


def described(v) -> str:
    return f"a {tuple(v.shape)} {v.dtype} tensor" if isinstance(v, torch.Tensor) else repr(v)


OURS = ("sampler", "dream", "blockdiff", "llada2", "guided", "uniform", "cache")   # the built-in hooks' modules


class Checked:
    """A fork's hook as the loop calls it: its answer's shapes checked as it comes back (`proposal`, `selection`,
    `stopped`), before anything reads it. The built-in hooks are called as they are: their answers are right by
    construction (the tests compare them with the official code and the uncached decode)."""

    def __init__(self, hook, call, check):
        self.__wrapped__, self.call, self.check = hook, call, check

    def __call__(self, *args):                  # propose(logits, at), select(p, at), stop(x, at, p): `at` is second
        return self.check(self.call(*args), args[1], self.__wrapped__)


class CheckedPolicy:
    """A fork's cache policy as the feed calls it (`guarded`): its span, key mask and slots checked as they come
    back, and the keys/values written so far followed, so that no fed query attends to a key no call has written yet
    (a KV cache starts empty). The built-in policies keep these by construction (tests/test_cache.py)."""

    def __init__(self, policy, sees, reads_block: bool):
        self.__wrapped__, self.sees, self.reads_block, self.written = policy, sees, reads_block, 0
        self.keeps_cache, self.spare, self.fixed_width = policy.keeps_cache, policy.spare, policy.fixed_width
        self.keys = policy.keys and (lambda at: key_mask(policy.keys(at), at.x.shape, policy))
        self.slots = policy.slots and (lambda at, fed: slots(policy.slots(at, fed), at.x.shape[0], fed, policy))

    def span(self, at):
        got, L = self.__wrapped__.span(at), at.x.shape[1]
        if isinstance(got, torch.Tensor):        # a set of positions: fastdllm.Plan.feed checks it (`positions`)
            self.written = L if got.numel() == L else self.written
            return got
        a, b = got if isinstance(got, (tuple, list)) and len(got) == 2 else (None, None)
        if not (type(a) is int and type(b) is int and 0 <= a < b <= L):
            refuse_span(self.__wrapped__, at, got)
        first = 0 if self.reads_block else at.masked_cols[0] if at.masked_cols else None
        a_fed = a - at.shift if first is not None and a == at.s + first else a     # as the feed shifts it
        seen_to = self.sees(b)
        if self.keeps_cache and not (a_fed <= self.written and max(self.written, b) >= seen_to):
            refuse_unwritten(self.__wrapped__, at, (a_fed, b), self.written, seen_to)
        self.written = max(self.written, b) if a_fed <= self.written else self.written
        return got


def guarded(step_rule, select, stop, cache, sees, reads_block: bool):
    """The hooks the loop calls, decided once (fastdllm.make_plan) -> (propose, select, stop, cache): a fork's wrapped
    (`Checked`, `CheckedPolicy`), a built-in's as it is (a class defined in OURS; a fork's subclass of one is a fork's).
    sees: the canvas's (family.Canvas.sees); reads_block: the step rule's (fastdllm.Plan.reads_block)."""
    fork = lambda hook: type(hook).__module__ not in OURS   # noqa: E731
    return (Checked(step_rule, step_rule.propose, proposal) if fork(step_rule) else step_rule.propose,
            Checked(select, select, selection) if fork(select) else select,
            Checked(stop, stop, stopped) if fork(stop) else stop,
            CheckedPolicy(cache, sees, reads_block) if fork(cache) else cache)


def step_rules(x, at, p, take, ended, before, open_, plan) -> torch.Tensor:
    """The rules the hooks' answers of one step keep (fastdllm.Plan.read): their values as (7,) bool on the device,
    brought back by the step's one read, for `refuse_step` to name the hook that broke one: non-finite logits; a
    proposal that opens a decided position (or edits an open one); one that opens a position without logits this call;
    a selection outside the proposal; a change to a position that was neither open nor the rule's edit of its answer;
    an ended row with a position still open; a token outside the vocabulary (a stop rule's fill). before: the canvas
    as the last step left it; open_: (B, L) the positions still open after this step."""
    s, e = at.s, at.e
    edit = torch.zeros_like(take) | p.edit                                # (B, N): the step rule's edits (T2T)
    with_logits = torch.zeros_like(at.masked[0]).index_fill_(0, at.cols, True)       # (N,)
    may_change = at.masked | edit & (plan.ar[s:e] >= at.prompt[:, 1:])  # (B, N): open, or an edit of the answer
    may_change = (before == at.mask_id) | F.pad(may_change, (s, x.shape[1] - e))   # (B, L): a stop rule fills masks
    changed = x != before
    return torch.stack([~torch.isfinite(p.logits.sum(-1, dtype=torch.float32)).all(),
                        (p.open & ~at.masked).any() | (edit & at.masked).any(), (p.open & ~with_logits).any(),
                        (take & ~p.open).any(), (changed & ~may_change).any(), (ended[:, None] & open_).any(),
                        (changed & ((x < 0) | (x >= plan.model.config.vocab_size))).any()])


def refuse_span(cache, at, span):
    """The cache policy's span for the step `at` is not a pair of ints inside the canvas."""
    where, L = f"at step {at.i} of block [{at.s}, {at.e})", at.x.shape[1]
    if not (isinstance(span, (tuple, list)) and len(span) == 2 and all(type(v) is int for v in span)):
        raise TypeError(f"cache= {name(cache)}.span() returned {span!r}: a span is a pair of ints (a, b), or a "
                        f"sorted 1-D long tensor of canvas positions")
    raise ValueError(f"cache= {name(cache)}.span() returned ({span[0]}, {span[1]}) {where}: a span lies inside the "
                     f"canvas [0, {L})")


def refuse_unwritten(cache, at, span, written: int, seen_to: int):
    """The span's queries would attend to keys no call has written yet (a KV cache starts empty)."""
    a, b = span
    if at.n == 0 and seen_to == at.x.shape[1]:
        bad(f"cache= {name(cache)}.span() returned ({a}, {b}) at the first call: it must feed the whole canvas "
            f"(0, {seen_to}), the cache starts empty")
    first = "at the first call" if at.n == 0 else f"at step {at.i} of block [{at.s}, {at.e})"
    bad(f"cache= {name(cache)}.span() returned ({a}, {b}) {first}: its queries attend to positions [0, {seen_to}), "
        f"and only [0, {written}) hold keys/values yet: feed from {min(a, written)} to at least {seen_to}")


def proposal(p, at, step_rule):
    """The step rule's proposal at the boundary, before anything reads it (host metadata): its fields of the shapes
    and dtypes the loop needs. -> p"""
    B, N = at.masked.shape
    kind = lambda v: "bool" if v.dtype == torch.bool else "float" if v.is_floating_point() else "integer"  # noqa: E731
    for f, want, dtype in (("x0", (B, N), "integer"), ("conf", (B, N), "float"), ("open", (B, N), "bool"),
                           ("k", (B,), "integer"), ("edit", (B, N), "bool"), ("busy", (B,), "bool")):
        v = getattr(p, f, None)
        if f == "edit" and v is False or f == "busy" and v is None:       # the defaults: no edit, every row with a mask
            continue
        if not (isinstance(v, torch.Tensor) and v.shape == want and kind(v) == dtype):
            raise TypeError(f"propose= {name(step_rule)}.propose() returned {f} = {described(v)}: a sampler.Proposal "
                            f"holds {f} of shape {want} ({dtype})")
    return p


def selection(take, at, select):
    """The selection rule's answer at the boundary, before the commit reads it. -> take"""
    B, N = at.masked.shape
    if not (isinstance(take, torch.Tensor) and take.shape == (B, N) and take.dtype == torch.bool):
        refuse_answer("select=", select, take, f"a selection rule returns a ({B}, {N}) bool tensor, one row per batch "
                      f"row, True = commit")
    return take


def stopped(ended, at, stop):
    """The stop rule's answer at the boundary."""
    B = at.masked.shape[0]
    if not (isinstance(ended, torch.Tensor) and ended.shape == (B,) and ended.dtype == torch.bool):
        refuse_answer("stop=", stop, ended, f"a stop rule returns a ({B},) bool tensor, True = the row's answer has "
                      f"ended")
    return ended


def refuse_answer(hook: str, rule, got, what: str):
    raise TypeError(f"{hook} {name(rule)} returned {described(got)}: {what}")


def key_mask(keys, shape, cache):
    """A cache policy's keys(at): None, or a (B, L) bool tensor."""
    if keys is None or isinstance(keys, torch.Tensor) and keys.shape == shape and keys.dtype == torch.bool:
        return keys
    raise TypeError(f"cache= {name(cache)}.keys() returned {described(keys)}: a key mask is a {tuple(shape)} bool "
                    f"tensor (True = the step may attend to that position), or None")


def positions(fed, at, cols, keeps_cache: bool, cache):
    """A fork's set of positions, checked with one host read: a sorted 1-D long tensor inside the canvas, the
    whole canvas at a generation's first call (a KV cache starts empty), holding each open position of the block
    and, for a shifted family, the one before it. -> the rows of the positions that predict the block's open columns."""
    L, want = at.x.shape[1], at.s + cols
    if not (fed.ndim == 1 and fed.dtype == torch.long and 0 < fed.numel() <= L):
        raise TypeError(f"cache= {name(cache)}.span() returned {described(fed)}: a set of positions is a 1-D long "
                        f"tensor of 1 to {L} canvas positions")
    rows = torch.searchsorted(fed, want).clamp(max=fed.numel() - 1)
    lo, hi, unsorted, missing = torch.stack([fed.min(), fed.max(), (fed[1:] <= fed[:-1]).any(), (
        (fed[rows] != want) | (fed[(rows - at.shift).clamp(min=0)] != want - at.shift)).any()]).tolist()
    where = f"at step {at.i} of block [{at.s}, {at.e})"
    if lo < 0 or hi >= L or unsorted:
        bad(f"cache= {name(cache)}.span() returned positions {where} that are not sorted and unique inside the canvas "
            f"[0, {L})")
    if at.n == 0 and keeps_cache and fed.numel() != L:
        bad(f"cache= {name(cache)}.span() fed {fed.numel()} positions at the first call: it must feed the whole "
            f"canvas ({L}), the cache starts empty")
    if missing:
        bad(f"cache= {name(cache)}.span() fed positions {where} without every open position of the block" +
            (" and the one before each (this family predicts position p from p - 1)" if at.shift else ""))
    return (rows - at.shift).clamp(min=0)       # sorted, unique and holding p and p - 1: p - 1 is the row before p


def slots(got, B: int, fed, cache):
    """A cache policy's slots(at, fed): None, or (B, T) long."""
    if got is None or isinstance(got, torch.Tensor) and got.shape == (B, fed.numel()) and got.dtype == torch.long:
        return got
    raise TypeError(f"cache= {name(cache)}.slots() returned {described(got)}: per-row slots are a ({B}, "
                    f"{fed.numel()}) long tensor (a canvas position, or the discard slot), or None")


def refuse_step(nonfinite, opened, unpredicted, outside, overwrote, unfilled, unknown, at, step_rule, select, stop,
                cache):
    """The values the step's one host read brought back (fastdllm.Plan.read) broke a rule of the hooks."""
    step = f"at step {at.n + 1}"
    if nonfinite:
        bad(f"the model produced NaN/inf logits {step}: the weights hold NaN/inf, or the activations overflowed "
            f"(try --dtype float32)")
    if opened:
        bad(f"propose= {name(step_rule)}.propose() opened positions that are not masks (or edited masks) {step}: a "
            f"proposal's open positions lie inside at.masked, its edits (Proposal.edit) outside it")
    if unpredicted:
        fed = f"fed {at.span}" if at.span else "fed a set of positions"
        bad(f"cache= {name(cache)}.span() {fed} {step} (block [{at.s}, {at.e})), and {name(step_rule)}.propose() "
            f"opened positions it has no logits for: a span must cover the open positions" + (
                " and the one before each (this family predicts position p from p - 1)" if at.shift else "") +
            "; a step rule opens only the columns at.cols")
    if outside:
        bad(f"select= {name(select)} chose positions outside the proposal's open positions {step} (committed tokens "
            f"would be overwritten): return a subset of proposal.open")
    if unfilled:
        bad(f"stop= {name(stop)} ended a row that still holds masks {step}: a stop rule fills an ended row's masks "
            f"(e.g. with an end token) before it returns True for it")
    custom = [f"{hook} {name(h)}" for hook, h in (("stop=", stop), ("propose=", step_rule), ("select=", select))
              if type(getattr(h, "__wrapped__", h)).__module__ not in OURS]
    if unknown:
        bad(f"{' or '.join(custom) or 'a hook'} wrote a token id outside the vocabulary [0, "
            f"{at.head.__self__.config.vocab_size}) {step}: a stop rule fills an ended row's masks with one of the "
            f"model's tokens (its end token or pad id), a step rule proposes token ids of the model")
    bad(f"{' or '.join(custom) or 'a hook'} changed a token that was not a mask (the prompt or a committed token) "
        f"{step}: hooks may only fill masked positions (the stop rule; a step rule's start_block), and a step rule's "
        f"edits (Proposal.edit) rewrite only the block's committed tokens, never the prompt")


def no_progress(proposed, at, step_rule, select):
    """A block that is still open after its schedule and one step per position: a rule that commits nothing."""
    hook = (f"select= {name(select)} committed nothing" if proposed else
            f"propose= {name(step_rule)}.propose() opened no position")
    bad(f"{hook}: the block [{at.s}, {at.e}) made no progress in {at.i + 1} steps; a block ends only once its "
        f"masks are committed")
