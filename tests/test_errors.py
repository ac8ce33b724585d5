"""
Issue 5: every bad input ends in one line that names the problem and the fix. The Python API
(`load_model`, `generate`) raises ValueError or FileNotFoundError; the CLI prints `error: ...` on stderr and
exits with status 2, never a traceback. Also: seeded sampling is reproducible and never touches torch's
global RNG, no code path can unpickle anything, and Ctrl-C during a generation prints the partial answer.

The CLI cases run as real subprocesses, all at once (a torch import costs ~3 s each), from one fixture.
"""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import tokenize

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import GOLDEN, ROOT, write_tokenizer
import fastdllm
from chat import Chat
from fastdllm import generate
from model import load_model

SPECIALS = {"llada-tiny": {1000: "<|mdm_mask|>", 1022: "<|endoftext|>"},
            "dream-tiny": {1023: "<|mask|>", 1000: "<|endoftext|>"}}
SHARD, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"   # llada-tiny's shards
PROMPT = torch.tensor([[5, 6, 7, 8]])


def checkpoint(tmp_path, name="llada-tiny", tokenizer=False) -> str:
    """A writable copy of a golden checkpoint (file by file: the golden files may be read-only)."""
    d = os.path.join(str(tmp_path), name)
    os.makedirs(d)
    for f in os.listdir(os.path.join(GOLDEN, name)):
        shutil.copyfile(os.path.join(GOLDEN, name, f), os.path.join(d, f))
    if tokenizer:
        write_tokenizer(d, SPECIALS[name])
    return d


def edit_config(d, **changes):
    """Set config.json fields; a value of ... deletes the field."""
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        cfg.pop(k) if v is ... else cfg.update({k: v})
    with open(path, "w") as f:
        json.dump(cfg, f)
    return d


def edit_shard(d, edit):
    path = os.path.join(d, SHARD)
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})
    return d


def read(d, name) -> bytes:
    with open(os.path.join(d, name), "rb") as f:
        return f.read()


def rewrite_bytes(d, edit, name=SHARD):
    data = edit(read(d, name))
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    return d


def remove(d, *names):
    for n in names:
        os.remove(os.path.join(d, n))
    return d


def make_folder(d, name):
    """A folder where a file should be."""
    path = os.path.join(d, name)
    if os.path.exists(path):
        os.remove(path)
    os.mkdir(path)
    return d


