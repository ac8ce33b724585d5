"""Block diffusion (Fast-dLLM v2, SDAR, LLaDA2.0, LLaDA2.1 with its edits) everywhere the others are: early stop
at the end token, streaming through
on_step, one host read per step, the server (batched requests equal to each alone, streamed equal to not) and the
lm-eval harness, on tiny checkpoints in each release's exact format (tools/checkpoint.py --release)."""

import pytest
import torch

import cli
import denoise
from chat import Chat
from terminal import streamer
from conftest import rows_as_alone, serving
from fastdllm import generate
from model import load_model
from test_serve import at_once, events, post, request, solo
from tools.checkpoint import make_release
from tools.step_count import counted

RELEASES = {"fastdllm_v2": ("Efficient-Large-Model/Fast_dLLM_v2_7B", 32), "sdar": ("JetLM/SDAR-4B-Chat", 8),
            "llada2.0": ("inclusionAI/LLaDA2.0-mini", 8), "llada2.1": ("inclusionAI/LLaDA2.1-mini", 8)}
EXTRA = {"llada2.1": dict(editing_threshold=0.5)}      # LLaDA2.1's editing decode (its card's Quality mode's)
QUESTIONS = ["Write a sort in Python.", "What is 2+2?", "Name a color.", "Tell me a joke about cats and dogs please."]


@pytest.fixture(scope="module", params=list(RELEASES))
def release(request, tmp_path_factory):
    """(family, folder, block, model, chat)."""
    repo, G = RELEASES[request.param]
    d = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    make_release(d, repo)
    model = load_model(d, device="cpu", dtype=torch.float32)
    return request.param, d, G, model, Chat(d, model.config)


# Every family, each in its release's format: a batch of prompts of different lengths through the command line.
EVERY = {"llada": "GSAI-ML/LLaDA-8B-Instruct", "dream": "Dream-org/Dream-v0-Instruct-7B",
         "moe": "inclusionAI/LLaDA-MoE-7B-A1B-Instruct", **{f: repo for f, (repo, _) in RELEASES.items()}}


@pytest.mark.parametrize("family", list(EVERY))
def test_the_cli_answers_a_batch_of_prompts_each_as_alone(family, tmp_path, capsys):
    """`fastdllm.py --prompt-file` with prompts of 1 to 42 characters in one batch: each answer line is the one
    `--prompt` gives that prompt alone (the issue's "x" got 55 tokens in a Fast-dLLM v2 batch, 8 alone)."""
    d = str(tmp_path / "ckpt")
    make_release(d, EVERY[family])
    questions = ["x", QUESTIONS[3], QUESTIONS[1], "Explain block diffusion in one sentence please."]
    (tmp_path / "q.txt").write_text("\n".join(questions) + "\n")
    common = ["--model", d, "--gen-length", "32", "--no-stream"] + [f"--{k.replace('_', '-')}={v}" for k, v in
                                                                      EXTRA.get(family, {}).items()]
    assert cli.main(common + ["--prompt-file", str(tmp_path / "q.txt"), "--batch-size", "4"]) is None
    batch = capsys.readouterr().out
    alone = []
    for q in questions:
        assert cli.main(common + ["--prompt", q]) is None
        alone.append(capsys.readouterr().out.rstrip("\n").rpartition("\n")[0])       # the answer, not the NFE line
    assert batch.rstrip("\n").rpartition("\n")[0] == "\n".join(alone)


@pytest.mark.parametrize("family", ["fastdllm_v2", "llada2.1"])
def test_the_cli_takes_a_gen_length_below_the_block(family, tmp_path, capsys):
    """--gen-length 16 on a model trained with blocks of 32 (Fast-dLLM v2, LLaDA2.1; no --block-length) was refused
    as "not a multiple of block_length 32", a flag never set, and Fast-dLLM v2's generate() then raised an
    IndexError: both answer (v2 to the end of one block: docs/parity.md; LLaDA2 16 tokens)."""
    d = str(tmp_path / "ckpt")
    make_release(d, EVERY[family])
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in EXTRA.get(family, {}).items()]
    assert cli.main(["--model", d, "--gen-length", "16", "--prompt", "x", "--no-stream", *extra]) is None
    assert capsys.readouterr().out.splitlines()[-1].startswith("NFE ")


