"""The decoding loop for a person using it: early stop at end of text, left-padded batches for both
families (every row as it would be alone), and Fast-dLLM's Dream threshold over the whole canvas."""
import os

import pytest
import torch

from conftest import GOLDEN, ROOT, rows_as_alone
from fastdllm import generate, pad_prompts
from model import load_model
from reference import reference_dream_canvas
from test_flashdlm import eos_bias

PROMPTS = {"llada": [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]],
           "dream": [[775, 171, 806, 365, 316, 564, 432, 625, 575, 529], [12, 44, 907]]}
MODES = [dict(cache=c, **r) for c in ("none", "prefix", "dual", "free")
         for r in (dict(), dict(threshold=0.9), dict(factor=2.0))]
mode_id = lambda m: "-".join(f"{k}={v}" for k, v in m.items())   # noqa: E731


def left_pad(rows, pad_id):
    """Prompts of different lengths -> (ids, attention_mask), left-padded (what the CLI's batch does)."""
    from fastdllm import pad_prompts
    return pad_prompts(rows, pad_id)


def answer(ids, eos):
    """The answer: generated tokens up to the first end token."""
    ids = ids.tolist()
    return ids[:ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_early_stop_keeps_the_answer_and_saves_calls(llada, dream, family, mode):
    """stop_at_eos=True fills the rest once a block holding an end token is complete: the answer text is
    identical with and without it, and calls_saved accounts for the missing calls (exactly on the fixed
    schedule, a lower bound with threshold/factor, which need at least one call per block)."""
    model = llada if family == "llada" else dream
    prompt = torch.tensor([PROMPTS[family][0]])
    kw = dict(gen_length=64, block_length=8, steps=64, **mode)
    with eos_bias(model, 28.0 if family == "llada" else 22.0):
        full, st_full = generate(model, prompt, **kw)
        short, st = generate(model, prompt, stop_at_eos=True, **kw)
    P, eos = prompt.shape[1], model.config.eos_id
    assert answer(short[0, P:], eos) == answer(full[0, P:], eos)
    ends = short[0, P:].tolist().index(eos) // 8 if eos in short[0, P:].tolist() else 8   # block of the first eos
    if mode["cache"] == "none":
        assert ends < 7          # the eos bias makes the uncached decode end early, in every rule
    assert (st["calls_saved"] > 0) == (ends < 7)
    assert (short[0, P + (ends + 1) * 8:] == eos).all()                     # everything after its block: eos
    parallel = "threshold" in mode or "factor" in mode
    assert (st["nfe"] + st["calls_saved"] <= st_full["nfe"]) if parallel else (st["nfe"] + st["calls_saved"] == st_full["nfe"])


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", [dict(cache="none"), dict(cache="dual", threshold=0.9), dict(cache="free")], ids=mode_id)
@pytest.mark.parametrize("stop", [False, True])
def test_padded_rows_decode_as_alone(llada, dream, family, mode, stop):
    """Both families honour attention_mask: pads are neither attended nor attended to and positions count
    from each row's first real token, so every row of a left-padded batch equals its solo run, early stop
    included: its ids, calls and tokens committed. (The official LLaDA model ignores the mask and attends to pads.)"""
    model = llada if family == "llada" else dream
    with eos_bias(model, (28.0 if family == "llada" else 22.0) if stop else 0):
        rows_as_alone(model, PROMPTS[family], gen_length=32, block_length=8, steps=32, stop_at_eos=stop, **mode)


def test_pad_prompts_left_pads_and_masks():
    ids, am = left_pad([[5, 6, 7], [8]], 0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and am.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_dream_whole_canvas_threshold(dream):
    """Fast-dLLM's Dream `confidence_threshold` without blocks (docs/official.md 6.1): gen/steps tokens are
    offered per step, the first always taken, the others at confidence >= tau, the refused ones offered
    again; after the scheduled steps only the carry is offered, until no mask is left."""
    prompt = torch.tensor([PROMPTS["dream"][0]])
    for tau in (0.9, 0.99):
        out, st = generate(dream, prompt, gen_length=64, block_length=None, steps=4, threshold=tau)
        # By value, against tests/reference.py's oracle of the official rule: the tokens, the calls and what each
        # call committed. Catches a quota that is not gen/steps, a carry dropped or offered twice (tau 0.99 refuses
        # within the schedule), the extra calls after it (7 and 14 calls here) not made or given a new quota.
        want, calls, committed, ties = reference_dream_canvas(dream, prompt, 64, 4, threshold=tau)
        assert ties == 0 and torch.equal(out, want) and (st["nfe"], st["committed"]) == (calls, committed)
        assert not (out == dream.config.mask_id).any() and st["committed"][0] <= 16   # step 0 offers 64 / 4
    strict, st2 = generate(dream, prompt, gen_length=64, block_length=None, steps=4, threshold=1.01)
    assert st2["committed"][:4] == [1, 1, 1, 1] and st2["nfe"] == 64   # unreachable tau: one per step
    with pytest.raises(ValueError, match="steps .* must divide gen_length"):
        generate(dream, prompt, gen_length=64, block_length=None, steps=5, threshold=0.9)


def test_eos_reached_rules():
    """The two early-stop rules on hand-made canvases (prompt 3 tokens, mask 9, eos 0)."""
    from sampler import eos_reached
    eos, M = torch.tensor([0]), 9
    x = torch.tensor([[5, 6, 7, 1, 0, 0, M, M],      # FlashDLM k=2: answer "1 $ $" then masks -> stop
                      [5, 6, 7, 1, M, 0, 0, M],      # a mask before the right-most decoded token -> no
                      [5, 6, 7, 0, M, M, M, M],      # k=2 window reaches into the prompt (7 is no eos) -> no
                      [5, 6, 0, 0, M, M, M, M]])     # ... and here the prompt's last token is an eos -> stop
    assert eos_reached(x, 3, 8, eos, M, 2).tolist() == [True, False, False, True]
    assert eos_reached(x, 3, 8, eos, M, 3).tolist() == [False, False, False, False]
    block = torch.tensor([[5, 6, 7, 1, 0, 4, M, M], [5, 6, 7, 1, 4, M, M, M], [5, 6, 7, 1, 2, 4, M, M]])
    assert eos_reached(block, 3, 6, eos, M, True).tolist() == [True, False, False]   # block [3, 6) done, holds eos


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "free"])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_host_sync_per_cached_step(family, cache, batch):
    """A GPU waits for the host whenever a step reads a device value back (.item(), bool(t), .tolist(),
    nonzero, boolean indexing): counted by a dispatch mode (tools/step_count.py), every cached step reads once,
    its "go on?" (there were 5 to 7, and 134 for FreeCache's diverged rows at 32 layers)."""
    import sys
    sys.path.insert(0, ROOT)
    from tools.step_count import counted, random_model
    model = random_model(family, "small", torch.float32)
    prompt = torch.randint(0, 3000, (batch, 12), generator=torch.Generator().manual_seed(batch))
    steps, _ = counted(model, prompt, cache=cache, threshold=0.9, gen_length=32, block_length=8, steps=32)
    assert steps and max(c["syncs"] for _, c in steps) == 1


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_diffusiongemma_reads_the_host_once_a_step(cache):
    """DiffusionGemma's step (its draws, the entropy bound, the renoise, adaptive stopping, the end of text) reads the
    device once, as the others'. With a generator per row it reads which rows still draw, once more a step and once
    at a canvas's start (each row draws from its own as it would alone, and a generator advances on the host:
    docs/fork.md)."""
    import sys
    sys.path.insert(0, ROOT)
    from tools.step_count import counted
    model = load_model(os.path.join(GOLDEN, "diffusiongemma", "tiny_dg_seed1234"), device="cpu", dtype=torch.float32)
    ids, am = pad_prompts([[2, 45, 300, 17, 999], [2, 811, 64, 3, 520, 77, 913, 402, 11]], 0)
    for per_row in (False, True):
        generator = [torch.Generator() for _ in range(2)] if per_row else torch.Generator()
        steps, _ = counted(model, ids, attention_mask=am, generator=generator, cache=cache, gen_length=48, steps=4)
        fed = [w for w, _ in steps]
        starts = [i > 0 and w > fed[i - 1] if cache == "none" else w > 16 for i, w in enumerate(fed)]   # a canvas's
        assert len(steps) > 4 and [c["syncs"] for _, c in steps] == [1 + per_row * (1 + s) for s in starts]


@pytest.mark.parametrize("cache", ["prefix", "free"])
def test_guided_steps_read_the_host_at_most_eight_times(cache):
    import sys
    sys.path.insert(0, ROOT)
    from tools.step_count import counted, random_model
    model, guide = random_model("dream", "small", torch.float32), random_model("qwen2", "small", torch.float32)
    prompt = torch.randint(0, 3000, (2, 12), generator=torch.Generator().manual_seed(0))
    steps, _ = counted(model, prompt, guide=guide, cache=cache, gen_length=32)
    assert steps and max(c["syncs"] for _, c in steps) <= 8
