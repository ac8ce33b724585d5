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
    from reference import predictions
    x = torch.cat([prompt, torch.full((1, gen_length), model.config.mask_id)], 1)
    for p in range(prompt.shape[1], x.shape[1]):
        with torch.no_grad():
            x[0, p] = S.argmax_except(predictions(model, x)[0, p], model.config.mask_id)
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


RULES = [dict(accept="deterministic"), dict(accept="topk", accept_k=512),
         dict(accept="topk_relative", accept_k=512, accept_ratio=1e-18),
         dict(accept="dynamic_threshold", accept_threshold=1e-15), dict(accept="aggressive")]


@pytest.mark.parametrize("speculative", [False, True], ids=["assisted", "speculative"])
@pytest.mark.parametrize("cache", ["none", "prefix", "free"])
@pytest.mark.parametrize("accept", RULES, ids=lambda a: a["accept"])
def test_guided_batch_rows_equal_single_rows(dream, guide, cache, accept, speculative):
    """A batch is decoded together (one diffusion forward per step, one guide forward per verification
    chunk), padded too: each row is decoded as it would be alone; every mode terminates."""
    from fastdllm import pad_prompts
    rows = [FLASH["prompts"]["p10"], FLASH["prompts"]["p24"][:7]]
    ids, am = pad_prompts(rows, dream.config.pad_id)
    kw = dict(gen_length=16, guide=guide, cache=cache, speculative=speculative, **accept)
    batch, st = generate(dream, ids, attention_mask=am, **kw)
    assert not (batch == dream.config.mask_id).any()
    for i, row in enumerate(rows):
        alone, _ = generate(dream, torch.tensor([row]), **kw)
        assert torch.equal(batch[i, -alone.shape[1]:], alone[0])


@pytest.mark.parametrize("speculative", [False, True], ids=["assisted", "speculative"])
@pytest.mark.parametrize("cache", ["prefix", "free"])
@pytest.mark.parametrize("eos", [None, 25.0], ids=["no-eos", "eos25"])
def test_guided_batch_of_four_costs_the_slowest_row(dream, guide, cache, speculative, eos):
    """Four prompts of four lengths (left-padded), rows that end at different steps (at the end of the
    canvas, or at an end token: the eos run adds a constant to the eos logit). Every row equals its solo
    run, a finished row's canvas never changes again, and the batch costs the diffusion forwards of its
    slowest row (not their sum) and fewer guide forwards than the rows' own together."""
    from fastdllm import pad_prompts
    p10, p24 = FLASH["prompts"]["p10"], FLASH["prompts"]["p24"]
    rows = [p10, p24[:7], p24, p10[:3]]
    ids, am = pad_prompts(rows, dream.config.pad_id)
    kw = dict(gen_length=24, guide=guide, cache=cache, speculative=speculative, accept="topk", accept_k=512)
    canvases = []
    with eos_bias(dream, eos):
        batch, st = generate(dream, ids, attention_mask=am, on_step=lambda x, s: canvases.append(x.clone()), **kw)
        solo = [generate(dream, torch.tensor([r]), **kw) for r in rows]
    for i, (alone, own) in enumerate(solo):
        assert torch.equal(batch[i, -alone.shape[1]:], alone[0])
        assert all(torch.equal(c[i], batch[i]) for c in canvases[own["nfe"] - 1:])   # done: nothing changes
    nfe = [own["nfe"] for _, own in solo]
    assert len(set(nfe)) > 1 and st["nfe"] == max(nfe)
    assert st["guide_calls"] < sum(own["guide_calls"] for _, own in solo)
    if eos:   # some rows stopped at an end token, before the canvas end
        assert any((alone[0, len(r):] == dream.config.eos_id).any() for (alone, _), r in zip(solo, rows))


def guide_greedy(guide, prompt, gen_length: int, eos: int):
    """The guide's own greedy decode, written out: one plain forward over the whole text per token, its argmax
    appended, the rest filled with eos after an end token."""
    x = prompt[0].tolist()
    while len(x) < prompt.shape[1] + gen_length:
        with torch.no_grad():
            x.append(int(guide(torch.tensor([x]))[0, -1].argmax()))
        if x[-1] == eos:
            x += [eos] * (prompt.shape[1] + gen_length - len(x))
    return x


@pytest.mark.parametrize("cache", ["prefix", "free"])
def test_speculative_deterministic_is_the_guides_greedy_decode(dream, guide, cache):
    """Speculative decoding with the diffusion model as the drafter: with deterministic acceptance every
    committed token is the guide's argmax given the committed text, so the answer is the guide's greedy text,
    whatever the diffusion model drafts and whatever its cache (here on random weights, and with an end
    token). On the demo pair, which agrees, it is reached in 3 guide calls instead of one per token."""
    prompt = torch.tensor([FLASH["prompts"]["p10"]])
    for bias in (None, 15.0):          # 15: the guide ends its text at answer token 19
        with eos_bias(guide, bias):
            ref = guide_greedy(guide, prompt, 32, guide.config.eos_id)
            out, st = generate(dream, prompt, gen_length=32, guide=guide, cache=cache, speculative=True)
        assert out[0].tolist() == ref
    assert bias is None or guide.config.eos_id in ref[prompt.shape[1]:]


def test_speculative_demo_pair_is_the_guides_greedy_decode_in_few_calls():
    from conftest import ROOT
    model = load_model(os.path.join(ROOT, "demo", "llada-arith"), device="cpu", dtype=torch.float32)
    g = load_model(os.path.join(ROOT, "demo", "qwen2-arith"), device="cpu", dtype=torch.float32)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(ROOT, "demo", "llada-arith", "tokenizer.json"))
    prompt = torch.tensor([tok.encode("Tom has 23 apples and buys 45 more. How many apples does he have?",
                                      add_special_tokens=False).ids])
    for cache in ("prefix", "free"):
        out, st = generate(model, prompt, gen_length=32, guide=g, cache=cache, speculative=True)
        assert out[0].tolist() == guide_greedy(g, prompt, 32, g.config.eos_id)
        assert st["guide_calls"] <= 4 and st["nfe"] <= 3


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
    with pytest.raises(ValueError, match="pass guide or threshold, not both"):
        generate(dream, prompt, gen_length=8, guide=guide, threshold=0.9)
    with pytest.raises(ValueError, match="unknown accept rule 'best'"):
        generate(dream, prompt, gen_length=8, guide=guide, accept="best")
    with pytest.raises(ValueError, match="temperature must be 0"):
        generate(dream, prompt, gen_length=8, guide=guide, temperature=0.5)
    with pytest.raises(ValueError):          # llada-tiny's ids (mask 1000 = the guide's eos) do not match
        generate(llada, prompt, gen_length=8, guide=guide)
