"""
cache.py: the KV cache and the cache policies: the block-wise approximate KV cache of Fast-dLLM (arXiv
2505.22618, section 3.2, Figure 2) and FlashDLM's FreeCache (arXiv 2505.21467).

A diffusion LM attends bidirectionally, so strictly every key changes whenever any token is unmasked and
nothing can be cached. Fast-dLLM's observation is that keys/values barely move *within* one block's
denoising steps, so they are computed once per block (the "refresh" forward over the whole canvas) and
reused for the block's remaining steps:

- prefix: later steps feed the current block *and everything after it*; only the prefix [0, s) is reused.
- dual (DualCache): later steps feed only the current block [s, e); both the prefix and the masked suffix
  [e, L) are reused from the refresh.
- free (FreeCache): no refresh after the generation's first call; every step feeds the block and the masked
  suffix, and everything left of the block stays as it was last written.

All are one operation here: write the fed chunk's keys/values at their canvas positions, then attend over
the whole canvas. In prefix mode the fed chunk covers [s, L), so every stale entry is overwritten; in dual
mode it covers [s, e) and the suffix stays as the refresh left it (Fast-dLLM's `replace_position`). Which
span a step feeds is the cache policy's `span`: the one place the caches differ. The storage never advances
itself: every write names its slots, as tensors, so a step's shapes do not depend on where its block is.
A fork's policy may feed any set of positions (each keeps its own RoPE position and KV slot) and mask keys out.
How the layers run on what a policy feeds (eager, CUDA graphs, compiled) is graphs.py's.
"""
import torch


class KVCache:
    """Preallocated keys/values over the whole canvas, one (B, n_kv_heads, L + spare, head_dim) tensor per layer,
    allocated once per generate() call; `shapes` lists each layer's (n_kv_heads, head_dim). `spare` slots past the
    canvas are a discard slot: a row that must keep what it has (a frozen FreeCache block) writes there instead of
    branching, so every step has the same shapes."""

    def __init__(self, shapes: list, batch: int, length: int, device, dtype, spare: int = 0):
        self.k = [torch.zeros(batch, h, length + spare, d, device=device, dtype=dtype) for h, d in shapes]
        self.v = [torch.zeros(batch, h, length + spare, d, device=device, dtype=dtype) for h, d in shapes]
        self.length = length
        self.rows = torch.arange(batch, device=device)[:, None]

    @classmethod
    def for_model(cls, model, batch: int, length: int, spare: int = 0) -> "KVCache":
        """Each layer's (n_kv_heads, head_dim): config.json's, or model.kv_shapes() (DiffusionGemma's layers differ)."""
        cfg, p = model.config, model.lm_head.weight
        shapes = model.kv_shapes() if hasattr(model, "kv_shapes") else [(cfg.n_kv_heads, cfg.head_dim)] * cfg.n_layers
        return cls(shapes, batch, length, p.device, p.dtype, spare)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        """Write k, v (B, n_kv_heads, T, head_dim) at canvas slots (T,) (every row) or (B, T) (row by row) in
        place and return this layer's keys/values over the canvas's `length` positions (views, no copy: the spare
        discard slots past them are never attended)."""
        K, V = self.k[layer], self.v[layer]
        if slots.ndim == 1:
            K.index_copy_(2, slots, k)
            V.index_copy_(2, slots, v)
        else:
            K[self.rows, :, slots] = k.transpose(1, 2)               # (B, T, nkv, hd) at (row, slot)
            V[self.rows, :, slots] = v.transpose(1, 2)
        return K[:, :, :self.length], V[:, :, :self.length]

    def keep_rows(self, keep: torch.Tensor):
        """Keep the batch rows whose indices `keep` lists (one copy; the guide's finished rows leave)."""
        self.k, self.v = [k.index_select(0, keep) for k in self.k], [v.index_select(0, keep) for v in self.v]
        self.rows = self.rows[:len(keep)]


