"""The EB-Sampler and KLASS forks (examples/eb_sampler.py, examples/klass.py) against references written here from
each paper's algorithm (notes: EB-Sampler's rule as every port has it; KLASS as its official code,
shkim0116/KLASS src/model/llada_klass.py and dream_klass.py, runs it): naive loops with one full forward of the
canvas per step, the rule written plainly, one prompt at a time; the forks run through fastdllm.generate and the
command line. Token for token at batch 1, and a left-padded batch equal to the solo references."""
import os
import sys

import pytest
import torch

import bounded

from conftest import GOLDEN, ROOT, copy_checkpoint, read_golden, write_tokenizer
from fastdllm import generate, pad_prompts
from model import load_model
from reference import predictions

sys.path.insert(0, os.path.join(ROOT, "examples"))
from eb_sampler import EBSampler  # noqa: E402
from klass import KLASS, hooks  # noqa: E402

PROMPTS = {"llada": [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]],
           "dream": [[775, 171, 806, 365, 316, 564, 432, 625, 575, 529], [12, 44, 907]]}
GEN, BLOCK = 32, 8


def canvas(model, row):
    return torch.tensor([row + [model.config.mask_id] * GEN])


def proposals(model, x, lo, hi):
    """One full forward of the canvas -> (logits (hi - lo, V), confidence, token) at positions [lo, hi): the argmax
    token, never the mask itself, and its probability in the family's official precision (LLaDA float64, Dream
    float32)."""
    logits = predictions(model, x)[0, lo:hi]
    probs = logits.double().softmax(-1) if model.config.family == "llada" else logits.float().softmax(-1)
    probs[:, model.config.mask_id] = -1
    conf, token = probs.max(-1)
    return logits, conf, token


@torch.inference_mode()
def eb_reference(model, row, gamma):
    """EB-Sampler by blocks: sort the block's masks by confidence (ties: the earlier position first), take them in
    that order while the sum of their entropies minus the largest stays <= gamma. Dream's block sampler (Fast-dLLM)
    commits a block's first position alone at the block's first step. -> (canvas, model calls)."""
    x, calls, mask = canvas(model, row), 0, model.config.mask_id
    for s in range(len(row), len(row) + GEN, BLOCK):
        first = True
        while (x[0, s:s + BLOCK] == mask).any():
            logits, conf, token = proposals(model, x, s, s + BLOCK)
            calls += 1
            logp = logits.double().log_softmax(-1)
            entropy = -(logp.exp() * logp).sum(-1)
            masks = [j for j in range(BLOCK) if x[0, s + j] == mask]
            if model.config.family == "dream" and first:
                masks = [0]
            total = largest = 0.0
            for j in sorted(masks, key=lambda j: -conf[j].item()):      # a stable sort
                total, largest = total + entropy[j].item(), max(largest, entropy[j].item())
                if total - largest > gamma:
                    break
                x[0, s + j] = token[j]
            first = False
    return x, calls


