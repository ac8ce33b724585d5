"""
EB-Sampler: entropy-bounded unmasking (Ben-Hamu, Gat, Severo, Nolte, Karrer; arXiv 2505.24857), as a selection rule.

Each step ranks the block's masked positions by an error proxy and commits the longest prefix of that order whose
entropies, summed, minus the largest of them stay <= gamma (the first always passes: 0 <= gamma). A step thus
commits many tokens where the model is sure of them jointly, one where it is not; gamma = 0 is about one token a
step, gamma = inf the whole block. Official code: none found; the rule is the one the public ports share
(nkalyanv99/UNI-D2 eb_sampler.py, HF diffusers EntropyBoundScheduler, Kamichanw/d2Cache confidence_unmasking).

Defaults: gamma = 0.01 (--gamma; the ports use 0.001 to 0.1). Proxy: confidence, the step rule's own p.conf (LLaDA:
the chosen token's probability; Dream: the max probability), so the fork changes only how many tokens a step
commits, never the family's order; the paper also names entropy and margin. Entropies in nats, float64, over the
whole vocabulary. Any cache (the rule reads only the block's logits); on Dream, Fast-dLLM's block sampler opens a
block's first position alone at its first step, so that step commits it alone.

Contract parts used: select= (a rule(p, at) with parallel = True), p.open, p.conf, p.logits at at.cols; the rule
is sampler.EntropyBound, which DiffusionGemma's acceptance shares.

    python examples/eb_sampler.py --model demo/llada-arith --gen-length 32 --block-length 8 --gamma 0.01 --prompt "..."
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from sampler import EntropyBound  # noqa: E402


class EBSampler(EntropyBound):
    """EB-Sampler's rule is sampler.EntropyBound over the step rule's own order, entropies in float64."""

    def __init__(self, gamma: float = 0.01):
        if not gamma >= 0:
            raise ValueError(f"EB-Sampler's gamma is an entropy bound in nats, >= 0 (got {gamma})")
        super().__init__(gamma, dtype=torch.float64)


if __name__ == "__main__":
    import cli
    cli.run(lambda gamma: dict(select=EBSampler(gamma)),
            gamma=(0.01, "the entropy bound in nats: a step commits the most confident masks while their entropies, "
                   "summed less the largest, stay <= gamma (0: about one token a step)"))