# ---------------------------------------------------------------------------------------- cache policies
# A cache policy answers, for every step `at` (fastdllm.Step), what the model is fed: span(at) -> (a, b), the canvas
# span [a, b) (a <= s and e <= b: the block's open positions are always fed, fastdllm.Plan.feed checks it and, for a
# shifted family, starts a span one earlier when it starts at the first open position), or a fork's set of canvas
# positions, a sorted 1-D long tensor (dKV-Cache, DPad). Everything not fed is read from the KV cache as the last
# call that fed it left it: that choice *is* the difference between the caches. The first call of a generation
# feeds the whole canvas (the cache starts empty). Two optional methods: keys(at), the keys this step may attend
# to, and slots(at, fed), per-row writes.
# A fork adds a policy by subclassing CachePolicy and passing an instance as generate(cache=...).
class CachePolicy:
    """The protocol, and its simplest policy: feed the whole canvas at every step, into the KV cache.
    keeps_cache: the model writes a KVCache (False: every call attends over the positions it is fed, alone).
    keys: None, or a method keys(at) -> (B, L) bool, the canvas positions this step's queries may attend to (a key
    mask: DPad drops far masks); padding is masked on top. slots: None, or a method slots(at, fed) -> (B, T) long,
    where each row writes the keys/values of the fed positions `fed` (T,): the cache's discard slot (`length`) for a
    position the row must keep (None: at their own positions, every row). spare: the discard slots slots() needs.
    fixed_width: False for a policy whose feed changes width from step to step within a block, which compile=True
    then leaves eager (a graph per step would not pay)."""
    keeps_cache = True
    keys = None
    slots = None
    spare = 0
    fixed_width = True

    def span(self, at):
        return 0, at.x.shape[1]


class NoCache(CachePolicy):
    """The exact reference: every call feeds the whole canvas and attends over it alone."""
    keeps_cache = False


class PrefixCache(CachePolicy):
    """Fast-dLLM's prefix cache (section 3.2): a block's first step refreshes the whole canvas, its later steps
    feed the block and everything after it [s, L); only the prefix [0, s) is reused from the refresh."""

    def span(self, at):
        return (0, at.x.shape[1]) if at.i == 0 else (at.s, at.x.shape[1])


class DualCache(CachePolicy):
    """Fast-dLLM's DualCache (section 3.2): a block's first step refreshes the whole canvas, its later steps
    feed the block alone [s, e); the prefix and the masked suffix are both reused from the refresh
    (Fast-dLLM's `replace_position`)."""

    def span(self, at):
        return (0, at.x.shape[1]) if at.i == 0 else (at.s, at.e)


class FreeCache(CachePolicy):
    """FlashDLM's FreeCache (arXiv 2505.21467; docs/official.md 7.1): only the generation's first call is full;
    every later step feeds [s - shift, L), the block and the masked suffix, from one position earlier for a
    shifted family (Dream predicts s from s - 1). Nothing left of that is ever recomputed: a block's keys/
    values stay frozen as its last step computed them, while some of its tokens were still masks. In a
    batch, a row that finished its block early must not be rewritten by the steps the other rows still need
    (or it would not decode as it would alone): its writes go to the discard slot."""
    spare = 1

    def span(self, at):
        return (0, at.x.shape[1]) if at.n == 0 else (at.s - at.shift, at.x.shape[1])

    def slots(self, at, fed):
        if at.x.shape[0] == 1:            # one row never steps once its block is done: no discard needed
            return None
        return torch.where(at.masked.any(-1, keepdim=True), fed, at.x.shape[1])


class BlockPrefix(CachePolicy):
    """A block-diffusion model's prefix cache (Fast-dLLM v2's block-level cache, SDAR's KV cache; blockdiff.py):
    exact, for its attention is block-causal. A block's first call stores the block before it, now clean: [prev, s)
    (the first block's: the prompt's whole blocks, [0, s), the prefill); every other call feeds the block [s, e)
    against the stored keys/values, and nothing after e is ever attended."""

    def span(self, at):
        return self.store(at) or (at.s, at.e)

    def store(self, at):
        """The store call's span, at a block's first call (s > 0); else None."""
        if at.n == 0:
            self.stored = 0                 # keys/values [0, stored) hold clean blocks
        if at.i == 0 and at.s > 0:
            a, self.stored = self.stored, at.s
            return a, at.s
        return None


