"""DiffusionGemma everywhere the others are, on a tiny checkpoint in the release's exact format (tools/checkpoint.py
--release google/diffusiongemma-26B-A4B-it; its canvas of 256, its generation_config.json's steps cut to 3 for the
tests' time): the command line (its flags, its defaults, the stream, the trace, prompt files, --interactive, the
refusals before the weights), the server (its request fields, /v1/denoise/info, the event stream, batches equal to
each request alone), the harness, bench.py and int8."""
import io
import json
import os
import re

import pytest
import torch

import cli
import loading
from conftest import serving
from chat import Chat
from fastdllm import generate
from model import load_model
from terminal import render_trace, streamer
from tools.checkpoint import make_release
from tools.gemma_checkpoint import make_gemma_release

QUESTIONS = ["w5 w6 w7", "w9 w10 w11 w12 w13 w14 w15 w16 w17", "w8", "w40 w41 w42 w43"]
STEPS = 3


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(folder, model, chat) of the release's format at tiny size, max_denoising_steps 3."""
    d = str(tmp_path_factory.mktemp("dg") / "ckpt")
    make_gemma_release(d)
    path = os.path.join(d, "generation_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | {"max_denoising_steps": STEPS}, f)
    model = load_model(d, device="cpu", dtype=torch.float32)
    return d, model, Chat(d, model.config)


def prompt_ids(chat, q: str) -> list:
    return chat.encode(chat.render([{"role": "user", "content": q}]))


def alone(release, q: str, seed: int = 0, **kw):
    """generate() on one question with the CLI's settings for DiffusionGemma (its canvas, its generation config, no
    threshold, DualCache: its exact prefix cache) -> (answer ids, stats)."""
    _, model, chat = release
    ids = prompt_ids(chat, q)
    out, stats = generate(model, torch.tensor([ids]), **dict(gen_length=256, cache="dual", eos_ids=sorted(
        chat.stop_ids), generator=torch.Generator().manual_seed(seed)) | kw)
    return out[0, len(ids):].tolist(), stats


def test_the_plain_command_answers(release, capsys):
    """`fastdllm.py --model <DiffusionGemma> --prompt ...` and nothing else: the CLI's defaults (DualCache, threshold
    0.9, block 32) are the others'; DiffusionGemma's are its canvas, its generation_config.json (3 steps here) and no
    threshold (it accepts by its entropy bound). The streamed answer is generate()'s with those, seed 0 (it failed:
    the mask id check read id -1)."""
    d, model, chat = release
    assert cli.main(["--model", d, "--prompt", QUESTIONS[0]]) is None
    *answer, cost = capsys.readouterr().out.rstrip("\n").split("\n")
    ids, stats = alone(release, QUESTIONS[0])
    assert "\n".join(answer) == chat.answer(ids) and cost.startswith(f"NFE {stats['nfe']} |") and stats["nfe"] == STEPS


def test_the_stream_prints_committed_canvases_only(release, capsys):
    """terminal.streamer on DiffusionGemma: a canvas's text once the canvas has ended (stats["final"]), never the
    argmax of one still denoising (it changes every step): every text printed so far is a prefix of the answer, and
    nothing is printed in the middle of a canvas."""
    _, model, chat = release
    ids = prompt_ids(chat, QUESTIONS[1])
    printer, shown = streamer(chat, len(ids), model.config.mask_id), []

    def on_step(x, st):
        printer(x, st)
        shown.append(capsys.readouterr().out)
    out, stats = generate(model, torch.tensor([ids]), gen_length=512, on_step=on_step, stop_at_eos=False,
                          stability_threshold=None, confidence_threshold=None)
    text = chat.answer(out[0, len(ids):].tolist())
    assert stats["nfe"] == 2 * STEPS and "".join(shown) == text and text
    assert all(text.startswith("".join(shown[:k])) for k in range(len(shown)))
    assert all(not piece for k, piece in enumerate(shown) if k % STEPS != STEPS - 1)


def test_trace_shows_each_steps_argmax_canvas(release, capsys):
    """--trace: a line per step, each the step's argmax canvas (on_step's view: what generate() shows), its changes
    since the step before in brackets."""
    d, model, chat = release
    assert cli.main(["--model", d, "--prompt", QUESTIONS[2], "--trace"]) is None
    lines = capsys.readouterr().out.splitlines()
    ids, views = prompt_ids(chat, QUESTIONS[2]), []
    alone(release, QUESTIONS[2], on_step=lambda x, st: views.append(x[0, len(ids):].tolist()))
    assert lines[:STEPS] == render_trace(views, chat.tok, model.config.mask_id, chat.stop_ids)
    assert len(views) == STEPS and lines[STEPS + 1].startswith(f"NFE {STEPS} |")


def test_a_prompt_file_batch_answers_each_prompt_as_alone(release, tmp_path, capsys):
    """--prompt-file: prompts of different lengths in one batch, each row drawing from a generator of its own (the
    per-row list; one generator would draw the batch's noise in one stream): each answer line is `--prompt`'s."""
    d = release[0]
    (tmp_path / "q.txt").write_text("\n".join(QUESTIONS) + "\n")
    assert cli.main(["--model", d, "--prompt-file", str(tmp_path / "q.txt"), "--batch-size", "4"]) is None
    batch = capsys.readouterr().out.rstrip("\n").split("\n")
    solo = []
    for q in QUESTIONS:
        assert cli.main(["--model", d, "--prompt", q, "--no-stream"]) is None
        solo.append(capsys.readouterr().out.rstrip("\n").rpartition("\n")[0])
    assert batch[:-1] == solo and len(set(solo)) == len(solo)


def test_interactive_answers_each_turn(release, monkeypatch, capsys):
    """--interactive: each turn answered in the chat format, the conversation so far rendered again (Gemma's turns)."""
    d, _, chat = release
    seen = []
    real = cli.generate
    monkeypatch.setattr(cli, "generate", lambda model, ids, **kw: seen.append(ids[0].tolist()) or real(model, ids,
                                                                                                         **kw))
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTIONS[0]}\n{QUESTIONS[2]}\nexit\n"))
    assert cli.main(["--model", d, "--interactive"]) is None
    out = capsys.readouterr().out
    assert out.count("assistant>") == 2 and out.count("NFE 3 |") == 2
    first = chat.answer(alone(release, QUESTIONS[0])[0])
    assert seen == [prompt_ids(chat, QUESTIONS[0]), chat.encode(chat.render([
        {"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first},
        {"role": "user", "content": QUESTIONS[2]}]))]


REFUSED = {   # argv: the one line, said from config.json before the weights
    "threshold": (["--threshold", "0.9"], r"^--threshold does not apply to DiffusionGemma: it samples at the "
                  r"temperatures --t-max down to --t-min and accepts by its --entropy-bound"),
    "factor": (["--factor", "1"], r"^--factor does not apply to DiffusionGemma"),
    "bound": (["--entropy-bound", "0"], r"^--entropy-bound must be a number > 0 \(got 0\.0\)"),
    "schedule": (["--t-min", "0.9"], r"need 0 <= --t-min < --t-max \(got --t-min 0\.9, --t-max 0\.8"),
    "half off": (["--stability-threshold", "none"], r"^set both --stability-threshold and --confidence-threshold"),
    "canvas": (["--block-length", "8"], r"^--block-length 8 is not this checkpoint's canvas: config\.json declares "
               r"canvas_length 256"),
    "free": (["--cache", "free"], r"^--cache 'free' does not apply to DiffusionGemma"),
    "flag type": (["--stability-threshold", "x"], r"--stability-threshold: expected an integer or none, got 'x'"),
    "llada": (["--entropy-bound", "0.2"], r"^--entropy-bound is DiffusionGemma's: a llada model does not read it; "
              r"drop --entropy-bound$"),
    "llada off": (["--t-min", "none", "--t-max", "none"], r"^--t-min is DiffusionGemma's: a llada model"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_its_flags_and_the_others_are_refused_before_the_weights(release, tmp_path, monkeypatch, case):
    argv, pattern = REFUSED[case]
    d = release[0]
    if case.startswith("llada"):
        d = str(tmp_path / "llada")
        make_release(d, "GSAI-ML/LLaDA-8B-Instruct")
    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("loaded the weights first"))
    with pytest.raises(ValueError) as e:
        cli.main(["--model", d, "--prompt", "w5", *argv])
    assert re.search(pattern, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_its_flags_reach_generate(release, capsys):
    """Each DiffusionGemma flag is the setting of the same name: the answer is generate()'s with them (none: off)."""
    d, _, chat = release
    flags = ["--entropy-bound", "1e6", "--t-min", "none", "--t-max", "none", "--stability-threshold", "0",
             "--confidence-threshold", "100", "--steps", "5", "--no-stream", "--seed", "4"]
    assert cli.main(["--model", d, "--prompt", QUESTIONS[3], *flags]) is None
    answer, cost = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    ids, stats = alone(release, QUESTIONS[3], seed=4, entropy_bound=1e6, t_min=None, t_max=None, stability_threshold=0,
                       confidence_threshold=100.0, steps=5)
    assert answer == chat.answer(ids) and cost.startswith(f"NFE {stats['nfe']} |") and stats["nfe"] == 1


# ----------------------------------------------------------------------------------------------------------
# The server

@pytest.fixture(scope="module")
def served(release):
    yield from serving(["--model", release[0]])


def chat_body(q: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": q}], **kw}


GEMMA = {"entropy_bound": 1e6, "t_min": None, "t_max": None, "stability_threshold": None, "confidence_threshold": None}


def test_the_server_lists_and_takes_what_diffusiongemma_reads(release, served):
    """GET /v1/denoise/info lists what generate()'s checks let a request set on DiffusionGemma (its five settings,
    steps and block_length; not threshold, factor, temperature, remasking, top_k nor the cache "free") and its
    defaults as its checkpoint decides them; a request sets them (null: off) and its answer reports them and is the
    CLI's decode with them; a value the model refuses is a 400 naming its field."""
    from test_serve import request
    app, port = served
    status, info = request(port, "GET", "/v1/denoise/info")
    assert status == 200 and info["family"] == "diffusion_gemma" and info["mask"] is None
    assert info["cache_modes"] == ["none", "prefix", "dual"] and info["remasking_modes"] == []
    assert info["settings"] == ["cache", "block_length", "steps", *GEMMA]
    want = {"entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
            "threshold": None, "block_length": 256}
    assert {k: info["defaults"][k] for k in want} == want
    status, got = request(port, "POST", "/v1/chat/completions", chat_body(QUESTIONS[3], seed=4, **GEMMA))
    choice = got["choices"][0]
    assert status == 200 and {k: choice["fastdllm"]["settings"][k] for k in GEMMA} == GEMMA
    ids, stats = alone(release, QUESTIONS[3], seed=4, **GEMMA)
    assert choice["message"]["content"] == release[2].answer(ids[:256]) and choice["fastdllm"]["nfe"] == stats["nfe"]
    for fields, param in [({"threshold": 0.9}, "threshold"), ({"temperature": 0.5}, "temperature"),
                          ({"entropy_bound": 0}, "entropy_bound"), ({"t_min": 0.9}, "t_min"),
                          ({"stability_threshold": None}, "stability_threshold"), ({"cache": "free"}, "cache"),
                          ({"block_length": 16}, "block_length"), ({"top_k": 3}, "top_k")]:
        status, r = request(port, "POST", "/v1/chat/completions", chat_body(QUESTIONS[0], **fields))
        assert (status, r.get("error", {}).get("param")) == (400, param), (fields, r)


def test_batched_requests_each_answer_as_alone(release, served):
    """Requests of different lengths at once, each with its own seed, are one batch whose rows draw each from a
    generator of their own: each answer, finish_reason and nfe (the calls that served it) are the request's alone,
    the CLI's path with its seed."""
    from test_serve import at_once
    app, port = served
    bodies = [chat_body(q, seed=10 + i, max_tokens=40) for i, q in enumerate(QUESTIONS)]
    results = at_once(app, port, bodies)
    assert max(out["choices"][0]["fastdllm"]["batch_size"] for _, out in results) > 1      # a batch was decoded
    for i, (q, (status, out)) in enumerate(zip(QUESTIONS, results)):
        assert status == 200, out
        ids, stats = alone(release, q, seed=10 + i)
        got, end = out["choices"][0], next((k for k, t in enumerate(ids[:40]) if t in app.chat.stop_ids), None)
        assert (got["message"]["content"], got["finish_reason"], got["fastdllm"]["nfe"]) == (
            app.chat.answer(ids[:40]), "length" if end is None else "stop", stats["nfe"])
        tokens = next((k for k, t in enumerate(ids) if t in app.chat.stop_ids), len(ids))   # to its end, as official
        assert got["fastdllm"]["tokens_per_call"] == round(tokens / stats["nfe"], 3)


def test_a_request_without_a_seed_gets_one_that_repeats_it(served):
    """DiffusionGemma always samples: a request without a seed draws a fresh one (the server has no --seed) and
    reports it; sent back, it repeats the answer; the OpenAI stream's pieces, the committed canvases, join to it."""
    from test_serve import events, post
    app, port = served
    first = post(port, "/v1/chat/completions", chat_body(QUESTIONS[1], max_tokens=300))["choices"][0]
    seed = first["fastdllm"]["seed"]
    again = post(port, "/v1/chat/completions", chat_body(QUESTIONS[1], max_tokens=300, seed=seed))["choices"][0]
    assert again["message"] == first["message"] and "seed" not in again["fastdllm"]
    chunks = events(port, "/v1/chat/completions", chat_body(QUESTIONS[1], max_tokens=300, seed=seed, stream=True))
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert "".join(pieces) == first["message"]["content"] and sum(map(bool, pieces)) <= 2 + 1


def replay(events: list) -> tuple:
    """The answer the event stream builds, each event checked against DiffusionGemma's contract (docs/serve.md):
    `committed` decides a position once, in canvas order; `drafted` only on the canvas after the committed ones;
    masks_left counts the positions not committed. -> (the final ids, each step's drafted canvas)."""
    start, steps, done = events[0], events[1:-1], events[-1]
    G, n = start["block_length"], start["positions"]
    canvas, final, drafts = [None] * n, 0, []
    for e in steps:
        assert [c["pos"] for c in e["committed"]] == list(range(final, final + len(e["committed"])))
        for c in e["committed"]:
            canvas[c["pos"]] = c["id"]
        final += len(e["committed"])
        assert all(final <= c["pos"] < final + G for c in e["drafted"]) and not e["edited"] + e["filled"]
        for c in e["drafted"]:
            canvas[c["pos"]] = c["id"]
        assert e["masks_left"] == n - final and e["final"] == final
        drafts.append(canvas[final:final + G])
    for c in done["cut"]:
        canvas[c["pos"]] = c["id"]
    return canvas, drafts


def test_the_event_stream_shows_each_steps_argmax_canvas(release, served):
    """POST /v1/denoise/stream on DiffusionGemma: a step event per decoder call of the answer; each step's drafted
    cells make the canvas being denoised that step's argmax (generate()'s on_step view alone, with the request's
    seed), a canvas is committed once it has ended, and the replay, then done's cut, is the answer's ids."""
    from test_serve import events
    app, port = served
    ev = events(port, "/v1/denoise/stream", chat_body(QUESTIONS[0], max_tokens=300, seed=3))
    start, steps, done = ev[0], ev[1:-1], ev[-1]
    assert start["block_length"] == 256 and start["positions"] == 512 and start["mask"] is None   # 300 in canvases
    views = []
    ids, stats = alone(release, QUESTIONS[0], seed=3, gen_length=512,
                       on_step=lambda x, st: views.append(x[0, -512:].tolist()))
    canvas, drafts = replay(ev)
    assert [e["step"] for e in steps] == list(range(1, stats["nfe"] + 1)) and done["fastdllm"]["nfe"] == stats["nfe"]
    for k, (draft, view) in enumerate(zip(drafts, views)):
        if k % STEPS < STEPS - 1:               # its canvas still denoising (adaptive stopping never fires here)
            s = 256 * (k // STEPS)
            assert draft == view[s:s + 256], k
        else:                                   # it ended: committed, the next one not started
            assert not steps[k]["drafted"] and len(steps[k]["committed"]) == 256 and draft == [None] * len(draft)
    assert canvas == ids and done["text"] == app.chat.answer(ids[:300])
    assert any(e["committed"] for e in steps)


# ----------------------------------------------------------------------------------------------------------
# The harness, bench.py, int8

def test_harness_answers_equal_generate_alone(release):
    """apps/harness.py's generate_until on DiffusionGemma with its defaults (the CLI's, then its own: its canvas, no
    threshold, its checkpoint's settings): a batch of prompts of different lengths, each answer the one generate()
    gives it alone (each row draws from a generator of its own), cut at the end token and the request's stop string."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -r requirements-eval.txt")
    import harness
    from lm_eval.api.instance import Instance
    d, model, chat = release
    lm = harness.FastDLLM(model=d, device="cpu", batch_size=4, seed=2)
    got = lm.generate_until([Instance("generate_until", {}, (q, {"max_gen_toks": 64, "until": ["w968"]}), 0,
                                      ("t", 0, 1)) for q in QUESTIONS])
    assert lm.settings["threshold"] is None and lm.settings["block_length"] == 256
    for q, text in zip(QUESTIONS, got):
        ids = chat.tok.encode(q).ids                 # lm-eval's request text is the prompt (no template asked)
        (out,), _ = generate(model, torch.tensor([ids]), gen_length=256, cache="dual", eos_ids=sorted(chat.stop_ids),
                             generator=torch.Generator().manual_seed(2))
        assert text == harness.cut(chat.answer(out[len(ids):].tolist()), ["w968"])
    assert len(set(got)) == len(got)
    t = lm.throughput["t"]
    assert t["batched_calls"] == STEPS and t["row_calls"] == 4 * STEPS


def test_active_weight_bytes_are_the_release_arithmetic(release):
    """quant.active_bytes (what one token reads: every weight but the experts it does not choose) on the tiny
    release in bf16 is tools/gemma_checkpoint.py's count from the config alone, x 2 bytes; weight_bytes is its total;
    int8 weights hold fewer of both."""
    from quant import active_bytes, weight_bytes
    from tools.gemma_checkpoint import TEXT_TINY, sizes
    total, active = sizes(TEXT_TINY)
    model = load_model(release[0], device="cpu", dtype=torch.bfloat16)
    assert (weight_bytes(model), active_bytes(model)) == (2 * total, 2 * active) and active < total
    int8 = load_model(release[0], device="cpu", dtype=torch.bfloat16, quantize="int8")
    assert active_bytes(int8) < active_bytes(model) and weight_bytes(int8) < weight_bytes(model)


def test_bench_rows_count_its_answer_tokens_per_call(release, tmp_path, capsys):
    """bench.py run on DiffusionGemma: its rows are its caches with its entropy bound (no threshold or factor rows,
    said), tokens per call its answer's tokens per decoder call (its accepted samples are renoised), each row's ids
    generate()'s, and the header says what a call reads: the weights at most, a token its active ones."""
    import bench
    from quant import active_bytes, weight_bytes
    d, model, chat = release
    out = tmp_path / "dg.json"
    bench.main(["run", "--model", d, "--prompt", QUESTIONS[1], "--gen-length", "300", "--caches", "none,prefix",
                "--stops", "off,on", "--json", str(out)])
    printed, rows = capsys.readouterr(), json.loads(out.read_text())["rows"]
    assert "no threshold or factor rows" in printed.err and [(r["cache"], r["rule"], r["stop"]) for r in rows] == [
        ("none", "entropy bound 0.1", "-"), ("prefix", "entropy bound 0.1", "-"),
        ("none", "entropy bound 0.1", "block"), ("prefix", "entropy bound 0.1", "block")]
    assert (f"{weight_bytes(model) / 2**20:.1f} MiB of weights once at most (one token reads its active "
            f"{active_bytes(model) / 2**20:.1f} MiB)") in printed.out
    for r in rows:
        ids, stats = alone(release, QUESTIONS[1], gen_length=300, cache=r["cache"], stop_at_eos=r["stop"] == "block")
        tokens = next((k for k, t in enumerate(ids) if t in chat.stop_ids), len(ids))
        assert (r["nfe"], r["answer_tokens"], r["tokens_per_call"]) == (stats["nfe"], tokens, tokens / stats["nfe"])


def decoder_logits(model, prompt, canvas):
    """The decoder's logits on `canvas` after the encoder has read `prompt`: a canvas's first step, then the next
    step self-conditioned on them."""
    from cache import KVCache
    P, L = prompt.shape[1], prompt.shape[1] + canvas.shape[1]
    kv, valid = KVCache.for_model(model, 1, L), torch.ones(1, L, dtype=torch.bool)
    with torch.inference_mode():
        model.encode(prompt, kv, torch.arange(P), valid)
        first = model.decode(canvas, kv, torch.arange(P, L), valid)
        return first.float(), model.decode(canvas, kv, torch.arange(P, L), valid, sc_logits=first).float()


def test_int8_weights_stay_within_four_times_bf16s_error_and_decode(release, capsys):
    """--quantize int8 on DiffusionGemma (its linear layers and expert stacks; the tied embedding, which is its head,
    and the routers stay as they are): the decoder's logits, a canvas's first step and the self-conditioned next one,
    move from float32's by at most 4x what bf16 weights move them, as the other families' bound (measured 0.98x and
    0.91x); and the command line loads it and decodes, in float32 and bf16, generate()'s answer on the int8 model."""
    pytest.importorskip("torchao", reason="torchao is not installed: pip install -r requirements-extras.txt")
    d, _, chat = release
    f32, int8, bf16 = (load_model(d, device="cpu", dtype=dt, **kw) for dt, kw in (
        (torch.float32, {}), (torch.float32, dict(quantize="int8")), (torch.bfloat16, {})))
    prompt = torch.tensor([prompt_ids(chat, QUESTIONS[1])])
    canvas = torch.randint(0, 1024, (1, 256), generator=torch.Generator().manual_seed(0))
    ref, q, b = (decoder_logits(m, prompt, canvas) for m in (f32, int8, bf16))
    for step in range(2):
        e_int8, e_bf16 = ((x[step] - ref[step]).abs().max().item() for x in (q, b))
        assert 0 < e_int8 <= 4 * e_bf16, (step, e_int8, e_bf16)
    for dtype in ("float32", "bfloat16"):
        assert cli.main(["--model", d, "--prompt", QUESTIONS[1], "--quantize", "int8", "--dtype", dtype,
                         "--no-stream"]) is None
        answer, cost = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
        model = int8 if dtype == "float32" else load_model(d, device="cpu", dtype=torch.bfloat16, quantize="int8")
        (out,), stats = generate(model, prompt, gen_length=256, cache="dual", eos_ids=sorted(chat.stop_ids),
                                 generator=torch.Generator().manual_seed(0))
        assert answer == chat.answer(out[prompt.shape[1]:].tolist()) and cost.startswith(f"NFE {STEPS} |")
