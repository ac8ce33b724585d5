"""
harness.py through lm-evaluation-harness's own command line, on the demo task (demo/arith.yaml: the demo
model's held-out problems, exact match on the final number), offline on a CPU: lm-eval's accuracy equals
demo/eval.py's for the same problems and settings, answers and model calls per problem do not depend on the
batch size, a loglikelihood task is refused before any weights load, `until` cuts the answer, two gloo
processes share the work, a launcher that starts fewer processes than asked is refused, and bad model
arguments fail in one line before anything is loaded.

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
from types import SimpleNamespace

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
    """harness.py's command line, as `python apps/harness.py ...` from the repo root -> (exit code, results,
    {task: samples sorted by doc_id}, throughput). monkeypatch: the fixture, or a pytest.MonkeyPatch()."""
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
    assert t["requests"] == 32 and 0 < t["batched_calls"] <= t["row_calls"]
    assert t["calls_per_problem"] == pytest.approx(t["row_calls"] / 32)
    # tokens per call: per problem (it was answer tokens over batched calls, 46 on a 32-position canvas when
    # guided at batch 8): at most the canvas, whatever the batch size
    assert t["tokens_per_call"] == pytest.approx(t["answer_tokens"] / t["row_calls"]) and t["tokens_per_call"] <= 32
    # generated tokens up to the first end token, prompt excluded: the answers' own tokens
    assert t["answer_tokens"] == sum(len(tok.encode(a, add_special_tokens=False).ids) for a in answers)
    assert t["tokens_per_s"] == pytest.approx(t["answer_tokens"] / t["seconds"])
    assert (t["guide_calls"] > 0) == ("accept" in kw)


PADDED = """include: {task}
task: demo_arith_padded
doc_to_text: "{{{{ 'The ' * (question | length % 4) }}}}{{{{question}}}}"
"""


@pytest.fixture(scope="module")
def by_batch(tmp_path_factory):
    """Batch 1 and 4, on the task and on a copy whose prompts differ in length by up to 3 tokens (so rows are
    left-padded), gen_length left to the task (its max_gen_toks 32) -> {batch: (samples, throughput)}."""
    tmp_path = tmp_path_factory.mktemp("by_batch")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    shutil.copy(TASK, tasks)
    (tasks / "padded.yaml").write_text(PADDED.format(task=TASK))
    runs = {}
    for batch in ("1", "4"):
        run_dir = tmp_path / batch
        run_dir.mkdir()
        with pytest.MonkeyPatch.context() as mp:
            rc, _, samples, throughput = lm_eval_run(mp, run_dir, "model=demo/llada-arith,block_length=8,threshold=0.9",
                                                     "--batch_size", batch, tasks="demo_arith,demo_arith_padded",
                                                     include=tasks)
        assert rc == 0
        runs[batch] = samples, throughput
    return runs


def test_answers_do_not_depend_on_the_batch_size(by_batch):
    """Identical answers at batch 1 and 4, sample by sample, in lm-eval's --log_samples."""
    (one, _), (four, _) = by_batch["1"], by_batch["4"]
    lengths = {len(s["arguments"]["gen_args_0"]["arg_0"].split()) for s in one["demo_arith_padded"]}
    assert len(lengths) > 1 and len(one["demo_arith_padded"]) == 32
    assert {task: [s["resps"] for s in rows] for task, rows in one.items()} == \
        {task: [s["resps"] for s in rows] for task, rows in four.items()}


def test_calls_per_problem_do_not_depend_on_the_batch_size(by_batch):
    """The bug: the harness reported NFE and tokens/call over batched calls, so the same problems gave NFE 159
    at batch 1 and 21 at batch 8. Now the papers' figure, model calls per problem (generate()'s row_nfe), is
    reported, the same at any batch size; batched calls are reported apart, and they do shrink."""
    one, four = by_batch["1"][1]["tasks"], by_batch["4"][1]["tasks"]
    for task in ("demo_arith", "demo_arith_padded"):
        for key in ("requests", "row_calls", "calls_per_problem", "answer_tokens", "tokens_per_call"):
            assert one[task][key] == four[task][key], (task, key)
        assert one[task]["batched_calls"] == one[task]["row_calls"] > four[task]["batched_calls"]
        assert 1 <= one[task]["calls_per_problem"] <= 32


