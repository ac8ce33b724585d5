"""DiffusionGemma's decode in the one loop (uniform.py) against the naive decode written apart from it
(tests/reference_gemma.py, itself checked against the official runs in tests/test_gemma.py): the same ids, decoder
calls per row, steps per canvas and random draws; the official runs that this machine's float kernels reproduce; the
refusals; a fork's selection rule on it (examples/gemma_threshold.py)."""
import copy
import dataclasses
import math
import os
import sys

import pytest
import torch

from conftest import GOLDEN, ROOT
from fastdllm import generate, pad_prompts
from model import load_model
from reference_gemma import reference_generate
from test_gemma import RUNS

sys.path.insert(0, os.path.join(ROOT, "examples"))
from gemma_threshold import SampleThreshold  # noqa: E402

TINY = os.path.join(GOLDEN, "diffusiongemma", "tiny_dg_seed1234")
RELEASE = dict(steps=48, entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005)
PROMPTS = [[2, 45, 300, 17, 999], [2, 811, 64, 3, 520, 77, 913, 402, 11], [2, 88, 431]]


@pytest.fixture(scope="module")
def dg():
    return {dt: load_model(TINY, device="cpu", dtype=dt) for dt in (torch.float32, torch.bfloat16)}


def with_canvas(model, C):
    """The model with another canvas length declared (the official runs set config.canvas_length so)."""
    model = copy.copy(model)
    model.config = dataclasses.replace(model.config, gemma=dataclasses.replace(model.config.gemma, canvas=C))
    return model


def canvases(fed, C):
    """Steps per canvas, from the widths each call fed (the prefix cache: a canvas's first call also commits the one
    before it, or the prompt, so it is wider than the canvas)."""
    steps = []
    for width in fed:
        steps.append(1) if width > C or not steps else steps.__setitem__(-1, steps[-1] + 1)
    return steps


def ours(model, rows, gen, seed, **kw):
    ids, mask = pad_prompts(rows, 0)
    g = torch.Generator().manual_seed(seed)
    out, stats = generate(model, ids, attention_mask=mask, gen_length=gen, generator=g, **dict(cache="prefix") | kw)
    return out, stats, torch.randint(0, 2 ** 31 - 1, (1,), generator=g).item()


def theirs(model, rows, gen, seed, eos_ids=(1, 106, 50), select=None, **kw):
    ids, mask = pad_prompts(rows, 0)
    g = torch.Generator().manual_seed(seed)
    out = reference_generate(model, ids, mask, max_new_tokens=gen, generator=g, eos_ids=eos_ids, rule=select,
                             **RELEASE | kw)
    return out, torch.randint(0, 2 ** 31 - 1, (1,), generator=g).item()


CASES = {   # name: (rows, gen_length, settings)
    "release, 2 canvases": ([PROMPTS[1]], 32, dict(steps=8)),
    "bound ~0": ([PROMPTS[1]], 16, dict(steps=10, entropy_bound=1e-9)),
    "bound 0.5": ([PROMPTS[0]], 32, dict(steps=10, entropy_bound=0.5)),
    "bound 1e6": ([PROMPTS[1]], 16, dict(steps=10, entropy_bound=1e6)),
    "t 0.3 to 0": ([PROMPTS[1]], 32, dict(steps=10, t_min=0.0, t_max=0.3)),
    "no schedule": ([PROMPTS[1]], 32, dict(steps=10, t_min=None, t_max=None)),
    "adaptive off": ([PROMPTS[0]], 32, dict(steps=12, stability_threshold=None, confidence_threshold=None)),
    "adaptive stops": ([PROMPTS[0]], 32, dict(steps=16, stability_threshold=0, confidence_threshold=1.0)),
    "not a multiple": ([PROMPTS[1]], 20, dict(steps=8)),
    "padded batch": (PROMPTS, 32, dict(steps=8)),
    "padded, adaptive": (PROMPTS, 32, dict(steps=12, stability_threshold=0, confidence_threshold=1.0)),
}


@pytest.mark.parametrize("name", CASES)
def test_the_loop_is_the_naive_decode(dg, name):
    """Every id, each row's decoder calls, each canvas's steps and the randomness drawn, to the last number."""
    rows, gen, kw = CASES[name]
    model = dg[torch.float32]
    out, stats, fingerprint = ours(model, rows, gen, 5, **kw)
    ref, ref_fingerprint = theirs(model, rows, gen, 5, **kw)
    assert out.tolist() == ref["ids"].tolist()
    assert stats["row_nfe"] == ref["decoder_calls"]
    assert canvases(stats["fed"], 16) == ref["steps_per_canvas"]
    assert fingerprint == ref_fingerprint


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_end_tokens_end_a_row_and_pad_what_follows(dg, cache):
    """A row whose finished canvas holds an end token has ended: the rest of its answer is padding, it makes no more
    calls, and once every row has, the decode stops (one canvas of three here); every cache mode is exact."""
    model, rows = dg[torch.float32], PROMPTS
    first, _, _ = ours(model, rows, 48, 9, steps=6, stop_at_eos=False)
    eos = first[1, 9 + 4].item()                      # a token the second row writes in its first canvas
    out, stats, fingerprint = ours(model, rows, 48, 9, steps=6, eos_ids=[eos], cache=cache)
    ref, ref_fingerprint = theirs(model, rows, 48, 9, steps=6, eos_ids=[eos])
    assert out.tolist() == ref["ids"][:, :out.shape[1]].tolist() and (out[1, 9 + 5:] == 0).all()
    assert stats["row_nfe"] == ref["decoder_calls"] and fingerprint == ref_fingerprint
    assert stats["nfe"] < 3 * 6 if (ref["ids"] == eos).any(-1).all() else stats["nfe"] == 3 * 6


