"""Every golden run of the official code, reproduced token for token with the same NFE (float32, CPU, T=0).

LLaDA: NVlabs/Fast-dLLM v1/llada/generate.py (`generate`, `generate_with_prefix_cache`,
`generate_with_dual_cache`). Dream: Dream's own `diffusion_generate` (impl dream_hf) and Fast-dLLM's Dream
block sampler (impl fastdllm_block). The README's API table documents this same mapping."""
import json
import os

import pytest
import torch

from conftest import GOLDEN, read_golden
from fastdllm import generate
from model import load_model

with open(os.path.join(GOLDEN, "llada-golden.json")) as f:
    LLADA_RUNS = json.load(f)["runs"]
with open(os.path.join(GOLDEN, "dream-golden.json")) as f:
    DREAM_RUNS = json.load(f)["runs"]
CACHE_OF = {"generate": "none", "generate_with_prefix_cache": "prefix", "generate_with_dual_cache": "dual"}


def llada_call(run):
    """Official LLaDA kwargs -> ours: the function name picks the cache mode, the rest maps one to one."""
    kw = {k: v for k, v in run["kwargs"].items() if k != "mask_id"}   # ours reads mask_id from config.json
    return dict(kw, cache=CACHE_OF[run["fn"]])


def dream_call(run):
    kw = run["kwargs"]
    ours = dict(gen_length=kw["max_new_tokens"], steps=kw["steps"], temperature=kw["temperature"],
                top_p=kw["top_p"], top_k=kw["top_k"], alg_temp=kw["alg_temp"])
    if run["impl"] == "dream_hf":           # diffusion_generate(alg=...): one whole-canvas block
        return dict(ours, block_length=None, remasking=kw["alg"])
    ours.update(block_length=kw["block_length"], cache="dual" if kw["dual_cache"] else "prefix")
    if kw["alg"] == "confidence_threshold":
        ours["threshold"] = kw["threshold"]
    return ours


@pytest.mark.parametrize("run", LLADA_RUNS, ids=lambda r: f"{r['fn']}-{r['batch']}-s{r['kwargs']['steps']}"
                         f"-thr{r['kwargs'].get('threshold')}")
def test_llada_golden_run(llada, llada_golden, run):
    assert run["head_scale"] == 1.0     # no run here rescales the LM head
    prompt = torch.tensor(llada_golden["prompts"][run["batch"]])
    out, stats = generate(llada, prompt, **llada_call(run))
    assert out.tolist() == run["output"]
    assert stats["nfe"] == run["nfe"]


@pytest.mark.parametrize("run", DREAM_RUNS, ids=lambda r: r["name"])
def test_dream_golden_run(dream, run):
    out, stats = generate(dream, torch.tensor(run["input_ids"]), **dream_call(run))
    assert out.tolist() == run["sequences"]
    assert stats["nfe"] == run["nfe"]


def test_llada_cached_forwards_match_golden(llada, llada_golden):
    """One prefix-cache and one dual-cache forward after three block tokens changed since the refresh:
    the official logits (stale cache included) within 1e-4."""
    from cache import KVCache
    from test_model import check_summary
    c = llada_golden["forward"]["cache"]
    before, after = torch.tensor(c["x_before"]), torch.tensor(c["x_after"])
    s, e = c["block"]
    B, L = before.shape
    with torch.no_grad():
        check_summary(llada(before), c["full_before"])
        check_summary(llada(after), c["full_after"])
        for mode, end in (("prefix", L), ("dual", e)):
            kv = KVCache.for_model(llada, B, L)
            llada(before, cache=kv, start=0)                 # refresh on the canvas as it was
            check_summary(llada(after[:, s:end], cache=kv, start=s), c[mode])


# Exact ties (saturated confidences, common on a trained model): the official runs with the LM head scaled up
# (tests/golden/ties-golden.json). An order of our own (a sort of the block alone) commits other positions in
# every one of these runs: the official call at the official width is what decides (docs/official.md 2, 5).
TIES = read_golden("ties-golden.json")


def scaled(folder: str, scale: float):
    model = load_model(os.path.join(GOLDEN, folder), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def tie_models():
    return {(f, s): scaled(f, s) for f in ("llada-tiny", "dream-tiny") for s in (30.0, 100.0)}


@pytest.mark.parametrize("run", TIES["llada_runs"], ids=lambda r: f"{r['fn']}-{r['batch']}-s{r['kwargs']['steps']}"
                         f"-x{r['head_scale']:g}")
def test_llada_ties_break_as_the_official_code_breaks_them(tie_models, llada_golden, run):
    model = tie_models[("llada-tiny", run["head_scale"])]
    out, stats = generate(model, torch.tensor(llada_golden["prompts"][run["batch"]]), **llada_call(run))
    assert out.tolist() == run["output"] and stats["nfe"] == run["nfe"]


@pytest.mark.parametrize("run", TIES["dream_runs"], ids=lambda r: f"{r['name']}-x{r['head_scale']:g}")
def test_dream_ties_break_as_the_official_code_breaks_them(tie_models, run):
    model = tie_models[("dream-tiny", run["head_scale"])]
    out, stats = generate(model, torch.tensor(run["input_ids"]), **dream_call(run))
    assert out.tolist() == run["sequences"] and stats["nfe"] == run["nfe"]
