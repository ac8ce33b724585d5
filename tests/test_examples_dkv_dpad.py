"""Two of the forks in examples/ tested by value (issue 31): dKV-Cache-Decode (examples/dkv_cache.py) and DPad
(examples/dpad.py). Each is compared token for token with a reference written here from the paper's algorithm as
the official code runs it (a naive loop like tests/reference.py, which builds the same feeds and keeps the same
keys/values the official code keeps, with none of the example's code), on LLaDA and on Dream where the method
applies, at batch 1 and on a left-padded batch equal to solo runs; and each program answers on the demo model."""
import math
import os
import runpy
import sys

import pytest
import torch

import bounded

import cli
from conftest import ROOT, copy_checkpoint, write_tokenizer
from examples.dkv_cache import DKVCacheDecode
from examples.dpad import DPad
from fastdllm import generate, pad_prompts
from reference import predictions

PROMPTS = {"llada": [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]],
           "dream": [[775, 171, 806, 365, 316, 564, 432, 625, 575, 529], [12, 44, 907]]}


def commit(x, logits, s, e, k, threshold, mask_id, dtype):
    """The official LLaDA/Dream step (Fast-dLLM's `get_transfer_index`): at the block's masks, the argmax (never the
    mask itself, as tests/reference.py) and its probability; the k most confident, or with a threshold the most
    confident and every other one at or above it. logits (V, e - s) at the block; x is changed in place."""
    probs = logits.to(dtype).softmax(-1)
    probs[..., mask_id] = -1
    conf, token = probs.max(-1)
    masked = x[0, s:e] == mask_id
    conf = conf.masked_fill(~masked, -math.inf)
    order = conf.argsort(descending=True)
    take = torch.zeros_like(masked)
    take[order[:k]] = True
    if threshold is not None:
        take = torch.zeros_like(masked)
        take[order[0]] = True
        take |= conf >= threshold
    take &= masked
    x[0, s:e] = torch.where(take, token, x[0, s:e])


def budget(masks: int, steps: int, i: int) -> int:
    """LLaDA's `get_num_transfer_tokens`: the block's masks spread evenly, the remainder to the first steps."""
    return masks // steps + (i < masks % steps)


# ---------------------------------------------------------------------------------------- dKV-Cache-Decode
class DelayedStore:
    """The official per-layer store of dKV-Cache-Decode (model forward with preprocess_cache): every call's keys are
    its fresh keys at the fed positions and the stored ones elsewhere; after the call only the positions in `keep`
    (decoded before the call: D_{i-1}) are stored. Everything not stored is NaN, so reading a key the official code
    does not hold would make the logits NaN."""

    def __init__(self):
        self.k, self.v, self.keep = {}, {}, None

    def update(self, layer, k, v, slots):
        B, H, _, D = k.shape
        L = self.keep.shape[0]
        K = self.k.get(layer, torch.full((B, H, L, D), math.nan)).clone()
        V = self.v.get(layer, torch.full((B, H, L, D), math.nan)).clone()
        K[:, :, slots], V[:, :, slots] = k, v
        drop = ~self.keep[:, None]
        self.k[layer], self.v[layer] = K.masked_fill(drop, math.nan), V.masked_fill(drop, math.nan)
        return K, V


@torch.inference_mode()
def dkv_reference(model, prompt, gen_length, block_length, steps, refresh):
    """dKV-Cache-Decode as the official LLaDA loop runs it (batch 1): per block the store starts empty; step i feeds
    the whole canvas when i == 0 (nothing stored), i == 1 or i % refresh == 0, else the positions not decoded two
    steps back (~D_{i-2}); each call stores D_{i-1}. -> (canvas, tokens fed per call)."""
    mask_id, P = model.config.mask_id, prompt.shape[1]
    x = torch.cat([prompt, torch.full((1, gen_length), mask_id)], 1)
    L, spb, fed_sizes = x.shape[1], steps // (gen_length // block_length), []
    for s in range(P, L, block_length):
        e, store, decoded = s + block_length, DelayedStore(), []     # decoded[t]: D_t, non-masks after step t
        masks = int((x[0, s:e] == mask_id).sum())
        for i in range(spb):
            fed = torch.arange(L) if i < 2 or i % refresh == 0 else (~decoded[i - 2]).nonzero().squeeze(1)
            store.keep = (x[0] != mask_id) & (i > 0)
            logits = model(x[:, fed], pos=fed[None], cache=store, start=fed)[0]
            assert torch.isfinite(logits).all()                   # no key read that the official code lacks
            full = torch.zeros(L, logits.shape[-1]).index_copy_(0, fed, logits)   # the block's masks are all fed
            commit(x, full[s:e], s, e, budget(masks, spb, i), None, mask_id, torch.float64)
            decoded.append(x[0] != mask_id)
            fed_sizes.append(len(fed))
    return x, fed_sizes


