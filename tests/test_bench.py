"""bench.py: that its numbers are computed right (never how fast anything is), that its random checkpoints
(tools/checkpoint.py) are in the real format, that the GPU check's small CPU shape (tools/gpu_check.py) still
runs end to end, that computing the LM head only at open positions (generate's `cols`) changes no decision, and
that bad input to bench.py and tools/ is one line that loses nothing."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import bench
import bounded
from conftest import GOLDEN, ROOT, copy_checkpoint, write_tokenizer
import cli
from fastdllm import generate
from model import load_model
from test_cache import PROMPT_DREAM, PROMPT_LLADA
from test_cli import LLADA_CHAT
from shapes import SHAPES, SPECIALS_FROM_END, hf_config, make_checkpoint


def test_agreement_counts_the_reference_answer_up_to_its_end_token():
    eos = {9}
    ref = torch.tensor([[1, 2, 3, 9, 9, 9], [1, 2, 3, 4, 5, 6]])
    assert bench.answer_lengths(ref, eos).tolist() == [3, 6]
    assert bench.agreement(ref, ref, eos) == (1.0, None)
    # row 0 is scored on [1, 2, 3, 9] only: what follows its end token is filler
    gen = torch.tensor([[1, 2, 3, 9, 7, 7], [1, 2, 0, 4, 5, 0]])
    share, first = bench.agreement(gen, ref, eos)
    assert share == pytest.approx(8 / 10) and first == 2
    gen = torch.tensor([[1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 5, 6]])     # the end token itself is scored
    assert bench.agreement(gen, ref, eos) == (pytest.approx(9 / 10), 3)


def test_real_special_ids_and_config_fields():
    """The real vocabularies get the real ids, and config.json has exactly the real files' fields."""
    llada = hf_config("llada", **{k: v for k, v in SHAPES["llada-8b"].items() if k != "family"})
    assert (llada["mask_token_id"], llada["eos_token_id"], llada["d_model"], llada["embedding_size"],
            llada["mlp_hidden_size"]) == (126336, 126081, 4096, 126464, 12288)
    dream = hf_config("dream", **{k: v for k, v in SHAPES["dream-7b"].items() if k != "family"})
    assert (dream["mask_token_id"], dream["eos_token_id"], dream["hidden_size"], dream["num_key_value_heads"],
            dream["intermediate_size"], dream["vocab_size"]) == (151666, 151643, 3584, 4, 18944, 152064)
    for family, cfg in (("llada", llada), ("dream", dream)):
        with open(os.path.join(GOLDEN, f"{family}-tiny", "config.json")) as f:
            assert set(cfg) == set(json.load(f))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_make_checkpoint_writes_the_real_layout(tmp_path, family):
    """Same tensor names and sharding files as the golden checkpoints (copies of the official layouts), and
    the strict loader takes it."""
    size = make_checkpoint(str(tmp_path), family, 32, 2, 1024, n_heads=4, n_kv_heads=2 if family == "dream" else 4,
                           ffn=64, shards=3)
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    with open(os.path.join(GOLDEN, f"{family}-tiny", "model.safetensors.index.json")) as f:
        golden = json.load(f)
    assert set(index["weight_map"]) == set(golden["weight_map"])
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == size == golden["metadata"]["total_size"]
    model = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    assert model.config.family == family and model.config.mask_id == 1024 - SPECIALS_FROM_END[family]["mask"]


def test_modes_rows_count_calls_tokens_and_agreement(llada):
    """The exact reference comes first and agrees with itself; calls x tokens per call = tokens; without a
    cache every call feeds the whole canvas."""
    G, P = 32, PROMPT_LLADA.shape[1]
    mode_list = bench.modes(["prefix", "dual"], [0.9], [], [False, True])
    assert mode_list[0] == dict(cache="none", threshold=None, factor=None, stop=False, guided=None)
    assert len(mode_list) == 1 + 2 * 2 * 2
    rows, _ = bench.run_modes(llada, PROMPT_LLADA, mode_list, dict(gen_length=G, block_length=8, steps=G), warmup=False)
    ref = rows[0]
    assert (ref["nfe"], ref["fed_per_call"], ref["agreement"], ref["first_diff"], ref["speedup"]) == (G, P + G, 1.0, None, 1.0)
    for r in rows:
        assert "error" not in r and 0 <= r["agreement"] <= 1
        if r["stop"] == "-":
            assert r["tokens_per_call"] * r["nfe"] == pytest.approx(G)
        assert r["answer_tokens"] <= G and r["all_tokens_per_s"] == pytest.approx(G / r["seconds"])
        assert (r["first_diff"] is None) == (r["agreement"] == 1.0)
    dual = next(r for r in rows if r["cache"] == "dual" and r["rule"] == "1 tok/step" and r["stop"] == "-")
    assert dual["fed_per_call"] == pytest.approx((4 * (P + G) + 4 * 7 * 8) / 32)   # one refresh + 7 blocks-only per block


