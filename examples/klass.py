"""
KLASS: KL-Adaptive Stability Sampling (Kim, Hong, Jung, Park, Yun; arXiv 2511.05664; official code shkim0116/KLASS:
src/model/llada_klass.py stable_confident_decode, src/model/dream_klass.py alg "klass"), as a selection rule.

Each step, in float64 at the block and every later position: KL(p_t || p_t-1) (1e-12 inside both logs); the last
`history` are kept. A mask is ready once they are all < kl, its confidence is > conf (Dream officially: >=) and the
block has taken >= history - 1 steps; a step commits every ready mask, else its fallback by confidence (LLaDA: the
schedule's p.k; Dream: one). p_prev and the history carry across blocks. Not copied from the official LLaDA code: a
fallback k above the masks left overwriting committed tokens; a block left with masks after its steps.
Defaults: conf 0.9, kl 0.01, history 2 (official argparse; its scripts use 0.6-0.9 and 0.001-0.015), temperature 0.
Each step needs the logits of [s - shift, L): cache "none", as officially (this program sets it; on LLaDA "prefix"
also feeds them, approximately; others are refused); memory (B, gen_length, V) float64. Dream: officially the whole
canvas, no blocks: generate(..., block_length=gen_length, propose=Canvas.of(model, gen_length)), every mask open from
the first step (the guard is moot there: the first KL, against zeros, is ~27.6 - entropy nats). The CLI runs Dream
by blocks, where Fast-dLLM's block sampler commits a block's first position alone at the block's first step.
Contract parts used: select= with state across steps (reset at at.n == 0), at.logits, p.x0/open/k, cache=, propose=.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import sampler  # noqa: E402


class KLASS:
    parallel = True      # the rule decides how many tokens a step commits

    def __init__(self, conf: float = 0.9, kl: float = 0.01, history: int = 2):
        self.conf, self.kl, self.history = conf, kl, history

    def __call__(self, p, at):
        L = at.x.shape[1]
        if not at.span or at.span[0] + at.shift > at.s or at.span[1] < L:
            raise ValueError(f"KLASS needs the logits of [{at.s}, {L}) at every step (its KL history), a feed of "
                             f"[{at.s - at.shift}, {L}): this cache fed {at.span or 'a set of positions'}; "
                             f"use cache='none'")
        probs = at.logits(at.s, L).double().softmax(-1)                 # (B, L - s, V), float64 as officially
        if at.n == 0:                                                   # a new generation: nothing seen yet
            self.prev = torch.zeros_like(probs)
            self.kls = torch.zeros(*probs.shape[:2], self.history, dtype=probs.dtype, device=probs.device)
        later = slice(at.s - L, None)                                   # [s, L) of the answer the state covers
        prev, kls = self.prev[:, later], self.kls[:, later]            # views: written in place
        kl = (probs * ((probs + 1e-12).log() - (prev + 1e-12).log())).sum(-1)
        live = at.masked.any(-1)[:, None, None]     # a row done with its block waits for the others: no step of its own
        kls.copy_(torch.where(live, torch.cat([kls[..., 1:], kl[..., None]], -1), kls))
        prev.copy_(torch.where(live, probs, prev))
        N = p.open.shape[1]
        conf = probs[:, :N].gather(-1, p.x0[..., None]).squeeze(-1).masked_fill(~p.open, float("-inf"))
        stable = (kls[:, :N] < self.kl).all(-1) & (at.i >= self.history - 1)
        ready = p.open & stable & (conf >= self.conf if at.shift else conf > self.conf)
        k = torch.ones_like(p.k) if at.shift else p.k                   # the official fallbacks: Dream one token
        fallback = sampler.Schedule()(p._replace(conf=conf, k=k), at)   # the k most confident masks
        return torch.where(ready.any(-1, keepdim=True), ready, fallback)


class Canvas(sampler.Dream):
    """Dream as the official KLASS runs it: the whole answer one block, every mask open from the first step."""
    first_token = False

    @classmethod
    def of(cls, model, gen_length: int):
        return cls(steps=gen_length, n_blocks=1, block_length=gen_length, alg="maskgit_plus",   # (p.conf unread)
                   mask_id=model.config.mask_id, schedule=False)


if __name__ == "__main__":
    import cache
    import cli
    cli.run(lambda conf, kl, history: dict(select=KLASS(conf, kl, history), cache=cache.NoCache()),
            conf=0.9, kl=0.01, history=2)
