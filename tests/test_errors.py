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
import bounded
import cli
import loading
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
        r"^gen_length 10 is not a multiple of block_length 4: pass a block_length that divides it, e.g. block_length "
        r"2, or a gen_length that is a multiple of 4, e.g. gen_length 12$"),
    "steps not divisible by blocks": (dict(gen_length=8, block_length=4, steps=3),
        r"steps 3 is not divisible by the number of blocks 2 .*use a multiple"),
    "steps 0": (dict(steps=0), r"steps must be >= 1 \(got 0\)"),
    "steps negative": (dict(steps=-4), r"steps must be >= 1 \(got -4\)"),
    "gen_length 0": (dict(gen_length=0), r"gen_length \(0\) and block_length \(4\) must be positive"),
    "block_length negative": (dict(block_length=-4), r"must be positive"),
    "threshold 0": (dict(threshold=0.0),
        r"threshold must be a number > 0 \(got 0\.0\): 0\.9 is Fast-dLLM's; above 1 means one token per step"),
    "threshold negative": (dict(threshold=-0.5), r"threshold must be a number > 0"),
    "factor 0": (dict(factor=0.0), r"factor must be > 0 \(got 0\.0\)"),
    "factor negative": (dict(factor=-1.0), r"factor must be > 0"),
    "threshold and factor": (dict(threshold=0.9, factor=1.0), r"pass threshold or factor, not both"),
    "temperature negative": (dict(temperature=-0.1), r"temperature must be >= 0 \(got -0\.1\); 0 is greedy"),
    "unknown cache": (dict(cache="full"), r"unknown cache mode 'full': use one of none, prefix, dual, free$"),
    "unknown remasking": (dict(remasking="entropy"),
        r"unknown remasking 'entropy' for llada: use one of low_confidence, random"),
    "Dream option on LLaDA": (dict(top_p=0.9), r"^top_p is a Dream option \(top_p, top_k, alg_temp\): LLaDA samples "
                              r"with temperature only; drop top_p$"),
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
        r"unknown remasking 'low_confidence' for dream: use one of entropy, maskgit_plus, topk_margin, origin"),
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
    (dict(threshold=float("nan")), PROMPT, r"threshold must be a number > 0"),
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
        cli.main(["--model", d, "--prompt", "w5", "--gen-length", "8", "--block-length", "8"])
    assert re.search(r"cannot read .*tokenizer\.json: permission denied", one_line(e)), str(e.value)


def test_interactive_ends_on_ctrl_d(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))      # input() sees the end of input at once
    d = checkpoint(tmp_path, tokenizer=True)
    assert cli.main(["--model", d, "--interactive", "--gen-length", "8", "--block-length", "8"]) is None


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
        # Three that need a process of their own (OWN_PROCESS): argv bytes, a closed stdin, the environment.
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
    procs, script = {}, os.path.join(ROOT, "fastdllm.py")
    for name, (argv, _, *closed) in cases.items():
        if name not in OWN_PROCESS:
            continue
        cmd = [sys.executable, script, *argv]
        if closed:
            cmd = ["sh", "-c", 'exec "$@" <&-', "sh", *cmd]      # no stdin at all, not an empty one
        procs[name] = bounded.start(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    out = {name: (*r, cases[name][1]) for name, r in bounded.drive(
        {name: (script, c[0]) for name, c in cases.items() if name not in OWN_PROCESS}, env=env).items()}
    for name, p in procs.items():      # a hang fails its case, not the whole run: its process group is killed
        stdout, stderr, _ = bounded.finish(p, timeout=120)
        out[name] = (p.returncode, stdout, stderr, cases[name][1])
    return out


OWN_PROCESS = ("prompt not UTF-8", "stdin closed", "repo id not cached, offline")   # the rest: one driver process
# A representative subset (the API tests cover every message): one per stage a CLI run goes through.
CLI_CASES = ["folder missing", "--device cuda without CUDA", "--dtype float16 on CPU", "truncated shard",
             "tokenizer.json missing", "mask token in prompt", "empty prompt",
             "prompt not UTF-8", "stdin closed", "repo id not cached, offline"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_error_is_one_line_and_exit_2(cli_results, case):
    if case == "--device cuda without CUDA" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out, err, pattern = cli_results[case]
    assert "Traceback" not in out + err, err
    assert code == 2, (code, out, err)
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("loaded ")]   # the load's summary line
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
    monkeypatch.setattr(cli, "resolve_model_dir", lambda *a, **kw: pytest.fail("resolved the model first"))
    argv, pattern = BEFORE_RESOLVING[case]
    with pytest.raises(ValueError) as e:
        cli.main(argv)
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
    # Issue 39: these need config.json and the tokenizer only, and were found by generate(), after the weights.
    "--top-k on LLaDA": (
        lambda d: checkpoint(d, tokenizer=True), ["--top-k", "5"],
        r"^--top-k is a Dream option \(--top-p, --top-k, --alg-temp\): LLaDA samples with --temperature only; "
        r"drop --top-k$"),
    "Dream's remasking on LLaDA": (
        lambda d: checkpoint(d, tokenizer=True), ["--remasking", "entropy"],
        r"^unknown --remasking 'entropy' for llada: use one of low_confidence, random$"),
    "LLaDA's remasking on Dream": (
        lambda d: checkpoint(d, "dream-tiny", tokenizer=True), ["--remasking", "random"],
        r"^unknown --remasking 'random' for dream: use one of entropy, maskgit_plus, topk_margin, origin,"),
    "the mask token in --prompt": (
        lambda d: checkpoint(d, tokenizer=True), ["--prompt", "w5 <|mdm_mask|> w6"],
        r"^the prompt contains the mask token id 1000: masks are reserved for the answer"),
    "prompt + --gen-length beyond the model's positions": (
        lambda d: edit_config(checkpoint(d, tokenizer=True), max_sequence_length=16), [],
        r"^prompt \(3 tokens\) \+ gen_length \(16\) exceeds the model's 16 positions"),
    # Issue 46: --sub-block was silently ignored on LLaDA and Dream; another family's LLaDA2 settings were refused
    # by generate(), after the weights.
    "--sub-block on LLaDA": (
        lambda d: checkpoint(d, tokenizer=True), ["--sub-block", "4"],
        r"^--sub-block is Fast-dLLM v2's: a llada model decodes the whole block at each step; drop --sub-block$"),
    "--sub-block on Dream": (
        lambda d: checkpoint(d, "dream-tiny", tokenizer=True), ["--sub-block", "4"],
        r"^--sub-block is Fast-dLLM v2's: a dream model decodes the whole block at each step; drop --sub-block$"),
    "--editing-threshold on LLaDA": (
        lambda d: checkpoint(d, tokenizer=True), ["--editing-threshold", "0.5"],
        r"^--editing-threshold is LLaDA2's \(model_type llada2_moe\): a llada model does not read it; drop "
        r"--editing-threshold$"),
    "--max-post-steps on Fast-dLLM v2": (
        lambda d: release(d, "Efficient-Large-Model/Fast_dLLM_v2_7B"), ["--max-post-steps", "2"],
        r"^--max-post-steps is LLaDA2's \(model_type llada2_moe\): a fastdllm_v2 model does not read it; drop "
        r"--max-post-steps$"),
    "--editing-threshold on SDAR": (
        lambda d: release(d, "JetLM/SDAR-4B-Chat"), ["--editing-threshold", "0.5"],
        r"^--editing-threshold is LLaDA2's \(model_type llada2_moe\): a sdar model does not read it"),
}


