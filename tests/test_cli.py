"""The command line end to end on the fixture checkpoints, as a user runs it (a subprocess, no test-only
branch): the same path a GPU user takes with the real 8B checkpoint, minus the download."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, copy_checkpoint, write_tokenizer

LLADA_CHAT = {1000: "<|mdm_mask|>", 1022: "<|endoftext|>", 1019: "<|startoftext|>",
              1020: "<|start_header_id|>", 1021: "<|end_header_id|>", 1023: "<|eot_id|>"}
DREAM_CHAT = {1023: "<|mask|>", 1000: "<|endoftext|>", 1001: "<|im_start|>", 1002: "<|im_end|>"}


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "fastdllm.py"), *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    d = copy_checkpoint("llada-tiny", tmp_path_factory.mktemp("cli"))
    write_tokenizer(d, LLADA_CHAT)
    return d


@pytest.mark.parametrize("name,specials", [("llada-tiny", LLADA_CHAT), ("dream-tiny", DREAM_CHAT)])
def test_cli_prints_answer_and_stats(tmp_path, name, specials):
    d = copy_checkpoint(name, tmp_path)
    write_tokenizer(d, specials)
    r = cli("--model", d, "--prompt", "w5 w6 w7", "--gen-length", "32", "--block-length", "8")
    assert r.returncode == 0, r.stderr
    answer, stats = r.stdout.strip().splitlines()[-2:]
    assert answer.strip() and all(w.startswith("w") for w in answer.split())   # decoded words, specials dropped
    assert stats.startswith("NFE ") and "tokens/s" in stats


def test_cli_modes_and_baseline(llada_dir):
    """--cache none --threshold none is the plain baseline: NFE = steps = gen_length."""
    r = cli("--model", llada_dir, "--prompt", "w1 w2", "--gen-length", "16", "--block-length", "8",
            "--cache", "none", "--threshold", "none")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("NFE 16 ")


def test_cli_interactive_two_turns(llada_dir):
    r = cli("--model", llada_dir, "--interactive", "--gen-length", "16", "--block-length", "8",
            stdin="w1 w2\nw3\nexit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant>") == 2 and r.stdout.count("NFE") == 2


def test_cli_checks_settings_before_loading_the_model():
    """A typo in a flag must not cost an 8B load: settings are checked first (the model path here does
    not even exist, and the error is about the flag)."""
    r = cli("--model", "/nonexistent/model", "--prompt", "hi", "--cache", "full")
    assert r.returncode == 2 and "unknown cache mode 'full'" in r.stderr and "Traceback" not in r.stderr
