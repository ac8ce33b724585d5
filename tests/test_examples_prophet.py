"""examples/prophet.py (Prophet, arXiv 2508.19982) against a naive loop written here from the paper's algorithm
(in the order of the official generate_earlyexit.py): token for token, at batch 1 and on a padded batch equal to
solo runs, on LLaDA (the fork is LLaDA only, as the official eval; a Dream checkpoint is refused before it loads);
its refusals; and its command line as a user runs it."""
import importlib.util
import os

import pytest
import torch

import bounded

from conftest import ROOT, copy_checkpoint, write_tokenizer
from fastdllm import generate, pad_prompts
from reference import predictions

spec = importlib.util.spec_from_file_location("prophet", os.path.join(ROOT, "examples", "prophet.py"))
prophet = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prophet)

PROMPTS = {"llada": [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]]}
SUFFIX = [5, 6, 7]     # any three ids: the step rule forces them, whatever they mean


@torch.inference_mode()
def reference(model, prompt, gen, block, spb, suffix, suffix_at, taus=(7.5, 5.0, 2.5)):
    """Prophet on one row, plainly: the suffix written into the canvas; per block spb calls committing the k[i] most
    confident masks (k spread evenly, earliest steps first; float64 probabilities). Before each commit, the mean
    top-1 minus top-2 logit gap over the 5 positions starting two after the suffix, against 7.5 / 5.0 / 2.5 as
    calls / (blocks x spb) passes 0.33 and 0.67: once reached, every mask takes this call's argmax and decoding
    ends. -> (canvas, calls, whether it ended early)."""
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
        while i < spb:
            logits = predictions(model, x)[0]                        # (L, V), at canvas positions
            calls += 1
            gaps = [float(logits[p].topk(2).values[0] - logits[p].topk(2).values[1]) for p in window]
            progress = calls / total
            tau = taus[0] if progress < 0.33 else taus[1] if progress < 0.67 else taus[2]
            probs = logits.double().softmax(-1)
            probs[:, M] = -1                                         # never propose the mask itself
            conf, token = probs.max(-1)
            if gaps and sum(gaps) / len(gaps) >= tau:
                x[0] = torch.where(x[0] == M, token, x[0])
                return x, calls, True
            masked = x[0, s:e] == M
            conf = conf[s:e].masked_fill(~masked, float("-inf"))
            take = torch.zeros_like(masked)
            take[conf.topk(ks[i]).indices] = True
            x[0, s:e] = torch.where(take & masked, token[s:e], x[0, s:e])
            i += 1
    return x, calls, False


def decode(model, ids, spb, suffix, suffix_at, **kw):
    rule = prophet.Prophet(suffix_ids=suffix, suffix_at=suffix_at, steps_per_block=spb, mask_id=model.config.mask_id)
    return generate(model, ids, gen_length=32, block_length=8, propose=rule, stop=rule, select=prophet.S.Schedule(),
                    **kw)


# Removing a key rule fails these tests: checked by editing the example, one edit at a time, and running this file
# (failed tests of its 11): the gap test never passing: 10; one threshold whatever the progress: 10; progress counted
# from 0 (at.n, not at.n + 1): 9; the fill cut to the block: 9; the suffix not forced: 10; blocks that end once
# unmasked (no exact steps): 5; the window one position after the suffix, not two: 8.
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


def test_prefix_cache_runs_and_dual_is_refused(llada):
    """prefix (and free): the window is tested while it is fed (at or after the block), and every answer ends
    unmasked; DualCache feeds the block alone after a block's first step: at.logits refuses it in one line."""
    for cache in ("prefix", "free"):
        got, st = decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, SUFFIX, -10, cache=cache)
        assert not (got == llada.config.mask_id).any() and st["nfe"] < 32
    with pytest.raises(ValueError, match=r"^at.logits\(\d+, 44\): this call fed \(\d+, \d+\) .* \(cache='none' feeds"):
        decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, SUFFIX, -10, cache="dual")
    with pytest.raises(ValueError, match=r"^prophet: --suffix-at -40 lies before the answer: use >= -32$"):
        decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, SUFFIX, -40, cache="none")
    for at in (-2, 0, 3):      # the suffix past the canvas end
        with pytest.raises(ValueError, match=f"^prophet: --suffix-at {at} counts from the canvas end: pass one <= -3$"):
            decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, SUFFIX, at, cache="none")


def test_no_suffix_at_the_answers_start(llada):
    """No suffix (--suffix ""): the window may start at the answer's first position, the official offset 0 (suffix_at =
    -gen - 1, the window two after an empty suffix); one further left is refused, naming the bound."""
    for row in PROMPTS["llada"]:
        want, calls, _ = reference(llada, torch.tensor([row]), 32, 8, 8, [], -33)
        got, st = decode(llada, torch.tensor([row]), 8, [], -33, cache="none")
        assert torch.equal(got, want) and st["nfe"] == calls
    with pytest.raises(ValueError, match=r"^prophet: --suffix-at -34 lies before the answer: use >= -33$"):
        decode(llada, torch.tensor([PROMPTS["llada"][0]]), 8, [], -34, cache="none")


def run_example(*args):
    """The example as a user runs it: its __main__ (tests/bounded.py run_main, in this process: test_fork_programs
    runs each program in a process of its own)."""
    return bounded.run_main(os.path.join(ROOT, "examples", "prophet.py"), args, cwd=ROOT)


def test_command_line_answers_and_refuses_dual_and_dream(tmp_path):
    demo = ["--model", os.path.join(ROOT, "demo", "llada-arith"), "--gen-length", "32", "--block-length", "8",
            "--prompt", "Tom has 23 apples and buys 45 more. How many apples does he have?", "--no-stream"]
    code, out, err = run_example(*demo, "--early", "22.5", "--mid", "15", "--late", "7.5")
    assert code == 0, err
    answer, stats = out.strip().splitlines()[-2:]
    assert answer.endswith("The answer is 68.") and stats.startswith("NFE ") and int(stats.split()[1]) < 32
    code, out, err = run_example(*demo, "--suffix", "", "--suffix-at", "-33")   # no suffix, the window at offset 0
    assert code == 0 and out.strip().splitlines()[-1].startswith("NFE "), err
    code, out, err = run_example(*demo, "--cache", "dual")
    assert code == 2 and err == "error: prophet runs LLaDA (its official eval) with --cache none (official) or " \
        "prefix: got a llada model, --cache dual\n"       # before the model loads
    dream = copy_checkpoint("dream-tiny", tmp_path)      # refused from its config, before its weights load
    write_tokenizer(dream, {1023: "<|mask|>", 1000: "<|endoftext|>"})
    code, out, err = run_example("--model", dream, "--prompt", "w5 w6")
    assert code == 2 and err == "error: prophet runs LLaDA (its official eval) with --cache none (official) or " \
        "prefix: got a dream model, --cache none\n"