def release(tmp_path, repo) -> str:
    """A tiny checkpoint in the release's format (tools/checkpoint.py --release)."""
    from tools.checkpoint import make_release
    make_release(os.path.join(str(tmp_path), "release"), repo)
    return os.path.join(str(tmp_path), "release")


@pytest.mark.parametrize("case", BEFORE_LOADING)
def test_cli_checks_the_small_files_before_the_weights(tmp_path, monkeypatch, case):
    make, argv, pattern = BEFORE_LOADING[case]
    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("loaded the weights first"))
    with pytest.raises(ValueError) as e:
        cli.main(["--model", make(tmp_path), *RUN, *argv])
    assert re.search(pattern, one_line(e)), str(e.value)


def test_cli_gen_length_not_filling_the_default_block_names_the_flags(tmp_path, monkeypatch):
    """Issue 46: it said "gen_length 20 is not a multiple of block_length 32", a setting the user never set (the
    default block): now the flags, and both fixes."""
    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("loaded the weights first"))
    with pytest.raises(ValueError) as e:
        cli.main(["--model", checkpoint(tmp_path, tokenizer=True), "--prompt", "w5", "--gen-length", "20"])
    assert re.search(r"^--gen-length 20 is not a multiple of --block-length 32: pass a --block-length that divides "
                     r"it, e\.g\. --block-length 20, or a --gen-length that is a multiple of 32, e\.g\. --gen-length "
                     r"32$", one_line(e)), str(e.value)


def test_cli_checks_each_prompt_file_line_before_the_weights(tmp_path, monkeypatch):
    """Issue 39: a --prompt-file line holding the mask token was found by generate(), after the weights; now
    before them, named by its line (blank lines count)."""
    d = checkpoint(tmp_path, tokenizer=True)
    (tmp_path / "prompts.txt").write_text("w5 w6\n\nw7 <|mdm_mask|>\n")
    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("loaded the weights first"))
    with pytest.raises(ValueError, match=r"^--prompt-file .*prompts\.txt line 3: the prompt contains the mask token"):
        cli.main(["--model", d, "--prompt-file", str(tmp_path / "prompts.txt"), "--gen-length", "16",
                  "--block-length", "8"])


def test_a_repo_id_is_checked_on_its_small_files_before_its_weights_are_fetched(tmp_path, monkeypatch):
    """Issue 39: for a repo id the weights came in the same download as config.json, so `--top-k 5` on LLaDA-8B
    cost 16 GB before its one line. The small files come first: refused there, no safetensors is ever asked for."""
    import huggingface_hub
    small = checkpoint(tmp_path, tokenizer=True)
    for f in os.listdir(small):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(small, f))
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, allow_patterns: asked.append(
        (repo, allow_patterns)) or small)
    with pytest.raises(ValueError, match=r"^--top-k is a Dream option"):
        cli.main(["--model", "someone/llada", *RUN, "--top-k", "5"])
    assert asked and all(repo == "someone/llada" and "*.safetensors" not in patterns for repo, patterns in asked)


