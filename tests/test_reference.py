"""The fast paths against the independent naive decode of tests/reference.py: exact where the method is exact
(no cache; any cache fed the whole canvas every step; padded batches), and a stated, measured bound where
it is approximate (the prefix cache, DualCache and FreeCache on the trained demo model)."""
import os

import pytest
import torch

from conftest import ROOT
from fastdllm import generate, pad_prompts
from model import load_model
from reference import reference_decode

PROMPTS = {"llada": [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]],
           "dream": [[775, 171, 806, 365, 316, 564, 432, 625, 575, 529], [12, 44, 907]]}
# Dream's one-token-per-step is the threshold rule with an unreachable tau (its schedule is not one per step).
RULES = {"llada": [None, 0.9, 0.5], "dream": [1.01, 0.9, 0.5]}


# Dream's FreeCache runs FlashDLM's own sampler, not this one: tests/test_flashdlm.py checks it against the
# official code and against the uncached model.
EXACT = [(f, c, r) for f in ("llada", "dream") for c, r in (("none", False), ("prefix", True), ("dual", True),
                                                          ("free", True)) if (f, c) != ("dream", "free")]


@pytest.mark.parametrize("rule", [0, 1, 2])
@pytest.mark.parametrize("family,cache,refresh", EXACT)
def test_exact_paths_equal_the_reference(llada, dream, family, rule, cache, refresh):
    """No cache, and every cache mode refreshed at every step, decode exactly the reference's tokens with the
    reference's number of model calls."""
    model, tau = (llada if family == "llada" else dream), RULES[family][rule]
    for row in PROMPTS[family]:
        prompt = torch.tensor([row])
        want, calls = reference_decode(model, prompt, 32, 8, tau)
        got, st = generate(model, prompt, gen_length=32, block_length=8, steps=32, cache=cache, threshold=tau,
                           refresh_every_step=refresh)
        assert torch.equal(got, want) and st["nfe"] == calls


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_padded_batch_rows_equal_the_reference(llada, dream, family):
    model, tau = (llada if family == "llada" else dream), RULES[family][1]
    ids, am = pad_prompts(PROMPTS[family], model.config.pad_id)
    got, _ = generate(model, ids, attention_mask=am, gen_length=32, block_length=8, steps=32, cache="dual",
                      threshold=tau, refresh_every_step=True)
    for i, row in enumerate(PROMPTS[family]):
        want, _ = reference_decode(model, torch.tensor([row]), 32, 8, tau)
        assert torch.equal(got[i, -want.shape[1]:], want[0])


# The share of answers equal to the reference's token for token, on 40 held-out demo problems in one batch
# (gen 32, block 8). Measured: prefix 0.950, dual 0.875, free 0.950, both at one token per step and at tau 0.9
# (`python -m pytest tests/test_reference.py -k approximate -s` prints them). DualCache also reuses the stale
# suffix, so it drifts most.
APPROX_BOUND = {("prefix", None): 0.9, ("dual", None): 0.85, ("free", None): 0.9,
                ("prefix", 0.9): 0.9, ("dual", 0.9): 0.85, ("free", 0.9): 0.9}


@pytest.fixture(scope="module")
def demo():
    import sys
    from tokenizers import Tokenizer
    sys.path.insert(0, os.path.join(ROOT, "demo"))
    from train import heldout
    folder = os.path.join(ROOT, "demo", "llada-arith")
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    prompt = torch.tensor([e.ids for e in tok.encode_batch([q for q, _, _ in heldout(40)], add_special_tokens=False)])
    return load_model(folder, device="cpu", dtype=torch.float32), prompt


@pytest.mark.parametrize("cache,tau", list(APPROX_BOUND), ids=lambda v: str(v))
def test_approximate_caches_stay_close_to_the_reference(demo, cache, tau):
    model, prompt = demo
    want, _ = reference_decode(model, prompt, 32, 8, tau)
    got, _ = generate(model, prompt, gen_length=32, block_length=8, steps=32, cache=cache, threshold=tau)
    same = (got == want).all(-1).float().mean().item()
    print(f"{cache} tau={tau}: {same:.3f} of the answers equal the reference's")
    assert same >= APPROX_BOUND[cache, tau]