@torch.inference_mode()
def klass_reference(model, row, conf_bar, kl_bar, history=2, steps=GEN):
    """KLASS as the official code runs it. LLaDA: blocks, at most `steps` / blocks per block (LLaDA's schedule k for
    the fallback), the history used from the block's step history - 1 on, confidence > conf_bar. Dream: the whole
    canvas, no blocks, no step guard, confidence >= conf_bar, a fallback of one token ranked by Dream's float32
    max probability. Both: p_prev and the KL history start at zero and are never reset; float64."""
    x, calls, mask, llada = canvas(model, row), 0, model.config.mask_id, model.config.family == "llada"
    L, P = x.shape[1], len(row)
    prev, kls = None, torch.zeros(L, history, dtype=torch.float64)
    for s, e in [(s, s + BLOCK) for s in range(P, L, BLOCK)] if llada else [(P, L)]:
        spb = steps * (e - s) // GEN
        n = int((x[0, s:e] == mask).sum())
        schedule = [n // spb + (t < n % spb) for t in range(spb)]
        t = 0
        # Officially a block takes at most spb steps, so a step whose ready set is smaller than k can leave masks
        # in the answer (and a fallback k above the masks left overwrites committed tokens): not the paper's
        # algorithm, not copied (equal whenever every step commits k or more, as with steps = gen_length, k = 1).
        while (x[0, s:e] == mask).any():
            logits, conf32, token = proposals(model, x, 0, L)
            calls += 1
            p = logits.double().softmax(-1)
            conf = p.gather(-1, token[:, None]).squeeze(-1)
            prev = torch.zeros_like(p) if prev is None else prev
            kl = (p * ((p + 1e-12).log() - (prev + 1e-12).log())).sum(-1)
            kls, prev = torch.cat([kls[:, 1:], kl[:, None]], -1), p
            masked = torch.zeros(L, dtype=torch.bool)
            masked[s:e] = x[0, s:e] == mask
            stable = (kls < kl_bar).all(-1) & (t >= history - 1 or not llada)
            ready = stable & masked & (conf > conf_bar if llada else conf >= conf_bar)
            if ready.any():
                take = ready.nonzero().flatten().tolist()
            elif llada:     # the official call: topk over the canvas, per row with its own k (ties: its choice)
                top = torch.where(masked, conf, float("-inf")).topk(schedule[min(t, spb - 1)]).indices.tolist()
                take = [j for j in top if masked[j]]      # a k above the masks left: not over committed tokens
            else:           # argmax of Dream's float32 max probability over the masks: the first of equals
                take = [int(torch.where(masked, conf32, float("-inf")).argmax())]
            x[0, take] = token[take]
            t += 1
    return x, calls


def klass_settings(model, conf_bar, kl_bar, steps=GEN):
    """The program's parts (klass.hooks, from the checkpoint's config): LLaDA by blocks, Dream one block."""
    parts = hooks(conf_bar, kl_bar, 2, model.config)
    return dict(block_length=BLOCK, steps=steps, **parts) if model.config.family == "llada" else \
        dict(block_length=None, cache="none", **parts)


# Each case makes the method's rule decide (multi-token steps and fallbacks both occur on these tiny models).
# Removing a key rule fails these tests: checked by editing the example, one edit at a time, and running this file
# (failed tests of its 21):
#   EB: gamma ignored (count = every open position): 8; the largest entropy not subtracted: 9; entropy as the proxy
#   instead of confidence: 8.
#   KLASS: the KL history ignored (stable = True): 11; a history of 1 (this step's KL alone): 11; p_prev and the
#   history reset at each block: 5 (LLaDA); the t >= history - 1 guard dropped: 5 (LLaDA); fallback k = 1 instead
#   of the schedule's p.k: 2 (steps=16); a row done with its block still moving its state while the batch waits: 1
#   (the LLaDA padded batch); Dream's rule with Fast-dLLM's first token alone (first_token=True): 6. Not seen by
#   value: > against >= on LLaDA (no float64 confidence here equals a threshold).
EB_CASES = [("llada", 0.1), ("llada", 1.0), ("llada", 10.0), ("dream", 0.01), ("dream", 0.1), ("dream", 1.0)]
KLASS_CASES = [("llada", 0.0, 1.0, GEN), ("llada", 0.5, 0.3, GEN), ("llada", 0.5, 0.3, 16),
               ("llada", 0.0, 1.0, 16), ("dream", 0.9, 0.01, GEN), ("dream", 0.0, 1.0, GEN),
               ("dream", 0.05, 0.001, GEN), ("dream", 0.99, 0.1, GEN)]


@pytest.mark.parametrize("family,gamma", EB_CASES)
def test_eb_sampler_equals_the_reference(llada, dream, family, gamma):
    model = llada if family == "llada" else dream
    for row in PROMPTS[family]:
        want, calls = eb_reference(model, row, gamma)
        got, st = generate(model, torch.tensor([row]), gen_length=GEN, block_length=BLOCK, cache="none",
                           select=EBSampler(gamma))
        assert torch.equal(got, want) and st["nfe"] == calls
        assert calls < GEN       # the bound lets some step commit more than one token


@pytest.mark.parametrize("family,conf_bar,kl_bar,steps", KLASS_CASES)
def test_klass_equals_the_reference(llada, dream, family, conf_bar, kl_bar, steps):
    model = llada if family == "llada" else dream
    for row in PROMPTS[family]:
        want, calls = klass_reference(model, row, conf_bar, kl_bar, steps=steps)
        got, st = generate(model, torch.tensor([row]), gen_length=GEN,
                           **klass_settings(model, conf_bar, kl_bar, steps))
        assert torch.equal(got, want) and st["nfe"] == calls


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_padded_batches_equal_the_solo_references(llada, dream, family):
    model = llada if family == "llada" else dream
    ids, am = pad_prompts(PROMPTS[family], model.config.pad_id)
    eb, _ = generate(model, ids, attention_mask=am, gen_length=GEN, block_length=BLOCK, cache="none",
                     select=EBSampler(1.0))
    conf_bar, kl_bar = (0.5, 0.3) if family == "llada" else (0.9, 0.01)
    kl, _ = generate(model, ids, attention_mask=am, gen_length=GEN, **klass_settings(model, conf_bar, kl_bar))
    for i, row in enumerate(PROMPTS[family]):
        assert torch.equal(eb[i, -GEN:], eb_reference(model, row, 1.0)[0][0, -GEN:])
        want = klass_reference(model, row, conf_bar, kl_bar)[0]
        assert torch.equal(kl[i, -GEN:], want[0, -GEN:])


def test_klass_refuses_a_cache_that_does_not_feed_its_history(llada):
    with pytest.raises(ValueError, match=r"^KLASS needs .* use cache='none' \(Dream: --block-length 0 too\)$") as e:
        generate(llada, torch.tensor([PROMPTS["llada"][0]]), gen_length=GEN, block_length=BLOCK, cache="dual",
                 select=KLASS())
    assert "\n" not in str(e.value)


def test_klass_refuses_dream_by_blocks(dream):
    """Dream's official KLASS decodes the whole answer as one block."""
    with pytest.raises(ValueError, match=r"^KLASS .* on Dream as one block .*\(Dream: --block-length 0 too\)$"):
        generate(dream, torch.tensor([PROMPTS["dream"][0]]), gen_length=GEN, block_length=BLOCK, cache="none",
                 **hooks(0.9, 0.01, 2, dream.config))


def run_example(name, *args):
    """The fork's program as a user runs it: its __main__ (tests/bounded.py run_main, in this process:
    test_fork_programs runs each program in a process of its own)."""
    return bounded.run_main(os.path.join(ROOT, "examples", name), ["--no-stream", *args])


DEMO = ["--model", os.path.join(ROOT, "demo", "llada-arith"), "--gen-length", "32", "--block-length", "8",
        "--prompt", "Tom has 23 apples and buys 45 more. How many apples does he have?"]


@pytest.mark.parametrize("name,flags", [("eb_sampler.py", ("--gamma", "0.01")), ("klass.py", ("--kl", "0.01"))])
def test_example_answers_on_the_demo_model(name, flags):
    code, out, err = run_example(name, *DEMO, *flags)
    assert code == 0, err
    answer, stats = out.strip().splitlines()[-2:]
    assert answer.endswith("The answer is 68.") and stats.startswith("NFE ")


def test_klass_program_on_dream_is_the_official_whole_canvas(dream, tmp_path):
    """python examples/klass.py --model <a Dream checkpoint> --block-length 0 --cache none: the Dream rule built from
    the checkpoint's config decodes as the reference (the answer's words and the calls); by blocks, one refusal line."""
    folder = copy_checkpoint("dream-tiny", tmp_path)
    write_tokenizer(folder, {1023: "<|mask|>", 1000: "<|endoftext|>"})
    row = PROMPTS["dream"][0]
    model = ["--model", folder, "--no-chat", "--gen-length", str(GEN), "--prompt", " ".join(f"w{t}" for t in row)]
    code, out, err = run_example("klass.py", *model, "--block-length", "0", "--cache", "none")
    assert code == 0, err
    want, calls = klass_reference(dream, row, 0.9, 0.01)
    answer = want[0, len(row):].tolist()
    answer = answer[:answer.index(1000)] if 1000 in answer else answer
    words, stats = out.strip().splitlines()[-2:]
    assert words == " ".join(f"w{t}" for t in answer) and stats.startswith(f"NFE {calls} ")
    code, out, err = run_example("klass.py", *model, "--block-length", "8")
    assert code == 2 and err.splitlines()[-1] == ("error: KLASS needs the logits of [10, 42) at every step, on Dream "
                                                  "as one block (this call fed (0, 42) for [10, 18)): use "
                                                  "cache='none' (Dream: --block-length 0 too)")


@pytest.mark.parametrize("run", read_golden("ties-golden.json")["klass_runs"],
                         ids=lambda r: f"s{r['kwargs']['steps']}-c{r['kwargs']['conf_threshold']}-x{r['head_scale']:g}")
def test_klass_ties_break_as_the_official_code_breaks_them(run):
    """The official KLASS (shkim0116/KLASS src/model/llada_klass.py) on the golden LLaDA with its LM head scaled up
    (tests/golden/ties-golden.json): confidences saturate to exactly 1.0, and the fallback's `topk` over the canvas
    decides which of the equals a step commits."""
    model = load_model(os.path.join(GOLDEN, "llada-tiny"), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(run["head_scale"])
    kw = run["kwargs"]
    got, st = generate(model, torch.tensor([run["prompt"]]), gen_length=kw["gen_length"], block_length=kw["block_length"],
                       steps=kw["steps"], **hooks(kw["conf_threshold"], kw["kl_threshold"], 2, model.config))
    assert got.tolist() == run["output"] and st["nfe"] == run["nfe"]
