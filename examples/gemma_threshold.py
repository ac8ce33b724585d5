"""
Fast-dLLM's confidence threshold (Wu et al., arXiv 2505.22618, section 3.3) on DiffusionGemma, as a selection rule:
a step accepts every sample whose probability is >= tau, and always the most probable one; every other position is
renoised, as DiffusionGemma's own entropy bound leaves them (uniform.py). The rule reads only what any proposal
holds: the sampled tokens p.x0 and the step's (temperature-scaled) logits p.logits at the canvas columns at.cols, and
hands the threshold decision to sampler.Threshold, so it runs as well on LLaDA or Dream, where p.x0 is the argmax.

Contract parts used: select= (a rule(p, at) with parallel = True), p.x0, p.logits at at.cols, p.open.

    python examples/gemma_threshold.py --model <a DiffusionGemma checkpoint> --tau 0.9 --prompt "..."
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from sampler import NEG_INF, Threshold  # noqa: E402


class SampleThreshold:
    parallel = True      # the rule decides how many tokens a step accepts

    def __init__(self, tau: float = 0.9):
        self.tau = tau

    def __call__(self, p, at):
        probs = p.logits.float().softmax(-1)                                      # (B, n, V) at the canvas columns
        chosen = probs.gather(-1, p.x0[:, at.cols, None]).squeeze(-1)               # each sample's probability
        conf = torch.full(p.open.shape, NEG_INF, device=probs.device).index_copy_(1, at.cols, chosen)
        return Threshold(self.tau)(p._replace(conf=conf.masked_fill(~p.open, NEG_INF)), at)


if __name__ == "__main__":
    import cli
    cli.run(lambda tau: dict(select=SampleThreshold(tau)),
            tau=(0.9, "accept every sample whose probability is >= tau (and always the most probable one)"))
