"""compile=True: the model call through torch.compile (inductor on the CPU here; CUDA graphs on a GPU). One graph
per feed shape, no graph break, no recompilation across blocks or across calls of the same shapes, and in
float32 the same ids as eager in every mode, both families, a padded batch. Compiling is slow on a small CPU
(seconds per graph), so every test here shares one canvas shape: prompts of 12 tokens, 16 generated, blocks of 8."""
import pytest
import torch
from torch._dynamo.utils import counters

from cache import KVCache
from fastdllm import Compiled, generate, pad_prompts
from graphs import hidden_states
from model import load_model
from conftest import GOLDEN
from test_golden import DREAM_RUNS, LLADA_RUNS, dream_call, llada_call

ROWS = {"llada": [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]],
        "dream": [[775, 171, 806, 365, 316, 564, 432, 625, 575, 529, 17, 3], [12, 44, 907]]}
KW = dict(gen_length=16, block_length=8, steps=16)
MODES = [dict(cache=c, **r) for c in ("none", "prefix", "dual", "free") for r in ({}, {"threshold": 0.9})]


def batch(model, family):
    ids, am = pad_prompts(ROWS[family], model.config.pad_id or 0)
    return ids, am


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_one_graph_and_no_break_for_each_kind_of_call(llada, dream, family):
    """torch._dynamo.explain over what compile=True compiles (the layers of a step's call): the refresh (the whole
    canvas) and a cached block step (slots as tensors), a padded batch with its mask: each one graph, no break."""
    model = llada if family == "llada" else dream
    ids, am = batch(model, family)
    B, L = ids.shape[0], ids.shape[1] + 16
    x = torch.nn.functional.pad(ids, (0, 16), value=model.config.mask_id)
    m = torch.nn.functional.pad(am.bool(), (0, 16), value=True)
    mask, pos = m[:, None, None, :] & m[:, None, :, None], (m.long().cumsum(-1) - 1).clamp(min=0)
    kv, ar = KVCache.for_model(model, B, L), torch.arange(L)
    s = ids.shape[1]
    for args in [(x, pos, kv, ar, mask), (x[:, s:s + 8], pos[:, s:s + 8], kv, ar[s:s + 8], mask[:, :, s:s + 8])]:
        with torch.inference_mode():
            ex = torch._dynamo.explain(hidden_states)(model, *args)
        assert ex.graph_count == 1 and ex.graph_break_count == 0, ex.break_reasons


def test_one_graph_per_feed_shape_and_none_again(llada):
    """DualCache feeds two shapes (the refresh, a block step): two graphs for both blocks, and a second call of
    the same shapes compiles nothing, with a fresh Compiled too (the graphs live with the function). The prefix
    cache's suffix shrinks each block: one graph more (its last block's step is DualCache's shape). Dynamo's
    graphs are the backend's input: aot_eager counts them without generating code."""
    ids, am = batch(llada, "llada")
    kw = dict(attention_mask=am, cache="dual", threshold=0.9, **KW)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled = Compiled("aot_eager")
    first, _ = generate(llada, ids, compile=compiled, **kw)
    assert counters["stats"]["unique_graphs"] - before == 2
    generate(llada, ids.flip(1), compile=compiled, **kw)
    fresh, _ = generate(llada, ids, compile=Compiled("aot_eager"), **kw)
    assert counters["stats"]["unique_graphs"] - before == 2 and torch.equal(fresh, first)
    generate(llada, ids, compile=compiled, **(kw | dict(cache="prefix")))
    assert counters["stats"]["unique_graphs"] - before == 2 + 1


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_compiled_ids_equal_eager(llada, dream, family, mode):
    """Every mode of both families on a padded batch captures whole graphs (fullgraph: a break or a recompile-limit
    hit is an error) and decodes eager's ids. Through aot_eager (the same dynamo and AOT graphs, no code generated:
    inductor compiling each on a cold cache cost ~100 s of this file on the 2-core VM); inductor's own numbers are
    checked on every cache mode by test_golden_runs_compiled, and in bf16 bit for bit."""
    model = llada if family == "llada" else dream
    ids, am = batch(model, family)
    eager, st = generate(model, ids, attention_mask=am, **mode, **KW)
    compiled = Compiled("aot_eager")
    out, st2 = generate(model, ids, attention_mask=am, compile=compiled, **mode, **KW)
    assert compiled.fn is not None and torch.equal(out, eager) and st2["nfe"] == st["nfe"]


@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_diffusiongemma_compiled_one_graph_per_feed_shape_and_ids_equal_eager(cache):
    """DiffusionGemma's own call (the encoder, then the self-conditioned decoder: gemma.DiffusionGemma.hidden)
    compiled, a padded batch with a generator per row: eager's ids, calls and draws; one graph per width fed (prefix:
    a canvas's first call and its steps, one width more for the first canvas's prompt; none: a width per canvas),
    and a second call of the same shapes compiles nothing (aot_eager, as test_compiled_ids_equal_eager)."""
    model = load_model(f"{GOLDEN}/diffusiongemma/tiny_dg_seed1234", device="cpu", dtype=torch.float32)
    ids, am = pad_prompts([[2, 45, 300, 17, 999], [2, 811, 64, 3, 520, 77, 913, 402, 11]], 0)
    kw = dict(attention_mask=am, gen_length=48, steps=4, cache=cache)
    gens = lambda: [torch.Generator().manual_seed(3 + b) for b in range(2)]     # noqa: E731
    eager, st = generate(model, ids, generator=(eager_gens := gens()), **kw)
    torch._dynamo.reset()
    before, compiled = counters["stats"]["unique_graphs"], Compiled("aot_eager")
    for _ in range(2):
        out, st2 = generate(model, ids, generator=(compiled_gens := gens()), compile=compiled, **kw)
        assert torch.equal(out, eager) and st2["fed"] == st["fed"] and st2["row_nfe"] == st["row_nfe"]
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(eager_gens, compiled_gens))
        assert counters["stats"]["unique_graphs"] - before == len(set(st["fed"])) == 3


