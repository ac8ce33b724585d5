"""
harness.py through lm-evaluation-harness's own command line, on the demo task (demo/arith.yaml: the demo
model's held-out problems, exact match on the final number), offline on a CPU: lm-eval's accuracy equals
demo/eval.py's for the same problems and settings, answers do not depend on the batch size, a loglikelihood
task is refused before any weights load, `until` cuts the answer, and two gloo processes share the work.

lm-eval's CLI is run in this process (harness.main() reads sys.argv), except for the two-process run. Its
TaskManager would index lm-eval's ~15,000 built-in task files on every run (~8 s on a 2-core VM); the demo
task needs none of them, so the tests pass include_defaults=False.
"""
import functools
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -r requirements-eval.txt")
import datasets  # noqa: E402  (lm-eval's dependency)
import lm_eval.tasks  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "demo"))
import eval as demo_eval  # noqa: E402  (demo/eval.py)
import harness  # noqa: E402
from conftest import copy_checkpoint, write_tokenizer  # noqa: E402
from train import TEMPLATES, heldout  # noqa: E402

DEMO = dict(gen_length=32, block_length=8)
TASK = os.path.join(ROOT, "demo", "arith.yaml")
FINAL = re.compile(r"The answer is (-?[0-9]+)")      # the task's filter


@pytest.fixture(scope="module")
def demo():
    model = harness.load_model(os.path.join(ROOT, "demo", "llada-arith"), device="cpu", dtype=torch.float32)
    guide = harness.load_model(os.path.join(ROOT, "demo", "qwen2-arith"), device="cpu", dtype=torch.float32)
    tok = harness.Chat(os.path.join(ROOT, "demo", "llada-arith"), model.config).tok
    return model, guide, tok


def lm_eval_run(monkeypatch, tmp_path, model_args: str, *args, tasks="demo_arith", include="demo"):
    """harness.py's command line, as `python harness.py ...` from the repo root -> (exit code, results,
    {task: samples sorted by doc_id}, throughput)."""
    out = tmp_path / "out"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    monkeypatch.setattr(sys, "argv", ["harness.py", "--model", "fastdllm", "--model_args", model_args,
                                      "--include_path", str(include),
                                      "--tasks", tasks, "--output_path", str(out), "--log_samples", *args])
    rc = harness.main()
    if rc:
        return rc, None, None, None
    read = lambda pattern: sorted(glob.glob(str(out / "*" / pattern)))  # noqa: E731
    results = json.loads(open(read("results_*.json")[-1]).read())
    samples = {}
    for path in read("samples_*.jsonl"):
        rows = [json.loads(line) for line in open(path)]
        samples[re.search(r"samples_(.+)_\d{4}-\d\d-\d\dT", path)[1]] = sorted(rows, key=lambda r: r["doc_id"])
    throughput = json.loads(open(read("throughput_*.json")[-1]).read())
    return rc, results, samples, throughput


def test_task_data_is_the_demo_heldout_problems():
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "demo", "arith.jsonl"))]
    for row, (q, _, (t, a, b)) in zip(rows, heldout(len(rows)), strict=True):
        assert row == {"question": q, "answer": str(a + b if TEMPLATES[t][0] == "+" else a - b)}


SETTINGS = [   # (name, model_args, demo/eval.py's call)
    ("baseline", "cache=none,threshold=none,steps=32", dict(steps=32, cache="none", threshold=None)),
    ("dual, tau 0.9", "cache=dual,threshold=0.9,steps=32", dict(steps=32, cache="dual", threshold=0.9)),
    ("dual, tau 0.5", "cache=dual,threshold=0.5,steps=32", dict(steps=32, cache="dual", threshold=0.5)),
    ("FreeCache", "cache=free,threshold=none,steps=32", dict(steps=32, cache="free", threshold=None)),
    ("guided", "cache=prefix,guide=demo/qwen2-arith", dict(cache="prefix", accept="deterministic")),
]