def deny(monkeypatch, path):
    """Make `path` unreadable as os.access sees it: the tests run as root, which chmod does not stop."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **kw: os.fspath(p) != path and real(p, mode, *a, **kw))


def one_line(e) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    return msg


# ---------------------------------------------------------------------------------- model files (API)

FIRST = "model.transformer.blocks.0.attn_norm.weight"      # the first tensor of SHARD
CORRUPT = rf"^{SHARD} is not a readable safetensors file \(.+\): it is truncated or corrupt, re-download it$"
FILE_CASES = {
    # name: (turn a good copy into the bad input, the exception, what its message must say)
    "folder missing": (lambda d: d + "-nope", FileNotFoundError,
                       r"model folder .*-nope' not found: pass an existing folder"),
    "a file, not a folder": (lambda d: os.path.join(d, "config.json"), FileNotFoundError,
                             r"is a file: pass the model folder"),
    "folder is not a model": (lambda d: remove(d, *os.listdir(d)), FileNotFoundError,
                              r"config\.json is missing: .* is not a Hugging Face model folder"),
    "config.json missing": (lambda d: remove(d, "config.json"), FileNotFoundError,
                            r"config\.json is missing"),
    "config.json not JSON": (lambda d: rewrite_bytes(d, lambda b: b[:40], "config.json"), ValueError,
                             r"config\.json is not valid JSON .*re-download"),
    "config.json binary": (lambda d: rewrite_bytes(d, lambda b: b"\xff\xfe\x00" + b, "config.json"), ValueError,
                           r"config\.json is not valid JSON"),
    "config.json a list": (lambda d: rewrite_bytes(d, lambda b: b"[1, 2]", "config.json"), ValueError,
                           r"config\.json is not a config object"),
    "unknown model_type": (lambda d: edit_config(d, model_type="llama"), ValueError,
                           r"unknown model_type 'llama' in config\.json: fastdllm runs LLaDA"),
    "no model_type": (lambda d: edit_config(d, model_type=...), ValueError,
                      r"unknown model_type None"),
    "config field missing": (lambda d: edit_config(d, d_model=...), ValueError,
                             r"config\.json lacks the field 'd_model'"),
    "config field not an int": (lambda d: edit_config(d, n_layers="2"), ValueError,
                                r"n_layers = '2', not a positive integer"),
    "config field null": (lambda d: edit_config(d, d_model=None), ValueError,
                          r"dim = None, not a positive integer"),
    "heads do not divide": (lambda d: edit_config(d, n_heads=5), ValueError,
                            r"width of 32 does not split into 5 heads"),
    "mask id outside vocab": (lambda d: edit_config(d, mask_token_id=5000), ValueError,
                              r"mask_token_id 5000 is not a token id below 1024"),
    "eos_token_id a string": (lambda d: edit_config(d, eos_token_id="</s>"), ValueError,
                              r"eos_token_id '</s>' is not a token id or a list of them"),
    "rope_theta a string": (lambda d: edit_config(d, rope_theta="500000"), ValueError,
                            r"gives rope_theta = '500000', not a positive number: re-download"),
    "rope_theta null": (lambda d: edit_config(d, rope_theta=None), ValueError, r"rope_theta = None, not a positive"),
    "rope_theta 0": (lambda d: edit_config(d, rope_theta=0), ValueError, r"rope_theta = 0, not a positive number"),
    "rope_theta negative": (lambda d: edit_config(d, rope_theta=-10000.0), ValueError, r"rope_theta = -10000\.0, not"),
    "rms_norm_eps a string": (lambda d: edit_config(d, rms_norm_eps="1e-5"), ValueError,
                              r"gives rms_norm_eps = '1e-5', not a positive number"),
    "rms_norm_eps null": (lambda d: edit_config(d, rms_norm_eps=None), ValueError, r"rms_norm_eps = None, not"),
    "config.json a folder": (lambda d: make_folder(d, "config.json"), ValueError,
                             r"config\.json is a folder, not a file"),
    "shard named in index missing": (lambda d: remove(d, SHARD2), FileNotFoundError,
                                     rf"shard {SHARD2} named in .*index\.json is missing"),
    "shard a folder": (lambda d: make_folder(d, SHARD), ValueError, rf"{SHARD} is a folder, not a file"),
    "no safetensors at all": (lambda d: remove(d, SHARD, SHARD2, "model.safetensors.index.json"), FileNotFoundError,
                              r"no model\.safetensors or model\.safetensors\.index\.json"),
    "index without weight_map": (lambda d: rewrite_bytes(d, lambda b: b"{}", "model.safetensors.index.json"),
                                 ValueError, r"not a valid safetensors index"),
    # safetensors raises SafetensorError, in order: "incomplete metadata, file not fully covered" (twice),
    # "header too small", "invalid UTF-8 in header", "invalid JSON in header", "header too large".
    "shard truncated": (lambda d: rewrite_bytes(d, lambda b: b[:len(b) // 2]), ValueError, CORRUPT),
    "shard truncated by 10 bytes": (lambda d: rewrite_bytes(d, lambda b: b[:-10]), ValueError, CORRUPT),
    "shard cut to 4 bytes": (lambda d: rewrite_bytes(d, lambda b: b[:4]), ValueError, CORRUPT),
    "shard header binary garbage": (lambda d: rewrite_bytes(d, lambda b: b[:8] + b"\xff" * 64 + b[72:]),
                                    ValueError, CORRUPT),
    "shard header text garbage": (lambda d: rewrite_bytes(d, lambda b: b[:8] + b"garbage!" * 8 + b[72:]),
                                  ValueError, CORRUPT),
    "shard header length garbage": (lambda d: rewrite_bytes(d, lambda b: b"\xff" * 8 + b[8:]), ValueError, CORRUPT),
    "tensor missing": (lambda d: edit_shard(d, lambda s: s.pop(FIRST)), ValueError,
                       rf"tensor '{FIRST}' is missing from the checkpoint"),
    "tensor unexpected": (lambda d: edit_shard(d, lambda s: s.update({"lm_head.weight": torch.zeros(2)})),
                          ValueError, rf"unexpected tensor 'lm_head\.weight' in {SHARD}"),
    "tensor wrong shape": (lambda d: edit_shard(d, lambda s: s.update({FIRST: torch.zeros(3, 3)})), ValueError,
                           rf"tensor '{FIRST}' has shape \(3, 3\), config\.json implies \(32,\)"),
    "tensor not float": (lambda d: edit_shard(d, lambda s: s.update({FIRST: s[FIRST].long()})), ValueError,
                         rf"tensor '{FIRST}' has dtype torch\.int64, not a float"),
    "tensor stored twice": (lambda d: rewrite_bytes(d, lambda b: read(d, SHARD), SHARD2), ValueError,
                            rf"tensor '{FIRST}' is stored twice \(again in {SHARD2}\)"),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_bad_model_files(tmp_path, case):
    make, exc, pattern = FILE_CASES[case]
    path = make(checkpoint(tmp_path))
    with pytest.raises(exc) as e:
        load_model(path, device="cpu")
    assert re.search(pattern, one_line(e)), str(e.value)


def test_eos_token_id_list_keeps_every_id(tmp_path):
    """Real configs list several end-of-text ids (Qwen2.5's generation config lists two): all are kept."""
    cfg = load_model(edit_config(checkpoint(tmp_path), eos_token_id=[1022, 7]), device="cpu").config
    assert cfg.eos_id == 1022 and cfg.eos_ids == (1022, 7)


@pytest.mark.parametrize("name,pattern", [
    ("", r"cannot read the model folder .*llada-tiny: permission denied; fix its permissions \(chmod a\+rx\)"),
    ("config.json", r"cannot read .*config\.json: permission denied; fix its permissions \(chmod a\+r\)"),
    ("model.safetensors.index.json", r"cannot read .*index\.json: permission denied"),
    (SHARD2, rf"cannot read .*{SHARD2}: permission denied"),
])
def test_unreadable_files_are_not_called_missing(tmp_path, monkeypatch, name, pattern):
    d = checkpoint(tmp_path)
    deny(monkeypatch, os.path.join(d, name) if name else d)
    with pytest.raises(ValueError) as e:
        load_model(d, device="cpu")
    assert re.search(pattern, one_line(e)), str(e.value)


@pytest.mark.parametrize("kw,pattern", [
    (dict(name_or_path=None), r"the model must be a folder path or a Hugging Face repo id .*, not None"),
    (dict(dtype="bfloat16"), r"dtype 'bfloat16' is not a torch float dtype: pass torch\.float32, torch\.bfloat16"),
    (dict(dtype=torch.int8), r"dtype torch\.int8 is not a torch float dtype"),
])
def test_bad_load_arguments(kw, pattern):
    with pytest.raises(ValueError) as e:
        load_model(**{"name_or_path": os.path.join(GOLDEN, "llada-tiny"), "device": "cpu", **kw})
    assert re.search(pattern, one_line(e)), str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps", "bogus"])
def test_unavailable_device(device):
    with pytest.raises(ValueError) as e:
        load_model(os.path.join(GOLDEN, "llada-tiny"), device=device)
    assert re.search(rf"device '{device}' is not available here: use 'cpu'", one_line(e))


# ---------------------------------------------------------------------------------- arguments (API)

ARG_CASES = {
    "gen_length not a multiple of block_length": (dict(gen_length=10, block_length=4),
        r"gen_length 10 is not a multiple of block_length 4: pick a block_length that divides it, e.g. 2"),
    "steps not divisible by blocks": (dict(gen_length=8, block_length=4, steps=3),
        r"steps 3 is not divisible by the number of blocks 2 .*use a multiple"),
    "steps 0": (dict(steps=0), r"steps must be >= 1 \(got 0\)"),
    "steps negative": (dict(steps=-4), r"steps must be >= 1 \(got -4\)"),
    "gen_length 0": (dict(gen_length=0), r"gen_length \(0\) and block_length \(4\) must be positive"),
    "block_length negative": (dict(block_length=-4), r"must be positive"),
    "threshold 0": (dict(threshold=0.0),
        r"threshold must be in \(0, 1\] \(got 0\.0\); above 1 means one token per step"),
    "threshold negative": (dict(threshold=-0.5), r"threshold must be in \(0, 1\]"),
    "factor 0": (dict(factor=0.0), r"factor must be > 0 \(got 0\.0\)"),
    "factor negative": (dict(factor=-1.0), r"factor must be > 0"),
    "threshold and factor": (dict(threshold=0.9, factor=1.0), r"pass threshold or factor, not both"),
    "temperature negative": (dict(temperature=-0.1), r"temperature must be >= 0 \(got -0\.1\); 0 is greedy"),
    "unknown cache": (dict(cache="full"), r"unknown cache mode 'full': use one of none, prefix, dual, free$"),
    "unknown remasking": (dict(remasking="entropy"),
        r"unknown remasking 'entropy' for llada: use one of low_confidence, random"),
    "Dream option on LLaDA": (dict(top_p=0.9), r"top_p, top_k and alg_temp are Dream options"),
    "prompt + gen_length too long": (dict(gen_length=4096, block_length=32),
        r"prompt \(4 tokens\) \+ gen_length \(4096\) exceeds the model's 4096 positions: shorten"),
    # Wrong types: the same one line, not a TypeError (or AttributeError) from inside the loop.
    "gen_length a float": (dict(gen_length=8.0), r"gen_length must be an integer \(got 8\.0\)"),
    "block_length a string": (dict(block_length="4"), r"block_length must be an integer \(got '4'\)"),
    "steps a float": (dict(steps=8.0), r"steps must be an integer \(got 8\.0\)"),
    "threshold a string": (dict(threshold="0.9"), r"threshold must be a number or None \(got '0\.9'\)"),
    "temperature None": (dict(temperature=None), r"temperature must be a number \(got None\)"),
    "generator a string": (dict(generator="cpu"), r"generator must be a torch\.Generator, not 'cpu': e\.g\."),
    "eps 0": (dict(eps=0.0), r"eps must be in \(0, 1\) \(got 0\.0\)"),
    "eps 1": (dict(eps=1.0), r"eps must be in \(0, 1\) \(got 1\.0\)"),
}


DREAM_CASES = {
    "unknown remasking": (dict(remasking="low_confidence", block_length=None),
        r"unknown remasking 'low_confidence' for dream: use one of origin"),
    "cache without blocks": (dict(cache="dual", block_length=None),
        r"whole-canvas sampler \(block_length=None\) has no cache"),
    "one step per block": (dict(steps=2), r"needs >= 2 steps per block \(got 1\): raise steps to at least 4"),
    "top_p 0": (dict(top_p=0.0), r"top_p must be in \(0, 1\] \(got 0\.0\)"),
    "top_k 0": (dict(top_k=0), r"top_k must be >= 1"),
    "top_k a float": (dict(top_k=2.5), r"top_k must be an integer or None \(got 2\.5\)"),
    "attention_mask of the wrong shape": (dict(attention_mask=torch.ones(1, 3)),
        r"attention_mask must be a tensor of the prompt's shape \(1, 4\) \(1 = token, 0 = pad\), not .*3"),
    "attention_mask a list": (dict(attention_mask=[[1, 1, 1, 1]]), r"attention_mask must be a tensor .*not list"),
    "attention_mask all zeros": (dict(attention_mask=torch.zeros(1, 4)),
        r"attention_mask has a row of zeros: every prompt needs at least one real token"),
}


@pytest.mark.parametrize("family,case", [("llada", c) for c in ARG_CASES] + [("dream", c) for c in DREAM_CASES])
def test_bad_arguments(request, family, case):
    model = request.getfixturevalue(family)
    kw, pattern = (ARG_CASES if family == "llada" else DREAM_CASES)[case]
    with pytest.raises(ValueError) as e:
        generate(model, PROMPT, **{"gen_length": 8, "block_length": 4, **kw})
    assert re.search(pattern, one_line(e)), str(e.value)


def test_threshold_above_one_is_allowed_and_means_one_token_per_step(llada):
    out, stats = generate(llada, PROMPT, gen_length=8, block_length=4, threshold=1.5)
    assert stats["nfe"] == 8 and not (out == llada.config.mask_id).any()


@pytest.mark.parametrize("prompt,pattern", [
    (torch.zeros(1, 0, dtype=torch.long), r"the prompt is empty: pass at least one token"),
    (torch.tensor([[5, 1000, 6]]), r"the prompt contains the mask token id 1000: masks are reserved for the answer"),
])
def test_bad_prompts(llada, prompt, pattern):
    with pytest.raises(ValueError) as e:
        generate(llada, prompt, gen_length=8, block_length=4)
    assert re.search(pattern, one_line(e))


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("prompt,pattern", [
    ([[5, 6, 7]], r"the prompt must be a torch\.Tensor of token ids, not a list: e\.g\. torch\.tensor\(\[ids\]\)"),
    (torch.zeros(0, 4, dtype=torch.long), r"the prompt batch has 0 rows: pass at least one prompt"),
    (PROMPT.int(), r"integer token ids of dtype torch\.long, not torch\.int32 .*prompt\.long\(\)"),
    (PROMPT.to(torch.uint8), r"integer token ids of dtype torch\.long, not torch\.uint8"),
    (PROMPT[0], r"a \(batch, length\) tensor .* of shape \(4,\)"),
], ids=["a list", "0 rows", "int32", "uint8", "1-D"])
def test_bad_prompt_types(request, family, prompt, pattern):
    with pytest.raises(ValueError) as e:
        generate(request.getfixturevalue(family), prompt, gen_length=8, block_length=4)
    assert re.search(pattern, one_line(e)), str(e.value)


# NaN settings (NaN > 0 is False, so a plain `<= 0` check let them through) and malformed prompts.
@pytest.mark.parametrize("kw,prompt,pattern", [
    (dict(threshold=float("nan")), PROMPT, r"threshold must be in \(0, 1\]"),
    (dict(temperature=float("nan")), PROMPT, r"temperature must be >= 0"),
    (dict(), torch.tensor([[5, 5000]]), r"token id .*outside the vocabulary"),
    (dict(), torch.tensor([[-1, 5]]), r"token id .*outside the vocabulary"),
    (dict(), torch.tensor([[1.0, 2.0]]), r"integer token ids"),
])
def test_nan_settings_and_malformed_prompts(llada, kw, prompt, pattern):
    with pytest.raises(ValueError) as e:
        generate(llada, prompt, gen_length=8, block_length=4, **kw)
    assert re.search(pattern, one_line(e))


def test_corrupt_tokenizer_json(tmp_path, llada):
    d = rewrite_bytes(checkpoint(tmp_path, tokenizer=True), lambda b: b[:100], "tokenizer.json")
    with pytest.raises(ValueError) as e:
        Chat(d, llada.config)
    assert re.search(r"tokenizer\.json is not a readable tokenizer\.json .*re-download it", one_line(e))


def test_unreadable_tokenizer_json_is_not_called_missing(tmp_path, monkeypatch):
    d = checkpoint(tmp_path, tokenizer=True)
    deny(monkeypatch, os.path.join(d, "tokenizer.json"))
    with pytest.raises(ValueError) as e:
        fastdllm.main(["--model", d, "--prompt", "w5", "--gen-length", "8", "--block-length", "8"])
    assert re.search(r"cannot read .*tokenizer\.json: permission denied", one_line(e)), str(e.value)


def test_interactive_ends_on_ctrl_d(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))      # input() sees the end of input at once
    d = checkpoint(tmp_path, tokenizer=True)
    assert fastdllm.main(["--model", d, "--interactive", "--gen-length", "8", "--block-length", "8"]) is None


