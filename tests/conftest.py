"""Shared fixtures: the golden checkpoints and outputs of the official code (copied from shared/spec/golden),
loaded once per session, and a helper that gives a checkpoint folder a tiny word-level tokenizer."""
import json
import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))      # the server, the lm-eval model, the benchmark

from model import load_model  # noqa: E402

# The test models are tiny: on small shared CPUs OpenMP's thread hand-off costs more than the math (measured
# 20x slower per matmul with 2 threads than with 1 on our 2-core CI VM), so the suite runs single-threaded,
# and so do the CLI subprocesses it starts (OMP_NUM_THREADS in their environment).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def read_golden(name: str):
    with open(os.path.join(GOLDEN, name)) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def llada_golden():
    return read_golden("llada-golden.json")


@pytest.fixture(scope="session")
def dream_golden():
    return read_golden("dream-golden.json")


@pytest.fixture(scope="session")
def flashdlm_golden():
    return read_golden("flashdlm-golden.json")


@pytest.fixture(scope="session")
def qwen2():
    """The causal guide checkpoint (Qwen2.5-1.5B-Instruct layout), the same ids as dream-tiny."""
    return load_model(os.path.join(GOLDEN, "qwen2-tiny"), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def llada():
    return load_model(os.path.join(GOLDEN, "llada-tiny"), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def dream():
    return load_model(os.path.join(GOLDEN, "dream-tiny"), device="cpu", dtype=torch.float32)


def copy_checkpoint(name: str, dest) -> str:
    """A writable copy of a golden checkpoint folder (tests never modify tests/golden)."""
    out = os.path.join(str(dest), name)
    shutil.copytree(os.path.join(GOLDEN, name), out)
    return out


def write_tokenizer(model_dir: str, specials: dict[int, str]):
    """A word-level tokenizer.json over the config's vocab: token i is "w{i}", except `specials`, which are
    registered as special tokens at the checkpoint's own ids (mask, eos, ...). Id 0 must not be special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    n = cfg.get("embedding_size") or cfg["vocab_size"]
    vocab = {specials.get(i, f"w{i}"): i for i in range(n)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))   # unknown words -> id 0, never a special
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()   # joins words with spaces
    tok.add_special_tokens(list(specials.values()))
    tok.save(os.path.join(model_dir, "tokenizer.json"))


@pytest.fixture
def without_torchao(monkeypatch):
    """torchao made unimportable, as where it is not installed: None in sys.modules for it and every submodule
    already imported (`import` then raises ImportError)."""
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)