def test_each_step_shows_its_argmax_canvas(dg):
    """on_step (Parts.view, what a stream shows): after each call, that step's argmax on the canvas it denoises, as
    the naive decode's trace has it (not the sampled canvas with its renoise, which the commit writes), the
    committed canvases before it; the last one is generate()'s ids, which only pad after the first end token."""
    model, rows, seen, trace = dg[torch.float32], [PROMPTS[1]], [], []
    out, stats, _ = ours(model, rows, 48, 5, steps=6, on_step=lambda x, st: seen.append(x.clone()))
    ref, _ = theirs(model, rows, 48, 5, steps=6, trace=trace)
    assert len(seen) == len(trace) == stats["nfe"] > 6 and out.tolist() == ref["ids"].tolist()
    for x, step in zip(seen, trace):
        s = len(rows[0]) + 16 * step["canvas"]
        assert x[0, s:s + 16].tolist() == step["argmax"][0].tolist() and torch.equal(x[:, :s], seen[-1][:, :s])
    end = next((p for p in range(len(rows[0]), out.shape[1]) if out[0, p] in (1, 106, 50)), out.shape[1] - 1)
    assert seen[-1][0, :end + 1].tolist() == out[0, :end + 1].tolist()


def test_bf16_is_the_naive_decode_in_bf16(dg):
    model = dg[torch.bfloat16]
    out, stats, fingerprint = ours(model, [PROMPTS[1]], 32, 2, steps=8)
    ref, ref_fingerprint = theirs(model, [PROMPTS[1]], 32, 2, steps=8)
    assert out.tolist() == ref["ids"].tolist() and fingerprint == ref_fingerprint


@pytest.mark.parametrize("steps,rows", [(3, [0, 1, 2]), (16, [1])])
def test_a_row_decodes_as_it_would_alone(dg, steps, rows):
    """Rows of different lengths in one batch, a generator per row: each row as alone, to the id, the call and the
    random draw (a row whose canvas stops early draws no more; end tokens end some rows). A left-padded row's positions
    count from its first real token (the official numbers its pads too: docs/parity.md), and its logits are alone's
    within float noise (5e-5 at logits ~17: other shapes, other summation orders; tests/test_gemma.py), which the
    feedback of a sampled run grows tenfold a step: so every row for a few steps, the unpadded row for a whole run.
    With one generator the batch draws as the official does, one stream for all rows (test_the_loop_is_...)."""
    model, eos = dg[torch.float32], [427, 5]
    settings = dict(steps=steps, stability_threshold=0, confidence_threshold=1.0, eos_ids=eos)
    ids, mask = pad_prompts(PROMPTS, 0)
    gens = [torch.Generator().manual_seed(1) for _ in PROMPTS]
    batch, stats = generate(model, ids, attention_mask=mask, gen_length=48, generator=gens, **settings)
    for r in rows:
        g = torch.Generator().manual_seed(1)
        alone, solo = generate(model, torch.tensor([PROMPTS[r]]), gen_length=48, generator=g, **settings)
        assert batch[r, batch.shape[1] - alone.shape[1]:].tolist() == alone[0].tolist()
        assert stats["row_nfe"][r] == solo["row_nfe"][0]
        assert torch.equal(gens[r].get_state(), g.get_state())       # the same draws, to the last number
    assert len(set(stats["row_nfe"])) > 1                            # rows stopped apart


@pytest.mark.parametrize("name", ["g_cl4_stab1"])
def test_an_official_run_whole(dg, name):
    """The official run this machine's float kernels reproduce (tests/test_gemma.py: sampled runs are chaotic, a
    last-bit difference grows tenfold a step): everything it returned, through generate()."""
    run, res = RUNS[name], RUNS[name]["result"]
    s, eg = run["settings"], run["effective_generation_config"]
    model = with_canvas(dg[torch.float32], s["canvas_length"])
    kw = {k: eg[k] for k in ("entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold")}
    out, stats, fingerprint = ours(model, run["input_ids"], eg["max_new_tokens"], s["seed"],
                                   steps=eg["max_denoising_steps"], eos_ids=eg["eos_token_id"], **kw)
    assert out.tolist() == res["sequences"] and stats["row_nfe"] == res["decoder_forward_passes"]
    assert canvases(stats["fed"], s["canvas_length"]) == res["steps_per_canvas"]
    assert fingerprint == res["rng_fingerprint_after"]


