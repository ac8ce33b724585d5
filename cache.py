"""
cache.py: the block-wise approximate KV cache of Fast-dLLM (arXiv 2505.22618, section 3.2, Figure 2).

A diffusion LM attends bidirectionally, so strictly every key changes whenever any token is unmasked and
nothing can be cached. Fast-dLLM's observation is that keys/values barely move *within* one block's
denoising steps, so they are computed once per block (the "refresh" forward over the whole canvas) and
reused for the block's remaining steps:

- prefix mode: later steps feed the current block *and everything after it*; only the prefix [0, s) is
  reused from the refresh.
- dual mode (DualCache): later steps feed only the current block [s, e); both the prefix and the masked
  suffix [e, L) are reused from the refresh.
- free mode (FlashDLM's FreeCache, arXiv 2505.21467): no refresh after the generation's first call; every
  step feeds the block and the masked suffix, and everything left of the block stays as it was last written.

All are one operation here: write the fed chunk's keys/values at their canvas positions, then attend over
the whole canvas. In prefix mode the fed chunk covers [s, L), so every stale entry is overwritten; in dual
mode it covers [s, e) and the suffix stays as the refresh left it (Fast-dLLM's `replace_position`). What
each step feeds is `feed_span`, below: the one place the cache modes differ.

The storage never advances itself: every write names its position. What to feed is a cache policy (`Feed`
and its subclasses: `CacheMode` over feed_span, `FreeCache`, `GuidedFreeCache`, `Refresh`), which the
generation loop (fastdllm.py) asks at every step; a fork adds one by subclassing `Feed`. `Guide` at the end
is the other cache: the guided-diffusion guide's keys/values of the
committed text of every row of a batch, which only ever grows by what a step commits.
"""
from typing import NamedTuple

import torch


class KVCache:
    """Preallocated keys/values for every layer over the whole canvas: (n_layers, B, n_kv_heads, L, head_dim)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, length: int, head_dim: int, device, dtype):
        shape = (n_layers, batch, n_kv_heads, length, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # (B,) bool or None: rows whose writes are kept. FreeCache freezes a block as its *last* step left it;
        # in a batch, a row that finished its block early must not be rewritten by the steps the other rows
        # still need, or it would not decode as it would alone. The loop sets this; None = every row.
        self.write_rows = None
        # (B,) long or None: row b keeps its positions < write_from[b] as they are (guided FreeCache: each row
        # freezes up to its own last committed token, while the batch feeds from the leftmost row's).
        self.write_from = None

    @classmethod
    def for_model(cls, model, batch: int, length: int) -> "KVCache":
        cfg = model.config
        p = model.lm_head.weight
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, length, cfg.head_dim, p.device, p.dtype)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k, v (B, n_kv_heads, T, head_dim) at canvas positions [start, start+T) in place and return
        this layer's keys/values over the whole canvas (views, no copy)."""
        T = k.shape[2]
        if self.write_from is not None:
            keep = torch.arange(start, start + T, device=k.device) < self.write_from[:, None]      # (B, T)
            keep = keep[:, None, :, None]
            k = torch.where(keep, self.k[layer, :, :, start:start + T], k)
            v = torch.where(keep, self.v[layer, :, :, start:start + T], v)
        if self.write_rows is None:
            self.k[layer, :, :, start:start + T] = k
            self.v[layer, :, :, start:start + T] = v
        else:
            rows = self.write_rows
            self.k[layer, rows, :, start:start + T] = k[rows]
            self.v[layer, rows, :, start:start + T] = v[rows]
        return self.k[layer], self.v[layer]

    def keep_rows(self, keep: torch.Tensor):
        """Drop the batch rows where keep (B,) is False (one copy; the guide's finished rows)."""
        self.k, self.v = self.k[:, keep], self.v[:, keep]


def feed_span(cache: str, first: bool, block_step: int, s: int, e: int, L: int, shift: int):
    """Which canvas positions [a, b) a step feeds. Everything outside is read from the KV cache as the last
    forward that fed it left it; that choice *is* the difference between the caches:
    - none: the whole canvas every step (the exact reference);
    - prefix / dual (Fast-dLLM section 3.2): a block's first step refreshes the whole canvas, its later steps
      feed the block and everything after it [s, L) (prefix) or the block alone [s, e) (dual);
    - free (FreeCache, FlashDLM arXiv 2505.21467; spec/flashdlm.md 1): only the generation's first call is full;
      every later step feeds [s - shift, L), the block and the masked suffix, from one position earlier
      for Dream (its logits shift predicts s from s - 1). Nothing left of that is ever recomputed: a block's
      keys/values stay frozen as its last step computed them, while some of its tokens were still masks."""
    if cache == "none" or first:
        return 0, L
    if cache == "free":
        return s - shift, L
    if block_step == 0:
        return 0, L
    return s, L if cache == "prefix" else e


