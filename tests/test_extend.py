"""The fork test: a new cache policy and a new selection rule, defined here and nowhere else, run through
generate()'s public extension points (cache=a cache.Feed, select=a rule) on both families, without editing a
project file. What a fork of this project writes to add its method."""
import pytest
import torch

from cache import Feed
from fastdllm import generate
from reference import reference_decode
from sampler import NEG_INF, select_threshold, widen

PROMPTS = {"llada": torch.tensor([[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233]]),
           "dream": torch.tensor([[775, 171, 806, 365, 316, 564, 432, 625, 575, 529]])}
KW = dict(gen_length=32, block_length=8, steps=32)


class RefreshEvery(Feed):
    """(a) Refresh the whole canvas every k steps; in between, feed the block alone (DualCache-like)."""

    def __init__(self, k: int):
        self.k = k

    def span(self, at):
        return (0, at.x.shape[1]) if at.n % self.k == 0 else (at.s, at.e)


class Margin:
    """(b) Commit every masked position whose top-1 minus top-2 probability is at least m, and at least the
    position with the largest margin (so every step commits one token and decoding terminates)."""

    def __init__(self, m: float):
        self.m = m

    def __call__(self, p, cand, k):
        top2 = p.logits.float().softmax(-1).topk(2, dim=-1).values                 # (B, n_open, 2)
        margin = widen(top2[..., 0] - top2[..., 1], p.cols, cand.shape[1], NEG_INF).masked_fill(~cand, NEG_INF)
        return select_threshold(margin, cand, self.m)


@pytest.fixture
def model(request, llada, dream):
    return {"llada": llada, "dream": dream}[request.param]


@pytest.mark.parametrize("model,family", [("llada", "llada"), ("dream", "dream")], indirect=["model"])
def test_refresh_every_step_is_the_uncached_decode(model, family):
    prompt, tau = PROMPTS[family], (None if family == "llada" else 0.9)
    ours, st = generate(model, prompt, cache=RefreshEvery(1), threshold=tau, **KW)
    naive, st0 = generate(model, prompt, cache="none", threshold=tau, **KW)
    assert torch.equal(ours, naive) and st["nfe"] == st0["nfe"]
    assert torch.equal(ours, reference_decode(model, prompt, 32, 8, tau)[0])
    assert st["fed"] == [ours.shape[1]] * st["nfe"]


@pytest.mark.parametrize("model,family", [("llada", "llada"), ("dream", "dream")], indirect=["model"])
def test_refresh_every_k_steps_feeds_what_it_says(model, family):
    out, st = generate(model, PROMPTS[family], cache=RefreshEvery(4), threshold=0.9, **KW)
    L = out.shape[1]
    assert not (out == model.config.mask_id).any()
    assert st["fed"] == [L if n % 4 == 0 else 8 for n in range(st["nfe"])]


@pytest.mark.parametrize("model,family", [("llada", "llada"), ("dream", "dream")], indirect=["model"])
def test_margin_rule_terminates_and_above_one_commits_one_per_step(model, family):
    out, st = generate(model, PROMPTS[family], select=Margin(0.05), **KW)
    assert not (out == model.config.mask_id).any() and sum(st["committed"]) == 32
    strict, st1 = generate(model, PROMPTS[family], select=Margin(1.5), **KW)      # a margin is at most 1
    assert not (strict == model.config.mask_id).any()
    assert st1["committed"] == [1] * 32 and st1["nfe"] == 32
    assert st["nfe"] < st1["nfe"]                  # a reachable margin commits several tokens in some steps


def test_margin_rule_with_a_cache_policy_and_a_batch(llada):
    """Both extension points at once, on a batch: every row ends with no mask left."""
    prompt = torch.cat([PROMPTS["llada"], PROMPTS["llada"].flip(1)])
    out, _ = generate(llada, prompt, cache=RefreshEvery(2), select=Margin(0.2), **KW)
    assert not (out == llada.config.mask_id).any()