def test_calls_and_tokens_per_problem_do_not_depend_on_the_batch(llada):
    """NFE counts forward passes of the batch; NFE/problem (generate()'s row_nfe, the papers' figure) and
    tokens/call are per problem, so two rows of different prompts give each row's own figures (tokens/call
    counted the whole batch's tokens per call: 2.00 for one token per step at batch 2)."""
    kw, mode_list = dict(gen_length=32, block_length=8, steps=32), bench.modes(["dual"], [0.9], [], [False, True])
    prompts = [PROMPT_LLADA, PROMPT_LLADA.flip(1)]
    alone = [bench.run_modes(llada, p, mode_list, kw, warmup=False)[0] for p in prompts]
    both = bench.run_modes(llada, torch.cat(prompts), mode_list, kw, warmup=False)[0]
    for one, other, pair in zip(*alone, both):
        assert one["nfe"] == one["calls_per_problem"] and other["nfe"] == other["calls_per_problem"]
        assert pair["calls_per_problem"] == (one["nfe"] + other["nfe"]) / 2
        assert max(one["nfe"], other["nfe"]) <= pair["nfe"] < one["nfe"] + other["nfe"]   # blocks run to the slowest
        committed = one["tokens_per_call"] * one["nfe"] + other["tokens_per_call"] * other["nfe"]
        assert pair["tokens_per_call"] == pytest.approx(committed / (one["nfe"] + other["nfe"]))
    assert {r["tokens_per_call"] for r in both if r["rule"] == "1 tok/step" and r["stop"] == "-"} == {1.0}


def test_a_mode_the_settings_forbid_is_a_row_not_a_crash(dream):
    """Dream's whole-canvas sampler has no cache: those rows say why, the others run."""
    rows, _ = bench.run_modes(dream, PROMPT_DREAM, bench.modes(["dual"]), dict(gen_length=16, block_length=None, steps=16),
                              warmup=False)
    assert "error" not in rows[0] and "no cache" in rows[1]["error"]
    assert "n/a" in bench.table(rows, bench.MODE_COLUMNS).splitlines()[-1]


