"""
The demo model we ship (demo/llada-arith, trained by demo/train.py) must load like a real LLaDA checkpoint
and must show the method: threshold decoding at 0.9 keeps the worked solutions right with a fraction of the
model calls. Its guide (demo/qwen2-arith, train.py --guide) must load like a real Qwen2 checkpoint, share the
demo model's token ids, and solve the task on its own. CPU only, no network, seconds.
"""
import os
import sys

import pytest
import torch
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo")
sys.path.insert(0, ROOT)
sys.path.insert(0, DEMO)
import eval as demo_eval   # demo/eval.py
import train as demo_train  # demo/train.py
from fastdllm import generate
from guided import Guide, accept_drafts, check_guide
from model import load_model

SHIPPED = os.path.join(DEMO, "llada-arith")
GUIDE = os.path.join(DEMO, "qwen2-arith")


@pytest.fixture(scope="module")
def shipped():
    model = load_model(SHIPPED, device="cpu", dtype=torch.float32)
    return model, Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))


def test_shipped_model_loads(shipped):
    model, tok = shipped
    cfg = model.config
    assert cfg.family == "llada" and cfg.mask_id == tok.get_vocab_size() - 1 and cfg.eos_id == 0
    assert tok.id_to_token(cfg.eos_id) == "<|endoftext|>"
    # The CLI's path: raw prompt, no specials; digits are single tokens and decode back into numbers.
    ids = tok.encode("Tom has 23 apples and buys 45 more.", add_special_tokens=False).ids
    assert tok.id_to_token(ids[2]) == "2" and tok.decode(ids + [0], skip_special_tokens=True).endswith("45 more.")


def test_threshold_keeps_accuracy_with_few_steps(shipped):
    """Fast-dLLM's claim on our model: tau 0.9 + DualCache is as right as one token per step, in <= 1/3 NFE."""
    model, tok = shipped
    problems = demo_train.heldout(50)
    base, base_nfe, _ = demo_eval.solve(model, tok, problems, gen_length=32, block_length=8, steps=32, cache="none")
    fast, fast_nfe, _ = demo_eval.solve(model, tok, problems, gen_length=32, block_length=8, steps=32,
                                        cache="dual", threshold=0.9)
    valid = lambda answers: sum(demo_eval.is_valid(a, k) for a, (_, _, k) in zip(answers, problems)) / len(problems)
    acc_base, acc_fast = valid(base), valid(fast)
    assert base_nfe.mean() == 32
    assert acc_fast >= 0.9, f"tau 0.9 dual: valid {acc_fast:.2f} < 0.9; answers: {fast[:3]}"
    assert acc_fast >= acc_base - 0.02, f"tau 0.9 dual {acc_fast:.2f} vs one token per step {acc_base:.2f}"
    assert fast_nfe.mean() <= base_nfe.mean() / 3, f"tau 0.9 mean NFE {fast_nfe.mean():.1f}, want <= 32/3"


def test_heldout_never_trained_on():
    """The held-out (template, a, b) triples are filtered out of training, and the filter is needed."""
    import random
    held = {k for _, _, k in demo_train.heldout()}
    assert len(held) == 500
    rng = random.Random(0)
    plain = {demo_train.problem(rng)[2] for _ in range(5000)}
    trained = {k for _, _, k in demo_train.training_problems(random.Random(0), 5000, held)}
    assert plain & held and not trained & held


def test_validity_metric():
    key = (0, 23, 45)   # "... has 23 ... buys 45 more"
    assert demo_eval.is_valid("23 + 45 = 68. The answer is 68.", key)
    assert demo_eval.is_valid("45 + 23 = 68. The answer is 68.", key)
    assert not demo_eval.is_valid("23 + 23 = 68. The answer is 68.", key)    # a number used twice
    assert not demo_eval.is_valid("23 + 45 = 69. The answer is 68.", key)    # wrong arithmetic
    assert not demo_eval.is_valid("23 + 45 = 68. The answer is 69.", key)    # wrong final answer
    assert demo_eval.is_valid("18 + 23 = 41. The answer is 23.", (2, 41, 18))  # counting up, subtraction


