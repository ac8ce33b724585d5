"""examples/prophet.py (Prophet, arXiv 2508.19982) against a naive loop written here from the paper's algorithm
(in the order of the official generate_earlyexit.py): token for token, at batch 1 and on a padded batch equal to
solo runs, on LLaDA (its step rule with the suffix) and on Dream (the stop rule under Fast-dLLM's threshold
decoding); its refusals; and its command line as a user runs it."""
import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from fastdllm import generate, pad_prompts

spec = importlib.util.spec_from_file_location("prophet", os.path.join(ROOT, "examples", "prophet.py"))
prophet = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prophet)

PROMPTS = {"llada": [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]],
           "dream": [[775, 171, 806, 365, 316, 564, 432, 625, 575, 529], [12, 44, 907]]}
SUFFIX = [5, 6, 7]     # any three ids: the step rule forces them, whatever they mean


@torch.inference_mode()
def reference(model, prompt, gen, block, spb, suffix, suffix_at, taus=(7.5, 5.0, 2.5), threshold=None):
    """Prophet on one row, plainly: the suffix written into the canvas; per block spb calls committing the k[i] most
    confident masks (k spread evenly, earliest steps first; float64 probabilities), or with `threshold` (Dream)
    Fast-dLLM's threshold steps until the block is done (a block's first step: its first token only). Before each
    commit, the mean top-1 minus top-2 logit gap over the 5 positions starting two after the suffix, against 7.5 /
    5.0 / 2.5 as calls / (blocks x spb) passes 0.33 and 0.67: once reached, every mask takes this call's argmax
    and decoding ends. -> (canvas, calls)."""
    M = model.config.mask_id
    x = torch.cat([prompt, torch.full((1, gen), M)], 1)
    P, L = prompt.shape[1], x.shape[1]
    for j, t in enumerate(suffix):
        x[0, L + suffix_at + j] = t
    w = L + suffix_at + len(suffix) + 1
    window, total, calls = range(w, min(w + 5, L)), gen // block * spb, 0
    for s in range(P, L, block):
        e, i = s + block, 0
        n = int((x[0, s:e] == M).sum())
        ks = [n // spb + (j < n % spb) for j in range(spb)]
        while i < spb if threshold is None else bool((x[0, s:e] == M).any()):
            logits = model(x)[0]                                     # (L, V), at canvas positions
            calls += 1
            gaps = [float(logits[p].topk(2).values[0] - logits[p].topk(2).values[1]) for p in window]
            progress = calls / total
            tau = taus[0] if progress < 0.33 else taus[1] if progress < 0.67 else taus[2]
            probs = (logits.double() if threshold is None else logits.float()).softmax(-1)
            probs[:, M] = -1                                         # never propose the mask itself
            conf, token = probs.max(-1)
            if gaps and sum(gaps) / len(gaps) >= tau:
                x[0] = torch.where(x[0] == M, token, x[0])
                return x, calls, True
            masked = x[0, s:e] == M
            conf = conf[s:e].masked_fill(~masked, float("-inf"))
            take = torch.zeros_like(masked)
            if threshold is None:
                take[conf.topk(ks[i]).indices] = True
            elif i == 0:
                take[0] = True
            else:
                take[conf.argmax()] = True
                take |= conf >= threshold
            x[0, s:e] = torch.where(take & masked, token[s:e], x[0, s:e])
            i += 1
    return x, calls, False


def decode(model, ids, spb, suffix, suffix_at, threshold=None, **kw):
    rule = prophet.Prophet(suffix_ids=suffix, suffix_at=suffix_at, steps_per_block=spb, mask_id=model.config.mask_id)
    hooks = dict(stop=rule, threshold=threshold) if threshold else dict(propose=rule, stop=rule,
                                                                         select=prophet.S.Schedule())
    return generate(model, ids, gen_length=32, block_length=8, **hooks, **kw)


# (steps per block, suffix offset from the end): measured, the early exit fires in both rows at different calls
# (row 0 at call 11, 6, 29; row 1 at 30, never, 22): the fill and the ended rows of a batch are exercised.
LLADA_CASES = [(8, -10), (4, -14), (8, -25)]


@pytest.mark.parametrize("spb,suffix_at", LLADA_CASES)
@pytest.mark.parametrize("cache,refresh", [("none", False), ("prefix", True)])
def test_llada_equals_the_reference(llada, spb, suffix_at, cache, refresh):
    """Batch 1, the official uncached loop (and the prefix cache refreshed every step: the same feed)."""
    fired = []
    for row in PROMPTS["llada"]:
        want, calls, early = reference(llada, torch.tensor([row]), 32, 8, spb, SUFFIX, suffix_at)
        got, st = decode(llada, torch.tensor([row]), spb, SUFFIX, suffix_at, cache=cache, refresh_every_step=refresh)
        assert torch.equal(got, want) and st["nfe"] == calls
        fired.append(early)
    assert fired[0]            # the rule under test decided this decode


@pytest.mark.parametrize("spb,suffix_at", LLADA_CASES)
def test_llada_padded_batch_equals_solo_runs(llada, spb, suffix_at):
    ids, am = pad_prompts(PROMPTS["llada"], llada.config.pad_id)
    got, _ = decode(llada, ids, spb, SUFFIX, suffix_at, attention_mask=am, cache="none")
    for i, row in enumerate(PROMPTS["llada"]):
        want = reference(llada, torch.tensor([row]), 32, 8, spb, SUFFIX, suffix_at)[0]
        assert torch.equal(got[i, -want.shape[1]:], want[0])


@pytest.mark.parametrize("suffix_at", [-14, -6])
def test_dream_stop_rule_equals_the_reference(dream, suffix_at):
    """Dream: the stop rule alone (no suffix: the official code forces it on LLaDA only) under Fast-dLLM's
    threshold decoding, batch 1 and a padded batch; the window's logits come through Dream's shift."""
    ids, am = pad_prompts(PROMPTS["dream"], dream.config.pad_id)
    batch, _ = decode(dream, ids, 8, [], suffix_at, threshold=0.9, attention_mask=am, cache="none")
    fired = []
    for i, row in enumerate(PROMPTS["dream"]):
        want, calls, early = reference(dream, torch.tensor([row]), 32, 8, 8, [], suffix_at, threshold=0.9)
        got, st = decode(dream, torch.tensor([row]), 8, [], suffix_at, threshold=0.9, cache="none")
        assert torch.equal(got, want) and st["nfe"] == calls and torch.equal(batch[i, -want.shape[1]:], want[0])
        fired.append(early)
    assert any(fired)


def test_prefix_cache_runs_and_other_caches_are_refused(llada):
    """prefix: the window is fed while it lies at or after the block, and every answer ends unmasked;
    DualCache feeds the block alone after a block's first step: refused in one line naming the fix."""
    got, st = decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, SUFFIX, -10, cache="prefix")
    assert not (got == llada.config.mask_id).any() and st["nfe"] < 32
    for cache in ("dual", "free"):
        with pytest.raises(ValueError, match="prophet .* use cache 'none' \\(official\\) or 'prefix'"):
            decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, SUFFIX, -10, cache=cache)
    with pytest.raises(ValueError, match="--suffix-at -40 lies before the answer"):
        decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, SUFFIX, -40, cache="none")
    for at in (-2, 0, 3):      # the suffix past the canvas end
        with pytest.raises(ValueError, match=f"--suffix-at {at} counts from the canvas end"):
            decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, SUFFIX, at, cache="none")


def run_example(*args):
    """The example as a user runs it: a subprocess in its own process group, killed whole after 120 s."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", "prophet.py"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, stdout, stderr


def test_command_line_answers_and_refuses_dual():
    demo = ["--model", os.path.join(ROOT, "demo", "llada-arith"), "--gen-length", "32", "--block-length", "8",
            "--prompt", "Tom has 23 apples and buys 45 more. How many apples does he have?", "--no-stream"]
    code, out, err = run_example(*demo, "--early", "22.5", "--mid", "15", "--late", "7.5")
    assert code == 0, err
    answer, stats = out.strip().splitlines()[-2:]
    assert answer.endswith("The answer is 68.") and stats.startswith("NFE ") and int(stats.split()[1]) < 32
    code, out, err = run_example(*demo, "--cache", "dual")
    assert code == 2 and err.startswith("error: --cache dual") and "Traceback" not in err
