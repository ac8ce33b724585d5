"""
DPad, the Diffusion Scratchpad (Chen et al., "DPad: Efficient Diffusion Language Models with Suffix Dropout",
arXiv 2508.14148; official code Crys-Chen/DPad, llada/generate_dropout.py, llada/sampler.py, dream/model/
generation_utils_block.py): per block, keep only a random, distance-decayed subset of the masked suffix.

Once per block, before its first call, suffix position e + j is kept iff u_j < scale * phi(j * k_sigma /
(window - 1)) for j < window (phi the standard normal density, u uniform, one draw per block; nothing is kept
beyond the window). --cache-mode none: every step feeds [0, e) + kept and attends over them alone; dual (DPad's
dual_cache, Fast-dLLM's DualCache): the block's first step feeds [0, e) + kept into the cache, later steps feed the
block, and the dropped keys are masked out. Official defaults: window 256, k_sigma 4, scale 2.0 (LLaDA) / 1.6
(Dream; the program's --scale 0 picks the checkpoint family's), block 32, threshold 0.9, early stop at the end of
text. The official draw is torch.rand on the global CUDA generator (seeded 1234 by its eval, shared across prompts),
a stream no CPU can reproduce: here a torch.Generator seeded --drop-seed, afresh for every generation. A window
larger than the answer (the official code refuses it) keeps the table's first entries.
Contract used: a cache policy that feeds a sorted set of positions (span), with no KV cache (keeps_cache = False)
or with a key mask (keys), state across steps (the kept set, the generator, reset at at.n == 0); cli.run's `config`.
Shapes are fixed within a block (one host sync a block: the kept set's size). In dual mode the generation's first
call feeds the whole canvas (the contract's empty cache), its dropped keys masked. Both families in dual mode; in
none mode Dream keeps Fast-dLLM's block rule (its first token alone at the block's first step), which DPad's Dream
`_sample` does not have.
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cache import CachePolicy  # noqa: E402


class DPad(CachePolicy):
    def __init__(self, cache_mode="dual", window=256, k_sigma=4.0, scale=2.0, drop_seed=1234):
        if cache_mode not in ("none", "dual") or window < 1:
            raise ValueError(f"--cache-mode must be none or dual (got {cache_mode!r}) and --window >= 1 (got {window})")
        self.keeps_cache, self.seed = cache_mode == "dual", drop_seed
        x = torch.linspace(0, k_sigma, window)           # float32, as the official table
        self.pdf = scale * torch.exp(-0.5 * x ** 2) / torch.sqrt(torch.tensor(2 * math.pi))

    def span(self, at):
        L, dev = at.x.shape[1], at.x.device
        if at.i == 0:                                    # a block starts: draw its kept suffix once
            if at.n == 0:
                self.gen = torch.Generator(dev).manual_seed(self.seed)
            u, pdf = torch.rand(L - at.e, generator=self.gen, device=dev), self.pdf.to(dev)[:L - at.e]
            kept = at.e + (u[:len(pdf)] < pdf).nonzero().squeeze(1)
            self.fed = torch.cat([torch.arange(at.e, device=dev), kept])
            self.key = torch.zeros(L, dtype=torch.bool, device=dev).index_fill_(0, self.fed, True).expand_as(at.x)
        if not self.keeps_cache:
            return self.fed
        return (0, L) if at.n == 0 else self.fed if at.i == 0 else (at.s, at.e)

    def keys(self, at):
        return self.key if self.keeps_cache else None


if __name__ == "__main__":   # python examples/dpad.py --model demo/llada-arith --gen-length 32 --block-length 8 --prompt "..."
    import cli
    cli.run(lambda config, scale, **kw: dict(cache=DPad(scale=scale or {"dream": 1.6}.get(config.family, 2.0), **kw)),
            cache_mode=("dual", "dual: DualCache over the prefix and the kept suffix, the dropped keys masked out; "
                        "none: no KV cache, every step feeds them"),
            window=(256, "suffix positions after the block that may be kept (none beyond)"),
            k_sigma=(4.0, "the window spans this many standard deviations of the keep probability's Gaussian"),
            scale=(0.0, "the keep probability's scale; 0 = the checkpoint family's official one (LLaDA 2.0, Dream "
                   "1.6)"),
            drop_seed=(1234, "seed of the draw of kept positions, afresh for every generation"))