# ---------------------------------------------------------------------------------------- DPad
class KeptStore:
    """The official dual cache under DPad: keys/values exist for the block's first call's positions only ([0, e) and
    the kept suffix, in that order); later calls overwrite the block's rows in place (`replace_position`)."""

    def __init__(self, q):
        self.q, self.k, self.v = q, {}, {}

    def update(self, layer, k, v, slots):
        if layer not in self.k:                                  # the block's first call: it fed exactly q
            self.k[layer], self.v[layer] = k.clone(), v.clone()
        else:
            rows = torch.searchsorted(self.q, slots)
            self.k[layer][:, :, rows], self.v[layer][:, :, rows] = k, v
        return self.k[layer], self.v[layer]


@torch.inference_mode()
def dpad_reference(model, prompt, gen_length, block_length, steps, threshold, dual, window, k_sigma, scale, seed):
    """DPad as the official loops run it (llada/generate_dropout.py `generate`, `generate_with_dual_cache`; Dream's
    `_sample_cache` with dual_cache; batch 1): per block one uniform draw over the suffix [e, L) from the seeded
    generator, suffix offset j kept iff u_j < scale * phi(linspace(0, k_sigma, window)_j) (0 beyond the window);
    q = [0, e) + kept, each at its own position. No cache: every step runs the model on q alone. Dual: the first
    call runs q into the store, later calls the block [s, e) against it. Dream's first call commits the block's first
    position alone (Fast-dLLM's Dream rule). -> (canvas, tokens fed per call)."""
    cfg = model.config
    mask_id, P, dream = cfg.mask_id, prompt.shape[1], cfg.family == "dream"
    dtype = torch.float32 if dream else torch.float64
    x = torch.cat([prompt, torch.full((1, gen_length), mask_id)], 1)
    L, spb, fed_sizes = x.shape[1], steps // (gen_length // block_length), []
    grid = torch.linspace(0, k_sigma, window)
    pdf = torch.cat([scale * torch.exp(-0.5 * grid ** 2) / torch.sqrt(torch.tensor(2 * torch.pi)),
                     torch.zeros(gen_length)])
    generator = torch.Generator().manual_seed(seed)
    for s in range(P, L, block_length):
        e = s + block_length
        u = torch.rand(L - e, generator=generator)
        q = torch.cat([torch.arange(e), e + (u < pdf[:L - e]).nonzero().squeeze(1)])
        store, masks, i = KeptStore(q) if dual else None, int((x[0, s:e] == mask_id).sum()), 0
        while (x[0, s:e] == mask_id).any():
            fed = torch.arange(s, e) if dual and i > 0 else q
            logits = predictions(model, x[:, fed], pos=fed[None], cache=store, start=fed)[0]   # shifted within the feed
            block = logits[torch.searchsorted(fed, torch.arange(s, e))]
            if dream and dual and i == 0:
                x[0, s] = block[0].float().softmax(-1).index_fill(-1, torch.tensor([mask_id]), -1).argmax()
            else:
                commit(x, block, s, e, budget(masks, spb, min(i, spb - 1)), threshold, mask_id, dtype)
            fed_sizes.append(len(fed))
            i += 1
    return x, fed_sizes


# ---------------------------------------------------------------------------------------- the tests
def solo_and_padded(model, family):
    """The test prompts alone (1, P) and as one left-padded batch."""
    ids, am = pad_prompts(PROMPTS[family], model.config.pad_id or 0)
    return [torch.tensor([row]) for row in PROMPTS[family]], ids, am