# (Not the right-padded batch: generate() takes left padding only, options.check_prompt; nor the given start canvas.)
FIXED = [n for n, r in RUNS.items() if r.get("result") and "decoder_input_ids" not in r["settings"] and
         r["settings"]["pad_side"] != "right" and
         r["result"]["steps_per_canvas"] == [r["effective_generation_config"]["max_denoising_steps"]] * math.ceil(
             r["effective_generation_config"]["max_new_tokens"] / r["settings"]["canvas_length"])]


@pytest.mark.parametrize("name", FIXED)
def test_the_randomness_of_every_official_fixed_length_run(dg, name):
    """Every official run whose canvases all took their full steps (bf16 and padded batches included), with no early
    stop: the same steps per canvas, calls per row and randomness drawn, to the last number."""
    run, res = RUNS[name], RUNS[name]["result"]
    s, eg = run["settings"], run["effective_generation_config"]
    model = with_canvas(dg[getattr(torch, s["dtype"])], s["canvas_length"])
    rows = [[t for t, m in zip(row, mask) if m] for row, mask in zip(run["input_ids"], run["attention_mask"] or [
        [1] * len(r) for r in run["input_ids"]])]
    kw = {k: eg[k] for k in ("entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold")}
    out, stats, fingerprint = ours(model, rows, eg["max_new_tokens"], s["seed"], steps=eg["max_denoising_steps"],
                                   stop_at_eos=False, **kw)
    assert canvases(stats["fed"], s["canvas_length"]) == res["steps_per_canvas"]
    assert set(stats["row_nfe"]) == {sum(res["steps_per_canvas"])} and fingerprint == res["rng_fingerprint_after"]


def test_a_fork_threshold_on_diffusiongemma(dg):
    """examples/gemma_threshold.py, Fast-dLLM's confidence threshold as DiffusionGemma's acceptance, by value: the
    naive decode with the rule written from its formula (every sample of probability >= tau, and the most probable)."""
    def rule(scaled, sample, tau=0.5):
        p = scaled.float().softmax(-1).gather(-1, sample[..., None]).squeeze(-1)
        return (p >= tau) | torch.zeros_like(p, dtype=torch.bool).scatter_(-1, p.argmax(-1, keepdim=True), True)
    model = dg[torch.float32]
    out, stats, fingerprint = ours(model, PROMPTS, 32, 4, steps=8, select=SampleThreshold(0.5))
    ref, ref_fingerprint = theirs(model, PROMPTS, 32, 4, steps=8, select=rule)
    assert out.tolist() == ref["ids"].tolist() and stats["row_nfe"] == ref["decoder_calls"]
    assert fingerprint == ref_fingerprint


@pytest.mark.parametrize("settings,words", [
    (dict(entropy_bound=0.0), "entropy_bound must be a number > 0"),
    (dict(t_min=0.9, t_max=0.5), "need 0 <= t_min < t_max"),
    (dict(t_min=0.5, t_max=0.5), "need 0 <= t_min < t_max"),
    (dict(block_length=8), "block_length 8 is not this checkpoint's canvas"),
    (dict(steps=0), "steps must be >= 1"),
    (dict(threshold=0.9), "threshold does not apply to DiffusionGemma"),
    (dict(cache="free"), "'free' does not apply to DiffusionGemma"),
    (dict(stability_threshold=None), "set both stability_threshold and confidence_threshold"),
    (dict(generator=[torch.Generator()] * 2), "generator is a list of 2: one generator per row"),
])
def test_bad_settings_are_one_line(dg, settings, words):
    with pytest.raises(ValueError, match=words) as e:
        generate(dg[torch.float32], torch.tensor([PROMPTS[0]]), gen_length=16, **settings)
    assert "\n" not in str(e.value)


def test_the_others_refuse_its_settings():
    llada = load_model(os.path.join(GOLDEN, "llada-tiny"), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="entropy_bound is DiffusionGemma's: a llada model does not read it"):
        generate(llada, torch.tensor([[1, 2, 3]]), gen_length=8, block_length=8, entropy_bound=0.2)
    with pytest.raises(ValueError, match="one generator per row is DiffusionGemma's"):
        generate(llada, torch.tensor([[1, 2, 3]]), gen_length=8, block_length=8, generator=[torch.Generator()])


def test_the_renoise_is_counted_as_renewed_not_filled(dg):
    """stats per call: a step's renoise (and a canvas's last argmax) is the step rule's `rest`, counted in "renewed"
    where it changed a token; "filled" is the stop rule's alone (none here)."""
    _, st = generate(dg[torch.float32], torch.tensor([[5, 6, 7, 8, 9]]), gen_length=16, steps=6)
    assert st["filled"] == [0] * st["nfe"] and st["edited"] == [0] * st["nfe"] and min(st["renewed"]) > 0
    assert all(c + r <= 16 for c, r in zip(st["committed"], st["renewed"]))
