"""
KLASS: KL-Adaptive Stability Sampling (Kim, Hong, Jung, Park, Yun; arXiv 2511.05664; official code shkim0116/KLASS:
src/model/llada_klass.py stable_confident_decode, src/model/dream_klass.py alg "klass"), as a selection rule.

Each step, in float64 at the block and every later position: KL(p_t || p_t-1) (1e-12 inside both logs), the last
`history` kept (across blocks). A mask is ready once they are all < kl, its confidence is > conf (Dream: >=) and
the block has taken >= history - 1 steps; a step commits every ready mask, else the most confident (LLaDA: the
schedule's p.k; Dream: one). Not copied from the official LLaDA loop: a fallback k above the masks left overwrote
committed tokens; a block could end with masks. Defaults (official argparse): conf 0.9, kl 0.01, history 2, greedy,
cache none (it needs the logits of [s - shift, L) each step; memory (B, gen_length, V) float64). Dream as officially:
one block, all masks open from the first step (sampler.Dream(first_token=False)): --block-length 0 --cache none.
Contract parts used: select= with state across steps (reset at at.n == 0, a row's only while at.masked.any(-1)),
at.logits, p.x0/open/k; cache= (LLaDA), propose= (Dream, built from cli.run's `config`).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import sampler  # noqa: E402
from cache import NoCache  # noqa: E402


class KLASS:
    parallel = True      # the rule decides how many tokens a step commits

    def __init__(self, conf: float = 0.9, kl: float = 0.01, history: int = 2):
        self.conf, self.kl, self.history = conf, kl, history

    def __call__(self, p, at):
        L = at.x.shape[1]
        if not at.span or at.span[0] + at.shift > at.s or at.span[1] < L or at.shift and at.e < L:
            raise ValueError(f"KLASS needs the logits of [{at.s}, {L}) at every step, on Dream as one block (this call "
                             f"fed {at.span} for [{at.s}, {at.e})): use cache='none' (Dream: --block-length 0 too)")
        probs = at.logits(at.s, L).double().softmax(-1)                 # (B, L - s, V), float64 as officially
        if at.n == 0:                                                   # a new generation: nothing seen yet
            self.prev = torch.zeros_like(probs)
            self.kls = torch.zeros(*probs.shape[:2], self.history, dtype=probs.dtype, device=probs.device)
        prev, kls, N = self.prev[:, at.s - L:], self.kls[:, at.s - L:], at.e - at.s   # [s, L): views, written in place
        kl = (probs * ((probs + 1e-12).log() - (prev + 1e-12).log())).sum(-1)
        live = at.masked.any(-1)[:, None, None]     # a row done with its block waits for the others: no step of its own
        kls.copy_(torch.where(live, torch.cat([kls[..., 1:], kl[..., None]], -1), kls))
        prev.copy_(torch.where(live, probs, prev))
        conf = probs[:, :N].gather(-1, p.x0[..., None]).squeeze(-1).masked_fill(~p.open, float("-inf"))
        stable = (kls[:, :N] < self.kl).all(-1) & (at.i >= self.history - 1)   # Dream: moot (1st KL ~27.6 nats)
        ready = p.open & stable & (conf >= self.conf if at.shift else conf > self.conf)
        if at.shift:    # the official fallbacks: Dream the first most probable (its float32 p.conf), LLaDA topk(k)
            fallback = p.open & (torch.arange(N, device=conf.device) == p.conf.argmax(-1, keepdim=True))
        else:           # over the canvas, as the official loop calls it (ties decide alike)
            fallback = sampler.Schedule(lambda at: (at.s, L - at.e), topk=True)(p._replace(conf=conf), at)
        return torch.where(ready.any(-1, keepdim=True), ready, fallback)


def hooks(conf, kl, history, config):
    """The program's parts: Dream's step rule (steps, blocks: unread without a schedule) takes the CLI's --cache."""
    own = dict(propose=sampler.Dream(steps=1, n_blocks=1, block_length=1, alg="maskgit_plus", mask_id=config.mask_id,
                                   schedule=False, first_token=False))
    return dict(select=KLASS(conf, kl, history), **(own if config.shift else dict(cache=NoCache())))


if __name__ == "__main__":   # python examples/klass.py --model demo/llada-arith --gen-length 32 --block-length 8 --prompt "..."
    import cli
    cli.run(hooks, conf=(0.9, "a mask is ready once its confidence is above this (Dream: at least this)"),
            kl=(0.01, "... and its KL divergence between consecutive steps (nats, float64) is below this"),
            history=(2, "... for this many steps (and the block has taken history - 1 steps)"))