# ---------------------------------------------------------------------------------------- cache policies
# A cache policy is what the decoding loop asks at every step: which span [a, b) to feed (`span`), and which
# batch rows may write their keys/values (`rows`, None = all). A fork adds a policy by subclassing Feed and
# passing an instance as generate(cache=...).
class Step(NamedTuple):
    """Where a decoding step stands: what a cache policy and a step rule decide from."""
    n: int                 # model calls so far in this generation (0 = the first)
    step: int              # steps so far in the current block
    s: int                 # the block is canvas positions [s, e)
    e: int
    cand: torch.Tensor     # (B, e - s) bool: the block's positions still masked
    x: torch.Tensor        # (B, L) the canvas


class Feed:
    """The base policy: feed the whole canvas at every step. keeps_cache: the model writes a KVCache (False:
    every call attends over its own chunk alone)."""
    keeps_cache = True

    def span(self, at: Step) -> tuple[int, int]:
        return 0, at.x.shape[1]

    def rows(self, at: Step):
        return None

    def write_from(self, at: Step):
        return None


class CacheMode(Feed):
    """A built-in mode ("none", "prefix", "dual", "free"): feed_span decides. shift: Dream's logits shift."""

    def __init__(self, mode: str, shift: int = 0):
        self.mode, self.shift, self.keeps_cache = mode, shift, mode != "none"

    def span(self, at: Step) -> tuple[int, int]:
        return feed_span(self.mode, at.n == 0, at.step, at.s, at.e, at.x.shape[1], self.shift)


class FreeCache(CacheMode):
    """FreeCache freezes a block as its *last* step left it: in a batch, a row that finished its block early
    must not be rewritten by the steps the other rows still need, or it would not decode as it would alone."""

    def __init__(self, shift: int = 0):
        super().__init__("free", shift)

    def rows(self, at: Step):
        active = at.cand.any(-1)
        return None if active.all() else active


class GuidedFreeCache(FreeCache):
    """Guided FreeCache (FlashDLM's aggressive caching): each row's block starts at its first mask and its
    feed one earlier, at its last committed token, for both families: each committed token is frozen with keys
    computed while it held its token, not while it was a mask. A batch feeds from the leftmost row's last
    committed token, and every other row keeps its own frozen prefix (`write_from`)."""

    def last(self, at: Step):
        """(B,) each row's last committed position; L for a row with nothing left to decode."""
        return torch.where(at.cand.any(-1), at.s + at.cand.long().argmax(-1) - 1, at.x.shape[1])

    def span(self, at: Step) -> tuple[int, int]:
        return feed_span("free", at.n == 0, at.step, int(self.last(at).min()) + 1, at.e, at.x.shape[1], 1)

    def write_from(self, at: Step):
        last = self.last(at)
        return last if at.n > 0 and bool((last > last.min()).any()) else None


class Refresh(Feed):
    """refresh_every_step: another policy's cache, fed the whole canvas at every step (a check of the cache
    plumbing: the decode then equals the uncached one)."""

    def __init__(self, inner: Feed):
        self.inner, self.keeps_cache = inner, inner.keeps_cache

    def rows(self, at: Step):
        return self.inner.rows(at)     # (write_from: None, every position is fed afresh)


# The guide's state (FlashDLM guided diffusion, arXiv 2505.21467; spec/flashdlm.md 2): the committed text of a batch.