@pytest.mark.parametrize("repo", ["Efficient-Large-Model/Fast_dLLM_v2_7B"])
def test_block_diffusion_answers_and_calls_do_not_depend_on_the_batch_size(tmp_path, repo):
    """The issue's run: demo_arith --limit 8 on a tiny Fast-dLLM v2 release at --batch_size 4 and 1. Its
    prompts end in different grid blocks; docs 2, 6 and 7 were answered to the batch's longest prompt's grid block.
    Now every answer, and the calls per problem, as at batch 1."""
    from tools.checkpoint import make_release
    d = str(tmp_path / "ckpt")
    make_release(d, repo)
    runs = {}
    for batch in ("1", "4"):
        (tmp_path / batch).mkdir()
        with pytest.MonkeyPatch.context() as mp:
            rc, _, samples, throughput = lm_eval_run(mp, tmp_path / batch, f"model={d},threshold=0.9", "--limit", "8",
                                                     "--batch_size", batch)
        assert rc == 0
        runs[batch] = [s["resps"] for s in samples["demo_arith"]], throughput["tasks"]["demo_arith"]
    (one, t1), (four, t4) = runs["1"], runs["4"]
    assert one == four and len(one) == 8 and len(set(map(str, one))) > 1
    assert [t1[k] for k in ("row_calls", "answer_tokens")] == [t4[k] for k in ("row_calls", "answer_tokens")]
    assert t1["batched_calls"] > t4["batched_calls"]


def test_throughput_records_the_gen_length_used(by_batch):
    """The bug: throughput.json recorded the gen_length setting (256) when the task's max_gen_toks (32) was
    used; it records what each task used."""
    throughput = by_batch["1"][1]
    assert throughput["settings"]["gen_length"] == 32
    assert {t["gen_length"] for t in throughput["tasks"].values()} == {32}


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


DEMO_MODEL = os.path.join(ROOT, "demo", "llada-arith")


@pytest.mark.parametrize("kw,error", [
    (dict(treshold=0.9), "unknown --model_args key 'treshold'"),
    (dict(pretrained="x"), "unknown --model_args key 'pretrained' (fastdllm's is model=)"),
    (dict(batch_size="auto"), "no 'auto'"),
    (dict(batch_size=0), "batch_size must be a positive integer"),
    (dict(max_batch_size=8), "max_batch_size (8) only bounds lm-eval's --batch_size auto"),
    (dict(gen_length=30), "not a multiple of block_length"),
    (dict(gen_length="abc"), "gen_length must be an integer"),
    (dict(cache="dual-ish"), "unknown cache mode"),
    (dict(cache=3), "cache must be a mode name"),
    # the bugs: these passed the constructor and failed after loading, as a traceback or a late error
    (dict(seed="abc"), "seed must be an integer in [0, 2**64)"),
    (dict(seed=-1), "seed must be an integer in [0, 2**64)"),
    (dict(seed=2 ** 64), "seed must be an integer in [0, 2**64)"),
    (dict(device=1), "device must be a name"),
    (dict(dtype=[1]), "dtype must be a name"),
    (dict(device="tpu"), "unknown --device 'tpu'"),
    (dict(dtype="int8"), "unknown --dtype 'int8'"),
    (dict(quantize="int4"), "quantize='int4' is not supported: fastdllm quantizes weights to 'int8'"),
    (dict(stop_at_eos="yes"), "stop_at_eos must be False, True"),
    (dict(remasking="lowest"), "unknown remasking 'lowest'"),
    (dict(accept="topk"), "accept only apply to guided diffusion"),
    (dict(accept_k=3, speculative=True), "speculative, accept_k only apply to guided diffusion"),
    (dict(guide="demo/qwen2-arith", threshold=0.9), "pass guide or threshold, not both"),
    (dict(guide="demo/qwen2-arith", temperature=0.5), "temperature must be 0"),
    (dict(guide="demo/qwen2-arith", accept="best"), "unknown accept rule 'best'"),
    (dict(model=None), "the model must be a folder path or a Hugging Face repo id, not None"),
    (dict(model=""), "the model must be a folder path or a Hugging Face repo id, not ''"),
    (dict(model=DEMO_MODEL, guide=7), "the guide must be a folder path or a Hugging Face repo id, not 7"),
    (dict(model=DEMO_MODEL, guide=DEMO_MODEL), "the guide is a llada model, not a causal LM"),
    # issue 39: refused by generate() at the first request, after the weights
    (dict(model=DEMO_MODEL, top_k=5), "top_k is a Dream option (top_p, top_k, alg_temp): LLaDA samples with "
     "temperature only; drop top_k"),
    (dict(model=DEMO_MODEL, remasking="entropy"), "unknown remasking 'entropy' for llada"),
    (dict(model=DEMO_MODEL, guide=os.path.join(ROOT, "tests", "golden", "qwen2-tiny")),
     "the diffusion model's end-of-text id 0 is none of the guide's special ids"),
])
def test_bad_model_args_fail_in_one_line_before_loading(monkeypatch, kw, error):
    def no_weights(*a, **k):
        raise AssertionError("weights were loaded")
    monkeypatch.setattr(harness, "load_model", no_weights)
    with pytest.raises(ValueError, match=re.escape(error)):
        harness.FastDLLM(**dict(model="/nonexistent", device="cpu") | kw)


