"""
llada2.py: the decode of LLaDA2.0 and LLaDA2.1 (inclusionAI/LLaDA2.0-mini, -flash, LLaDA2.1-mini, -flash), the
"llada2" family of block diffusion (blockdiff.py): a mixture-of-experts model made block-causal on a grid anchored at
position 0, decoded a block at a time. The official `generate()`s are in the releases' remote code
(modeling_llada2_moe.py; docs/blockdiff.md tells them in our words, docs/parity.md where ours departs).

- LLaDA2.0 (no editing_threshold): each step of a block is owed a count of the schedule, block // steps (+1 for the
  first block % steps steps); the masks whose probability is strictly above the threshold are committed if there
  are at least the count of them, else the count's most likely ones (SDAR's low_confidence_dynamic).
- LLaDA2.1 (editing_threshold given): "M2T" commits masks as above with num_to_transfer as the count; "T2T" edits the
  block's committed tokens (never the prompt): one whose proposal differs and is above editing_threshold takes it.
  A block ends once it has no mask and a call edited nothing, or after max_post_steps calls without a mask.

Both sample as LLaDA2.1's sampler does (LLaDA2.0's draws at temperature 0: docs/parity.md): the arg-max and its
probability at temperature 0, else one draw per block position from softmax(logits / T) after top-k and top-p,
which is SDAR's sampler (blockdiff.sdar_sample).
"""
import torch

from sampler import NEG_INF, EndOfText, Proposal, StepRule, eos_reached

BLOCK, STEPS, THRESHOLD = 32, 32, 0.95      # the official generate()'s defaults (the card's block: 32)
EDITING, POST_STEPS, TRANSFER = 0.9, 16, 1  # LLaDA2.1's: editing_threshold, max_post_steps, num_to_transfer
MODES = {"quality": (0.7, 0.5), "speed": (0.5, 0.0)}   # the LLaDA2.1 card: (threshold, editing_threshold)
EDITING_ONLY = ("max_post_steps", "num_to_transfer")    # LLaDA2.1's settings: they need editing_threshold
OWN = ("minimal_topk", "editing_threshold", *EDITING_ONLY)   # the settings only this family reads


class LLaDA2(StepRule):
    """LLaDA2.0's and LLaDA2.1's block loop as one step rule. counts: LLaDA2.0's schedule (one count a step of the
    block), or None: LLaDA2.1's num_to_transfer every call. editing: LLaDA2.1's editing_threshold (None: no T2T).
    Per row: its calls without a mask in this block (`post`), so that in a batch a row stops editing where it would
    alone; `settled` says which rows' block is final after this call (the stop rule waits for it); `answer`, the
    positions it may edit (its answer's, until the row has ended)."""

    def __init__(self, *, counts, transfer: int, editing, max_post_steps: int, temperature: float, top_k, top_p,
                 generator, mask_id: int, sample):
        self.counts, self.transfer, self.editing, self.max_post_steps = counts, transfer, editing, max_post_steps
        self.edits = self.reads_block = editing is not None     # T2T reads every position of the block
        self.opts = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, mask_id=mask_id)
        self.sample = sample

    def end_of_text(self, *args):       # stop_at_eos: once the finished answer holds an end token, and its block is final
        return AfterBlock(self, *args)

    def start_block(self, x, s: int, e: int):
        self.step, self.post = 0, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        self.settled = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)

    def propose(self, logits, at) -> Proposal:
        N, masks = at.masked.shape[1], at.masked.sum(-1)
        if self.editing is None and self.opts["temperature"] > 0:
            # The official samples every position of the block (the random numbers a step draws): a position
            # without logits here (not masked) is drawn from another's, and never committed.
            block = torch.arange(N, device=at.masked.device)
            logits = logits[:, torch.searchsorted(at.cols, block).clamp(max=max(len(at.masked_cols) - 1, 0))]
        x0, p = self.sample(logits, **self.opts)                      # (B, n) each, at the columns of `logits`
        if x0.shape[1] < N:     # greedy LLaDA2.0 draws nothing: the masked columns' proposals, the rest as they are
            x0 = at.x[:, at.s:at.e].index_copy(1, at.cols, x0)
            p = p.new_zeros(x0.shape).index_copy(1, at.cols, p)
        count = min(self.counts[min(self.step, len(self.counts) - 1)] if self.counts else self.transfer, N)
        self.step += 1
        k = masks.clamp(max=count)                 # the official's top-k of min(count, masks)
        idle = masks == 0                          # rows with no mask at this call
        self.post += idle
        edit, busy = False, ~idle | ~self.settled   # a row its last call changed: alone, this call is its too
        if at.n == 0:           # each row's answer: the canvas's masks (not its prompt, nor a batch's fill past it)
            self.answer = at.x == at.mask_id
        if self.editing is not None:
            live = (self.post <= self.max_post_steps)[:, None]     # a row past its post steps makes no call alone
            edit = live & self.answer[:, at.s:at.e] & ~at.masked & (x0 != at.x[:, at.s:at.e]) & (p > self.editing)
            self.settled = (self.post >= self.max_post_steps) | idle & ~edit.any(-1)
        conf = p.masked_fill(~at.masked, NEG_INF)
        return Proposal(x0, conf, at.masked, k, logits, k_host=count, edit=edit, busy=busy)


