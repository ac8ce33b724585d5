"""The forks' programs (examples/*.py) as command lines, issue 39: each lists its own flags with their help, --help
loads and fetches no model, the title is the method's, and a fastdllm.py flag that the fork's part replaces is
refused in the CLI's words before any weight is read."""
import os
import re
import runpy

import pytest

import bounded
import cli
import loading
from conftest import ROOT

DEMO = os.path.join(ROOT, "demo", "llada-arith")
RUN = ["--model", DEMO, "--gen-length", "32", "--block-length", "8", "--prompt", "Tom has 23 apples."]
OWN = {"eb_sampler": ["--gamma"], "klass": ["--conf", "--kl", "--history"], "dkv_cache": ["--refresh"],
       "dpad": ["--cache-mode", "--window", "--k-sigma", "--scale", "--drop-seed"],
       "prophet": ["--suffix", "--suffix-at", "--steps-per-block", "--cache", "--early", "--mid", "--late"]}
TITLES = {"eb_sampler": "EB-Sampler: entropy-bounded unmasking", "klass": "KLASS: KL-Adaptive Stability Sampling",
          "dkv_cache": "dKV-Cache-Decode", "dpad": "DPad, the Diffusion Scratchpad",
          "prophet": "Prophet: early commit once the answer is settled"}


def programs(cases: dict, env=None) -> dict:
    """{key: (fork name, argv)} -> {key: (exit status, stdout, stderr)}: each `python examples/NAME.py ARGV` as its
    __main__, all in one process (tests/bounded.py drive)."""
    return bounded.drive({k: (os.path.join(ROOT, "examples", f"{name}.py"), argv) for k, (name, argv) in cases.items()},
                         env=env)


def test_help_lists_the_forks_own_flags_and_fetches_no_model(tmp_path):
    """klass, dkv_cache, dpad and prophet fetched GSAI-ML/LLaDA-8B-Instruct before printing help (here: offline,
    an empty cache, so that was an error); none listed its own flags, parsed by hand outside argparse."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    for name, (code, out, err) in programs({name: (name, ["--help"]) for name in OWN}, env=env).items():
        assert code == 0 and err == "", (name, code, err)
        text = " ".join(out.split())          # argparse wraps lines
        assert text.startswith(f"usage: {name}.py") and TITLES[name] in text and "Fast-dLLM inference" not in text
        assert "--gen-length" in text and "--temperature" in text          # the CLI's flags too
        own = out.split("this method's own flags:\n")[1]
        assert [f for f in re.findall(r"^  (--[a-z-]+)", own, re.M)] == OWN[name], own
        assert " ".join(own.split()).count("(default: ") == len(OWN[name]) and not os.path.exists(tmp_path / "hf" / "hub"), own


def fork_of(name):
    """The (fork, own flags) a fork's file hands cli.run as a program."""
    caught, run = {}, cli.run
    cli.run = lambda fork, **own: caught.update(fork=fork, own=own)
    try:
        runpy.run_path(os.path.join(ROOT, "examples", f"{name}.py"), run_name="__main__")
    finally:
        cli.run = run
    return caught["fork"], caught["own"]


WHAT = {"select": "selection rule decides how many tokens a step commits", "cache": "cache policy decides what each "
        "call feeds", "propose": "step rule makes the proposals (and draws its own noise)", "stop": "stop rule decides "
        "when an answer has ended"}
REPLACED = [("eb_sampler", ["--threshold", "0.5"], "select"), ("eb_sampler", ["--factor", "1"], "select"),
            ("klass", ["--cache", "dual"], "cache"), ("klass", ["--threshold", "0.9"], "select"),
            ("dkv_cache", ["--cache", "prefix"], "cache"), ("dpad", ["--cache", "none"], "cache"),
            ("prophet", ["--temperature", "0.5"], "propose"), ("prophet", ["--steps", "16"], "propose"),
            ("prophet", ["--remasking", "random"], "propose"), ("prophet", ["--no-early-stop"], "stop")]


@pytest.mark.parametrize("name,argv,kind", REPLACED, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_flag_the_forks_part_replaces_is_refused_in_the_clis_words(monkeypatch, name, argv, kind):
    """eb_sampler.py --threshold 0.5 answered in generate()'s words ("pass select or threshold/factor"), after the
    weights; prophet.py --no-early-stop was silently ignored."""
    fork, own = fork_of(name)
    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("loaded the weights first"))
    with pytest.raises(ValueError) as e:
        cli.main([*RUN, *argv], fork, own)
    assert str(e.value) == f"{argv[0]} does not apply: this program's own {WHAT[kind]}; drop {argv[0]}"


def test_the_forks_flags_as_a_user_meets_them():
    """One line, exit status 2, before any model is loaded: a replaced flag, an own flag's bad value; and the
    fork's own --cache (prophet's: none or prefix) is its own, not the CLI's."""
    cases = {("eb_sampler", "--threshold", "0.5"): "error: --threshold does not apply: this program's own selection "
             "rule decides how many tokens a step commits; drop --threshold\n",
             ("eb_sampler", "--gamma", "x"): "error: argument --gamma: invalid float value: 'x' (see --help)\n",
             ("prophet", "--suffix-at", "y"): "error: argument --suffix-at: invalid int value: 'y' (see --help)\n"}
    got = programs({" ".join(case): (case[0], [*RUN, *case[1:]]) for case in cases})
    for case in cases:
        assert tuple(got[" ".join(case)]) == (2, "", cases[case]), (case, got[" ".join(case)])
    fork, own = fork_of("prophet")
    args = cli.parse_args([*RUN, "--cache", "prefix"], fork=fork, own=own)
    assert args.hooks["cache"] == "prefix" and args.cache == "dual"      # the fork's cache; the CLI's is unused