class BlockWindow(BlockPrefix):
    """LLaDA2's prefix cache (llada2.py; the official generate() has none: each call feeds [0, e) under the
    block-causal mask): exact, and with no call that only stores. A block's first call feeds the block before it,
    now clean, with the block itself: [prev, e) (the first block's: [0, e), the prompt's whole blocks too); its
    later calls feed the block [s, e). So it makes the official's calls, one for one."""

    def span(self, at):
        return (self.store(at) or (at.s,))[0], at.e


class Window(NoCache):
    """LLaDA2's uncached decode, the official one: every call feeds the window [0, e), the blocks up to this one."""

    def span(self, at):
        return 0, at.e


class SubBlockCache(BlockPrefix):
    """Fast-dLLM v2's sub-block cache (`use_block_cache`; arXiv 2509.26328, the hierarchical cache): DualCache inside
    a block, approximate. The block's first denoising call, and a call whose sub-block still has its first position
    masked, feed the whole block and so rebuild its keys/values; the others feed only the sub-block [s + j, s + j +
    sub) against the prefix and the block as the last full call left it. Per row (slots, the discard slot): a row
    rebuilds only when its own sub-block needs it and a row with no mask in the sub-block keeps its cache, so each
    row decodes as it would alone (the official rebuilds every row when any row needs it: docs/parity.md)."""
    spare = 1

    def __init__(self, sub_block: int):
        self.sub_block = sub_block

    def span(self, at):
        stored = self.store(at)
        if at.i == 0:
            self.built, self.kind = False, "store"          # no keys/values of this block yet
        if stored:
            return stored
        j = at.masked_cols[0] // self.sub_block * self.sub_block          # the sub-block in decoding: [j, j + sub)
        self.kind = "build" if not self.built else "rebuild" if j in at.masked_cols else "sub"
        self.built, self.j = True, j
        return (at.s, at.e) if self.kind != "sub" else (at.s + j, min(at.s + j + self.sub_block, at.e))

    def slots(self, at, fed):
        if self.kind in ("store", "build") or at.x.shape[0] == 1:    # every row writes (one row: its own choice)
            return None
        j, sub = self.j, self.sub_block
        inside = (fed >= at.s + j) & (fed < at.s + j + sub)                 # (T,) the fed positions in the sub-block
        active = at.masked[:, j:j + sub].any(-1, keepdim=True)            # (B, 1) rows with a mask there
        write = active & (at.masked[:, j:j + 1] | inside)                  # a rebuilding row writes all it is fed
        return torch.where(write, fed, at.x.shape[1])


class Refresh(CachePolicy):
    """refresh_every_step: another policy's cache, fed the whole canvas at every step (a check of the cache
    plumbing: the decode then equals the uncached one)."""

    def __init__(self, inner: CachePolicy):
        self.keeps_cache, self.keys, self.slots, self.spare = inner.keeps_cache, inner.keys, inner.slots, inner.spare


CACHE_POLICIES = {"none": NoCache, "prefix": PrefixCache, "dual": DualCache, "free": FreeCache}
# A block-diffusion model's (blockdiff.py): "dual" is Fast-dLLM v2's sub-block cache (its sub-block size given).
BLOCK_CACHE_POLICIES = {"none": lambda sub: NoCache(), "prefix": lambda sub: BlockPrefix(),
                        "dual": SubBlockCache}
# LLaDA2's: no store call; it has no sub-blocks, so "dual" is its exact prefix cache too.
LLADA2_CACHE_POLICIES = {"none": lambda sub: Window(), "prefix": lambda sub: BlockWindow(),
                         "dual": lambda sub: BlockWindow()}