class AfterBlock(EndOfText):
    """stop_at_eos for LLaDA2: a row's answer ends once its finished answer holds an end token (EndOfText) and its
    block is final (LLaDA2.1: its edit-only calls done, LLaDA2.0: always), as the official checks after a block."""

    def __init__(self, rule: LLaDA2, *args):
        super().__init__(*args)
        self.rule = rule

    def __call__(self, x, at, p):
        if at.e == x.shape[1]:      # the last block: nothing left to save
            return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        if at.n == 0:
            self.ended = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        # An ended row stays ended (in a batch its filled blocks may still be edited: after its end, never read).
        done = eos_reached(x, self.P, at.e if self.run is True else x.shape[1], self.eos, self.mask_id, self.run)
        done = self.ended = self.ended | done & self.rule.settled
        x.masked_fill_(done[:, None] & (x == self.mask_id), self.fill)
        self.rule.answer &= ~done[:, None]      # alone, its decode is over: an ended row edits nothing more
        return done


def schedule(block: int, steps: int) -> list:
    """LLaDA2.0's counts: the block split evenly over its steps, the remainder to the first ones (zeros past it)."""
    base, rem = divmod(block, steps)
    return [base + (i < rem) for i in range(steps)]


def llada2_parts(cfg, st, generator, sample, select):
    """The call's step rule (LLaDA2.0's schedule, or LLaDA2.1's editing) and selection (strict threshold, else the
    count's most likely: the caller's DynamicThreshold)."""
    editing = st.editing_threshold
    steps = min(st.steps, st.gen_length // st.minimal_topk)
    rule = LLaDA2(counts=None if editing is not None else schedule(st.block_length, steps),
                  transfer=st.num_to_transfer or TRANSFER, editing=editing,
                  max_post_steps=0 if editing is None else POST_STEPS if st.max_post_steps is None else
                  st.max_post_steps, temperature=st.temperature, top_k=st.top_k, top_p=st.top_p,
                  generator=generator, mask_id=cfg.mask_id, sample=sample)
    return rule, st.select or select(THRESHOLD if st.threshold is None else st.threshold)


def check_llada2(st, given: dict, bad):
    """What a LLaDA2 call refuses (bad(msg) raises, naming the setting as the caller words it)."""
    if given.get("sub_block") is not None:
        bad("sub_block is Fast-dLLM v2's: LLaDA2 denoises the whole block at each step; drop sub_block")
    if given.get("remasking") is not None:
        bad("remasking does not apply to LLaDA2: it commits by its threshold, else the most likely masks; drop "
            "remasking")
    if st.editing_threshold is None:
        for key in EDITING_ONLY:
            if given.get(key) is not None:
                bad(f"{key} is LLaDA2.1's editing decode: pass editing_threshold too (0.9 is its default, 0.5 "
                    f"the card's quality mode), or drop {key}")
    elif given.get("steps") is not None:
        bad("steps does not apply with editing_threshold (LLaDA2.1): each call commits num_to_transfer masks or "
            "every one above the threshold; drop steps")
    for key, v, ok, what in (
            ("steps", st.steps, lambda v: v >= 1, "an integer >= 1"),
            ("minimal_topk", st.minimal_topk, lambda v: 1 <= v <= st.gen_length, "an integer in [1, gen_length]"),
            ("num_to_transfer", st.num_to_transfer, lambda v: v >= 1, "an integer >= 1"),
            ("max_post_steps", st.max_post_steps, lambda v: v >= 0, "an integer >= 0")):
        if v is not None and not (type(v) is int and ok(v)):
            bad(f"{key} {v!r} must be {what}")
    e = st.editing_threshold
    if e is not None and not (isinstance(e, (int, float)) and not isinstance(e, bool) and 0 <= e <= 1):
        bad(f"editing_threshold {e!r} must be in [0, 1]: a committed token whose new proposal is more likely than "
            f"it is edited (0.9 is LLaDA2.1's default, 0.5 the quality mode, 0 the speed mode)")
