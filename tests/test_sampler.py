"""sampler.py: confidence-aware parallel decoding (Fast-dLLM section 3.3) against one-token-per-step
decoding, its properties, and the selection rules in isolation."""
import pytest
import torch

import sampler as S
from fastdllm import generate

PROMPT = torch.tensor([[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233]])
KW = dict(gen_length=32, block_length=8)


def trace(model, prompt, **kw):
    """(output, stats, per-step list of {position: token} unmasked at that step)."""
    steps, prev = [], [None]

    def on_step(x, st):
        before = prev[0] if prev[0] is not None else torch.cat(
            [prompt, torch.full((prompt.shape[0], x.shape[1] - prompt.shape[1]), model.config.mask_id)], 1)
        changed = (x != before).nonzero().tolist()
        steps.append({(b, p): x[b, p].item() for b, p in changed})
        prev[0] = x.clone()
    out, st = generate(model, prompt, on_step=on_step, **kw)
    return out, st, steps


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "free"])
def test_unreachable_threshold_is_one_token_per_step(llada, cache):
    """tau = 1.01 can never be met, so only the always-taken most confident token is unmasked each step:
    exactly plain top-1 decoding (steps == gen_length) in the same cache mode."""
    top1, st1 = generate(llada, PROMPT, steps=32, cache=cache, **KW)
    thr, st2 = generate(llada, PROMPT, steps=32, cache=cache, threshold=1.01, **KW)
    assert torch.equal(top1, thr) and st1["nfe"] == st2["nfe"] == 32


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_tiny_factor_is_one_token_per_step_up_to_the_official_last_candidate_rule(llada, cache):
    """With a factor so small that no token but the top one passes (1 - f/(n+1) ~ 1), factor decoding is
    top-1 decoding, with one documented exception kept for parity with get_transfer_index_dynamic: when
    the first failure is the *last* candidate, the official rule takes all candidates. So each block's
    last two tokens come in one step. Everything before that step is identical to top-1 decoding."""
    _, _, top1 = trace(llada, PROMPT, steps=32, cache=cache, **KW)
    out, st, fac = trace(llada, PROMPT, steps=32, cache=cache, factor=1e-9, **KW)
    assert st["nfe"] == 4 * 7                                 # 8 tokens per block: 6 single steps + 1 double
    for b in range(4):
        single, double = fac[7 * b: 7 * b + 6], fac[7 * b + 6]
        assert single == top1[8 * b: 8 * b + 6]               # the same tokens at the same steps
        assert len(double) == 2 and set(double) == set(top1[8 * b + 6]) | set(top1[8 * b + 7])
    assert not (out == llada.config.mask_id).any()


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "free"])
@pytest.mark.parametrize("rule", [dict(threshold=0.9), dict(threshold=0.3), dict(factor=2.0)])
def test_parallel_decoding_properties(llada, dream, family, cache, rule):
    """At least one token per step, always terminates, nfe <= gen_length, no mask id returned, and rows of
    an unpadded batch equal their single-row runs (the official Dream threshold path never ends at batch 2)."""
    model = llada if family == "llada" else dream
    prompt = PROMPT[:, :10] if family == "dream" else PROMPT
    batch = torch.cat([prompt, torch.roll(prompt, 5, 1)])
    out, st, steps = trace(model, batch, steps=4, cache=cache, **KW, **rule)
    assert all(len(s) >= 1 for s in steps)
    assert st["nfe"] <= KW["gen_length"] and len(steps) == st["nfe"]     # one forward per step
    assert not (out == model.config.mask_id).any()
    for i in range(2):
        alone, _ = generate(model, batch[i:i + 1], steps=4, cache=cache, **KW, **rule)
        assert torch.equal(out[i:i + 1], alone)


def test_threshold_reduces_nfe(llada):
    _, base = generate(llada, PROMPT, steps=32, cache="dual", **KW)
    _, fast = generate(llada, PROMPT, steps=32, cache="dual", threshold=0.5, **KW)
    assert fast["nfe"] < base["nfe"]


# ------------------------------------------------------------------------------ selection rules, in isolation
def proposal(k=(0, 0)):
    conf = torch.tensor([[0.95, 0.2, 0.91, 0.5, 0.99, 0.1],
                         [0.3, 0.4, 0.2, 0.1, 0.0, 0.0]], dtype=torch.float64)
    cand = torch.tensor([[1, 1, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    return S.Proposal(torch.zeros(2, 6, dtype=torch.long), conf.masked_fill(~cand, S.NEG_INF), cand,
                      torch.tensor(k), None)


def test_threshold():
    p = proposal()
    assert S.Threshold(0.9)(p, None).tolist() == [[True, False, True, False, False, False],   # 0.99 is not open
                                                  [False, True, False, False, False, False]]  # none clears 0.9: the best
    assert S.Threshold(0.9)(p._replace(open=torch.zeros_like(p.open)), None).sum() == 0      # finished rows: nothing


def test_factor():
    p = proposal()
    # row 0 sorted: .95 .91 .5 .2 .1 with bars -1, 1-f/3, 1-f/4, ...; f=1: .91 >= .667, .5 < .75 -> take 2
    assert S.Factor(1.0)(p, None)[0].tolist() == [True, False, True, False, False, False]
    # row 1 has 2 candidates; .3 < 1 - 1/3 fails at the last candidate -> the official rule takes both
    assert S.Factor(1.0)(p, None)[1].tolist() == [True, True, False, False, False, False]
    assert S.Factor(100.0)(p, None).sum(-1).tolist() == [5, 2]  # everything passes
    big = torch.tensor([[0.9, 0.8, 0.7, 0.6]], dtype=torch.float64)
    assert S.Factor(1e-9)(S.Proposal(None, big, torch.ones_like(big, dtype=torch.bool), None, None), None).sum() == 1


def test_schedule_per_row_budget():
    sel = S.Schedule()(proposal(k=(3, 5)), None)
    assert sel.tolist() == [[True, False, True, True, False, False], [True, True, False, False, False, False]]


def test_num_transfer_tokens():
    assert S.num_transfer_tokens(torch.tensor([8, 8]), 3).tolist() == [[3, 3, 2], [3, 3, 2]]
    sched = S.num_transfer_tokens(torch.tensor([8]), 16)
    assert sched.sum() == 8 and sched[0, :8].tolist() == [1] * 8


def test_dream_schedule_floors_in_float32():
    """Official quirk reproduced: 64 masks over 64 steps decodes nothing at the first step (float32)."""
    ts = torch.linspace(1, 1e-3, 65)
    assert S.dream_num_transfer(torch.tensor(64.0), ts[0], ts[1], last=False) == 0
    assert S.dream_num_transfer(torch.tensor(2.0), ts[63], ts[64], last=True) == 2


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_seeded_sampling_is_reproducible(llada, temperature):
    runs = [generate(llada, PROMPT, steps=16, temperature=temperature, remasking=r,
                     generator=torch.Generator().manual_seed(7), **KW)[0]
            for r in ("low_confidence", "low_confidence", "random", "random")]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[2], runs[3])


def test_a_dream_rule_with_an_unknown_alg_is_refused_where_it_is_made():
    """A fork's propose=sampler.Dream(alg=...) names its remasking at construction, not at the first step."""
    with pytest.raises(ValueError, match=r"^unknown Dream remasking 'margin': use one of entropy, maskgit_plus"):
        S.Dream(steps=8, n_blocks=1, block_length=8, alg="margin", mask_id=5)