# How the tests below were checked to fail without the method's key rule (each mutation made in the example, the
# file run, then reverted; failed tests of its 21): dKV with a refresh at every step: 5, only at steps 0 and 1: 4,
# immediate caching (feeding this step's masks instead of the previous step's): 6, no per-row discard slots: 2, Dream
# not refused: 2; DPad with the dropped keys attended in dual mode (keys() -> None): 6, the whole canvas fed in none
# mode: 3, the kept set drawn again at every step: 9, the generator not reset for a new generation (one policy serves
# two prompts): 6, the program's scale not the family's: 1.
@pytest.mark.parametrize("gen,block,steps,refresh", [(32, 8, 32, 2), (32, 8, 32, 4), (32, 8, 16, 4), (64, 32, 64, 8)])
def test_dkv_cache_decode_is_the_official_loop(llada, gen, block, steps, refresh):
    """Token for token and feed for feed; and not the uncached decode (which a refresh at every step would give)."""
    kw, policy = dict(gen_length=gen, block_length=block, steps=steps), DKVCacheDecode(llada.config, refresh)
    for prompt in solo_and_padded(llada, "llada")[0]:           # one policy, two generations: its state restarts
        ref, fed = dkv_reference(llada, prompt, gen, block, steps, refresh)
        ours, st = generate(llada, prompt, cache=policy, **kw)
        assert torch.equal(ours, ref) and st["fed"] == fed
        assert not torch.equal(ours, generate(llada, prompt, cache="none", **kw)[0])


@pytest.mark.parametrize("threshold", [None, 0.9])
def test_dkv_cache_decode_padded_batch_equals_solo_runs(llada, threshold):
    """Rows decode different positions: the batch feeds the union of their sets and each row keeps its cached
    keys at the others' positions (the discard slot). With a threshold rows also end their blocks apart."""
    prompts, ids, am = solo_and_padded(llada, "llada")
    kw = dict(gen_length=32, block_length=8, steps=32, threshold=threshold)
    batch, st = generate(llada, ids, attention_mask=am, cache=DKVCacheDecode(llada.config, 4), **kw)
    for row, prompt in zip(batch, prompts):
        alone = (dkv_reference(llada, prompt, 32, 8, 32, 4)[0] if threshold is None else
                 generate(llada, prompt, cache=DKVCacheDecode(llada.config, 4), **kw)[0])
        assert torch.equal(row[-alone.shape[1]:], alone[0])


def test_dkv_cache_decode_refuses_dream_in_one_line(dream):
    """Built from the checkpoint's config: a Dream model is refused before anything runs."""
    with pytest.raises(ValueError, match=r"^dKV-Cache-Decode is written here for LLaDA.*: got a dream model$"):
        DKVCacheDecode(dream.config, 4)


DPAD = [("llada", "none", 32, 8, 0.9, 256, 4.0, 2.0), ("llada", "none", 32, 8, None, 16, 4.0, 2.0),
        ("llada", "dual", 32, 8, 0.9, 16, 3.0, 1.0), ("llada", "dual", 32, 8, None, 16, 4.0, 2.0),
        ("dream", "dual", 32, 8, 0.9, 16, 3.0, 1.0), ("dream", "dual", 64, 16, 0.5, 32, 3.0, 2.3)]


@pytest.fixture
def model(request, llada, dream):
    return {"llada": llada, "dream": dream}[request.param]


@pytest.mark.parametrize("model,mode,gen,block,threshold,window,k_sigma,scale", DPAD, indirect=["model"])
def test_dpad_is_the_official_loop(model, mode, gen, block, threshold, window, k_sigma, scale):
    """Token for token and feed for feed (dual mode: the generation's first call feeds the whole canvas, its dropped
    keys masked, where the official code feeds [0, e) + kept); and not the decode without dropout."""
    kw = dict(gen_length=gen, block_length=block, steps=gen, threshold=threshold)
    policy = DPad(mode, window, k_sigma, scale, 7)
    for prompt in solo_and_padded(model, model.config.family)[0]:   # one policy, two generations: each draws afresh
        ref, fed = dpad_reference(model, prompt, gen, block, gen, threshold, mode == "dual", window, k_sigma, scale, 7)
        ours, st = generate(model, prompt, cache=policy, **kw)
        assert torch.equal(ours, ref)
        assert st["fed"] == ([prompt.shape[1] + gen] + fed[1:] if mode == "dual" else fed)
        assert not torch.equal(ours, generate(model, prompt, cache=mode, **kw)[0])


