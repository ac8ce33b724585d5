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

Both are one operation here: write the fed chunk's keys/values at their canvas positions, then attend over
the whole canvas. In prefix mode the fed chunk covers [s, L), so every stale entry is overwritten; in dual
mode it covers [s, e) and the suffix stays as the refresh left it (Fast-dLLM's `replace_position`). What
each step feeds is `feed_span` in fastdllm.py.

This file holds only the storage. When to refresh is decided by the generation loop (fastdllm.py), and
the cache never advances itself: every write names its position.
"""
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
    forward that fed it left it (cache.py); that choice *is* the difference between the caches:
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
