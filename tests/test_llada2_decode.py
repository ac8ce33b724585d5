"""LLaDA2.0 / LLaDA2.1's decode (llada2.py) against the official generate()s on the golden tiny checkpoint
(tests/golden/llada2-README.md): every run's answer and its calls, the exact prefix cache against the official's
uncached window, batches against solo runs, the end-of-text stop, and what a call refuses."""
import os

import pytest
import torch

from conftest import GOLDEN, read_golden, rows_as_alone
from fastdllm import generate
from model import load_model

GOLD = read_golden("llada2-golden.json")
RUNS = {r["name"]: r for r in GOLD["runs"]}
EOS, MASK = GOLD["special_ids"]["eos"], GOLD["special_ids"]["mask"]
# LLaDA2.0 as is samples at temperature 0 (docs/parity.md): its run decodes at temperature 1, ours greedily, which
# is the LLaDA2.0-greedy run of the same settings.
GREEDY_TWIN = {"20_official_t0_p13": "20_b8_s8_thr90_p13", "20_official_t0_b32_p40": "20_b32_thr95_p40"}


@pytest.fixture(scope="module")
def llada2():
    return load_model(os.path.join(GOLDEN, "llada2-tiny"), device="cpu", dtype=torch.float32)


def our_call(run, cache="prefix"):
    """The official generate()'s arguments -> ours. LLaDA2.1's decode is the one with an editing_threshold (its
    generate()'s default 0.9). LLaDA2.0's stops after a block holding an end token whatever eos_early_stop says
    (docs/parity.md): that is our stop_at_eos; LLaDA2.1's stops so only with eos_early_stop. A sampled run's seed
    seeds the generator (the official draws from the global one, seeded the same)."""
    kw = dict(run["kwargs"])
    eos_early_stop = kw.pop("eos_early_stop", False)
    if run["version"] == "llada2.1":
        kw.setdefault("editing_threshold", 0.9)
    generator = torch.Generator().manual_seed(run["seed"]) if run["seed"] is not None else None
    stop = eos_early_stop if run["version"] == "llada2.1" else True
    return torch.tensor(GOLD["prompts"][run["prompt"]]), dict(kw, cache=cache, stop_at_eos=stop, generator=generator)


def answer(out, P: int, n: int):
    """Our answer's first n tokens, and whether everything after them is the pad id (the answer cut, as official)."""
    return out[0, P:P + n].tolist(), bool((out[0, P + n:] == EOS).all())


DECODED = {}


def decode(model, run, cache="prefix"):
    """Our decode of a golden run (each run and cache decoded once for the module: several tests read it)."""
    key = (id(model), run["name"], cache)
    if key not in DECODED:
        prompt, kw = our_call(run, cache)
        DECODED[key] = (*generate(model, prompt, **kw), prompt.shape[1])
    return DECODED[key]


@pytest.mark.parametrize("name", RUNS)
def test_golden_run(llada2, name):
    """The answer token for token, the official's calls one for one, and what each call committed and edited."""
    run = RUNS[name]
    out, stats, P = decode(llada2, run)
    if "t0_samples" in run["flags"]:          # the official draws at temperature 0: ours is its greedy twin
        twin = RUNS[GREEDY_TWIN[name]]
        assert answer(out, P, len(twin["output"][0])) == (twin["output"][0], True) and stats["nfe"] == twin["nfe"]
        assert out[0, P:P + len(run["output"][0])].tolist() != run["output"][0]
        return
    want = run["output"][0]
    if "early_stop_returns_prompt" in run["flags"]:    # the official's early return starts with the prompt
        assert want[:P] == GOLD["prompts"][run["prompt"]][0]
        want = want[P:]
    assert answer(out, P, len(want)) == (want, True)
    assert stats["nfe"] == run["nfe"]
    assert stats["committed"] == [len(s["commit"]) for s in run["steps"]]
    assert stats["edited"] == [len(s["edit"]) for s in run["steps"]]


def test_the_golden_covers_the_decode():
    runs = GOLD["runs"]
    assert len(runs) == 44 and {r["version"] for r in runs} == {"llada2.0", "llada2.0-greedy", "llada2.1"}
    assert sum(any(s["edit"] for s in r["steps"]) for r in runs) >= 15        # T2T edits happen
    assert any(r["kwargs"].get("max_post_steps") == 0 for r in runs) and any("sampled" in r["flags"] for r in runs)
    assert any(EOS in r["output"][0] for r in runs) and not any("near_tie" in r["flags"] for r in runs)


@pytest.mark.parametrize("name", ["20_b8_s4_thr90_p13", "20_b32_thr95_p5", "20_b8_g20_thr60_p13",
                                  "21_q_b8_post0_p13", "21_s_b8_post2_p13", "21_q_b32_p40", "21_q_b8_eos_p40",
                                  "21_s_t08_p13"])