def test_train_smoke(tmp_path):
    out = str(tmp_path / "m")
    demo_train.main(["--smoke", "--out", out, "--threads", "1"])
    model = load_model(out, device="cpu")
    # What makes smoke mode quick, by value rather than by the clock: the tiny config, not the demo's.
    assert (model.config.dim, model.config.n_layers) == (32, 2)
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    prompt = torch.tensor([tok.encode(demo_train.heldout(1)[0][0], add_special_tokens=False).ids])
    x, stats = generate(model, prompt, gen_length=32, block_length=8, steps=32, cache="dual", threshold=0.9)
    assert x.shape == (1, prompt.shape[1] + 32) and not (x == model.config.mask_id).any()
    assert 1 <= stats["nfe"] <= 32


def test_shipped_guide_loads_and_shares_the_ids(shipped):
    model, tok = shipped
    guide = load_model(GUIDE, device="cpu", dtype=torch.float32)
    guide_tok = Tokenizer.from_file(os.path.join(GUIDE, "tokenizer.json"))
    cfg = guide.config
    assert cfg.family == "qwen2" and cfg.causal and cfg.tie_embeddings and guide.lm_head.weight is guide.embed.weight
    assert cfg.vocab_size == model.config.vocab_size and cfg.eos_id == model.config.eos_id == 0
    assert cfg.bos_id == tok.token_to_id("<|startoftext|>")
    check_guide(model.config, cfg, tok, guide_tok)
    with open(os.path.join(SHIPPED, "tokenizer.json"), "rb") as a, open(os.path.join(GUIDE, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()
    assert os.path.getsize(os.path.join(GUIDE, "model.safetensors")) < 4e6     # a few MB, bf16


def test_shipped_guide_solves_the_task_alone():
    """The guide's own greedy answers are mostly right: a guide that cannot do the task cannot judge drafts."""
    guide = load_model(GUIDE, device="cpu", dtype=torch.float32)
    problems = demo_train.heldout(100)
    answers = demo_eval.guide_greedy(guide, Tokenizer.from_file(os.path.join(GUIDE, "tokenizer.json")), problems)
    valid = sum(demo_eval.is_valid(a, k) for a, (_, _, k) in zip(answers, problems)) / len(problems)
    assert valid >= 0.9, f"guide greedy valid {valid:.2f}; answers: {answers[:3]}"


def test_train_smoke_guide(tmp_path):
    out = str(tmp_path / "g")
    demo_train.main(["--guide", "--smoke", "--out", out, "--threads", "1"])
    guide = load_model(out, device="cpu")
    assert (guide.config.dim, guide.config.n_layers) == (32, 2)        # the tiny smoke config (see above)
    assert guide.config.family == "qwen2" and guide.config.n_kv_heads < guide.config.n_heads   # GQA, as Qwen2.5
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    prompt = torch.tensor(tok.encode(demo_train.heldout(1)[0][0], add_special_tokens=False).ids)
    g = Guide(guide, 1, len(prompt) + 3)
    assert g.prefill(prompt[None]) == 1
    n, _, calls = g.verify(torch.cat([prompt, torch.tensor([5, 6, 7])])[None], accept_drafts, chunk=2)
    assert 0 <= n <= 3 and calls == (1 if n < 2 else 2)


def test_guided_decoding_keeps_accuracy_where_threshold_0_5_breaks(shipped):
    """FlashDLM's claim on our demo pair: guided decoding (deterministic acceptance) stays as right as one
    token per step with far fewer diffusion calls, where threshold 0.5 breaks (README demo table: 0.14).
    Bounds below the measured values on these 50 problems (this session: prefix valid 1.00, FreeCache 0.88,
    whose tokens committed several at a time stay frozen with the keys they had as masks; mean NFE 2.0)."""
    model, tok = shipped
    guide = load_model(GUIDE, device="cpu", dtype=torch.float32)
    problems = demo_train.heldout(50)
    valid = lambda answers: sum(demo_eval.is_valid(a, k) for a, (_, _, k) in zip(answers, problems)) / len(problems)
    for cache, bound in (("prefix", 0.9), ("free", 0.8)):
        answers, nfe, calls, _ = demo_eval.solve_guided(model, guide, tok, problems, cache=cache)
        assert valid(answers) >= bound, f"guided {cache}: valid {valid(answers):.2f}; answers: {answers[:3]}"
        assert nfe <= 4 and calls <= nfe + 2, (nfe, calls)
    loose, _, _ = demo_eval.solve(model, tok, problems, gen_length=32, block_length=8, steps=32, cache="dual",
                                  threshold=0.5)
    assert valid(loose) < 0.5         # the failure guidance fixes is real on this model