@pytest.mark.parametrize("model,mode", [("llada", "none"), ("llada", "dual"), ("dream", "dual")], indirect=["model"])
def test_dpad_padded_batch_equals_solo_runs(model, mode):
    """One draw per block serves every row (the suffix is the same length in each), as each row's solo run draws it."""
    prompts, ids, am = solo_and_padded(model, model.config.family)
    kw = dict(gen_length=32, block_length=8, steps=32, threshold=0.9)
    batch, _ = generate(model, ids, attention_mask=am, cache=DPad(mode, 16, 3.0, 1.0, 7), **kw)
    for row, prompt in zip(batch, prompts):
        alone = dpad_reference(model, prompt, 32, 8, 32, 0.9, mode == "dual", 16, 3.0, 1.0, 7)[0]
        assert torch.equal(row[-alone.shape[1]:], alone[0])


# ---------------------------------------------------------------------------------------- the programs
def program(name, *args):
    """python examples/<name>.py on the demo model, as a user runs it: its __main__ (tests/bounded.py run_main, in
    this process: test_fork_programs runs each program in a process of its own)."""
    cmd = [sys.executable, os.path.join(ROOT, "examples", f"{name}.py"),
           "--model", os.path.join(ROOT, "demo", "llada-arith"), "--gen-length", "32", "--block-length", "8", "--prompt",
           "Tom has 23 apples and buys 45 more. How many apples does he have?", *args]
    return bounded.run_main(cmd[1], cmd[2:])


@pytest.mark.parametrize("name,args", [("dkv_cache", ()), ("dpad", ()), ("dpad", ("--cache-mode", "none"))])
def test_the_program_answers_on_the_demo_model(name, args):
    code, out, err = program(name, *args)
    assert code == 0, err
    answer, stats = out.strip().splitlines()[-2:]
    assert answer == "45 + 23 = 68. The answer is 68." and stats.startswith("NFE ")


def test_a_bad_flag_is_refused_in_one_line():
    code, out, err = program("dkv_cache", "--refresh", "0")
    assert code == 2 and err.strip() == "error: --refresh must be >= 1 (got 0): it is the refresh interval in steps"
    for bad in (dict(cache_mode="prefix"), dict(window=0)):
        with pytest.raises(ValueError, match=r"^--cache-mode must be none or dual .* and --window >= 1"):
            DPad(**bad)


def program_parts(name, **values):
    """The hooks python examples/<name>.py builds: its cli.run(fork, **flags) caught (flags: name=(default, help)),
    fork called with its flags' defaults and `values` (the checkpoint's config, as cli.run hands it)."""
    caught, run = {}, cli.run
    cli.run = lambda fork, **own: caught.update(fork=fork, own=own)
    try:
        runpy.run_path(os.path.join(ROOT, "examples", f"{name}.py"), run_name="__main__")
    finally:
        cli.run = run
    return caught["fork"](**{key: default for key, (default, _) in caught["own"].items()} | values)


def test_the_programs_follow_the_checkpoint_family(llada, dream, tmp_path):
    """DPad's scale is the family's official one (LLaDA 2.0, Dream 1.6); dKV-Cache-Decode refuses a Dream checkpoint
    from its config, before the weights load."""
    for model, scale in ((llada, 2.0), (dream, 1.6)):
        pdf = program_parts("dpad", config=model.config)["cache"].pdf
        assert torch.allclose(pdf[0], torch.tensor(scale / math.sqrt(2 * math.pi)))
    folder = copy_checkpoint("dream-tiny", tmp_path)
    write_tokenizer(folder, {1023: "<|mask|>", 1000: "<|endoftext|>"})
    code, out, err = program("dkv_cache", "--model", folder)
    assert code == 2 and err == ("error: dKV-Cache-Decode is written here for LLaDA; the official Dream variant (a "
                                 "whole-canvas decode with a shifted cached set) is not: got a dream model\n")