def test_a_repo_id_and_the_prompts_are_checked_before_the_weights(monkeypatch, tmp_path):
    """Issue 39: a repo id's model_args (top_k=5 on LLaDA) and a request's prompt (the mask token in it, or too long
    for the model) were refused by generate(), after the weights were fetched and read; now on the small files."""
    asked = []

    def resolve(name, role="model", weights=True):     # the repo's small files, here the demo's folder
        asked.append(weights)
        assert not weights, "the weights were fetched"
        return DEMO_MODEL
    monkeypatch.setattr(harness, "resolve_model_dir", resolve)
    monkeypatch.setattr(harness, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    lm = harness.FastDLLM(model="someone/llada", device="cpu", top_k=5)      # a repo id: fetched on first use
    with pytest.raises(ValueError, match=r"^top_k is a Dream option"):
        lm.net()
    assert asked == [False]
    lm = harness.FastDLLM(model="someone/llada", device="cpu", block_length=8)
    request = lambda text, n: SimpleNamespace(args=(text, {"until": [], "max_gen_toks": n}), task_name="arith")
    for text, n, error in (("2 + 2 <|mdm_mask|>", 8, "the prompt contains the mask token id 47"),
                           ("2 + 2", 64, "exceeds the model's 64 positions")):
        with pytest.raises(ValueError, match=rf"^a request of arith: .*{re.escape(error)}"):
            lm.generate_until([request("1 + 1", 8), request(text, n)])


def test_folders_are_checked_when_the_model_is_made_and_the_guide_is_named(tmp_path):
    """The bug: a missing guide folder said "model folder ... not found", after lm-eval had built its tasks
    (and, for a real task, downloaded its data set). Local folders are checked at once, each named by role."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="^guide folder '.*missing' not found.*Qwen/Qwen2.5-1.5B-Instruct"):
        harness.FastDLLM(model=DEMO_MODEL, guide=str(tmp_path / "missing"), device="cpu").net()
    with pytest.raises(FileNotFoundError, match="^model folder '.*missing' not found"):
        harness.FastDLLM(model=str(tmp_path / "missing"), device="cpu")
    with pytest.raises(FileNotFoundError, match="is a file: pass the guide folder"):
        harness.FastDLLM(model=DEMO_MODEL, guide=str(tmp_path / "file"), device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        harness.FastDLLM(model=str(tmp_path / "empty"), device="cpu")
    broken = shutil.copytree(DEMO_MODEL, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json is not a readable tokenizer.json"):
        harness.FastDLLM(model=str(broken), device="cpu")


def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    """The bug: lm-eval only warns ("Could not save results aggregated") when --output_path cannot be created,
    after the whole run: the results were lost, exit status 0."""
    (tmp_path / "out").write_text("a file where the results folder would be")
    rc, *_ = lm_eval_run(monkeypatch, tmp_path, "model=demo/llada-arith,block_length=8", "--limit", "2")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"error: --output_path {tmp_path / 'out'}: ") and "is a file" in err[-1]
    assert (tmp_path / "out").read_text() == "a file where the results folder would be"
    monkeypatch.setattr(sys, "argv", ["harness.py", "--model", "fastdllm", "--model_args", "model=demo/llada-arith",
                                      "--tasks", "demo_arith", "--output_path", "/proc/fastdllm_out"])
    assert harness.main() == 2           # a folder nothing can be written in, even by root
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --output_path /proc/fastdllm_out: "
                                                                       "cannot write in /proc")


def test_none_from_lm_eval_is_the_no_cache_baseline():
    """The bug: the documented baseline `cache=none,threshold=none` was refused where lm-eval turns the word
    into None before the model sees it (its Python API's model_args string; `None` on its command line)."""
    lm = harness.FastDLLM.create_from_arg_string(f"model={DEMO_MODEL},cache=none,threshold=none,stop_at_eos=off",
                                                 {"batch_size": None, "device": "cpu"})
    assert (lm.settings["cache"], lm.settings["threshold"], lm.settings["stop_at_eos"]) == ("none", None, False)
    lm = harness.FastDLLM.create_from_arg_obj({"model": DEMO_MODEL, "cache": None, "threshold": "none"}, {})
    assert (lm.settings["cache"], lm.settings["threshold"]) == ("none", None)


def test_lm_eval_flags_and_model_args_merge(monkeypatch, tmp_path, capsys):
    """The bug: lm-eval always passes its --batch_size and --device (defaults 1 and cuda:0) beside
    --model_args and merges them as cls(**model_args, **flags), so the documented `--model_args device=cpu` or
    `batch_size=4` was a TypeError traceback. Now lm-eval's defaults yield; a value given twice must agree."""
    rc, _, samples, throughput = lm_eval_run(monkeypatch, tmp_path / "a", "model=demo/llada-arith,block_length=8,"
                                             "device=cpu,batch_size=4", "--limit", "5")
    assert rc == 0 and len(samples["demo_arith"]) == 5 and throughput["settings"]["batch_size"] == 4
    assert throughput["tasks"]["demo_arith"]["batched_calls"] < throughput["tasks"]["demo_arith"]["row_calls"]
    capsys.readouterr()
    rc, *_ = lm_eval_run(monkeypatch, tmp_path / "b", "model=demo/llada-arith,batch_size=4", "--batch_size", "8")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == ("error: batch_size is given twice, as --batch_size 8 and as --model_args "
                                   "batch_size=4: pass one")


@pytest.mark.parametrize("gen_kwargs,error", [
    (dict(max_gen_toks="abc"), "max_gen_toks must be an integer >= 1, not 'abc'"),
    (dict(max_gen_toks=0), "max_gen_toks must be an integer >= 1, not 0"),
    (dict(until=5), "a request's until must be a string or a list of strings, not 5"),
    (dict(until=["\n", None]), "a request's until must be a string or a list of strings"),
])
def test_bad_request_settings_fail_in_one_line(gen_kwargs, error):
    """The bug: a task's (or --gen_kwargs') max_gen_toks or until of the wrong type was a TypeError traceback."""
    lm = harness.FastDLLM(model=DEMO_MODEL, block_length=8, device="cpu")
    with pytest.raises(ValueError, match=re.escape(error)):
        lm.generate_until([request(heldout(1)[0][0], **gen_kwargs)])


def test_local_completions_works_with_requirements_eval():
    """The bug: lm-eval's API models (`--model local-completions` against serve.py, docs/serve.md) need its
    [api] extra (tenacity, aiohttp, ...), which requirements-eval.txt did not install: ModuleNotFoundError on a
    fresh install. The pins are the only versions named, and they name no torch (requirements.txt's is used)."""
    import lm_eval.models.openai_completions  # noqa: F401  (registers it; lm-eval imports it so, lazily)
    from lm_eval.api.registry import get_model
    model = get_model("local-completions")(model="demo", base_url="http://127.0.0.1:9/v1/completions",
                                           tokenizer_backend=None)
    assert type(model).__name__ == "LocalCompletionsAPI"
    with open(os.path.join(ROOT, "requirements-eval.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    assert "lm-eval[api]==0.4.13" in pins and all("==" in p and not p.startswith("torch") for p in pins)


def test_compile_is_one_compiled_for_every_batch(monkeypatch):
    """The bug: model_args compile=True reached generate() as True, so every batch compiled the model call
    anew (on CUDA: captured its graphs again). Now one fastdllm.Compiled, made with the model, serves every
    batch (generate() is stubbed: the test is about what it is given, not about compiling)."""
    lm = harness.FastDLLM(model=DEMO_MODEL, block_length=8, device="cpu", compile=True)
    given = []

    def generate(net, ids, **kw):
        given.append(kw["compile"])
        return torch.cat([ids, ids], 1), {"row_length": [ids.shape[1]] * ids.shape[0]}
    monkeypatch.setattr(harness, "generate", generate)
    lm.decode(None, [[5, 6]], 8)
    lm.decode(None, [[7]], 8)
    assert isinstance(given[0], harness.Compiled) and given[1] is given[0]
    assert lm.get_model_info()["fastdllm"]["compile"] is True      # reported as it was given


def test_defaults_are_the_clis():
    """DEFAULTS comes from cli.CLI_DEFAULTS (block_length 32 is generate()'s own): the values docs/eval.md
    states."""
    d = harness.DEFAULTS
    assert [d[k] for k in ("gen_length", "block_length", "cache", "threshold", "stop_at_eos")] == [256, 32, "dual",
                                                                                                  0.9, True]


def test_every_generate_setting_is_a_model_arg():
    import dataclasses
    names = {f.name for f in dataclasses.fields(harness.Settings)} - harness.SUPPLIED
    assert names == set(harness.SETTINGS) and {"threshold", "factor", "cache", "accept", "verify_chunk"} <= names


TWO_PROCESSES = """import functools, sys
import datasets, lm_eval.tasks
datasets.config.HF_DATASETS_CACHE = sys.argv.pop(1)
lm_eval.tasks.TaskManager = functools.partial(lm_eval.tasks.TaskManager, include_defaults=False)
sys.path.insert(0, {root!r} + "/apps")
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
    proc = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), str(tmp_path / "datasets"), "--model", "fastdllm",
                             "--model_args", "model=demo/llada-arith,gen_length=32,block_length=8",
                             "--include_path", "demo", "--tasks", "demo_arith", "--batch_size", "4",
                             "--output_path", str(tmp_path / "out"), "--log_samples"], env)
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == 0, stderr[-3000:]
    samples = [json.loads(line) for path in glob.glob(str(tmp_path / "out" / "*" / "samples_*.jsonl"))
               for line in open(path)]
    assert sorted(s["doc_id"] for s in samples) == list(range(32))
    throughput = json.loads(open(glob.glob(str(tmp_path / "out" / "*" / "throughput_*.json"))[0]).read())
    assert throughput["world_size"] == 2 and throughput["tasks"]["demo_arith"]["requests"] == 32
    assert "|demo_arith|" in stdout and "fastdllm throughput, demo_arith (2 processes)" in stdout   # after the table
    results = json.loads(open(glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))[0]).read())
    assert results["results"]["demo_arith"]["exact_match,final-number"] == 1.0     # as one process (dual, 0.9)


def run_group(cmd, env):
    """A launcher and its worker processes, as one process group killed whole after 180 s."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_accelerate_cpu_launch_of_two_processes_is_refused(tmp_path):
    """The bug: `accelerate launch --cpu --num_processes 2 harness.py ...` starts one process (accelerate runs
    several on CPUs only through MPI) and the run went on silently as one. It now stops in one line naming
    torchrun, before any task is built."""
    script = tmp_path / "run.py"
    script.write_text(TWO_PROCESSES.format(root=ROOT))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    proc = run_group([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
                             "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                             str(script), str(tmp_path / "datasets"), "--model", "fastdllm",
                             "--model_args", "model=demo/llada-arith,gen_length=32,block_length=8",
                             "--include_path", "demo", "--tasks", "demo_arith", "--output_path", str(tmp_path / "out")], env)
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode != 0 and "|demo_arith|" not in stdout
    assert "error: accelerate launch asked for several processes but started one" in stderr
    assert "use torchrun --nproc_per_node N apps/harness.py" in stderr
    assert not (tmp_path / "out").exists()


def test_a_block_length_that_does_not_divide_the_default_gen_length():
    """Issue 28: block_length=7 failed with "gen_length 256 is not a multiple of block_length 7", a gen_length
    the user never set: each request's max_gen_toks decides it, rounded up to whole blocks. Now it decodes
    (saying how it rounded), exactly as with that gen_length given; a canvas a request's max_gen_toks makes
    impossible names max_gen_toks and the fix."""
    q = heldout(1)[0][0]
    lm = harness.FastDLLM(model=DEMO_MODEL, block_length=7, device="cpu")
    (answer,) = lm.generate_until([request(q, max_gen_toks=30)])
    assert "max_gen_toks 30 -> gen_length 35, a multiple of block_length 7" in lm.said
    assert [answer] == harness.FastDLLM(model=DEMO_MODEL, block_length=7, gen_length=35,
                                        device="cpu").generate_until([request(q)])
    assert FINAL.search(answer)
    lm = harness.FastDLLM(model=DEMO_MODEL, block_length=8, gen_length=16, steps=2, device="cpu")
    with pytest.raises(ValueError, match=re.escape("steps 2 is not divisible by the number of blocks 4 (gen_length / "
                                                   "block_length): use a multiple, e.g. steps=32 (here gen_length 32 is "
                                                   "the request's max_gen_toks 32: set another with --gen_kwargs "
                                                   "max_gen_toks=N")):
        lm.generate_until([request(q, max_gen_toks=32)])


def test_quantize_int8_loads_int8_weights_and_answers():
    """quantize=int8 in --model_args: the model's linear layers as torchao's int8 (quant.py), the demo answered."""
    pytest.importorskip("torchao", reason="torchao is not installed: pip install -r requirements-extras.txt")
    from torchao.quantization import Int8Tensor
    lm = harness.FastDLLM(model=DEMO_MODEL, block_length=8, device="cpu", quantize="int8")
    assert isinstance(lm.net().layers[0].mlp.w_gate_up.weight, Int8Tensor)
    assert lm.get_model_info()["fastdllm"]["quantize"]
    [answer] = lm.generate_until([request("Tom has 23 apples and buys 45 more. How many apples does he have?",
                                          max_gen_toks=32)])
    assert answer.endswith("The answer is 68."), answer


@pytest.mark.parametrize("key,near", [("treshold", "threshold"), ("blocklength", "block_length"), ("modle", "model"),
                                      ("batchsize", "batch_size")])
def test_an_unknown_model_arg_gets_the_nearest_name(key, near):
    """Issue 28: a typo got the list of keys but no "did you mean", which the server's unknown fields have."""
    with pytest.raises(ValueError, match=re.escape(f"unknown --model_args key {key!r} (did you mean {near!r}?): ")):
        harness.FastDLLM(model=DEMO_MODEL, device="cpu", **{key: 1})
