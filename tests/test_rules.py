"""The decoding rules by value, each against an oracle written apart from the code under test (tests/reference.py,
from the official formulas as docs/official.md records them), through the public generate() only:
Dream's whole-canvas sampler with every ranking (topk_margin included), greedy and sampled with top_p / top_k from
a fixed generator; Fast-dLLM's Dream block schedule without a threshold (entropy, blocks); and the factor rule
(Fast-dLLM 3.3) in whole decodes. The whole-canvas oracle is itself anchored on the official golden runs."""
import pytest
import torch

import sampler as S
from fastdllm import generate
from reference import reference_decode, reference_dream_blocks, reference_dream_canvas
from test_golden import DREAM_RUNS

PROMPTS = {"llada": [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]],
           "dream": [[775, 171, 806, 365, 316, 564, 432, 625, 575, 529], [12, 44, 907]]}
PAIR = torch.tensor([PROMPTS["dream"][0], [12, 44, 907, 5, 6, 7, 8, 9, 10, 11]])    # two rows, no padding


@pytest.mark.parametrize("run", [r for r in DREAM_RUNS if r["impl"] == "dream_hf"], ids=lambda r: r["name"])
def test_canvas_oracle_reproduces_the_official_runs(dream, run):
    """The oracle first: Dream's own diffusion_generate, token for token and call for call (entropy and
    maskgit_plus, batch 1 and 2), so the rules below are checked against the official sampler's arithmetic."""
    kw = run["kwargs"]
    want, calls, _, _ = reference_dream_canvas(dream, torch.tensor(run["input_ids"]), kw["max_new_tokens"],
                                               kw["steps"], alg=kw["alg"])
    assert want.tolist() == run["sequences"] and calls == run["nfe"]


@pytest.mark.parametrize("steps", [64, 16])
def test_topk_margin_equals_the_reference(dream, steps):
    """remasking="topk_margin" (Dream's whole-canvas sampler, docs/official.md 5): positions ranked by the top two
    probabilities' difference. On this fixture the margin's order decodes other tokens than maskgit_plus's and
    entropy's, so a sampler that ranked by either (or ignored remasking) fails here."""
    want, calls, _, ties = reference_dream_canvas(dream, PAIR, 64, steps, alg="topk_margin")
    for other in ("maskgit_plus", "entropy"):
        assert not torch.equal(reference_dream_canvas(dream, PAIR, 64, steps, alg=other)[0], want)
    got, st = generate(dream, PAIR, gen_length=64, block_length=None, steps=steps, remasking="topk_margin")
    assert ties == 0 and torch.equal(got, want) and st["nfe"] == calls


# (temperature, top_p, top_k) where each filter changes the draws on this fixture and no step's choice falls
# between tied scores. This model is so peaked that at lower temperatures the nucleus is often one token: every
# such position then scores 1.0, and which of the tied positions is committed is torch.topk's order over the
# official code's (B, L) width, which the rule does not define (tests/reference.py commit_top).
SAMPLED = [(4.0, 0.9, None), (4.0, None, 3), (4.0, 0.8, 3)]


@pytest.mark.parametrize("alg", ["maskgit_plus", "entropy", "topk_margin"])
@pytest.mark.parametrize("temperature,top_p,top_k", SAMPLED)
def test_sampled_top_p_top_k_equal_the_reference(dream, alg, temperature, top_p, top_k):
    """Dream's sampling at temperature > 0 (docs/official.md 5): logits / T, the nucleus, the top-k, then one
    Categorical draw over the masked positions in row-major order per call from the seeded generator, scored by
    the drawn token's probability. The oracle draws with the official torch.distributions.Categorical from the
    global RNG seeded alike. Catches a filter applied in another order or not at all (each changes the tokens
    here), another draw order or width (the stream shifts), and the greedy token's score kept for a drawn one."""
    kw = dict(alg=alg, temperature=temperature, seed=11)
    want, calls, _, ties = reference_dream_canvas(dream, PAIR, 32, 16, top_p=top_p, top_k=top_k, **kw)
    unfiltered = reference_dream_canvas(dream, PAIR, 32, 16, **kw)[0]
    assert ties == 0 and not torch.equal(want, unfiltered)
    if top_p is not None and top_k is not None:         # both matter, not just one of them
        assert not torch.equal(want, reference_dream_canvas(dream, PAIR, 32, 16, top_p=top_p, **kw)[0])
        assert not torch.equal(want, reference_dream_canvas(dream, PAIR, 32, 16, top_k=top_k, **kw)[0])
    got, st = generate(dream, PAIR, gen_length=32, block_length=None, steps=16, remasking=alg,
                       temperature=temperature, top_p=top_p, top_k=top_k, generator=torch.Generator().manual_seed(11))
    assert torch.equal(got, want) and st["nfe"] == calls