# ---------------------------------------------------------------------------------- reproducibility

def runs(model, seeds, **kw):
    return [generate(model, PROMPT, generator=torch.Generator().manual_seed(s), temperature=1.0, **kw)[0]
            for s in seeds]


@pytest.mark.parametrize("family,kw", [
    ("llada", dict(gen_length=16, block_length=8)),
    ("llada", dict(gen_length=16, block_length=8, remasking="random", cache="dual", threshold=0.9)),
    ("dream", dict(gen_length=16, block_length=None, steps=16)),
    ("dream", dict(gen_length=16, block_length=None, steps=16, remasking="origin")),
    ("dream", dict(gen_length=16, block_length=8, steps=16)),
    ("dream", dict(gen_length=16, block_length=8, cache="dual", threshold=0.9)),
])
def test_same_seed_same_output(llada, dream, family, kw):
    model = llada if family == "llada" else dream
    a, b, *others = runs(model, [0, 0, 1, 2, 3], **kw)
    assert torch.equal(a, b)
    assert any(not torch.equal(a, o) for o in others), "the seed changes nothing: is the generator used?"


@pytest.mark.parametrize("family,kw", [
    ("llada", dict(remasking="random")),
    ("dream", dict(block_length=None, steps=16, remasking="origin")),
    ("dream", dict(block_length=None, steps=16, alg_temp=0.5, top_p=0.9, top_k=50)),
    ("dream", dict(block_length=8, steps=16)),
])
def test_generate_never_touches_the_global_rng(llada, dream, family, kw):
    model = llada if family == "llada" else dream
    torch.manual_seed(0)
    a = torch.rand(3)
    torch.manual_seed(0)
    generate(model, PROMPT, **{"gen_length": 16, "block_length": 8, "temperature": 1.0, **kw})  # default generator
    generate(model, PROMPT, generator=torch.Generator().manual_seed(5), **{"gen_length": 16, "block_length": 8,
                                                                           "temperature": 1.0, **kw})
    assert torch.equal(a, torch.rand(3))