@pytest.mark.parametrize("name,model_args,kw", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_accuracy_equals_demo_eval(monkeypatch, tmp_path, demo, name, model_args, kw):
    model, guide, tok = demo
    rc, results, samples, throughput = lm_eval_run(
        monkeypatch, tmp_path, "model=demo/llada-arith,gen_length=32,block_length=8," + model_args,
        "--batch_size", "3")       # 10 batches of 3 and one of 2; demo/eval.py decodes all 32 at once
    assert rc == 0
    problems = heldout(32)
    if "accept" in kw:
        answers = demo_eval.solve_guided(model, guide, tok, problems, **kw)[0]
    else:
        answers = demo_eval.solve(model, tok, problems, **kw, **DEMO)[0]
    truth = [str(a + b if TEMPLATES[t][0] == "+" else a - b) for _, _, (t, a, b) in problems]
    expected = sum((m := FINAL.search(ans)) is not None and m[1] == y for ans, y in zip(answers, truth)) / 32
    assert results["results"]["demo_arith"]["exact_match,final-number"] == pytest.approx(expected)
    assert [s["resps"][0][0] for s in samples["demo_arith"]] == answers     # the same answers, one by one
    t = throughput["tasks"]["demo_arith"]
    assert t["requests"] == 32 and t["nfe"] > 0 and t["tokens_per_call"] == pytest.approx(t["tokens"] / t["nfe"])
    # generated tokens up to the first end token, prompt excluded: the answers' own tokens
    assert t["tokens"] == sum(len(tok.encode(a, add_special_tokens=False).ids) for a in answers)
    assert (t["guide_calls"] > 0) == ("accept" in kw)


PADDED = """include: {task}
task: demo_arith_padded
doc_to_text: "{{{{ 'The ' * (question | length % 4) }}}}{{{{question}}}}"
"""


def test_answers_do_not_depend_on_the_batch_size(monkeypatch, tmp_path):
    """Batch 1 vs 4, on the task and on a copy whose prompts differ in length by up to 3 tokens (so rows
    are left-padded): identical answers, sample by sample, in lm-eval's --log_samples."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(TASK, tasks)
    (tasks / "padded.yaml").write_text(PADDED.format(task=TASK))
    runs = []
    for batch in ("1", "4"):
        run_dir = tmp_path / batch
        run_dir.mkdir()
        rc, results, samples, _ = lm_eval_run(monkeypatch, run_dir, "model=demo/llada-arith,gen_length=32,"
                                              "block_length=8,threshold=0.9", "--batch_size", batch,
                                              tasks="demo_arith,demo_arith_padded", include=tasks)
        assert rc == 0
        runs.append({task: [s["resps"] for s in rows] for task, rows in samples.items()})
    lengths = {len(s["arguments"]["gen_args_0"]["arg_0"].split()) for s in samples["demo_arith_padded"]}
    assert len(lengths) > 1 and len(runs[0]["demo_arith_padded"]) == 32
    assert runs[0] == runs[1]


LOGLIKELIHOOD = """include: {task}
task: demo_arith_loglikelihood
output_type: loglikelihood
doc_to_target: " {{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_loglikelihood_task_is_refused_before_any_weights_load(monkeypatch, tmp_path, capsys):
    (tmp_path / "ll.yaml").write_text(LOGLIKELIHOOD.format(task=TASK))

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded")
    monkeypatch.setattr(harness, "load_model", no_weights)
    rc, *_ = lm_eval_run(monkeypatch, tmp_path, "model=demo/llada-arith", tasks="demo_arith_loglikelihood",
                         include=tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"error: {harness.REFUSAL}"


def request(text, **gen_kwargs):
    return Instance("generate_until", {}, (text, gen_kwargs), 0, ("demo", 0, 1))


def test_until_cuts_at_the_first_stop_string_and_max_gen_toks_rounds_up():
    lm = harness.FastDLLM(model=os.path.join(ROOT, "demo", "llada-arith"), block_length=8, device="cpu")
    q = heldout(1)[0][0]
    full, cut, early = lm.generate_until([request(q, max_gen_toks=32), request(q, until=[". The", "="], max_gen_toks=30),
                                          request(q, until=". The", max_gen_toks=32)])
    assert FINAL.search(full) and "=" in full.split(". The")[0]
    assert cut == full.split("=")[0] and early == full.split(". The")[0]      # the earliest stop string wins
    assert "max_gen_toks 30 -> gen_length 32, a multiple of block_length 8" in lm.said


def test_chat_template_is_the_models_own(tmp_path):
    """With --apply_chat_template lm-eval renders through chat.Chat (the CLI's template); the demo model has
    none and says so."""
    folder = copy_checkpoint("llada-tiny", tmp_path)
    cfg = harness.read_config(folder)
    write_tokenizer(folder, {cfg.mask_id: "<|mdm_mask|>", cfg.eos_id: "<|endoftext|>", 1: "<|startoftext|>",
                             2: "<|start_header_id|>", 3: "<|end_header_id|>", 4: "<|eot_id|>"})
    lm = harness.FastDLLM(model=folder, device="cpu")
    turns = [{"role": "user", "content": "w7 w8"}, {"role": "assistant", "content": "w9"},
             {"role": "user", "content": "w10"}]
    chat = harness.Chat(folder, cfg)
    assert lm.apply_chat_template(turns) == chat.render(turns)
    assert lm.encode(chat.render(turns)) == chat.encode(chat.render(turns))     # the rendered specials, once
    with pytest.raises(ValueError, match="no chat template"):
        harness.FastDLLM(model=os.path.join(ROOT, "demo", "llada-arith"), device="cpu").apply_chat_template(turns)


@pytest.mark.parametrize("kw,error", [
    (dict(treshold=0.9), "unknown --model_args key 'treshold'"),
    (dict(batch_size="auto"), "no 'auto'"),
    (dict(gen_length=30), "not a multiple of block_length"),
    (dict(cache="dual-ish"), "unknown cache mode"),
])
def test_bad_model_args_fail_in_one_line_before_loading(kw, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        harness.FastDLLM(model="/nonexistent", device="cpu", **kw)


def test_every_generate_setting_is_a_model_arg():
    import dataclasses
    names = {f.name for f in dataclasses.fields(harness.Settings)} - harness.SUPPLIED
    assert names == set(harness.SETTINGS) and {"threshold", "factor", "cache", "accept", "verify_chunk"} <= names


TWO_PROCESSES = """import functools, sys
import datasets, lm_eval.tasks
datasets.config.HF_DATASETS_CACHE = sys.argv.pop(1)
lm_eval.tasks.TaskManager = functools.partial(lm_eval.tasks.TaskManager, include_defaults=False)
sys.path.insert(0, {root!r})
import harness
sys.exit(harness.main())
"""


def test_two_gloo_processes_share_the_requests(tmp_path):
    """torchrun, 2 CPU processes: lm-eval shards the 32 requests by rank and gathers every sample on rank 0;
    the throughput counts both processes' requests."""
    script = tmp_path / "run.py"
    script.write_text(TWO_PROCESSES.format(root=ROOT))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # its own session, so that a hang kills torchrun's workers too, not only torchrun
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), str(tmp_path / "datasets"), "--model", "fastdllm",
                             "--model_args", "model=demo/llada-arith,gen_length=32,block_length=8",
                             "--include_path", "demo", "--tasks", "demo_arith", "--batch_size", "4",
                             "--output_path", str(tmp_path / "out"), "--log_samples"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, stderr[-3000:]
    samples = [json.loads(line) for path in glob.glob(str(tmp_path / "out" / "*" / "samples_*.jsonl"))
               for line in open(path)]
    assert sorted(s["doc_id"] for s in samples) == list(range(32))
    throughput = json.loads(open(glob.glob(str(tmp_path / "out" / "*" / "throughput_*.json"))[0]).read())
    assert throughput["world_size"] == 2 and throughput["tasks"]["demo_arith"]["requests"] == 32
    assert "|demo_arith|" in stdout and "fastdllm throughput, demo_arith (2 processes)" in stdout   # after the table
    results = json.loads(open(glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))[0]).read())
    assert results["results"]["demo_arith"]["exact_match,final-number"] == 1.0     # as one process (dual, 0.9)