def test_uncached_is_the_official_window(llada2, name):
    """cache='none' makes the official's calls, each fed the window [0, e) (their input lengths), and decodes as
    the exact prefix cache does; the cache's first call of a block feeds that block and the one before it."""
    run = RUNS[name]
    plain, p_stats, P = decode(llada2, run, "none")
    cached, c_stats, _ = decode(llada2, run, "prefix")
    assert plain.tolist() == cached.tolist() and answer(plain, P, len(run["output"][0])) == (run["output"][0], True)
    assert p_stats["fed"] == [c[0] for c in run["calls"]] and p_stats["nfe"] == c_stats["nfe"] == run["nfe"]
    block = run["kwargs"]["block_length"]
    first = [i for i, s in enumerate(run["steps"]) if i == 0 or s["block"] != run["steps"][i - 1]["block"]]
    assert [c_stats["fed"][i] for i in first] == [run["calls"][first[0]][0]] + [2 * block] * (len(first) - 1)
    assert all(c_stats["fed"][i] == block for i in range(run["nfe"]) if i not in first)


@pytest.mark.parametrize("settings", [dict(gen_length=24, block_length=8, steps=4, threshold=0.9),
                                      dict(gen_length=24, block_length=8, threshold=0.7, editing_threshold=0.5),
                                      dict(gen_length=24, block_length=8, threshold=0.5, editing_threshold=0.0,
                                           max_post_steps=2)])
@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_a_batch_decodes_each_row_as_alone(llada2, settings, cache):
    """Prompts of 5, 13, 21 and 8 tokens (first blocks at 0 and 8; a row's edits and post steps its own): each row
    of the right-padded batch, uncached or cached, as it decodes alone with the exact cache, stop included."""
    rows = [GOLD["prompts"][p][0] for p in ("p5", "p13", "p8")] + [GOLD["prompts"]["p13"][0] + [5] * 8]

    def alone(row):                         # each row alone once for both caches
        key = (id(llada2), tuple(row), tuple(sorted(settings.items())))
        if key not in DECODED:
            DECODED[key] = generate(llada2, torch.tensor([row]), cache="prefix", stop_at_eos=True, **settings)
        return DECODED[key]
    rows_as_alone(llada2, rows, alone, cache=cache, stop_at_eos=True, **settings)     # the rest: EOS, its pad id


def test_without_stop_the_answer_is_the_same(llada2):
    """LLaDA2.0's official stops after a block holding an end token whatever eos_early_stop says; ours decodes on
    without stop_at_eos (the later blocks cost calls), and the answer, cut at its end token, is the same."""
    run = RUNS["20_b8_thr100_noeos_p21"]
    prompt, kw = our_call(run)
    stopped, s1 = generate(llada2, prompt, **kw)
    on, s2 = generate(llada2, prompt, **dict(kw, stop_at_eos=False))
    assert stopped.tolist() == on.tolist() and EOS in stopped[0].tolist()
    assert s1["nfe"] == run["nfe"] < s2["nfe"] and s1["calls_saved"] > 0


def test_defaults_are_the_official_generate(llada2):
    """No settings: LLaDA2.0's decode with the official defaults (block 32, steps 32, threshold 0.95); an
    editing_threshold alone: LLaDA2.1's (max_post_steps 16, num_to_transfer 1): the golden default runs."""
    prompt = torch.tensor(GOLD["prompts"]["p32"])
    run = RUNS["21_default_b32_p32"]
    out, stats = generate(llada2, prompt, gen_length=64, editing_threshold=0.9, cache="prefix")
    assert answer(out, 32, len(run["output"][0])) == (run["output"][0], True) and stats["nfe"] == run["nfe"]
    run = RUNS["20_b32_thr95_p32"]
    out, stats = generate(llada2, prompt, gen_length=64, stop_at_eos=True)
    assert answer(out, 32, len(run["output"][0])) == (run["output"][0], True) and stats["nfe"] == run["nfe"]


@pytest.mark.parametrize("settings,match", [
    (dict(max_post_steps=2), "max_post_steps is LLaDA2.1's editing decode: pass editing_threshold"),
    (dict(num_to_transfer=2), "num_to_transfer is LLaDA2.1's editing decode"),
    (dict(editing_threshold=0.5, steps=8), "steps does not apply with editing_threshold"),
    (dict(editing_threshold=1.5), r"editing_threshold 1.5 must be in \[0, 1\]"),
    (dict(editing_threshold=0.5, max_post_steps=-1), "max_post_steps -1 must be an integer >= 0"),
    (dict(editing_threshold=0.5, num_to_transfer=0), "num_to_transfer 0 must be an integer >= 1"),
    (dict(minimal_topk=0), r"minimal_topk 0 must be an integer in \[1, gen_length\]"),
    (dict(sub_block=4), "sub_block is Fast-dLLM v2's"),
    (dict(remasking="low_confidence"), "remasking does not apply to LLaDA2"),
    (dict(cache="free"), "cache 'free' does not apply to a block-diffusion model"),
    (dict(threshold=1.5), r"threshold 1.5 is outside \(0, 1\]"),
])
def test_bad_settings_are_one_line(llada2, settings, match):
    with pytest.raises(ValueError, match=match):
        generate(llada2, torch.tensor(GOLD["prompts"]["p5"]), **dict(dict(gen_length=16, block_length=8), **settings))


def test_editing_settings_are_refused_elsewhere():
    model = load_model(os.path.join(GOLDEN, "sdar-tiny"), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="editing_threshold is LLaDA2's .* drop editing_threshold"):
        generate(model, torch.tensor([[1, 2, 3]]), gen_length=8, block_length=4, editing_threshold=0.5)