# ---------------------------------------------------------------------------------- safety

def test_no_pickle_anywhere():
    """Weights come from safetensors only: no torch.load, no pickle, no remote code, in any code line
    (comments and strings do not count) of any .py outside tests/."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("tests", "__pycache__")]
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                toks = [t for t in tokenize.tokenize(f.readline) if t.type in (tokenize.NAME, tokenize.OP)]
            words = [t.string for t in toks]
            for i, t in enumerate(toks):
                if t.string in ("pickle", "cPickle", "dill", "joblib", "trust_remote_code") or \
                        words[i:i + 3] == ["torch", ".", "load"]:
                    found.append(f"{os.path.relpath(path, ROOT)}:{t.start[0]}: {t.line.strip()}")
    assert not found, "unsafe deserialisation:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------- the CLI

def cli_cases(tmp):
    """name: (argv, the pattern of the one error line, run with stdin closed)."""
    ok = checkpoint(tmp / "ok", tokenizer=True)
    truncated = rewrite_bytes(checkpoint(tmp / "trunc", tokenizer=True), lambda b: b[:len(b) // 2])
    no_tok = checkpoint(tmp / "notok")
    run = ["--prompt", "w5 w6 w7", "--gen-length", "16", "--block-length", "8"]
    return {
        # Three that need a real process: argv bytes, a closed stdin, the environment.
        "prompt not UTF-8": ([*run, "--model", ok, "--prompt", b"w5 \xff w6"], r"the prompt is not valid UTF-8 text"),
        "stdin closed": (["--model", ok, "--interactive"], r"--interactive reads questions from stdin, which is "
                         r"closed: run it in a terminal or pipe the questions in", True),
        "repo id not cached, offline": (["--model", "nobody/no-such-model", *run],
                                        r"'nobody/no-such-model' is not in the local Hugging Face cache and offline "
                                        r"mode is on \(HF_HUB_OFFLINE is set\)"),
        "folder missing": ([*run, "--model", str(tmp / "nope")], r"model folder .*nope' not found"),
        "--device cuda without CUDA": ([*run, "--model", ok, "--device", "cuda"],
                                       r"--device cuda was asked for but CUDA is not available here: use --device cpu"),
        "--dtype float16 on CPU": ([*run, "--model", ok, "--device", "cpu", "--dtype", "float16"],
                                   r"--dtype float16 is not supported on CPU: use float32"),
        "truncated shard": ([*run, "--model", truncated], r"is not a readable safetensors file .*re-download it"),
        "tokenizer.json missing": ([*run, "--model", no_tok], r"tokenizer\.json is missing: the CLI needs"),
        "mask token in prompt": ([*run, "--model", ok, "--prompt", "w5 <|mdm_mask|> w6"],
                                 r"the prompt contains the mask token id 1000"),
        "empty prompt": ([*run, "--model", ok, "--no-chat", "--prompt", " "], r"the prompt is empty"),
    }


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Every CLI case started at once (they are mostly torch imports), then collected."""
    tmp = tmp_path_factory.mktemp("cli")
    cases = cli_cases(tmp)
    # Offline, with an empty Hugging Face cache (conftest already sets OMP_NUM_THREADS=1).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf")}
    procs = {}
    for name, (argv, _, *closed) in cases.items():
        cmd = [sys.executable, os.path.join(ROOT, "fastdllm.py"), *argv]
        if closed:
            cmd = ["sh", "-c", 'exec "$@" <&-', "sh", *cmd]      # no stdin at all, not an empty one
        procs[name] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        try:
            out[name] = (p, *p.communicate(timeout=120), cases[name][1])
        except subprocess.TimeoutExpired:      # a hang fails its case, not the whole run
            p.kill()
            out[name] = (p, *p.communicate(), cases[name][1])
    return out


