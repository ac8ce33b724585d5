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
committed text, which only ever grows by what a step commits.
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

    @classmethod
    def for_model(cls, model, batch: int, length: int) -> "KVCache":
        cfg = model.config
        p = model.lm_head.weight
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, length, cfg.head_dim, p.device, p.dtype)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k, v (B, n_kv_heads, T, head_dim) at canvas positions [start, start+T) in place and return
        this layer's keys/values over the whole canvas (views, no copy)."""
        T = k.shape[2]
        if self.write_rows is None:
            self.k[layer, :, :, start:start + T] = k
            self.v[layer, :, :, start:start + T] = v
        else:
            rows = self.write_rows
            self.k[layer, rows, :, start:start + T] = k[rows]
            self.v[layer, rows, :, start:start + T] = v[rows]
        return self.k[layer], self.v[layer]


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
    """Guided FreeCache (FlashDLM's aggressive caching): the block starts at the first mask and the feed one
    earlier, at the last committed token, for both families: each committed token is frozen with keys
    computed while it held its token, not while it was a mask."""

    def span(self, at: Step) -> tuple[int, int]:
        head = at.s + int(at.cand.long().argmax(-1).min())
        return feed_span("free", at.n == 0, at.step, head, at.e, at.x.shape[1], 1)


class Refresh(Feed):
    """refresh_every_step: another policy's cache, fed the whole canvas at every step (a check of the cache
    plumbing: the decode then equals the uncached one)."""

    def __init__(self, inner: Feed):
        self.inner, self.keeps_cache = inner, inner.keeps_cache

    def rows(self, at: Step):
        return self.inner.rows(at)


# The guide's state (FlashDLM guided diffusion, arXiv 2505.21467; spec/flashdlm.md 2): one row of committed text.

class Guide:
    """
    A causal guide model and its KV cache of the committed text, for ONE row (the decoding loop keeps one
    Guide per batch row: rows commit different numbers of tokens per step).

    Invariant: cache rows [0, length) hold the committed text *except its last token*. Each verification
    teacher-forces [last committed token, d0, d1, ...]: the row fed `last` predicts d0, the row fed d_i
    predicts d_{i+1}, so one forward scores a whole run of drafts at once (as in speculative
    decoding). The rows a step then commits were all computed on accepted text, so keeping them is just
    moving `length` forward: nothing is recomputed and nothing is copied.
    """

    def __init__(self, model, max_len: int):
        if not model.config.causal:
            raise ValueError(f"the guide must be a causal LM (model_type 'qwen2'), not a {model.config.family} "
                             f"diffusion model: pass a Qwen2-format checkpoint as the guide")
        if max_len > model.config.max_seq_len:
            raise ValueError(f"the text ({max_len} tokens) is longer than the guide's {model.config.max_seq_len} "
                             f"positions: shorten the prompt or gen_length, or use a guide with a longer context")
        self.model = model
        self.cache = KVCache.for_model(model, 1, max_len)   # max_len: the canvas, prompt + answer
        self.length = 0

    def prefill(self, ids: torch.Tensor) -> int:
        """Start a new text: push the committed ids (T,) except the last token, in one forward (the last
        token is fed by the first verification, where its row predicts the first draft). -> guide calls."""
        self.length = 0
        if ids.numel() < 2:
            return 0
        self.model(ids[None, :-1], cache=self.cache, start=0)
        self.length = ids.numel() - 1
        return 1

    def verify(self, last: int | torch.Tensor, drafts: torch.Tensor, accept, chunk: int = 32):
        """
        Score drafts (N,) that follow the committed token `last`. accept(logits (n, V), drafts (n,)) -> bool (n,)
        is the acceptance rule (sampler.accept_drafts). The fed text [last, d0, ..., d_{N-2}] goes in chunks
        of `chunk` tokens, each verifying `chunk` drafts (the official verify_batch_size, 32), and stops after
        the first chunk with a rejection: a run of n < N accepted drafts costs n // chunk + 1 forwards, a
        fully accepted one ceil(N / chunk). The last draft is never fed: no draft follows it.
        -> (n, calls): n = length of the accepted run from d0, calls = guide forwards made.
        Leaves `length` alone; the caller commits with `commit`.
        """
        fed = torch.cat([torch.as_tensor(last, device=drafts.device).view(1), drafts[:-1]])   # (N,)
        calls = 0
        for a in range(0, drafts.numel(), chunk):
            logits = self.model(fed[None, a:a + chunk], cache=self.cache, start=self.length + a)[0]   # (n, V)
            calls += 1
            ok = accept(logits, drafts[a:a + chunk])
            if not ok.all():
                return a + int(ok.long().argmin()), calls                  # index of the first rejection
        return drafts.numel(), calls

    def commit(self, n: int):
        """The step committed n >= 1 tokens. Keep the rows of `last` and of the first n - 1 of them: that is
        the committed text minus its (new) last token again. This also covers a rejected d0 that the loop
        commits anyway (n = 1: only `last` is kept) and a run cut at an end-of-text token. Rows past `length`
        are stale drafts; the next chunk overwrites them and the causal mask never reads past the chunk."""
        self.length += n
