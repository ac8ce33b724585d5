"""tools/dg_vs_official.py without the official side (it needs transformers, never installed beside the project): the
JSON it writes, by value against generate() run here on the prompts it records; and an official side that cannot run
is one line."""
import json
import math
import os
import stat
import sys

import pytest
import torch

from bounded import run_main
from conftest import GOLDEN, ROOT
from fastdllm import generate
from model import load_model

TOOL = os.path.join(ROOT, "tools", "dg_vs_official.py")
DG = os.path.join(GOLDEN, "diffusiongemma", "tiny_dg_seed1234")
RELEASE = dict(steps=3, entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("dg") / "dg.json"
    code, stdout, stderr = run_main(TOOL, ["--steps", "3", "--prompt-lengths", "6", "--gen-lengths", "16,32",
                                           "--batches", "1,2", "--repeat", "2", "--json", out])
    assert code == 0, stderr
    return json.loads(out.read_text()), stdout


def test_our_side_is_what_generate_does(result):
    res, stdout = result
    assert "official: not run (pass --official-python" in stdout and "--official-python" in res["official"]["not_run"]
    assert res["settings"] == RELEASE and res["seed"] == 1 and res["machine"]["threads"] == 1
    rows = res["side_by_side"]
    assert [(r["prompt_length"], r["gen_length"], r["batch"]) for r in rows] == [(6, 16, 1), (6, 16, 2), (6, 32, 1),
                                                                                 (6, 32, 2)]
    model = load_model(DG, device="cpu", dtype=torch.float32)
    for r in rows:
        ids = torch.tensor(r["prompts"])
        assert ids.shape == (r["batch"], 6) and (ids[:, 0] == 2).all()
        assert not torch.isin(ids[:, 1:], torch.tensor([0, 1, 2, 50, 106])).any()     # no special id of the model
        g = torch.Generator().manual_seed(1)
        out, st = generate(model, ids, gen_length=r["gen_length"], generator=g, cache="prefix", **RELEASE)
        o = r["ours"]
        assert (o["calls"], o["row_calls"], o["answer_tokens"]) == (st["nfe"], st["row_nfe"], st["answer_tokens"])
        assert o["fingerprint"] == torch.randint(0, 2 ** 31 - 1, (1,), generator=g).item()
        assert sum(o["steps_per_canvas"]) == o["calls"] and len(o["steps_per_canvas"]) <= r["canvases"]
        assert r["canvases"] == math.ceil(r["gen_length"] / 16) and max(o["steps_per_canvas"]) <= 3
        assert len(o["cpu_s_runs"]) == 2 and o["cpu_s"] == pytest.approx(min(o["cpu_s_runs"]), abs=1e-4)
        assert o["ms_per_call"] == pytest.approx(1000 * o["cpu_s"] / o["calls"]) and o["repeatable"] is True
        assert r["official"] is None and r["ratio"] is None and r["calls_agree"] is None


def test_tokens_per_call_beside_llada_and_fastdllm_v2(result):
    res, _ = result
    rows = res["families"]
    assert [(r["gen_length"], r["model"].split(" (")[0]) for r in rows] == [
        (g, m) for g in (16, 32) for m in ("DiffusionGemma", "LLaDA", "Fast-dLLM v2")]
    table1 = {r["gen_length"]: r for r in res["side_by_side"] if r["batch"] == 1}
    llada = load_model(os.path.join(GOLDEN, "llada-tiny"), device="cpu", dtype=torch.float32)
    for r in rows:
        ids = torch.tensor(table1[r["gen_length"]]["prompts"])
        if r["model"].startswith("DiffusionGemma"):
            o = table1[r["gen_length"]]["ours"]
            assert (r["calls"], r["answer_tokens"], r["canvases"]) == (o["calls"], o["answer_tokens"],
                                                                       len(o["steps_per_canvas"]))
        if r["model"].startswith("LLaDA"):
            _, st = generate(llada, ids, gen_length=r["gen_length"], block_length=16, cache="dual", threshold=0.9)
            assert (r["calls"], r["answer_tokens"], r["canvases"]) == (st["nfe"], st["answer_tokens"],
                                                                       r["gen_length"] // 16)
        if r["model"].startswith("Fast-dLLM v2"):     # one block of 32 after the prompt's, for both lengths
            assert r["canvas"] == 32 and r["canvases"] == 1 and r["answer_tokens"] <= 32 + 1 - 6
        assert r["tokens_per_call"] == pytest.approx(r["answer_tokens"] / r["calls"])
        assert r["calls_per_canvas"] == pytest.approx(r["calls"] / r["canvases"])


def fake_python(tmp_path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("kind,words", [
    ("missing", "not an executable file; pass the python of an environment with transformers 5.23.0"),
    ("dies", "the official side ended: boom"),
    ("no transformers", "cannot run the official DiffusionGemma (ModuleNotFoundError: import of transformers halted"),
])
def test_an_official_side_that_cannot_run_is_one_line(tmp_path, kind, words):
    python = {"missing": lambda: str(tmp_path / "nothing"),
              "dies": lambda: fake_python(tmp_path, "echo boom >&2; exit 1"),
              # the real interpreter with transformers made unimportable: the script's own import guard answers
              "no transformers": lambda: fake_python(tmp_path, f'exec "{sys.executable}" -c "import sys; '
                                                     f"sys.modules['transformers'] = None; sys.argv = sys.argv[1:]; "
                                                     f'exec(open(sys.argv[0]).read())" "$@"')}[kind]()
    code, _, stderr = run_main(TOOL, ["--official-python", python, "--steps", "1", "--gen-lengths", "16",
                                      "--batches", "1", "--prompt-lengths", "4", "--repeat", "1"])
    assert code == 2 and words in stderr and stderr.count("\n") == 1, stderr