def test_compiled_guided_ids_equal_eager(dream, qwen2):
    """Guided diffusion's diffusion calls compiled (aot_eager, as test_compiled_ids_equal_eager): eager's ids."""
    ids, am = batch(dream, "dream")
    for cache in ("prefix", "free"):
        eager, st = generate(dream, ids, attention_mask=am, guide=qwen2, cache=cache, gen_length=16)
        compiled, st2 = generate(dream, ids, attention_mask=am, guide=qwen2, cache=cache, gen_length=16,
                                 compile=Compiled("aot_eager"))
        assert torch.equal(compiled, eager) and st2["guide_calls"] == st["guide_calls"]


def test_bf16_compiled_equals_eager_bit_for_bit():
    """In bfloat16, inductor with emulate_precision_casts rounds every intermediate where eager does: on the CPU
    the compiled logits equal eager's bit for bit, so the ids do (on a GPU tools/gpu_check.py measures it)."""
    model = load_model(f"{GOLDEN}/llada-tiny", device="cpu", dtype=torch.bfloat16)
    ids, am = batch(model, "llada")
    steps, outs = {"eager": [], "compiled": []}, {}
    for name in steps:
        outs[name], _ = generate(model, ids, attention_mask=am, cache="dual", threshold=0.9, compile=name == "compiled",
                                 on_step=lambda x, st, seen=steps[name]: seen.append(x.clone()), **KW)
    assert torch.equal(outs["compiled"], outs["eager"])
    # Every step's canvas, not only the last: a compiled step that committed other tokens on the way (more or
    # fewer calls, another order) and still ended on the same ids would differ here.
    assert len(steps["compiled"]) == len(steps["eager"]) > 2
    assert all(torch.equal(c, e) for c, e in zip(steps["compiled"], steps["eager"]))
    x, L = torch.nn.functional.pad(ids, (0, 16), value=model.config.mask_id), ids.shape[1] + 16
    m = torch.nn.functional.pad(am.bool(), (0, 16), value=True)
    args = ((m.long().cumsum(-1) - 1).clamp(min=0), None, torch.arange(L), m[:, None, None, :] & m[:, None, :, None],
            torch.arange(12, 20))
    with torch.inference_mode():
        a = model.logits(model.hidden(x, args[0], KVCache.for_model(model, 2, L), *args[2:4]), args[4])
        b = model.logits(Compiled()(model, x, args[0], KVCache.for_model(model, 2, L), *args[2:4]), args[4])
    assert torch.equal(a, b)


# The official golden runs (tests/test_golden.py), compiled. Equal to eager is not enough when both paths share
# an error; these are the official code's tokens and NFE. The batch-1 runs cover each cache mode of both families
# (LLaDA none, prefix and dual, with and without a threshold; Dream's own sampler, and Fast-dLLM's block sampler
# with each cache); the batch-2 runs would add only new shapes (a padded batch is compared with eager above).
# 12 graphs. Measured on the 2-core VM, `python -m pytest tests/test_compile.py -k golden_runs_compiled` with
# TORCHINDUCTOR_CACHE_DIR an empty folder (cold): 102 s of CPU (user + sys); again (inductor's FX graph cache
# holds them): 12 s, the ~5 s of imports included.
GOLDEN_B1 = [r for r in LLADA_RUNS if r["batch"] == "b1"] + [r for r in DREAM_RUNS if r["name"].endswith("/b1")]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_golden_runs_compiled(llada, dream, llada_golden, family):
    """Each run through a fresh Compiled, which must have been called (the run went through torch.compile, not
    a silent eager fallback); fullgraph=True turns any graph break or recompile-limit hit into an error."""
    model = llada if family == "llada" else dream
    for run in [r for r in GOLDEN_B1 if ("fn" in r) == (family == "llada")]:
        if family == "llada":
            prompt, kw, want = torch.tensor(llada_golden["prompts"]["b1"]), llada_call(run), run["output"]
        else:
            prompt, kw, want = torch.tensor(run["input_ids"]), dream_call(run), run["sequences"]
        compiled = Compiled()
        out, st = generate(model, prompt, compile=compiled, **kw)
        assert compiled.fn is not None, run["name"]
        assert out.tolist() == want and st["nfe"] == run["nfe"], run["name"]


def test_compile_is_checked():
    with pytest.raises(ValueError, match=r"Compiled\(backend='nope'\): not a torch.compile backend here"):
        Compiled("nope")
    from fastdllm import generate as g  # noqa: F401  (the same entry point)
    model = load_model(f"{GOLDEN}/llada-tiny", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"compile must be True, False or a fastdllm.Compiled \(got 'yes'\)"):
        generate(model, torch.tensor([[5, 6, 7]]), compile="yes", gen_length=8, block_length=8)