def test_the_issue_commands_refuse_before_reading_a_truncated_checkpoint(tmp_path):
    """Issue 39, as reported: the demo model with its safetensors cut to 1000 bytes. Each command said the file was
    corrupt (the weights were read first); each is refused on config.json and the tokenizer, one line, exit 2."""
    d = shutil.copytree(os.path.join(ROOT, "demo", "llada-arith"), tmp_path / "t")
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    cases = {("--top-k", "5", "--prompt", "hi"): "--top-k is a Dream option",
             ("--prompt", "hi <|mdm_mask|>"): "the prompt contains the mask token id 47",
             ("--gen-length", "64", "--prompt", "hi"): "exceeds the model's 64 positions"}
    procs = {argv: bounded.start([sys.executable, os.path.join(ROOT, "fastdllm.py"), "--model", str(d), "--block-length",
                                  "8", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in cases}
    for argv, p in procs.items():
        out, err, late = bounded.finish(p, timeout=120)
        assert not late and p.returncode == 2 and out == "", (argv, p.returncode, out, err)
        assert err.startswith("error: ") and cases[argv] in err and len(err.splitlines()) == 1, (argv, err)


# Runs fastdllm.py's own __main__ (runpy), with one hook: the second denoising step says so on stderr, so
# the test interrupts a generation that is surely running and has steps to show, not the import or the load.
INTERRUPT = """
import runpy, sys
import sampler
real = sampler.LLaDA.propose
def predict(*args, **kw):
    predict.calls += 1
    if predict.calls == 2:
        print("second step", file=sys.stderr, flush=True)
    return real(*args, **kw)
predict.calls = 0
sampler.LLaDA.propose = predict
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
        while line.startswith("loaded "):      # the load's summary line
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


# ============================================================================================================
# Issue 20, the CLI and loading side: guide flags, prompt files, --trace, --interactive, closed pipes, absurd
# temperatures, load progress. Every flag error wins over a missing model (flags are checked before anything
# is looked up) and names the flag. The cases run as fastdllm.py's __main__ in ONE subprocess (bounded.drive:
# a torch import per case costs seconds); those that need real file descriptors (a closed pipe, a shell pipe
# into head, piped stdin) get their own processes; all start at once.

DEMO20, GUIDE20 = os.path.join(ROOT, "demo", "llada-arith"), os.path.join(ROOT, "demo", "qwen2-arith")
Q20 = ["Tom has 23 apples and buys 45 more. How many apples does he have?",
       "A box has 24 apples. Tom takes 10. How many apples are left?"]
A20 = ["45 + 23 = 68. The answer is 68.", "24 - 10 = 14. The answer is 14."]
DEMO_RUN = ["--model", DEMO20, "--gen-length", "32"]
MISSING = ["--model", "{tmp}/no-model"]          # {tmp}: the fixture's folder
GUIDED = [*MISSING, "--prompt", "w5", "--guide", GUIDE20]
CLI20_ERRORS = {   # argv: the pattern of the one error line (after "error: ")
    "--guide missing folder": ([*DEMO_RUN, "--prompt", Q20[0], "--guide", "{tmp}/no-guide"],
                               r"^guide folder '.*no-guide' not found: pass an existing folder .* Qwen/"),
    "--guide repo id not cached, offline": ([*DEMO_RUN, "--prompt", Q20[0], "--guide", "nobody/no-guide"],
                                            r"^the guide 'nobody/no-guide' is not in the local Hugging Face cache"),
    "--guide empty": ([*MISSING, "--prompt", "w5", "--guide", ""], r"^--guide is empty"),
    "--model empty": (["--model", " ", "--prompt", "w5"], r"^--model is empty"),
    "--accept bogus": ([*GUIDED, "--accept", "bogus"], r"^argument --accept: invalid choice: 'bogus' \(choose from"),
    "--accept-k 0": ([*GUIDED, "--accept-k", "0"], r"^argument --accept-k: expected an integer >= 1, got '0'"),
    "--accept-k x": ([*GUIDED, "--accept-k", "x"], r"^argument --accept-k: expected an integer >= 1, got 'x'"),
    "--accept-ratio 0": ([*GUIDED, "--accept-ratio", "0"], r"^argument --accept-ratio: expected a number in \(0, 1\]"),
    "--accept-ratio 1.5": ([*GUIDED, "--accept-ratio", "1.5"], r"^argument --accept-ratio: expected a number in"),
    "--accept-ratio nan": ([*GUIDED, "--accept-ratio", "nan"], r"^argument --accept-ratio: expected a number in"),
    "--accept-ratio inf": ([*GUIDED, "--accept-ratio", "inf"], r"^argument --accept-ratio: expected a number in"),
    "--accept without --guide": ([*MISSING, "--prompt", "w5", "--accept", "topk"],
                                 r"^--accept only applies with --guide: add --guide, or drop --accept$"),
    "--accept-k without --guide": ([*MISSING, "--prompt", "w5", "--accept-k", "3"], r"^--accept-k only applies with --guide"),
    "--accept-ratio without --guide": ([*MISSING, "--prompt", "w5", "--accept-ratio", "0.5"],
                                       r"^--accept-ratio only applies with --guide"),
    "--batch-size without --prompt-file": ([*MISSING, "--prompt", "w5", "--batch-size", "2"],
                                           r"^--batch-size only applies with --prompt-file"),
    "--guide with --threshold": ([*GUIDED, "--threshold", "0.5"], r"^pass --guide or --threshold, not both"),
    "--guide with --temperature": ([*GUIDED, "--temperature", "0.5"], r"^--temperature must be 0 with --guide"),
    "--prompt-file missing": ([*MISSING, "--prompt-file", "{tmp}/none.txt"],
                              r"^cannot read --prompt-file .*none\.txt: No such file or directory$"),
    "--prompt-file a folder": ([*MISSING, "--prompt-file", "{tmp}"], r"^cannot read --prompt-file .*: Is a directory$"),
    "--prompt-file not UTF-8": ([*MISSING, "--prompt-file", "{tmp}/latin1.txt"],
                                r"^--prompt-file .*latin1\.txt is not valid UTF-8 text"),
    "--prompt-file without a prompt": ([*MISSING, "--prompt-file", "{tmp}/blank.txt"],
                                       r"^--prompt-file .*blank\.txt has no prompt"),
    "--prompt-file empty path": ([*MISSING, "--prompt-file", ""], r"^--prompt-file is empty"),
    "--trace with --prompt-file": ([*MISSING, "--prompt-file", "{tmp}/ok.txt", "--trace"],
                                   r"^--trace shows the steps of one answer: use it with --prompt or --interactive"),
    "--temperature inf": ([*MISSING, "--prompt", "w5", "--temperature", "inf"],
                          r"^argument --temperature: expected a finite number, got 'inf'"),
    "--temperature nan": ([*MISSING, "--prompt", "w5", "--temperature", "nan"],
                          r"^argument --temperature: expected a finite number, got 'nan'"),
}
CLI20_RUNS = {   # argv, stdin (not a terminal: as from a pipe): runs that succeed
    "--temperature 1e9": ([*DEMO_RUN, "--prompt", Q20[0], "--temperature", "1e9"], None),
    "interactive: empty lines, then quit": ([*DEMO_RUN, "--interactive"], f"\n{Q20[0]}\n\n \nquit\n{Q20[1]}\n"),
    "interactive: exit": ([*DEMO_RUN, "--interactive"], f"{Q20[0]}\nexit\n{Q20[1]}\n"),
    "interactive: --prompt is the first turn": ([*DEMO_RUN, "--interactive", "--prompt", Q20[0]], f"{Q20[1]}\n"),
}

@pytest.fixture(scope="module")
def cli20(tmp_path_factory):
    """name -> (exit status, stdout, stderr) for CLI20_ERRORS, CLI20_RUNS and the real-pipe cases."""
    tmp = tmp_path_factory.mktemp("cli20")
    (tmp / "blank.txt").write_text("\n  \n")
    (tmp / "latin1.txt").write_bytes(b"caf\xe9\n")
    (tmp / "ok.txt").write_text(Q20[0] + "\n")
    cases = {name: ([a.replace("{tmp}", str(tmp)) for a in argv], None) for name, (argv, _) in CLI20_ERRORS.items()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf")}
    kw = dict(cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cli = [sys.executable, os.path.join(ROOT, "fastdllm.py"), *DEMO_RUN]
    piped = lambda cmd: ["sh", "-c", 'exec "$@" ' + cmd, "sh", *cli]    # noqa: E731
    procs = {   # name: (process, its stdin); each its own process group (tests/bounded.py)
        "driver": (bounded.start([sys.executable, "-c", bounded.DRIVER], **kw), bounded.driver_input(
            {name: (os.path.join(ROOT, "fastdllm.py"), argv, stdin) for name, (argv, stdin) in (cases | CLI20_RUNS).items()})),
        # The reader is gone before the first answer is written: EPIPE every time, no race with a reader.
        "closed pipe": (bounded.start([*cli, "--prompt", Q20[0]], **kw), None),
        "| head -1": (bounded.start(piped("--prompt-file /dev/stdin | head -1"), **kw), "\n".join(Q20 * 4)),
        "| head -c 5": (bounded.start(piped(f"--prompt '{Q20[0]}' | head -c 5"), **kw), None),
        "interactive: piped questions to their end": (bounded.start([*cli, "--interactive"], **kw),
                                                      "\n".join(Q20) + "\n"),
    }
    procs["closed pipe"][0].stdout.close()
    out = {}
    for name, (p, stdin) in procs.items():
        # A hang fails its cases, not the whole run: the group is killed (sh, python and head alike: killing sh
        # alone left the others holding the pipe, and the read after it never returned).
        *res, _ = bounded.finish(p, stdin, timeout=240)
        out[name] = (p.returncode, *res)
    return out | bounded.driven(*out.pop("driver"))


def quiet_stderr(err: str) -> bool:
    """Nothing on stderr but the load's summary lines (stderr is not a terminal here)."""
    return all(re.fullmatch(r"loaded .+ in \d+\.\d\d s \(\d+\.\d (MB|GB)\)", ln) for ln in err.splitlines())


@pytest.mark.parametrize("case", CLI20_ERRORS)
def test_cli20_flag_error_wins_and_names_the_cause(cli20, case):
    code, out, err = cli20[case]
    assert "Traceback" not in out + err, err
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(CLI20_ERRORS[case][1], lines[0][len("error: "):]), lines[0]
    assert "LLaDA" not in lines[0] and "model folder" not in lines[0], lines[0]   # a guide's error says "guide"


def answers(out: str) -> list[str]:
    """--interactive's answers: each on its own line, after "assistant> " (never after "user> ... ")."""
    assert "user> assistant>" not in out, out
    return re.findall(r"^assistant> (.*)$", out, re.M)


def test_cli20_huge_temperature_still_samples_and_stdout_holds_only_the_answer(cli20):
    """--temperature 1e9 used to overflow the official Gumbel formula: every token the lowest id, an empty
    answer. Also: the load's summary is the one line on stderr (not a terminal), nothing extra on stdout."""
    code, out, err = cli20["--temperature 1e9"]
    assert code == 0 and "Traceback" not in err, err
    answer, stats = out.splitlines()
    assert answer.strip() and stats.startswith("NFE ")
    assert quiet_stderr(err) and err.startswith(f"loaded {DEMO20} in ") and err.count("\n") == 1, err


@pytest.mark.parametrize("case,expected", [("interactive: empty lines, then quit", A20[:1]),
                                           ("interactive: exit", A20[:1]),
                                           ("interactive: --prompt is the first turn", A20),
                                           ("interactive: piped questions to their end", A20)])
def test_cli20_interactive(cli20, case, expected):
    """An empty line asks again; exit, quit or the end of input ends the session; --prompt is the first
    turn. From a pipe each question is echoed after "user> ", so every answer starts a line of its own,
    and there is no banner (stdin is not a terminal)."""
    code, out, err = cli20[case]
    assert code == 0 and quiet_stderr(err), (code, err)
    assert answers(out) == expected
    assert [q for q in re.findall(r"^user> (.+)$", out, re.M) if q not in ("exit", "quit")] == Q20[:len(expected)]


def test_cli20_interactive_banner_on_a_terminal(monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("sys.stdin", Terminal(f"{Q20[0]}\n"))
    cli.main([*DEMO_RUN, "--interactive"])
    out, err = capsys.readouterr()
    assert "exit, quit or Ctrl-D ends it" in err and "Ctrl-D" not in out
    assert out.startswith("user> assistant> ") and answers(out.replace("user> assistant>", "")) == []   # typed, not echoed
    assert A20[0] in out


@pytest.mark.parametrize("case,status,expected", [("closed pipe", 141, ""), ("| head -1", 0, A20[0] + "\n"),
                                                  ("| head -c 5", 0, A20[0][:5])])
def test_cli20_a_closed_pipe_ends_quietly(cli20, case, status, expected):
    """The reader stopped reading: no message, no traceback; status 141 (128 + SIGPIPE, what the shell
    reports for a Unix tool killed by the closed pipe; through `sh -c ... | head` it is head's 0)."""
    code, out, err = cli20[case]
    assert "Traceback" not in err and "error" not in err and quiet_stderr(err), err
    assert code == status and out == expected, (code, out, err)


def test_load_progress(monkeypatch, capsys):
    """load_model is silent unless given progress=; the CLI's load() shows a live line (shard i of n, GB)
    on a terminal, then one summary line, which is all it prints when stderr is a file or pipe."""
    path = os.path.join(GOLDEN, "llada-tiny")     # two shards
    calls = []
    load_model(path, progress=lambda *a: calls.append(a))
    assert capsys.readouterr() == ("", "")
    assert [c[0] for c in calls] == sorted(c[0] for c in calls) and {c[:2] for c in calls} == {(1, 2), (2, 2)}
    assert all(0 < done <= total for _, _, done, total in calls) and calls[-1][2] > 0.9 * calls[-1][3]
    loading.load("tiny", path, "cpu", torch.float32)
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(r"loaded tiny in \d+\.\d\d s \(0\.\d MB\)\n", err), err

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("sys.stderr", Terminal())
    loading.load("tiny", path, "cpu", torch.float32)
    err = sys.stderr.getvalue()
    assert err.startswith("\rloading tiny: shard 1 of 2, 0.0 of 0.0 GB") and "\r\x1b[Kloaded tiny in " in err, err


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 5.0])
def test_gumbel_noise_picks_what_the_official_formula_picks(temperature):
    """LLaDA's sampler in log space and float32: the same ids as the official float64 exp(l) / (-log u)^T
    wherever that is finite (moderate temperatures), on the same uniforms (ours are float32: the official
    formula is evaluated on them in float64)."""
    import sampler
    for seed in range(5):
        logits = torch.randn(4, 16, 3000, generator=torch.Generator().manual_seed(100 + seed)) * 4
        ours = sampler.add_gumbel_noise(logits, temperature, torch.Generator().manual_seed(seed)).argmax(-1)
        u = torch.rand(logits.shape, generator=torch.Generator().manual_seed(seed)).double()
        official = logits.double().exp() / (-torch.log(u)) ** temperature
        assert torch.isfinite(official).all()
        assert torch.equal(ours, official.argmax(-1))


def test_gumbel_noise_still_samples_at_a_huge_temperature():
    """At T = 1e9 softmax(l/T) is nearly uniform: the choices spread over the vocabulary (the official
    formula overflows there and picks the lowest ids)."""
    import sampler
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 4
    ids = sampler.add_gumbel_noise(logits, 1e9, torch.Generator().manual_seed(0)).argmax(-1)
    assert len(set(ids.tolist())) > 40 and 300 < ids.double().mean() < 700


# ============================================================================================================
# Issue 20, the API's new arguments: end of text, guides, padding, temperatures. One line each, naming the cause.
API20_CASES = {
    "stop_at_eos a string": (dict(stop_at_eos="yes"), r"stop_at_eos must be False, True .* or an integer k >= 1.*'yes'"),
    "stop_at_eos negative": (dict(stop_at_eos=-1), r"stop_at_eos must be False, True .*not -1"),
    "stop_at_eos zero": (dict(stop_at_eos=0), r"stop_at_eos must be False, True .*not 0"),
    "eos id negative": (dict(eos_ids=[0, -1]), r"eos_ids must be a non-empty list of token ids in \[0, 1024\), not \[0, -1\]"),
    "eos ids a string": (dict(eos_ids="abc"), r"eos_ids must be a non-empty list of token ids .*'abc'"),
    "eos id past the vocabulary": (dict(eos_ids=[5000]), r"eos_ids must be .*\[0, 1024\)"),
    "eos id the mask": (dict(eos_ids=[1000]), r"eos_ids holds the mask token id 1000"),
    "temperature inf": (dict(temperature=float("inf")), r"temperature must be finite \(got inf\)"),
    "accept without a guide": (dict(accept="topk"), r"accept only apply to guided diffusion: pass guide= too"),
    "accept_k and accept_ratio without a guide": (dict(accept_k=3, accept_ratio=0.5),
        r"accept_k, accept_ratio only apply to guided diffusion"),
    "guide a path": (dict(guide="some/path"), r"guide must be a loaded causal model, not the path 'some/path': load it"),
    "guide an object": (dict(guide=object()), r"guide must be a causal LM loaded with model.load_model .*not object"),
    "unknown setting": (dict(treshold=0.9), r"unknown setting 'treshold': generate\(\) takes .*threshold"),
    "select not callable": (dict(select=3), r"select must be a selection rule, a callable"),
    "select and threshold": (dict(select=lambda p, at: p.open, threshold=0.9), r"pass select or threshold/factor, not both"),
    "cache an object without span": (dict(cache=object()), r"cache must be a mode name .* or a cache.CachePolicy"),
}


@pytest.mark.parametrize("case", API20_CASES)
def test_api20_bad_arguments(llada, case):
    kw, pattern = API20_CASES[case]
    with pytest.raises((ValueError, TypeError)) as e:     # TypeError: a hook that is not of its protocol
        generate(llada, PROMPT, **{"gen_length": 8, "block_length": 4, **kw})
    assert re.search(pattern, one_line(e)), str(e.value)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_api20_right_padding_is_refused_everywhere(request, family, qwen2):
    """Left padding is what the README documents; a pad after a real token would sit between the prompt and
    its answer. Refused in every path, guided included, before anything is decoded."""
    model = request.getfixturevalue(family)
    am = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    prompt = torch.cat([PROMPT, PROMPT])
    paths = [dict(cache="none"), dict(cache="dual", threshold=0.9)] + ([dict(guide=qwen2)] if family == "dream" else [])
    for kw in paths:
        with pytest.raises(ValueError, match=r"attention_mask pads a row on the right .* pad on the left"):
            generate(model, prompt, attention_mask=am, gen_length=8, block_length=4, **kw)


def test_api20_guide_settings_have_types(dream, qwen2):
    for kw, pattern in [(dict(accept_ratio="0.5"), r"accept_ratio must be in \(0, 1\] \(got '0.5'\)"),
                        (dict(accept_ratio=True), r"accept_ratio must be in \(0, 1\] \(got True\)"),
                        (dict(accept_k=2.0), r"accept_k must be an integer >= 1 \(got 2.0\)")]:
        with pytest.raises(ValueError, match=pattern):
            generate(dream, torch.tensor([[5, 6, 7]]), gen_length=8, guide=qwen2, **kw)


def test_api20_stop_at_eos_k_and_eos_ids_work(llada):
    """The valid forms run, and custom end ids, several of them, decide where the answer ends, by value. The
    oracle is the same decode without a stop rule (its canvas after every step): stop_at_eos=True keeps it up to
    the end of the first finished block holding any of the ids, then end tokens; stop_at_eos=2 keeps the first
    canvas whose decoded answer is a prefix ending in 2 of the ids (FlashDLM's rule), then end tokens. The ids
    are read off that decode: a config eos used instead of eos_ids, only the list's first id honoured, or the
    stop placed in another block would each give another canvas (or none at all: no stop)."""
    kw, M, P = dict(gen_length=16, block_length=4, steps=16), llada.config.mask_id, PROMPT.shape[1]
    canvases = []
    full, _ = generate(llada, PROMPT, on_step=lambda x, st: canvases.append(x[0].tolist()), **kw)
    blocks = [full[0, P + 4 * b:P + 4 * b + 4].tolist() for b in range(4)]
    early = next(t for t in blocks[1] if t not in blocks[0])                 # first seen in block 1
    late = next(t for t in blocks[2] if t not in blocks[0] + blocks[1])      # first seen in block 2
    out, st = generate(llada, PROMPT, stop_at_eos=True, eos_ids=[late, early], **kw)
    assert out[0, :P + 8].tolist() == full[0, :P + 8].tolist()              # the answer up to block 1's end
    assert set(out[0, P + 8:].tolist()) <= {late, early}
    assert st["nfe"] == 8 and st["calls_saved"] == 8           # blocks 0-1 decoded, 2-3 saved (4 calls each)

    def ended(c, ids, k=2):     # FlashDLM: the right-most decoded token and the one before it are end tokens,
        r = max(i for i in range(P, len(c)) if c[i] != M)                    # and no mask before it
        return M not in c[P:r] and all(t in ids for t in c[r - k + 1:r + 1])
    ids = blocks[1][2:]                                        # two end tokens in a row: block 1's last two
    assert len(set(ids)) == 2
    n = next(i for i, c in enumerate(canvases) if ended(c, ids))
    out, st = generate(llada, PROMPT, stop_at_eos=2, eos_ids=ids, **kw)
    got, want = out[0].tolist(), canvases[n]
    assert M in want and st["nfe"] == n + 1                                  # it stops before the decode's end
    assert all(g == w if w != M else g in ids for g, w in zip(got, want)) and len(set(got[want.index(M):])) == 1


# ---------------------------------------------------------------------------------- the benchmark's flags
# bench.py and tools/: every flag type- and range-checked before anything is loaded or written, in one line
# that names the flag, exit status 2, no traceback. All cases run in one process (tests/bounded.py drive: each
# would be mostly a torch import).

def bench_cases(tmp):
    """name: (script and argv, the flag (or file) the one error line must name)."""
    demo, bad_dir = os.path.join(ROOT, "demo", "llada-arith"), os.path.join(tmp, "no-such-folder", "x.json")
    run = ["apps/bench.py", "run", "--model", demo, "--gen-length", "32", "--block-length", "8"]
    small = ["--d-model", "64", "--layers", "1", "--vocab", "1024"]
    return {
        "run --batch 0": ([*run, "--batch", "0"], "--batch"),
        "run --repeat 0": ([*run, "--repeat", "0"], "--repeat"),
        "run --stops -1": ([*run, "--stops", "-1"], "--stops"),
        "run --thresholds abc": ([*run, "--thresholds", "abc"], "--thresholds"),
        "run --caches bogus": ([*run, "--caches", "prefix,bogus"], "--caches"),
        "run --json in a missing folder": ([*run, "--json", bad_dir], "--json"),
        "run --cache (no meaning in a table)": ([*run, "--cache", "dual"], "--cache"),
        "modes --heads that do not divide": (["apps/bench.py", "modes", "--d-model", "100", "--heads", "3"], "--heads"),
        "modes --gen-length not a block multiple": (["apps/bench.py", "modes", *small, "--gen-length", "100"],
                                                    "--gen-length"),
        "modes --guide ''": (["apps/bench.py", "modes", *small, "--guide", ""], "--guide"),
        "modes --gain nan": (["apps/bench.py", "modes", *small, "--gain", "nan"], "--gain"),
        "sweep --lengths 0": (["apps/bench.py", "sweep", *small, "--lengths", "0,32"], "--lengths"),
        "sweep --thresholds with two values": (["apps/bench.py", "sweep", *small, "--thresholds", "0.9,0.5"],
                                               "--thresholds"),
        "compare a file that is not JSON": (["apps/bench.py", "compare", os.path.join(ROOT, "README.md"), "x"], "README.md"),
        "checkpoint --layers 0": (["tools/checkpoint.py", os.path.join(tmp, "ck"), "--layers", "0"], "--layers"),
        "gpu_check --batch 0": (["tools/gpu_check.py", "--out", os.path.join(tmp, "g.json"), "--batch", "0"],
                                "--batch"),
    }


@pytest.fixture(scope="module")
def bench_results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bench_flags"))
    cases = bench_cases(tmp)
    got = bounded.drive({name: (os.path.join(ROOT, script), argv) for name, ((script, *argv), _) in cases.items()},
                        timeout=300, cwd=tmp)
    return {name: (*got[name], cases[name][1]) for name in cases}, tmp


@pytest.mark.parametrize("case", list(bench_cases("tmp")))
def test_bench_flag_error_is_one_line_naming_the_flag(bench_results, case):
    results, tmp = bench_results
    code, out, err, flag = results[case]
    assert "Traceback" not in out + err, err
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert flag in lines[0], lines[0]
    assert not {"ck", "g.json"} & set(os.listdir(tmp))   # nothing was written


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


@pytest.mark.parametrize("value", ["high", "1.5", "nan"])
def test_cli_bad_accept_threshold_is_one_line(value):
    with pytest.raises(ValueError, match=rf"argument --accept-threshold: expected a number in \[0, 1\), got '{value}'"):
        cli.parse_args(["--prompt", "hi", "--guide", "g", "--accept-threshold", value])


def test_cli_speculative_needs_a_guide():
    with pytest.raises(ValueError, match="--speculative only applies with --guide"):
        cli.parse_args(["--prompt", "hi", "--speculative"])


def test_api20_a_guide_with_nan_weights_stops_with_one_line_naming_the_guide(dream):
    """Before: the NaN verdicts rejected every draft and the decode silently fell back to one token a step."""
    guide = load_model(os.path.join(GOLDEN, "qwen2-tiny"), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        guide.layers[0].mlp.w_gate_up.weight[-1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"the guide produced NaN/inf logits: its weights hold NaN/inf") as e:
        generate(dream, torch.tensor([[5, 6, 7, 8]]), gen_length=8, guide=guide)
    one_line(e)


@pytest.mark.parametrize("flag", [["--steps", "8"], ["--remasking", "random"], ["--top-k", "3"], ["--no-early-stop"]])
def test_cli_flags_without_effect_under_a_guide_are_refused(flag):
    with pytest.raises(ValueError, match=rf"{flag[0]} does not apply with --guide: .*drop it"):
        cli.parse_args(["--prompt", "hi", "--guide", "g", *flag])


def test_api20_guided_settings_at_their_defaults_pass_without_a_guide(llada):
    """Callers that pass every keyword (the old flat API) keep working: a guided setting at its default changes
    nothing without a guide; only a value that would be silently ignored is refused."""
    out, st = generate(llada, PROMPT, gen_length=8, block_length=4, accept="deterministic", accept_k=5,
                       accept_ratio=0.95, verify_chunk=32, speculative=False, accept_threshold=0.1)
    plain, st_plain = generate(llada, PROMPT, gen_length=8, block_length=4)
    # The same tokens, calls and per-step commits as the call without them: a guided setting that leaked into
    # the unguided decode (a rule, a stop, a step count) would change one of these.
    assert torch.equal(out, plain) and (st["nfe"], st["committed"]) == (st_plain["nfe"], st_plain["committed"])


# ============================================================================================================
# Issue 25, the CLI and loading: a causal LM given as the model, acceptance settings their rule never reads, a
# truncated guide named as the guide, stdout closed, boolean settings typed. One line each, exit 2.
CLI25_ERRORS = {
    "a causal LM as --model": (["--model", GUIDE20, "--prompt", "w5"],
                               r"^--model .*qwen2-arith is a causal LM \(model_type qwen2\), not a diffusion LM: it "
                               r"belongs to --guide"),
    "--accept-k with deterministic": ([*DEMO_RUN, "--prompt", Q20[0], "--guide", GUIDE20, "--accept-k", "3"],
                                      r"^--accept-k only applies to --accept topk or topk_relative, not "
                                      r"'deterministic'"),
    "--accept-threshold with topk": ([*DEMO_RUN, "--prompt", Q20[0], "--guide", GUIDE20, "--accept", "topk",
                                      "--accept-threshold", "0.2"], r"^--accept-threshold only applies to --accept "
                                                                    r"dynamic_threshold, not 'topk'"),
    "--accept-ratio with aggressive": ([*DEMO_RUN, "--prompt", Q20[0], "--guide", GUIDE20, "--accept", "aggressive",
                                        "--accept-ratio", "0.5"], r"^--accept-ratio only applies to --accept "
                                                                  r"topk_relative"),
    "a truncated guide": ([*DEMO_RUN, "--prompt", Q20[0], "--guide", "{tmp}/guide"],
                          r"^the guide .*guide: model\.safetensors is not a readable safetensors file .*truncated"),
}


@pytest.fixture(scope="module")
def cli25(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli25")
    shutil.copytree(GUIDE20, tmp / "guide")
    with open(tmp / "guide" / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp / "guide" / "model.safetensors") // 2)
    cases = {name: ([a.replace("{tmp}", str(tmp)) for a in argv], None) for name, (argv, _) in CLI25_ERRORS.items()}
    kw = dict(cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              text=True, timeout=240)
    driven = bounded.drive({name: (os.path.join(ROOT, "fastdllm.py"), argv) for name, (argv, _) in cases.items()},
                           cwd=ROOT, env=kw["env"], timeout=240)
    closed = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "fastdllm.py", *DEMO_RUN, "--prompt",
                             Q20[0]], **kw)
    return driven | {"stdout closed": (closed.returncode, closed.stdout, closed.stderr)}


@pytest.mark.parametrize("case", [*CLI25_ERRORS, "stdout closed"])
def test_cli25_error_is_one_line_and_exit_2(cli25, case):
    code, out, err = cli25[case]
    assert "Traceback" not in out + err and code == 2, (code, out, err)
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("loaded ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    pattern = CLI25_ERRORS[case][1] if case in CLI25_ERRORS else r"^standard output is closed: the answer has nowhere"
    assert re.search(pattern, lines[0][len("error: "):]), lines[0]


@pytest.mark.parametrize("name", ["refresh_every_step", "speculative", "compile"])
def test_boolean_settings_are_typed(llada, name):
    """refresh_every_step="no" used to run as True (a non-empty string is truthy)."""
    with pytest.raises(ValueError, match=rf"{name} must be True"):
        generate(llada, PROMPT, gen_length=8, block_length=8, **{name: "no"})


SERVE28 = {   # issue 28: serve.py's start-up errors, each one line naming the flag and its value, before any model
    "--port 99999": (["--port", "99999"], r"^argument --port: expected a port in \[0, 65535\], got '99999'"),
    "--max-batch 0": (["--max-batch", "0"], r"^argument --max-batch: expected an integer >= 1, got '0'"),
    "--batch-window nan": (["--batch-window", "nan"], r"^argument --batch-window: expected a number of ms >= 0"),
    "--gen-length 30 --block-length 8": (["--gen-length", "30", "--block-length", "8"],
                                         r"^--gen-length 30 is not a multiple of --block-length 8: pass a "
                                         r"--block-length that divides it, e\.g\. --block-length 6, or a --gen-length"),
    "--host that does not resolve": (["--host", "no-such-host.invalid"],
                                     r"^port 8000 of no-such-host\.invalid cannot be listened on \(.+\): check --host"),
    # issue 39: it started, then answered every request 400, blaming the client for the server's flag
    "--top-k 5 on LLaDA": (["--top-k", "5", "--port", "0"], r"^--top-k is a Dream option .*; drop --top-k$"),
}


def test_serve_start_up_errors_are_one_line_and_exit_2():
    """`python apps/serve.py` as a user runs it, with a bad flag each (all in one process: a torch import is seconds
    each; a server that started fails them all by the time limit): one line naming the flag and its value, status 2,
    nothing loaded."""
    results = bounded.drive({name: (os.path.join(ROOT, "apps", "serve.py"), ["--model", DEMO20, *argv])
                             for name, (argv, _) in SERVE28.items()}, timeout=120, cwd=ROOT)
    for name, (code, out, err) in results.items():
        assert code == 2 and out == "" and "Traceback" not in err, (name, code, out, err)
        lines = err.splitlines()
        assert len(lines) == 1 and re.search(SERVE28[name][1], lines[0][len("error: "):]), (name, err)