class FullHead(torch.nn.Module):
    """The model before the cut: the LM head over every fed position, indexed afterwards."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.lm_head, self.rows = model, model.config, model.lm_head, []

    def hidden(self, *args):
        return self.inner.hidden(*args)

    def logits(self, x, rows):
        logits = self.inner.logits(x)                   # every fed position
        self.rows.append(len(rows))
        return logits[:, rows]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "free"])
@pytest.mark.parametrize("rule", [{}, {"threshold": 0.9}, {"threshold": 0.5}, {"factor": 1.0}])
def test_lm_head_only_at_open_positions_changes_nothing(llada, dream, family, cache, rule):
    """generate() computes the LM head only at block positions where some row still has a mask. Against the
    model computing every fed position's logits and indexing them afterwards: the same ids, calls, and tokens
    committed per call; and at one token per step the head did skip decided positions."""
    model, prompt, kw = ((llada, PROMPT_LLADA, dict(gen_length=32, block_length=8, steps=32)) if family == "llada"
                         else (dream, PROMPT_DREAM, dict(gen_length=64, block_length=16, steps=64)))
    prompt = torch.cat([prompt, prompt.flip(1)])          # two rows: a position is skipped once both decided it
    full = FullHead(model)
    ids, st = generate(model, prompt, cache=cache, **kw, **rule)
    ids_full, st_full = generate(full, prompt, cache=cache, **kw, **rule)
    assert torch.equal(ids, ids_full)
    assert (st["nfe"], st["committed"], st["fed"]) == (st_full["nfe"], st_full["committed"], st_full["fed"])
    if not rule:
        assert sum(full.rows) < st["nfe"] * kw["block_length"]


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_golden_runs_with_the_whole_head(llada, dream, llada_golden, dream_golden, name):
    """Every golden run of the official code through the whole-head model: the official ids and calls, so
    the cut is exactly what the official code decides."""
    from test_golden import DREAM_RUNS, LLADA_RUNS, dream_call, llada_call
    model = FullHead(llada if name == "llada" else dream)
    runs = ([(torch.tensor(llada_golden["prompts"][r["batch"]]), llada_call(r), r["output"], r["nfe"]) for r in LLADA_RUNS]
            if name == "llada" else
            [(torch.tensor(r["input_ids"]), dream_call(r), r["sequences"], r["nfe"]) for r in DREAM_RUNS])
    for prompt, kw, want, nfe in runs:
        out, st = generate(model, prompt, **kw)
        assert out.tolist() == want and st["nfe"] == nfe


def bench_cli(*args, timeout=120):
    return subprocess.run([sys.executable, os.path.join(ROOT, "apps", "bench.py"), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    d = copy_checkpoint("llada-tiny", tmp_path_factory.mktemp("bench"))
    write_tokenizer(d, LLADA_CHAT)
    return d


def test_bench_run_passes_factor_to_the_parallel_rows(llada_dir, monkeypatch, capsys):
    calls, real = [], bench.generate        # bench.py runs the rows with its own reference to generate()
    monkeypatch.setattr(bench, "generate", lambda model, prompt, **kw: calls.append((prompt, kw)) or
                        real(model, prompt, **kw))
    bench.main(["run", "--model", llada_dir, "--prompt", "w1 w2", "--gen-length", "16", "--block-length", "8",
                "--factor", "2"])
    rules = {(kw["cache"], kw.get("threshold"), kw.get("factor")) for _, kw in calls}
    assert {(c, None, 2.0) for c in ("none", "prefix", "dual", "free")} <= rules   # --factor F is a row per cache
    assert "factor 2" in capsys.readouterr().out


def test_bench_run_table_and_json(tmp_path):
    d = copy_checkpoint("llada-tiny", tmp_path)
    write_tokenizer(d, LLADA_CHAT)
    out = tmp_path / "bench.json"
    r = bench_cli("run", "--model", d, "--prompt", "w1 w2 w3", "--gen-length", "32", "--block-length", "8",
                  "--caches", "prefix,dual,free", "--thresholds", "0.9,0.5", "--stops", "off,on", "--batch", "2",
                  "--json", str(out))
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("| ")]
    header, rows = [c.strip() for c in lines[0].strip("|").split("|")], lines[1:]
    assert header[:4] == ["cache", "rule", "early stop", "NFE"] and "agreement" in header and "answer tok/s" in header
    cells = [dict(zip(header, (c.strip() for c in l.strip("|").split("|")))) for l in rows]
    assert (cells[0]["cache"], cells[0]["rule"], cells[0]["NFE"], cells[0]["agreement"]) == ("none", "1 tok/step", "32", "1.000")
    assert len(cells) == 1 + 3 * 4 * 2            # reference + caches x (1 tok, tau 0.9, tau 0.5, factor 1) x stop
    assert int(next(c for c in cells if c["rule"] == "tau 0.5")["NFE"]) < 32
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == len(cells) and saved["settings"]["batch"] == 2
    assert {"torch", "device", "dtype", "threads", "cpu"} <= set(saved["environment"])
    same = bench.compare(str(out), str(out))
    assert same.count("| yes |") == len(cells) and "1.00x" in same


def test_sweep_feeds_what_each_cache_feeds(tmp_path):
    """Positions fed per generated token (one token per step): none feeds the canvas, dual one refresh per
    block plus the block."""
    out = tmp_path / "sweep.json"
    r = bench_cli("sweep", "--d-model", "64", "--layers", "1", "--vocab", "1024", "--prompt-length", "8",
                  "--block-length", "8", "--lengths", "16,32", "--caches", "none,dual", "--thresholds", "",
                  "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "| gen | cache |" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    fed = {(x["gen_length"], x["cache"]): x["fed_per_token"] for x in rows}
    assert fed == {(16, "none"): 24, (32, "none"): 40, (16, "dual"): (2 * 24 + 2 * 7 * 8) / 16,
                   (32, "dual"): (4 * 40 + 4 * 7 * 8) / 32}


def test_gpu_check_small_shape_on_cpu(tmp_path):
    """The GPU check's whole path at a tiny shape on the CPU, so it cannot rot between GPU runs: the model made
    in place, the speed rows with their step types and bytes, 16 rows against their solo runs, the int8 phase, the
    golden runs in float32 (exact) and bf16 (three of each family: every one is test_golden's). It checks the
    script, not the machine: no time box (--budget 0) and eager only (compiling is the GPU run's), so what runs
    never depends on the machine's speed. Then the time box itself,
    with a budget no phase fits (1 s): every picked phase is skipped and says so, the others do not run."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--shape", "tiny", "--device", "cpu",
           "--gen-length", "16", "--block-length", "8", "--prompt-length", "8", "--official-dir", str(tmp_path)]
    out = tmp_path / "gpu.json"
    r = bounded.run([*cmd, "--budget", "0", "--variants", "eager", "--golden-runs", "3", "--profile-calls", "2",
                     "--out", str(out)], timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    # the phases since the CUDA graphs: no official code here (tools/gpu_prep.py brings it), so said and skipped
    assert res["official"]["error"].startswith("skipped: no ") and "tools/gpu_prep.py" in res["official"]["error"]
    assert res["graphs_ids"]["equal"] == res["graphs_ids"]["total"] > 50 and not res["graphs_ids"]["differ"]
    assert res["launches"]["ours"] <= 1.2 * res["launches"]["minimal"]
    assert res["profile"]["eager"]["launches_per_call"] > 0 and res["profile"]["eager"]["kernels"]
    eager = {x["mode"]: x for x in res["speed"] if x["variant"] == "eager"}
    assert set(eager) == {"baseline", "dual 0.9"} and eager["baseline"]["nfe"] == 16
    assert eager["dual 0.9"]["refresh"]["steps"] == 2 and eager["dual 0.9"]["cached"]["ms"] > 0
    assert eager["baseline"]["refresh"]["bytes"] > eager["dual 0.9"]["cached"]["bytes"] > 0
    assert res["batch"] == {"eager": dict(rows=16, equal=16)} and len(res["speed"]) == 2     # no compiled rows
    assert res["golden"]["float32"]["exact"] == res["golden"]["float32"]["total"] == 9     # 3 of each family
    assert 0 < res["golden"]["bfloat16"]["agreement"] <= 1
    if importlib.util.find_spec("torchao") is None:      # the int8 phase without torchao: said, the rest ran
        assert "pip install -r requirements-extras.txt" in res["int8"]["error"] and "int8_speed" not in res
    else:      # the model of the speed rows, quantized: fewer bytes, the same modes again, the logits near
        int8 = res["int8"]
        assert int8["bytes_int8"] < 0.8 * int8["bytes_before"] and int8["max_logit_diff"] < 0.1 * int8["max_logit"]
        assert {x["mode"]: x["nfe"] for x in res["int8_speed"]}["baseline"] == 16 and 0 < int8["ids_agreement"] <= 1
    boxed = tmp_path / "boxed.json"
    r = bounded.run([*cmd, "--budget", "1", "--phases", "speed,golden", "--out", str(boxed)], timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(boxed.read_text())
    assert "speed" not in res and "batch" not in res and "batch" not in r.stdout
    assert [ln.split(":")[0] for ln in r.stdout.splitlines() if "skipped" in ln] == [
        "speed eager baseline", "speed eager dual 0.9", "speed graphs baseline", "speed graphs dual 0.9",
        "speed compiled baseline", "speed compiled dual 0.9", "golden float32", "golden bfloat16"]


STUB_OFFICIAL = {   # the official llada/ folder's interface, nothing of its decode: the side-by-side plumbing's test
    "generate.py": """import torch
def generate(model, prompt, steps=128, gen_length=128, block_length=128, temperature=0.0, mask_id=126336,
             threshold=None):
    if prompt.shape[0] > 1:
        raise RuntimeError("one row")             # as the pinned commit's canvas (1, L)
    return torch.cat([prompt, torch.full((1, gen_length), 7, device=prompt.device)], 1), gen_length + 1
generate_with_prefix_cache = generate_with_dual_cache = generate
""",
    "model/__init__.py": "",
    "model/configuration_llada.py": "class LLaDAConfig(dict):\n    def __init__(self, **kw):\n        super().__init__(kw)\n",
    "model/modeling_llada.py": """import torch
class LLaDAModelLM(torch.nn.Module):
    def __init__(self, config, init_params=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(2, 2))
"""}


def test_gpu_check_side_by_side_phase_on_cpu(tmp_path):
    """The official phase's plumbing on the CPU (the GPU run's is the real code: tools/gpu_prep.py), against a stub
    of the official llada/ folder that refuses a batch, as the pinned commit's generate does: its child process, a
    row per mode and batch, the batch-4 rows its batch-1 run (batched False), ours through CUDA graphs (here: their
    static buffers) and, at batch 1, eager, and the side-by-side table in "rows"; then the profile of the graphs."""
    for name, text in STUB_OFFICIAL.items():
        os.makedirs(os.path.dirname(tmp_path / "llada" / name), exist_ok=True)
        (tmp_path / "llada" / name).write_text(text)
    out = tmp_path / "gpu.json"
    r = bounded.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--shape", "tiny", "--device", "cpu",
                     "--gen-length", "8", "--block-length", "8", "--prompt-length", "8", "--batch", "4", "--budget", "0",
                     "--phases", "official,profile", "--variants", "graphs", "--profile-calls", "2", "--official-eager",
                     "--official-dir", str(tmp_path / "llada"), "--out", str(out)], timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["official"]["error"] is None and len(res["official"]["official"]) == 12
    assert {o["batched"] for o in res["official"]["official"] if o["batch"] == 4} == {False}
    assert [x["side"] for x in res["official"]["ours"]].count("ours, eager") == 6          # batch 1, --official-eager
    assert [x["side"] for x in res["official"]["ours"]].count("ours, CUDA graphs") == 12
    assert len(res["rows"]) == 12 and all(x["official_nfe"] == 9 and x["ours_nfe"] >= 1 for x in res["rows"])
    four = [x for x in res["rows"] if x["batch"] == 4]
    assert all(x["tokens_ratio"] > 0 and x["ids_agreement"] < 1 and not x["official_batched"] for x in four)
    assert res["profile"]["graphs"]["kernels"] and res["profile"]["graphs"]["wall_ms"] > 0


def test_the_library_never_imports_the_benchmark(capsys):
    """python apps/bench.py is the benchmark's entry point; the library and its CLI never load bench.py or tools/
    (no import cycle), and fastdllm.py's --help has no benchmark flags."""
    import ast
    for name in sorted(f for f in os.listdir(ROOT) if f.endswith(".py") and f != "bench.py"):
        with open(os.path.join(ROOT, name)) as f:
            tree = ast.parse(f.read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"bench", "tools"}, name
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    assert "bench" not in capsys.readouterr().out.lower()


def test_guide_settings_reach_only_the_guided_rows(dream, qwen2):
    """`bench.py run --guide G --speculative` passes the guide's settings with every row's keywords: the
    unguided rows must drop them (generate() refuses guided-only settings without a guide), not become n/a."""
    kw = dict(gen_length=16, block_length=8, steps=16, speculative=True, accept_k=5)
    rows, _ = bench.run_modes(dream, PROMPT_DREAM, bench.modes(["prefix"], [0.9], guided=["deterministic"]), kw,
                              guide=qwen2, warmup=False)
    assert all("error" not in r for r in rows), rows
    assert {r["rule"] for r in rows} >= {"tau 0.9", "speculative deterministic"}


# ----------------------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, no traceback, and no file of the user's overwritten

SHAPE = ["--d-model", "64", "--layers", "1", "--vocab", "1024", "--prompt-length", "8", "--block-length", "8",
         "--gen-length", "16", "--caches", "none", "--thresholds", ""]
ROW = dict(cache="none", rule="1 tok/step", stop="-", batch=1, gen_length=16, nfe=16, seconds=0.5, ids_sha1="abc")


@pytest.mark.parametrize("content,error", [
    ({"rows": []}, "has no measured rows (it has none): nothing to compare"),
    ({"rows": [dict(cache="none", rule="tau 0.9", stop="-", batch=1, gen_length=16, error="no cache")]},
     "has no measured rows (all 1 are n/a): nothing to compare"),
    ({"rows": [dict(ROW, nfe=None) | {"cache": "dual"}]}, "is not a bench.py --json file: row 1 has nfe=None"),
    ({"rows": [{k: v for k, v in ROW.items() if k != "batch"}]}, "row 1 has batch=None"),   # was a KeyError
    ({"rows": [dict(ROW, seconds=0)]}, "row 1 has seconds=0"),                            # was a ZeroDivisionError
    ({"rows": "abc"}, "it has no list of rows"),                                        # was an AttributeError
    ({"rows": [1]}, "it has no list of rows"),
    ([1, 2], "it has no list of rows"),
    ("not json", "(not JSON:"),
    (b"\xff\xfe", "(not JSON:"),
    (None, "is a folder: pass a file written by bench.py --json"),
])
def test_compare_refuses_what_it_cannot_compare(tmp_path, content, error):
    """The bug: `bench.py compare a.json a.json` on result files without measured rows (or with rows lacking a
    field) was a KeyError traceback. Each such file is now one line naming it."""
    path = tmp_path / "a.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=re.escape(error)):
        bench.compare(str(path), str(path))


def test_compare_of_results_with_no_mode_in_common(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": [ROW]}))
    b.write_text(json.dumps({"rows": [dict(ROW, cache="dual")]}))
    with pytest.raises(ValueError, match="no row of .*b.json has the mode of a row of .*a.json"):
        bench.compare(str(a), str(b))
    assert "| yes |" in bench.compare(str(a), str(a))


def test_modes_dir_never_overwrites_what_it_did_not_write(tmp_path):
    """The bug: `bench.py modes --dir D`, D holding a model.safetensors but no config.json, overwrote that file
    and exited 0. A non-empty folder that is not a checkpoint this tool wrote is refused; a file is refused; a
    checkpoint written with other flags is refused; the tool's own is reused, untouched."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.safetensors").write_bytes(b"their weights")
    with pytest.raises(ValueError, match="is not empty and holds no checkpoint written by tools/checkpoint.py"):
        bench.main(["modes", *SHAPE, "--dir", str(theirs)])
    assert os.listdir(theirs) == ["model.safetensors"]
    assert (theirs / "model.safetensors").read_bytes() == b"their weights"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        bench.main(["modes", *SHAPE, "--dir", str(tmp_path / "file")])
    with pytest.raises(ValueError, match="is a file, not a folder"):
        bench.main(["modes", *SHAPE, "--dir", str(tmp_path / "file" / "sub")])
    ours = tmp_path / "ours"
    bench.main(["modes", *SHAPE, "--dir", str(ours)])
    written = {f: os.stat(ours / f).st_mtime_ns for f in os.listdir(ours)}
    assert "random_checkpoint.json" in written and "model.safetensors" in written
    bench.main(["modes", *SHAPE, "--dir", str(ours)])                  # reused
    with pytest.raises(ValueError, match="holds a checkpoint written with other flags"):
        bench.main(["modes", *SHAPE, "--dir", str(ours), "--gain", "2"])   # was silently reused at gain 1.13
    assert {f: os.stat(ours / f).st_mtime_ns for f in os.listdir(ours)} == written


def test_checkpoint_tool_writes_only_into_a_new_or_empty_folder(tmp_path):
    """tools/checkpoint.py checked only for a config.json, so a folder of other files was written over."""
    from tools import checkpoint
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.safetensors").write_bytes(b"their weights")
    flags = ["--d-model", "64", "--layers", "1", "--vocab", "1024"]
    with pytest.raises(ValueError, match="is not empty"):
        checkpoint.main([str(theirs), *flags])
    assert (theirs / "model.safetensors").read_bytes() == b"their weights"
    (tmp_path / "empty").mkdir()
    checkpoint.main([str(tmp_path / "empty"), *flags])
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        checkpoint.main([str(tmp_path / "empty"), *flags])


def test_a_shape_too_large_for_the_machine_is_one_line(tmp_path):
    """A huge --vocab or --d-model was a failed allocation deep in torch (or a full disk halfway through the
    write); now one line before anything is written."""
    from tools import checkpoint
    huge = ["--d-model", "512", "--layers", "1", "--vocab", "2000000000"]
    with pytest.raises(ValueError, match="the shape flags describe a 4096.0 GB checkpoint, more than the"):
        bench.main(["modes", *huge, "--dir", str(tmp_path / "d")])
    with pytest.raises(ValueError, match="GB checkpoint, more than the"):
        checkpoint.main([str(tmp_path / "c"), *huge])
    assert os.listdir(tmp_path) == []


def test_json_output_overwrites_only_an_earlier_result(tmp_path, capsys):
    """--json may replace an earlier result (a rerun), never another file; and its temporary file is a new
    one (it was `<path>.tmp`, overwriting and then removing a file of that name)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(SystemExit) as e:
        bench.main(["modes", *SHAPE, "--json", str(notes)])
    assert e.value.code == 2 and "is not an earlier result of these tools" in capsys.readouterr().err
    out, tmp = tmp_path / "out.json", tmp_path / "out.json.tmp"
    tmp.write_text("mine too")
    for _ in range(2):     # the second run replaces the first's result
        bench.main(["modes", *SHAPE, "--json", str(out)])
        assert json.loads(out.read_text())["rows"] and tmp.read_text() == "mine too"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "out.json", "out.json.tmp"]


TOOL_CASES = [
    (["apps/bench.py", "compare", "{rows}", "{rows}"], "has no measured rows"),
    (["apps/bench.py", "modes", *SHAPE, "--guide", "{missing}"], "guide folder '{missing}' not found"),
    (["apps/bench.py", "modes", *SHAPE, "--guide", "demo/llada-arith"], "the guide is a llada model, not a causal LM"),
    (["tools/checkpoint.py", "{file}", "--d-model", "64"], "is a file, not a folder"),
    # a folder nothing can be written in, even by root (os.access said yes: the write failed after the run)
    (["apps/bench.py", "modes", *SHAPE, "--json", "/proc/fastdllm.json"], "cannot write '/proc/fastdllm.json'"),
    (["apps/bench.py", "modes", *SHAPE, "--dir", "/proc/fastdllm"], "cannot write --dir /proc/fastdllm"),
    (["tools/loop_time.py", "--model", "{missing}"], "model folder '{missing}' not found"),
    (["tools/loop_time.py", "--model", "demo/llada-arith", "--root", "{missing}"], "holds no fastdllm.py"),
    (["tools/loop_time.py", "--model", "demo/llada-arith", "--gen-length", "0"], "expected an integer >= 1"),
    (["tools/load.py", "--clients", "0"], "argument --clients: expected an integer >= 1, got '0'"),
    (["tools/load.py", "--port", "1", "--clients", "1", "--requests", "1"], "none of the 1 requests got an answer"),
]


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory):
    """Every TOOL_CASES command line, run as its script's __main__ in one process (tests/bounded.py drive)."""
    tmp = tmp_path_factory.mktemp("tools")
    names = dict(missing=str(tmp / "missing"), file=str(tmp / "file"), rows=str(tmp / "rows.json"))
    (tmp / "file").write_text("x")
    (tmp / "rows.json").write_text('{"rows": []}')
    got = bounded.drive({i: (os.path.join(ROOT, argv[0]), [a.format(**names) for a in argv[1:]])
                         for i, (argv, _) in enumerate(TOOL_CASES)}, timeout=300, cwd=ROOT)
    return {int(i): r for i, r in got.items()}, names


@pytest.mark.parametrize("case", range(len(TOOL_CASES)), ids=[" ".join(a[:2]) for a, _ in TOOL_CASES])
def test_tools_bad_input_is_one_line(tool_runs, case):
    """The tools' command lines: each bad input one `error:` line on stderr, exit status 2, no traceback (they
    were tracebacks, a silent exit 0 with 0 requests, or guided rows all n/a)."""
    (code, _, err), names = tool_runs[0][case], tool_runs[1]
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert TOOL_CASES[case][1].format(**names) in lines[0]


@pytest.mark.parametrize("family", ["fastdllm_v2", "sdar"])
def test_modes_on_a_block_diffusion_checkpoint(tmp_path, family):
    """bench.py modes --family fastdllm_v2 / sdar: the prefix cache of a block-causal model is exact, so its
    one-token-a-step row agrees with the uncached reference everywhere; it feeds the block (v2: plus the position
    before it) against the stored prefix, the reference the whole canvas; the weights read per call are named."""
    out = tmp_path / "modes.json"
    r = bench_cli("modes", "--family", family, "--d-model", "64", "--layers", "1", "--vocab", "1024",
                  "--prompt-length", "8", "--gen-length", "16", "--block-length", "8", "--caches", "none,prefix",
                  "--thresholds", "", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert re.search(r"each call reads its \d+\.\d MiB of weights once", r.stdout)
    rows = {x["cache"]: x for x in json.loads(out.read_text())["rows"]}
    assert rows["prefix"]["agreement"] == 1.0 and rows["prefix"]["first_diff"] is None
    assert rows["prefix"]["ids_sha1"] == rows["none"]["ids_sha1"] and rows["prefix"]["nfe"] == rows["none"]["nfe"]
    assert rows["prefix"]["fed_per_call"] < rows["none"]["fed_per_call"]
