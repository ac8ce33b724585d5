"""Every decode terminates with no mask left, whatever the model predicts (issue: a head that prefers the
mask token, or a config whose mask id is wrong, made the block loop spin forever), and a model that
produces NaN/inf stops with one line instead of returning an empty answer."""
import copy

import pytest
import torch

from fastdllm import generate

PROMPT = torch.tensor([[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689]])
MODES = [dict(cache=c, **r) for c in ("none", "prefix", "dual", "free")
         for r in (dict(), dict(threshold=0.9), dict(factor=2.0))]


def mask_loving(model):
    """A copy whose LM head puts a huge logit on the mask token at every position: the argmax is always
    the mask, so only the rule "never propose the mask" lets the decode end."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.lm_head.weight[m.config.mask_id] = 0
        m.norm.weight.fill_(1.0)
        hook_bias = 1e4
        m.lm_head.register_forward_hook(lambda mod, i, out: out.index_add(
            -1, torch.tensor([m.config.mask_id]), torch.full((*out.shape[:-1], 1), hook_bias)))
    return m


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_head_that_prefers_the_mask_still_terminates(llada, dream, family, mode):
    model = mask_loving(llada if family == "llada" else dream)
    out, st = generate(model, PROMPT, gen_length=32, block_length=8, steps=32, **mode)
    assert not (out == model.config.mask_id).any()
    assert st["nfe"] <= 32 + 4                # at least one token per step (+ Dream's refresh steps)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_whole_canvas_samplers_never_return_the_mask(dream, family, llada):
    model = mask_loving(dream)
    for kw in (dict(remasking="entropy"), dict(remasking="origin"), dict(threshold=0.9)):
        out, _ = generate(model, PROMPT, gen_length=32, block_length=None, steps=8, **kw)
        assert not (out == model.config.mask_id).any(), kw


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_nan_weights_stop_with_one_line(llada, dream, family):
    model = copy.deepcopy(llada if family == "llada" else dream)
    with torch.no_grad():
        model.layers[0].mlp.w_gate_up.weight[-1, 0] = float("nan")      # one of up's weights
    with pytest.raises(ValueError, match=r"NaN/inf logits at step 1: .*weights hold NaN/inf.*float32") as e:
        generate(model, PROMPT, gen_length=16, block_length=8, cache="dual", threshold=0.9)
    assert "\n" not in str(e.value)