# A representative subset (the API tests cover every message): one per stage a CLI run goes through.
CLI_CASES = ["folder missing", "--device cuda without CUDA", "--dtype float16 on CPU", "truncated shard",
             "tokenizer.json missing", "mask token in prompt", "empty prompt",
             "prompt not UTF-8", "stdin closed", "repo id not cached, offline"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_error_is_one_line_and_exit_2(cli_results, case):
    if case == "--device cuda without CUDA" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p, out, err, pattern = cli_results[case]
    assert "Traceback" not in out + err, err
    assert p.returncode == 2, (p.returncode, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(pattern, lines[0]), lines[0]


RUN = ["--prompt", "w5 w6 w7", "--gen-length", "16", "--block-length", "8"]
BEFORE_RESOLVING = {   # argv: the error, said before the model is even looked up (it may be a 16 GB download)
    "no prompt": ([], r"^no prompt: pass --prompt"),
    "bad flag value": (["--gen-length", "x"], r"^argument --gen-length: invalid int value: 'x' \(see --help\)$"),
    "unknown flag": ([*RUN, "--tresh", "1"], r"^unrecognized arguments: --tresh 1 \(see --help\)$"),
    "--seed beyond 64 bits": ([*RUN, "--seed", str(2**64)], r"^--seed \d+ does not fit in 64 bits: use a seed"),
    "--factor and --threshold": ([*RUN, "--factor", "1", "--threshold", "0.5"], r"pass threshold or factor, not both"),
    "prompt not UTF-8": ([*RUN, "--prompt", "w5 \udcff w6"], r"^the prompt is not valid UTF-8 text: pass UTF-8"),
}


@pytest.mark.parametrize("case", BEFORE_RESOLVING)
def test_cli_checks_arguments_before_the_model(monkeypatch, case):
    monkeypatch.setattr(fastdllm, "resolve_model_dir", lambda *a: pytest.fail("resolved the model first"))
    argv, pattern = BEFORE_RESOLVING[case]
    with pytest.raises(ValueError) as e:
        fastdllm.main(argv)
    assert re.search(pattern, one_line(e)), str(e.value)


BEFORE_LOADING = {   # a bad checkpoint folder: the error, said from config.json / tokenizer.json before the weights
    "Dream --block-length 0 with the default cache": (
        lambda d: checkpoint(d, "dream-tiny", tokenizer=True), ["--block-length", "0"],
        r"--block-length 0 selects Dream's own whole-canvas sampler, .*: add --cache none --threshold none"),
    "mask id an ordinary token": (
        lambda d: edit_config(checkpoint(d, tokenizer=True), mask_token_id=5), [],
        r"config\.json's mask_token_id 5 is the ordinary token 'w5' of tokenizer\.json, not a special mask "
        r"token: fix config\.json"),
    "tokenizer.json a folder": (
        lambda d: make_folder(checkpoint(d, tokenizer=True), "tokenizer.json"), [],
        r"tokenizer\.json is a folder, not a file"),
}


@pytest.mark.parametrize("case", BEFORE_LOADING)
def test_cli_checks_the_small_files_before_the_weights(tmp_path, monkeypatch, case):
    make, argv, pattern = BEFORE_LOADING[case]
    monkeypatch.setattr(fastdllm, "load_model", lambda *a, **kw: pytest.fail("loaded the weights first"))
    with pytest.raises(ValueError) as e:
        fastdllm.main(["--model", make(tmp_path), *RUN, *argv])
    assert re.search(pattern, one_line(e)), str(e.value)


# Runs fastdllm.py's own __main__ (runpy), with one hook: the second denoising step says so on stderr, so
# the test interrupts a generation that is surely running and has steps to show, not the import or the load.
INTERRUPT = """
import runpy, sys
import sampler
real = sampler.llada_predict
def predict(*args, **kw):
    predict.calls += 1
    if predict.calls == 2:
        print("second step", file=sys.stderr, flush=True)
    return real(*args, **kw)
predict.calls = 0
sampler.llada_predict = predict
sys.argv = ["fastdllm.py"] + sys.argv[1:]
runpy.run_path("fastdllm.py", run_name="__main__")
"""


def test_ctrl_c_prints_the_partial_answer(tmp_path):
    d = edit_config(checkpoint(tmp_path, tokenizer=True), max_sequence_length=8192)
    # 2048 one-token steps over a 2051-token canvas: far longer than the test waits.
    p = subprocess.Popen([sys.executable, "-c", INTERRUPT, "--model", d, "--prompt", "w5 w6 w7", "--gen-length",
                          "2048", "--block-length", "2048", "--cache", "none", "--threshold", "none"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # readline() has no timeout: a watchdog kills a run that never gets to its second step, which then
    # fails here in two minutes instead of waiting out all 2048 steps.
    watchdog = threading.Timer(120, p.kill)
    watchdog.start()
    try:
        line = p.stderr.readline()
        if line != "second step\n":       # it failed before generating (or printed something first)
            p.kill()
            pytest.fail(f"no second step: {line}{p.stderr.read()}")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        watchdog.cancel()
        p.kill()
    assert "Traceback" not in out + err, err
    assert p.returncode == 130, (p.returncode, out, err)
    m = re.search(r"\[interrupted after (\d+) steps\]", out)
    assert m and int(m.group(1)) >= 1, out


# ---------------------------------------------------------------------------------- issue 18: guided settings
# FlashDLM's speculative variant and acceptance thresholds (generate(guide=...)): one line each, before any
# model call.
@pytest.fixture(scope="module")
def guided_pair():
    return (load_model(os.path.join(GOLDEN, "dream-tiny"), device="cpu", dtype=torch.float32),
            load_model(os.path.join(GOLDEN, "qwen2-tiny"), device="cpu", dtype=torch.float32))


@pytest.mark.parametrize("kw,pattern", [
    (dict(accept_threshold=1.0), r"accept_threshold must be a number in \[0, 1\) \(got 1\.0\)"),
    (dict(accept_threshold=-0.1), r"accept_threshold must be a number in \[0, 1\) \(got -0\.1\)"),
    (dict(accept_threshold=float("nan")), r"accept_threshold must be a number in \[0, 1\) \(got nan\)"),
    (dict(accept_threshold="0.1"), r"accept_threshold must be a number in \[0, 1\) \(got '0\.1'\)"),
    (dict(accept_threshold=True), r"accept_threshold must be a number in \[0, 1\) \(got True\)"),
    (dict(speculative="yes"), r"speculative must be True or False \(got 'yes'\)"),
    (dict(speculative=1), r"speculative must be True or False \(got 1\)"),
    (dict(accept="greedy"), r"unknown accept rule 'greedy': use one of .*dynamic_threshold, aggressive"),
])
def test_bad_guided_settings(guided_pair, kw, pattern):
    dream, guide = guided_pair
    with pytest.raises(ValueError, match=pattern) as e:
        generate(dream, torch.tensor([[5, 6, 7, 8]]), gen_length=8, guide=guide, **kw)
    one_line(e)


def test_cli_bad_accept_threshold_is_one_line():
    with pytest.raises(ValueError, match="argument --accept-threshold: invalid float value: 'high'"):
        fastdllm.parse_args(["--prompt", "hi", "--guide", "g", "--accept-threshold", "high"])