class Guide:
    """
    A causal guide model and its KV cache of the committed text, for a batch of rows verified together: one
    guide forward per verification chunk serves every row, although rows commit different numbers of tokens.

    Slots are canvas positions: slot i of row b holds the keys/values of the token at canvas position i, so
    each row's committed text sits where the canvas has it, whatever its length so far or its left padding.
    RoPE positions are per row (real tokens count from 0, `pos`) and pads are never attended (`real`), so each
    row's numbers are the ones it would get alone.

    Invariant: row b's slots [0, length[b]) hold its committed text *except its last token*, at slot
    length[b] (the last committed position, just before the first mask). A verification teacher-forces the
    drafted canvas from there: the slot of the last committed token predicts the first draft, the slot of
    draft i predicts draft i+1, so one forward scores a whole run of drafts at once (as in speculative
    decoding). The slots a step then commits were computed on committed text, so keeping them is moving
    `length` forward; a slot whose draft was replaced (speculative) lies past the new length and is fed again.
    Rows that have finished are dropped from the guide's batch (`rows` maps the guide's rows to the batch's).
    """

    def __init__(self, model, batch: int, max_len: int, pos=None, real=None):
        if not model.config.causal:
            raise ValueError(f"the guide must be a causal LM (model_type 'qwen2'), not a {model.config.family} "
                             f"diffusion model: pass a Qwen2-format checkpoint as the guide")
        if max_len > model.config.max_seq_len:
            raise ValueError(f"the text ({max_len} tokens) is longer than the guide's {model.config.max_seq_len} "
                             f"positions: shorten the prompt or gen_length, or use a guide with a longer context")
        self.model = model
        self.cache = KVCache.for_model(model, batch, max_len)   # max_len: the canvas, prompt + answer
        device = self.cache.k.device
        self.rows = torch.arange(batch, device=device)           # the batch rows the guide still serves
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos, self.real = pos, real                          # (B, L) RoPE positions, real-token mask; or None

    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids (R, T) of the served rows at slots [start, start+T) -> next-token logits (R, T, V)."""
        end = start + ids.shape[1]
        pos = None if self.pos is None else self.pos[:, start:end]
        mask = None if self.real is None else self.real[:, None, None, :end]    # keys: never a pad
        logits = self.model(ids, pos, self.cache, start, mask)
        if not torch.isfinite(logits.sum(-1, dtype=torch.float32)).all():   # the diffusion model's check (fastdllm.py)
            raise ValueError(f"the guide produced NaN/inf logits: its weights hold NaN/inf, or its activations "
                             f"overflowed {logits.dtype} (try --dtype float32)")
        return logits

    def prefill(self, prompt: torch.Tensor) -> int:
        """Start new texts: push the prompts (B, P) except their last token, in one forward (the last token is
        fed by the first verification, where its slot predicts the first draft). -> guide calls."""
        P = prompt.shape[1]
        self.length.fill_(P - 1)
        if P < 2:
            return 0
        self.forward(prompt[self.rows, :-1], 0)
        return 1

    def verify(self, drafted: torch.Tensor, accept, chunk: int = 32):
        """
        Score each row's drafts: drafted (B, L) is the canvas with every open position drafted, row b's drafts
        at [length[b] + 1, L). accept(logits (R, T, V), tokens (R, T)) -> bool (R, T) is the acceptance rule
        (sampler.accept_drafts). A row's fed text [last, d0, ..., d_{N-2}] goes in chunks of `chunk` tokens,
        each verifying `chunk` drafts (the official verify_batch_size, 32), up to its first chunk with a
        rejection: a run of n < N accepted drafts takes n // chunk + 1 chunks, a fully accepted one
        ceil(N / chunk); the last draft is never fed (no draft follows it). Batched, forward k feeds the span
        covering every undecided row's chunk k (the guide is causal: re-feeding a row's already verified
        slots recomputes the same keys/values), so a step costs the largest of the rows' chunk counts.
        -> (n (B,), at (B, V), calls): n = the accepted run from the first draft, at = the guide's logits at
        the first rejected draft (zeros elsewhere), calls = guide forwards. Leaves `length` alone: `commit`.
        """
        y = drafted[self.rows]                                      # (R, L)
        R, L = y.shape
        start = self.length                                         # (R,) slot of the last committed token
        n = torch.full((R,), -1, dtype=torch.long, device=y.device)  # -1: not decided yet
        at = torch.zeros(R, self.model.config.vocab_size, dtype=self.cache.k.dtype, device=y.device)
        calls = 0                                                   # = the chunk index k
        while (n < 0).any():
            open_ = n < 0
            lo, hi = start + calls * chunk, (start + (calls + 1) * chunk).clamp(max=L - 1)   # each row's chunk k
            a, b = int(lo[open_].min()), int(hi[open_].max())
            logits = self.forward(y[:, a:b], a)                     # (R, b - a, V): slot i judges token i + 1
            calls += 1
            slot = torch.arange(a, b, device=y.device)
            mine = open_[:, None] & (slot >= lo[:, None]) & (slot < hi[:, None])
            bad = mine & ~accept(logits, y[:, a + 1:b + 1])
            first = torch.where(bad, slot, L).min(-1).values        # the first rejection's slot, L if none
            hit = first < L
            at[hit] = logits[hit, first[hit] - a]
            n = torch.where(hit, first - start, n)
            n = torch.where(open_ & ~hit & (hi >= L - 1), L - 1 - start, n)      # every draft accepted
        B = drafted.shape[0]
        n_all = torch.zeros(B, dtype=torch.long, device=y.device).index_copy_(0, self.rows, n)
        at_all = at.new_zeros(B, at.shape[-1]).index_copy_(0, self.rows, at)
        return n_all, at_all, calls

    def commit(self, n: torch.Tensor, done: torch.Tensor):
        """Row b committed n[b] tokens this step (the accepted run, d0 when the guide rejected it, the guide's
        token in place of a rejected draft, or a run cut at an end token): keep the slots of `last` and the
        first n - 1 of them, i.e. the committed text minus its (new) last token again. Slots past `length`
        hold stale drafts; the next verification overwrites them and the causal mask never reads past the
        chunk. done (B,): rows whose answer is complete leave the guide's batch, so they cost no more guide
        work (one copy of the cache, when a row finishes)."""
        self.length += n[self.rows]
        keep = ~done[self.rows]
        if not keep.all():
            self.rows, self.length = self.rows[keep], self.length[keep]
            self.cache.keep_rows(keep)
            self.pos = None if self.pos is None else self.pos[keep]
            self.real = None if self.real is None else self.real[keep]
