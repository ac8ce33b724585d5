"""Kernel launches per model call (tools/launches.py): a cached DualCache call at LLaDA-8B's depth, counted as aten
ops that launch a kernel, against a minimal LLaMA-style forward of the same shape counted the same way (fused q/k/v
and gate/up, one RMSNorm op with its weight, RoPE on q and on k, SDPA; q/k norms where the family has them).

Ours stays within 1.2x for every dense family, in bf16 and float32. It is below the minimal's count where it rotates
q's and k's heads in one RoPE (5 ops fewer a layer), and it keeps, for bit parity with the official models:
- every RMSNorm's weight as an op after torch's rms_norm (the official norms cast back to the model's dtype, then
  scale; rms_norm's own weight would scale in float32 before the cast: other bits), 2 a layer, and 2 more for a
  q/k norm, whose two norms are then joined (cat) for the one RoPE;
- LLaDA's RoPE in float32 (its official RotaryEmbedding casts q and k up and back): 2 casts a layer in bf16;
- a call under a mask (a padded batch, a block-diffusion grid) zeroes the query rows with nothing to attend to
  (some GPU kernels return NaN there; the rows are found once a call), and there torch's CPU SDPA returns its output
  heads-first, one copy before the output projection (on CUDA its layout needs none).
Dream's q/k/v biases cost nothing: the fused projection adds them in its one matmul (addmm), as the official's
three do. The MoE families' routing has no counterpart in a dense yardstick: tools/launches.py reports them."""
from collections import Counter

import pytest
import torch

from tools.launches import config, minimal, ours, per_layer

DENSE = ("llada", "dream", "fastdllm_v2", "sdar")
# The ops ours launches in a layer beyond the minimal forward's, each one for the reason in the module docstring.
KEPT = {"to": "LLaDA's float32 RoPE", "mul": "a q/k norm's weight after the cast back",
        "cat": "q's and k's norms joined for one RoPE", "masked_fill": "rows with nothing to attend to, zeroed",
        "reshape": "SDPA under a mask, heads-first on the CPU"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("family", DENSE)
def test_a_call_launches_at_most_1_2x_the_minimal_forward(family, dtype):
    cfg, one = config(family), config(family, 1)
    a, b = ours(cfg, dtype), minimal(cfg, dtype)
    assert a.total <= 1.2 * b.total, (a.total, b.total)
    extra = per_layer(a, ours(one, dtype)) - per_layer(b, minimal(one, dtype))
    assert set(extra) <= set(KEPT), extra
    if family == "llada":      # the casts of its float32 RoPE, in bf16 only; Dream rotates in its own dtype
        assert extra == (Counter(to=2) if dtype == torch.bfloat16 else Counter())
    if family == "dream":
        assert not extra