def prompts(chat):
    return [torch.tensor([chat.encode(chat.render([{"role": "user", "content": q}]))]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def ends_sometimes(release):
    """The release's model with its end token's head row a copy of the token the decodes commit most, plus noise:
    random weights that decode the end token at some positions of some answers (an early stop to test)."""
    family, d, G, _, chat = release
    model = load_model(d, device="cpu", dtype=torch.float32)
    outs = [generate(model, p, gen_length=64, block_length=G, cache="prefix", threshold=0.9)[0][0, p.shape[1]:]
            for p in prompts(chat)]
    often, w = torch.cat(outs).bincount().argmax(), model.lm_head.weight
    noise = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w[model.config.eos_id] = w[often] + 0.05 * w[often].std() * noise
    return model


def test_early_stop_equals_the_full_decode_up_to_the_end_token(release, ends_sometimes):
    """stop_at_eos: the answer equals the full decode's up to its first end token, in fewer calls where one ends
    before the last block; after the end, Fast-dLLM v2 fills (its batch_sample), SDAR fills after the block."""
    family, _, G, _, chat = release
    model, eos, stopped = ends_sometimes, ends_sometimes.config.eos_id, 0
    for p in prompts(chat):
        kw = dict(gen_length=64, block_length=G, cache="prefix", threshold=0.9, **EXTRA.get(family, {}))
        (full,), a = generate(model, p, **kw)
        (cut,), b = generate(model, p, stop_at_eos=True, **kw)
        full, cut = full[p.shape[1]:].tolist(), cut[p.shape[1]:].tolist()
        if eos not in full:
            assert cut == full and b["nfe"] == a["nfe"]
            continue
        end = full.index(eos)
        assert cut[:end + 1] == full[:end + 1] and b["nfe"] <= a["nfe"]
        after = end + 1 if family == "fastdllm_v2" else -(-(p.shape[1] + end + 1) // G) * G - p.shape[1]
        assert set(cut[after:]) <= {model.config.pad_id, eos}
        stopped += b["nfe"] < a["nfe"]
    assert stopped, "no answer ended before its last block: the test checks nothing"


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_a_batch_with_early_stop_equals_each_row_alone(release, ends_sometimes, cache):
    """Prompts ending in different grid blocks: each row decodes, stops and is counted as alone (its ids, its answer
    as long as alone, its calls: not the longest prompt's canvas, as the official batch_sample sizes it), early stop
    included: a row that ended stays ended while the others go on."""
    family, _, G, _, chat = release
    rows = [p[0].tolist() for p in prompts(chat)] + [chat.encode(chat.render([{"role": "user", "content": "x"}]))]
    assert len({len(r) // G for r in rows}) > 1
    kw = dict(gen_length=64, block_length=G, cache=cache, threshold=0.9, stop_at_eos=True, **EXTRA.get(family, {}))
    rows_as_alone(ends_sometimes, rows, **kw)


def test_streaming_shows_each_call_and_ends_on_the_output(release, capsys):
    """on_step: once a call, each canvas in the output's layout, a committed token never changes (LLaDA2.1: one
    before stats["final"]), the last one is what generate() returns (before LLaDA2's cut at the end token); the CLI's
    streamer prints exactly the answer."""
    family, _, G, model, chat = release
    p, P, mask = prompts(chat)[0], prompts(chat)[0].shape[1], model.config.mask_id
    seen, finals, printer = [], [], streamer(chat, P, mask)

    def on_step(x, st):
        seen.append(x.clone())
        finals.append(st["final"][0])
        printer(x, st)
    out, stats = generate(model, p, gen_length=32, block_length=G, cache="prefix", threshold=0.9, on_step=on_step,
                          **EXTRA.get(family, {}))
    assert len(seen) == stats["nfe"] and all(s.shape == out.shape for s in seen)
    last, end = seen[-1][0, P:].tolist(), model.config.eos_id
    cut = last.index(end) + 1 if family.startswith("llada2") and end in last else len(last)
    assert out[0, P:].tolist() == last[:cut] + [model.config.pad_id] * (len(last) - cut)
    for before, after in zip(seen, seen[1:]):
        kept = before != mask       # LLaDA2.1 may edit the answer's committed tokens, never the prompt
        kept[:, P:] &= family not in EXTRA
        assert torch.equal(after[kept], before[kept])
    for x, final in zip(seen, finals):      # what a stream shows is final
        shown = x[0, P:P + final]
        assert torch.equal(shown[shown != mask], out[0, P:P + final][shown != mask])
    assert finals[-1] >= out.shape[1] - P and (family not in EXTRA or min(finals) < out.shape[1] - P)
    assert (seen[0] == mask).sum() > (seen[-1] == mask).sum() == 0
    assert capsys.readouterr().out == chat.answer(out[0, P:].tolist())


def replayed(steps: list, cut: list = ()) -> list:
    """The answer the stream's events build, each one checked against the contract (docs/serve.md, "The per-step
    event stream"): a commit or a fill decides a mask, once; an edit rewrites a token; masks_left never grows and
    counts what is left."""
    canvas = [None] * (len(steps[0]["committed"] + steps[0]["filled"]) + steps[0]["masks_left"])
    for e in steps:
        for c in e["committed"] + e["filled"]:
            assert canvas[c["pos"]] is None, (c, canvas)
            canvas[c["pos"]] = c["id"]
        for c in e["edited"]:
            assert canvas[c["pos"]] not in (None, c["id"]), (c, canvas)
            canvas[c["pos"]] = c["id"]
        assert e["masks_left"] == canvas.count(None)
    for c in cut:
        canvas[c["pos"]] = c["id"]
    return canvas


def test_the_step_view_has_a_step_per_call_and_counts_that_add_up(release, ends_sometimes):
    """denoise.Calls and Answer, the server's step view, on generate()'s on_step with early stop and an end token
    the model sometimes writes (issue 46: the view was cut at the end token, so LLaDA2.1's edits and Fast-dLLM v2's
    later commits after an end token showed as masks coming back and cells nobody committed): a step per call of the
    answer, commits the model's own count (where the answer runs past the gen_length positions shown, at most: the
    model commits there too), edits only where a rule edits, and the replay is generate()'s answer."""
    family, _, G, _, chat = release
    kw = dict(gen_length=32, block_length=G, cache="prefix", threshold=0.9, stop_at_eos=True, **EXTRA.get(family, {}))
    ended = edited = 0
    for p in prompts(chat):
        P, calls, steps, answer = p.shape[1], denoise.Calls(1), [], []

        def on_step(x, st):
            row = x[0, P:].tolist()
            answer[:] = answer or [denoise.Answer(min(32, len(row)), ends_sometimes.config.mask_id, lambda q, t: {
                "pos": q, "id": t})]
            (committed,) = calls.step(st)
            if committed is not None:
                steps.append(answer[0].step(row, committed))
        out, stats = generate(ends_sometimes, p, on_step=on_step, **kw)
        ids = out[0, P:P + len(answer[0].canvas)].tolist()
        assert replayed(steps, answer[0].end(ids)) == ids and len(steps) == stats["row_nfe"][0] == stats["nfe"]
        committed, shown = sum(len(e["committed"]) for e in steps), len(answer[0].canvas)
        assert committed == stats["row_committed"][0] if shown == out.shape[1] - P else \
            committed <= stats["row_committed"][0]
        ended += any(e["filled"] for e in steps) or ends_sometimes.config.eos_id in ids
        edited += any(e["edited"] for e in steps)
    assert ended and bool(edited) == (family in EXTRA)


def test_the_event_stream_has_a_step_per_call_and_counts_that_add_up(release, served):
    """POST /v1/denoise/stream (issue 46: on LLaDA2.1 20 step events for 36 calls, committing 209 cells over 32
    positions, masks_left 0 -> 5, and the page at "-197 masked"): a step event per call of the answer, the
    replay of its changes (then done's cut) the answer the chat endpoint gives."""
    family = release[0]
    app, port = served
    edited = 0
    for q in QUESTIONS[:2]:
        body = {"messages": [{"role": "user", "content": q}]}
        ev = events(port, "/v1/denoise/stream", body)
        start, steps, done = ev[0], ev[1:-1], ev[-1]
        assert [e["step"] for e in steps] == list(range(1, done["fastdllm"]["nfe"] + 1))
        assert start["positions"] == len(replayed(steps)) and start["settings"] == done["fastdllm"]["settings"]
        canvas = replayed(steps, done["cut"])
        one = post(port, "/v1/chat/completions", body)["choices"][0]
        assert app.chat.answer(canvas) == done["text"] == one["message"]["content"]
        assert done["fastdllm"]["nfe"] == one["fastdllm"]["nfe"] == solo(app, q)[1]
        assert [e["final"] for e in steps] == sorted(e["final"] for e in steps)
        edited += sum(len(e["edited"]) for e in steps)
    assert bool(edited) == (family in EXTRA)


EDITING = {"editing_threshold": 0.5, "max_post_steps": 2, "num_to_transfer": 2}


def test_the_server_lists_and_takes_what_the_model_accepts(release, served):
    """Issue 46: a LLaDA2.1 server took none of its editing settings per request, showed them nowhere, and
    /v1/denoise/info listed the cache "free", which the model refuses. Now info lists the model's caches and settings
    (as generate()'s own checks answer them); on LLaDA2 a request sets the editing settings, its answer's settings say
    them and it is the CLI's decode with them; a value the model refuses is one line naming its field."""
    family = release[0]
    app, port = served
    status, info = request(port, "GET", "/v1/denoise/info")
    assert status == 200 and info["cache_modes"] == ["none", "prefix", "dual"]
    assert (set(EDITING) <= set(info["settings"])) == family.startswith("llada2")
    assert ("steps" in info["settings"], "top_k" in info["settings"]) == ((False, False) if family == "fastdllm_v2"
                                                                           else (True, True))
    q = QUESTIONS[1]
    refused = [({"cache": "free"}, "cache"), ({"top_k": 5}, "top_k" if family == "fastdllm_v2" else None)]
    if family.startswith("llada2"):
        got = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": q}], **EDITING})
        choice = got["choices"][0]
        assert {k: choice["fastdllm"]["settings"][k] for k in EDITING} == EDITING
        assert choice["message"]["content"] == solo(app, q, **EDITING)[0]
        assert info["defaults"]["editing_threshold"] == EXTRA.get(family, {}).get("editing_threshold")
        refused += [({"editing_threshold": 2}, "editing_threshold"), ({"num_to_transfer": 0}, "num_to_transfer"),
                    ({"editing_threshold": None, "max_post_steps": 3}, "max_post_steps")]
        refused += [({"steps": 4}, "steps")] if family in EXTRA else []       # steps and edits do not mix
    else:
        refused += [({"editing_threshold": 0.5}, "editing_threshold"), ({"num_to_transfer": 2}, "num_to_transfer")]
    for fields, param in refused:
        status, r = request(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": q}],
                                                                     **fields})
        assert (status, r.get("error", {}).get("param")) == ((400, param) if param else (200, None)), (fields, r)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_one_host_read_per_step(release, cache):
    """tools/step_count.py's counter: every step after the set-up reads the device once."""
    family, _, G, model, chat = release
    steps, _ = counted(model, prompts(chat)[1], cache=cache, threshold=0.9, gen_length=32, block_length=G,
                       **EXTRA.get(family, {}))
    assert steps and all(c["syncs"] == 1 for _, c in steps), [c["syncs"] for _, c in steps]


@pytest.fixture(scope="module")
def served(release):
    family, d, G, _, _ = release
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in EXTRA.get(family, {}).items()]
    yield from serving(["--model", d, "--gen-length", "32", "--block-length", str(G), *flags])


def test_served_answers_equal_each_alone_streamed_or_not(served):
    """Requests of different lengths at once are one batch; each answer equals the CLI's path for it alone (cut at
    max_tokens), and the stream's pieces join to the same answer."""
    app, port = served
    bodies = [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS[:3]]
    results = at_once(app, port, bodies)
    for q, (status, out) in zip(QUESTIONS, results):
        assert status == 200, out
        ids = app.chat.encode(app.chat.render([{"role": "user", "content": q}]))
        (alone,), _ = cli.run_batch(app.model, [ids], app.args, app.engine.device)
        # A block decode runs to its grid block's edge; the server answers at most max_tokens (here gen_length).
        assert out["choices"][0]["message"]["content"] == app.chat.answer(alone[len(ids):][:32])
    one = post(port, "/v1/chat/completions", bodies[0])
    assert one["choices"][0]["message"]["content"] == results[0][1]["choices"][0]["message"]["content"]
    # The stream's pieces only grow (an editing rule's block is sent once it has ended) and join to the answer; the
    # answer's calls are its calls alone (an editing rule's edit-only calls included).
    assert streamed(port, bodies[0]) == one["choices"][0]["message"]["content"]
    assert one["choices"][0]["fastdllm"]["nfe"] == solo(app, QUESTIONS[0])[1]


def test_served_batch_answers_their_calls_and_finish_as_alone(served):
    """Requests whose prompts end in different grid blocks, batched: each answer, its finish_reason and its nfe (the
    calls that served it) are the ones it gets alone (a row answered to the longest prompt's grid block ran on past
    its own answer, and was counted for the others' calls)."""
    app, port = served
    bodies = [{"messages": [{"role": "user", "content": q}]} for q in ("x", QUESTIONS[3], QUESTIONS[1])]
    results = at_once(app, port, bodies)
    assert max(out["choices"][0]["fastdllm"]["batch_size"] for _, out in results) > 1      # a batch was decoded
    for body, (status, out) in zip(bodies, results):
        assert status == 200, out
        one = post(port, "/v1/chat/completions", body)["choices"][0]
        got = out["choices"][0]
        assert (got["message"], got["finish_reason"], got["fastdllm"]["nfe"]) == (
            one["message"], one["finish_reason"], one["fastdllm"]["nfe"])


def streamed(port, body) -> str:
    chunks = events(port, "/v1/chat/completions", dict(body, stream=True))
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def test_harness_answers_equal_generate(release):
    """apps/harness.py's generate_until on a block-diffusion checkpoint: the answer generate() gives, cut at the end
    token and the request's stop string."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -r requirements-eval.txt")
    import harness
    from lm_eval.api.instance import Instance
    family, d, G, model, chat = release
    lm = harness.FastDLLM(model=d, block_length=G, device="cpu", cache="prefix", threshold=0.9, **EXTRA.get(family, {}))
    got = lm.generate_until([Instance("generate_until", {}, (q, {"max_gen_toks": 32}), 0, ("t", 0, 1))
                             for q in QUESTIONS[:2]])
    for q, text in zip(QUESTIONS, got):
        ids = chat.tok.encode(q).ids                 # lm-eval's request text is the prompt (no template asked)
        (out,), _ = generate(model, torch.tensor([ids]), gen_length=32, block_length=G, cache="prefix",
                             threshold=0.9, stop_at_eos=True, eos_ids=sorted(chat.stop_ids), **EXTRA.get(family, {}))
        assert text == chat.answer(out[len(ids):].tolist())
    assert len(set(got)) == 2


@pytest.mark.parametrize("family", ["llada2.1"])
def test_llada2_compiled_one_graph_per_feed_width_and_ids_equal_eager(family, tmp_path):
    """compile=True on LLaDA2.1 (LLaDA2's sigmoid-routed MoE and block window cache, and the edits; Fast-dLLM v2's
    in test_blockdiff.py): the ids, calls and edits eager's, one graph per width fed (a block's first call: it and
    the block before; then the block)."""
    from torch._dynamo.utils import counters
    from fastdllm import Compiled
    make_release(str(tmp_path), RELEASES[family][0])
    model, p = load_model(str(tmp_path), device="cpu", dtype=torch.float32), torch.tensor([list(range(5, 18))])
    kw = dict(gen_length=32, block_length=8, cache="prefix", threshold=0.9, **EXTRA.get(family, {}))
    eager, e = generate(model, p, **kw)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled, c = generate(model, p, compile=Compiled(), **kw)
    assert torch.equal(compiled, eager) and c["fed"] == e["fed"] and c["edited"] == e["edited"]
    assert counters["stats"]["unique_graphs"] - before == len(set(e["fed"])) == 2