@pytest.mark.parametrize("steps", [64, 32, 8])
def test_dream_block_schedule_equals_the_reference(dream, steps):
    """Fast-dLLM's Dream block sampler without a threshold (docs/official.md 6.2, its default entropy ranking):
    the refresh call decodes the block's first token, then steps/blocks - 1 calls follow the float32 schedule
    over the block's masks. 16, 8 and 2 steps a block, two rows. Catches a wrong grid (per block, not per
    decode), a first call that ranks like the others, or another ranking. (The float32 floor: no decode of a full
    block reaches a count where float64 floors otherwise; test_the_count_floors_in_float32 reaches one.)"""
    want, calls = reference_dream_blocks(dream, PAIR, 64, 16, steps)
    got, st = generate(dream, PAIR, gen_length=64, block_length=16, steps=steps, cache="none")
    assert torch.equal(got, want) and st["nfe"] == calls == steps


def test_the_count_floors_in_float32(dream):
    """Dream's count int(n (1 - s/t)) is float32 arithmetic (docs/official.md 5): at 55 masks, step 35 of 37 on the
    grid, it is 27 where float64 floors to 26. A decode reaches that state when a fork's selection commits one
    token a step until step 35 (one block of 90, 37 steps: the first token, then 34): the step rule then proposes
    the float32 count, as the oracle's (tests/reference.py dream_count) and the official arithmetic give it."""
    from reference import dream_count
    grid = torch.linspace(1, 1e-3, 38)
    assert int(55 * (1 - grid[36].item() / grid[35].item())) == 26        # float64: the case tells them apart
    assert dream_count(torch.ones(1, 55, dtype=torch.bool), grid[35], grid[36], False) == 27
    seen = {}

    class OneAStepThenTheSchedule:
        parallel = False

        def __call__(self, p, at):
            seen[at.i] = (int(at.masked.sum()), int(p.k[0]))
            if at.i >= 35:
                return S.Schedule()(p, at)
            first = torch.zeros_like(p.open)
            first[0, int(p.open[0].nonzero()[0])] = True
            return first

    generate(dream, PAIR[:1], gen_length=90, block_length=90, steps=37, cache="none", select=OneAStepThenTheSchedule())
    assert seen[35] == (55, 27)


@pytest.mark.parametrize("f", [1.0, 2.0])
@pytest.mark.parametrize("family,cache,refresh", [("llada", "none", False), ("llada", "prefix", True),
                                                  ("llada", "dual", True), ("llada", "free", True),
                                                  ("dream", "none", False), ("dream", "dual", True)])
def test_factor_rule_in_a_decode_equals_the_reference(llada, dream, family, cache, refresh, f):
    """Fast-dLLM's factor rule (3.3; docs/official.md 2) over whole decodes: each step takes the top n-1 by
    confidence, n the first rank with c(n) < 1 - f/(n+1) (a first failure at the last rank takes all, as the
    official code does). These decodes reach every branch (a failure mid-way, at the last rank, none). Dream:
    our extension, its block's first call still decodes the first token alone. Caches refreshed every step
    feed the whole canvas, so they must give the uncached tokens. Catches a bar off by one rank, the last-rank
    rule dropped, or a factor read as a threshold (the NFE and tokens move)."""
    model = llada if family == "llada" else dream
    for row in PROMPTS[family]:
        prompt = torch.tensor([row])
        want, calls = reference_decode(model, prompt, 32, 8, factor=f)
        assert not torch.equal(want, reference_decode(model, prompt, 32, 8)[0])     # the rule decides here
        got, st = generate(model, prompt, gen_length=32, block_length=8, steps=32, cache=cache, factor=f,
                           refresh_every_step=refresh)
        assert torch.equal(got, want) and st["nfe"] == calls


@pytest.mark.parametrize("select", [None, S.Schedule()])
def test_a_schedule_given_as_select_is_checked_as_the_built_in_schedule(dream, select):
    """One answer to "is this rule parallel?" (sampler.is_parallel): a select= rule with parallel = False follows
    the family's schedule, so Dream's block sampler refuses topk_margin for it as for the built-in schedule (it
    used to run, counted as parallel because it was a fork's rule)."""
    with pytest.raises(ValueError, match="ranks tokens by entropy; remasking='topk_margin'"):
        generate(dream, PAIR, gen_length=32, block_length=8, steps=16, remasking="topk_margin", select=select)
    assert not S.is_parallel(S.Schedule()) and S.is_parallel(S.Threshold(0.9)) and S.is_parallel(None, threshold=0.9)
    assert S.is_parallel(lambda p, at: p.open) and not S.is_parallel(None)
