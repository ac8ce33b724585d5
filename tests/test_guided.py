"""Guided diffusion (FlashDLM, arXiv 2505.21467): the diffusion model drafts every masked position, a small
causal model verifies the drafts, the accepted run is committed. Against the official code (golden runs),
and against what the rule means (a guide that always / never agrees)."""
import json
import os

import pytest
import torch

from conftest import GOLDEN
from fastdllm import generate
from model import load_model
from test_flashdlm import eos_bias

with open(os.path.join(GOLDEN, "flashdlm-golden.json")) as f:
    FLASH = json.load(f)
GUIDED_RUNS = [r for r in FLASH["runs"] if r["settings"]["method"] in ("guided_assisted", "guided_speculative")]
# The official guide does one spurious forward in this run (when an accepted run spans two verification
# chunks it re-pushes a token its cache already holds); the tokens are unaffected. We count 51, not 52.
OFFICIAL_EXTRA_GUIDE_CALLS = {"as_prompt_topk512_g64_vb4": 1}


@pytest.fixture(scope="module")
def guide(qwen2):
    return qwen2


def guided_call(st):
    """Official `assisted_block_diffusion_generate` / `speculative_block_diffusion_generate` settings -> our
    generate() arguments."""
    acc = st["acceptance"]
    return dict(gen_length=st["gen_length"], cache={"prompt_frozen": "prefix", "aggressive": "free"}[st["cache_mode"]],
                accept=acc["rule"], accept_k=acc.get("k", 5), accept_ratio=acc.get("ratio", 0.95),
                accept_threshold=acc.get("threshold", 0.1), verify_chunk=st["verify_chunk"],
                speculative=st["method"] == "guided_speculative")


@pytest.mark.parametrize("run", GUIDED_RUNS, ids=lambda r: r["name"])
def test_guided_golden_run(dream, guide, run):
    """Exact ids, diffusion calls, guide calls, tokens committed per step and fed slices."""
    prompt = torch.tensor([FLASH["prompts"][run["prompt"]]])
    with eos_bias(dream, run["settings"].get("eos_bias", {}).get("dream")):
        out, st = generate(dream, prompt, guide=guide, **guided_call(run["settings"]))
    assert out[0].tolist() == run["output"]
    assert st["nfe"] == run["nfe"]
    assert st["committed"] == run["committed_per_step"]
    assert st["guide_calls"] == run["ar_calls"] - OFFICIAL_EXTRA_GUIDE_CALLS.get(run["name"], 0)
    assert st["fed"] == [n for _, n in run["slices"]]


def stubborn(guide, token):
    """A copy of the guide whose next-token argmax is always `token` (a huge logit on it)."""
    import copy
    g = copy.deepcopy(guide)
    g.lm_head.register_forward_hook(lambda m, i, out: out.index_add(
        -1, torch.tensor([token]), torch.full((*out.shape[:-1], 1), 1e4)))
    return g


def left_to_right(model, prompt, gen_length):
    """The plain left-to-right decode of the diffusion model: each step, one full forward and the argmax
    (never the mask token) at the first mask."""
    import sampler as S
    x = torch.cat([prompt, torch.full((1, gen_length), model.config.mask_id)], 1)
    for p in range(prompt.shape[1], x.shape[1]):
        with torch.no_grad():
            x[0, p] = S.argmax_except(model(x)[0, p], model.config.mask_id)
    return x


@pytest.mark.parametrize("cache", ["none", "prefix", "free"])
def test_a_guide_that_never_agrees_is_left_to_right_decoding(dream, guide, cache):
    """Every draft rejected: exactly one diffusion token per step (the first draft, the model's own), so
    with the exact cache the output is the plain left-to-right decode, written out above."""
    never = stubborn(guide, dream.config.mask_id)      # the guide always wants the mask, never drafted
    prompt = torch.tensor([FLASH["prompts"]["p10"]])
    out, st = generate(dream, prompt, gen_length=24, guide=never, cache=cache)
    assert st["committed"] == [1] * 24 and st["nfe"] == 24
    if cache == "none":
        assert torch.equal(out, left_to_right(dream, prompt, 24))


def test_a_guide_that_always_agrees_commits_every_draft(dream, guide):
    """topk over the whole vocabulary accepts anything: the first step commits all 24 drafts."""
    prompt = torch.tensor([FLASH["prompts"]["p10"]])
    out, st = generate(dream, prompt, gen_length=24, guide=guide, accept="topk", accept_k=1024, verify_chunk=8)
    assert st["committed"] == [24] and st["nfe"] == 1 and st["guide_calls"] == 1 + 3
    assert not (out == dream.config.mask_id).any()


@pytest.mark.parametrize("cache", ["none", "prefix", "free"])
@pytest.mark.parametrize("accept", [dict(accept="deterministic"), dict(accept="topk", accept_k=512),
                                    dict(accept="topk_relative", accept_k=512, accept_ratio=1e-18)])
def test_guided_batch_rows_equal_single_rows(dream, guide, cache, accept):
    """Any batch size, padded too: each row is decoded as it would be alone; every mode terminates."""
    from fastdllm import pad_prompts
    rows = [FLASH["prompts"]["p10"], FLASH["prompts"]["p24"][:7]]
    ids, am = pad_prompts(rows, dream.config.pad_id)
    batch, st = generate(dream, ids, attention_mask=am, gen_length=16, guide=guide, cache=cache, **accept)
    assert not (batch == dream.config.mask_id).any()
    for i, row in enumerate(rows):
        alone, _ = generate(dream, torch.tensor([row]), gen_length=16, guide=guide, cache=cache, **accept)
        assert torch.equal(batch[i, -alone.shape[1]:], alone[0])


def test_guided_llada(llada, guide, tmp_path):
    """A LLaDA-format model with a guide that shares its ids works the same way. The free feed starts at
    the last committed token for LLaDA too (no logits shift needs it, but then that token is frozen with
    keys computed while it held its token). Here the tiny guide is given LLaDA's special ids."""
    from conftest import copy_checkpoint
    d = copy_checkpoint("qwen2-tiny", tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.update(bos_token_id=llada.config.bos_id or 1019, eos_token_id=llada.config.eos_id)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    g = load_model(d, device="cpu", dtype=torch.float32)
    prompt = torch.tensor([[815, 723, 294, 53, 204, 372, 664, 1017]])
    for cache in ("none", "prefix", "free"):
        out, st = generate(llada, prompt, gen_length=16, guide=g, cache=cache, accept="topk", accept_k=512)
        assert not (out == llada.config.mask_id).any() and sum(st["committed"]) <= 16
        P = prompt.shape[1]
        if cache == "free":   # after the first call each step feeds from the last committed token to the end
            firsts = [P + sum(st["committed"][:i]) for i in range(1, st["nfe"])]
            assert st["fed"][1:] == [P + 16 - f + 1 for f in firsts]


def test_guided_settings_are_checked(dream, guide, llada):
    prompt = torch.tensor([FLASH["prompts"]["p10"]])
    with pytest.raises(ValueError, match="guide or threshold/factor, not both"):
        generate(dream, prompt, gen_length=8, guide=guide, threshold=0.9)
    with pytest.raises(ValueError, match="unknown accept rule 'best'"):
        generate(dream, prompt, gen_length=8, guide=guide, accept="best")
    with pytest.raises(ValueError, match="temperature must be 0"):
        generate(dream, prompt, gen_length=8, guide=guide, temperature=0.5)
    with pytest.raises(ValueError):          # llada-tiny's ids (mask 1000 = the guide's eos) do not match
        generate(llada, prompt, gen_length=8, guide=guide)
