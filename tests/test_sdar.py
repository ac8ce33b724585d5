"""SDAR (blockdiff.py) against the official code: JetAstra/SDAR generate.py `block_diffusion_generate` and the
remote code's SDARForCausalLM, run on a tiny checkpoint made with the official classes (tests/golden/sdar-README.md
says how). The official decode samples (its temperature 0 divides by zero): seeded, ours draws the same numbers."""
import json
import os

import pytest
import torch

from blockdiff import block_causal
from cache import KVCache
from conftest import GOLDEN, rows_as_alone
from fastdllm import generate
from model import load_model

with open(os.path.join(GOLDEN, "sdar-golden.json")) as f:
    SDAR = json.load(f)
ATOL = 1e-4     # the official's own two attention paths (SDPA, flash) differ by 2.1e-5 on these logits (up to ~31)


@pytest.fixture(scope="module")
def sdar():
    return load_model(os.path.join(GOLDEN, "sdar-tiny"), device="cpu", dtype=torch.float32)


def test_the_checkpoint_reads_its_ids(sdar):
    c, ids = sdar.config, SDAR["ids"]
    assert (c.family, c.mask_id, c.block, c.shift, c.qk_norm, c.head_dim) == ("sdar", ids["mask"], 4, 0, True, 32)
    assert c.eos_ids == tuple(ids["generation_config_eos"]) and c.pad_id == ids["pad"]    # generation_config.json's


def check_positions(logits, ref):
    assert logits.argmax(-1).tolist() == [p["argmax"] for p in ref]
    gap = max((logits.logsumexp(-1) - torch.tensor([p["logsumexp"] for p in ref])).abs().max().item(),
              (logits.topk(5, -1).values - torch.tensor([p["top5"] for p in ref])).abs().max().item(),
              (logits[:, SDAR["forward"]["columns"]] - torch.tensor([p["cols"] for p in ref])).abs().max().item())
    assert gap < ATOL, gap


@torch.inference_mode()
def test_forward_matches_the_official_logits(sdar):
    """Raw logits (no shift): one block-causal call, a prefill then a block against its cache, one block alone."""
    f = SDAR["forward"]
    x = torch.tensor([f["input_ids"]])
    mask = block_causal(12, 4, "cpu")
    check_positions(sdar(x, mask=mask)[0], f["full"])
    kv = KVCache.for_model(sdar, 1, 12)
    check_positions(sdar(x[:, :8], cache=kv, start=0, mask=mask[:, :, :8])[0], f["prefill"])
    check_positions(sdar(x[:, 8:], cache=kv, start=8, mask=mask[:, :, 8:])[0], f["cached_block"])
    check_positions(sdar(x[:, :4])[0], f["single_block"])


def our_call(run):
    st = run["settings"]
    stop = st["stopping_criteria_idx"]
    kw = dict(gen_length=st["gen_length"], block_length=st["block_length"], steps=st["denoising_steps"],
              temperature=st["temperature"], top_k=st["top_k"] or None, top_p=None if st["top_p"] >= 1 else st["top_p"],
              remasking=st["remasking_strategy"], cache="prefix", stop_at_eos=stop is not None, eos_ids=stop,
              generator=torch.Generator().manual_seed(run["seed"]))
    if st["remasking_strategy"] == "low_confidence_dynamic":
        kw["threshold"] = st["confidence_threshold"]
    return kw


def canvases(run) -> list:
    """The official canvas after each denoise call, rebuilt from the recorded commits (positions in the block)."""
    x, out, G = list(run["prompt"]) + [SDAR["ids"]["mask"]] * (run["total_length"] - run["prompt_length"]), {}, \
        run["settings"]["block_length"]
    for step in run["steps"]:
        for p, t in zip(step["commit_pos"], step["commit_tok"]):
            x[step["block"] * G + p] = t
        out[step["call"]] = list(x)
    return out


@pytest.mark.parametrize("run", SDAR["runs"], ids=lambda r: r["name"])
def test_golden_run(sdar, run):
    prompt, kw = torch.tensor([run["prompt"]]), our_call(run)
    if not run["ok"]:     # the official fails: at temperature 0 (ours decodes greedily), entropy_bounded (refused)
        if run["settings"]["remasking_strategy"] == "entropy_bounded":
            with pytest.raises(ValueError, match="remasking 'entropy_bounded' is not one of SDAR's"):
                generate(sdar, prompt, **kw)
        else:
            out, _ = generate(sdar, prompt, **kw)
            assert run["settings"]["temperature"] == 0 and not (out == sdar.config.mask_id).any()
        return
    seen = []
    out, stats = generate(sdar, prompt, on_step=lambda x, st: seen.append(x[0].tolist()), **kw)
    bug = run["flags"]["first_bug_call"]
    if bug is None:
        ended = run["flags"]["stopped_early"]       # the official leaves masks after a stop; ours fills them
        want = [t if t != SDAR["ids"]["mask"] or not ended else sdar.config.pad_id for t in run["output"]]
        assert out[0].tolist() == want
        assert stats["nfe"] == run["n_calls"] - 1     # the official stores the last block too: nothing reads it
    else:                 # equal until the official's top-k writes a non-masked position (ours never does)
        official = canvases(run)
        upto = [c for c in official if c < bug]
        assert all(seen[c] == official[c] for c in upto)
        assert not (out == sdar.config.mask_id).any() and out[0, :len(run["prompt"])].tolist() == run["prompt"]


def test_the_golden_covers_the_rules():
    exact = [r for r in SDAR["runs"] if r["ok"] and r["flags"]["first_bug_call"] is None]
    assert len(exact) >= 100          # every one compared whole, the three closest to flipping too (margins < 1e-4)
    assert {r["settings"]["remasking_strategy"] for r in exact} == {"low_confidence_dynamic", "low_confidence_static",
                                                                     "sequential"}
    assert any(r["flags"]["stopped_early"] for r in exact) and any(r["prefill_length"] for r in exact)


@pytest.mark.parametrize("remasking", ["low_confidence_dynamic", "low_confidence_static", "sequential"])
def test_greedy_prefix_cache_is_exact_and_batches_equal_rows_alone(sdar, remasking):
    """At temperature 0 (ours; the official has none): the prefix cache decodes as the uncached, and a padded batch
    of prompts of different lengths (on and off block edges, ending in different grid blocks) as each row alone: its
    ids, its answer's length (the official sizes each by its own prompt, one at a time), its calls."""
    rows = [SDAR["runs"][i]["prompt"] for i in range(0, 40, 7)]
    assert len({len(r) // 4 for r in rows}) > 1
    kw = dict(gen_length=12, block_length=4, steps=2, remasking=remasking, threshold=0.7 if "dynamic" in remasking
              else None)
    for row in rows:
        alone, a = generate(sdar, torch.tensor([row]), cache="prefix", **kw)
        plain, p = generate(sdar, torch.tensor([row]), cache="none", **kw)
        assert alone.tolist() == plain.tolist() and a["nfe"] == p["nfe"]
    rows_as_alone(sdar, rows, cache="prefix", stop_at_eos=True, **kw)
