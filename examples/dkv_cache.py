"""
dKV-Cache-Decode (Ma, Yu, Fang, Wang, "dKV-Cache: The Cache for Diffusion Language Models", arXiv 2505.15781;
official code horseee/dKV-Cache, read in its copy mukul54/dKV-Cache generation_utils/llada_dkv_cache_decode.py):
a token's keys/values are cached one step after it is decoded, and the whole canvas is refreshed every R steps.

Within a block, step i feeds the whole canvas when i < 2 or i % R == 0; otherwise only the positions that were
masks at the start of step i - 1 (every mask of the canvas and the tokens decoded at step i - 1), against the KV
cache for the rest. Official defaults (LLaDA): R = 8, block 32, steps = gen_length, low-confidence remasking,
no threshold, no early stop: `--refresh 8 --threshold none --no-early-stop` (the CLI's own defaults, threshold
0.9 and early stop, stay on otherwise).

Contract used: a cache policy that feeds a sorted set of positions (span), per-row slots with one discard slot
(a batch feeds the union of its rows' sets; a row's extra positions write to the discard slot, so it decodes as
alone), state across steps (the last step's masks; every block's first two steps refresh), cli.run's `config`. Not
fixed shapes: the feed shrinks every step (fixed_width = False: compile=True leaves the calls eager), and reading
its width is one more host sync per cached step. LLaDA only: the official Dream variant decodes the whole canvas
with a shifted cached set, not written here (the policy is built from the checkpoint's config and refuses Dream).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cache import CachePolicy  # noqa: E402


class DKVCacheDecode(CachePolicy):
    spare, fixed_width = 1, False

    def __init__(self, config, refresh: int = 8):       # config: the checkpoint's model.ModelConfig
        if config.family != "llada":
            raise ValueError(f"dKV-Cache-Decode is written here for LLaDA; the official Dream variant (a whole-canvas "
                             f"decode with a shifted cached set) is not: got a {config.family} model")
        if refresh < 1:
            raise ValueError(f"--refresh must be >= 1 (got {refresh}): it is the refresh interval in steps")
        self.refresh = refresh

    def span(self, at):
        fed, self.before = getattr(self, "before", None), at.x == at.mask_id     # (B, L) masks at the step's start
        if at.i < 2 or at.i % self.refresh == 0:     # refresh: the whole canvas, into the cache
            self.fed = None
            return 0, at.x.shape[1]
        self.fed = fed                       # per row: masked at the start of the previous step (delayed caching)
        return fed.any(0).nonzero().squeeze(1)

    def slots(self, at, fed):
        if self.fed is None or at.x.shape[0] == 1:
            return None
        return torch.where(self.fed[:, fed], fed, at.x.shape[1])   # another row's position: the discard slot


if __name__ == "__main__":   # python examples/dkv_cache.py --model demo/llada-arith --gen-length 32 --block-length 8 --prompt "..."
    import cli
    cli.run(lambda refresh, config: dict(cache=DKVCacheDecode(config, refresh)),
            refresh=(8, "feed the whole canvas at a block's first two steps and every this many; between, only "
                     "the positions that were masks a step before"))
