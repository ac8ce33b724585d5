"""
serve.py end to end on the demo model, with a standard-library client: the OpenAI answers equal the CLI's,
streamed or not; concurrent requests are batched and every answer equals its solo answer; each bad input gets
its status and error JSON; a client that disconnects mid-stream costs nobody else anything; the page and its
per-step event stream. The server runs in-process on an ephemeral port (and once as `python apps/serve.py`, for
the CLI comparison and Ctrl-C). Every request and subprocess has a timeout.
"""
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

import bounded
import cli
import serve
from conftest import ROOT

DEMO = os.path.join(ROOT, "demo", "llada-arith")
FLAGS = ["--gen-length", "32", "--block-length", "8"]
PROMPT = "Tom has 23 apples and buys 45 more. How many apples does he have?"
PROMPTS = [PROMPT, "A box has 50 books. Sam takes 12. How many books are left?",
           "Anna has 5 coins and buys 7 more. How many coins does she have?",        # shorter: left-padded
           "Mia has 81 cards and sells 29. How many cards does she have left?",
           "A box has 34 apples. Tom adds 9. How many apples are there?",
           "Sam has 66 books and buys 21 more. How many books does he have?",
           "A box has 90 coins. Anna takes 45. How many coins are left?",
           "Tom has 3 cards and sells 2. How many cards does he have left?"]
TIMEOUT = 30
STARTUP = 180     # `python apps/serve.py` until it prints its URL: a torch import and the model's load, on a busy VM


@contextlib.contextmanager
def serving(*flags):
    """serve.py in this process on a free port, with the demo model and FLAGS -> (app, port, the server)."""
    app = serve.build(serve.parse_args(["--model", DEMO, *FLAGS, "--port", "0", "--quiet", *flags]))
    httpd = serve.make_server(app, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield app, httpd.server_address[1], httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        app.engine.stop()


@pytest.fixture(scope="module")
def server():
    with serving() as (app, port, _):
        yield app, port


def request(port, method, path, body=None, raw=None, headers=None):
    """-> (status, parsed JSON or text). raw: bytes sent as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def connected(app, port, n, also=()):
    """n connections, made before any request is sent: the server waits for more requests to batch only while
    another connection could still send one, so these (and the sockets `also`) are known to it before the first
    request arrives."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT) for _ in range(n)]
    for c in conns:
        c.connect()
    deadline = time.monotonic() + TIMEOUT
    while True:
        peers = set()
        for sock in list(app.conns):      # the server's side of each connection it has accepted
            with contextlib.suppress(OSError):
                peers.add(sock.getpeername())
        if all(c.getsockname() in peers for c in [c.sock for c in conns] + list(also)) or time.monotonic() > deadline:
            return conns
        time.sleep(0.01)


def raw_answer(conn, body, path="/v1/chat/completions"):
    """One request on an open connection -> (status, headers, body bytes) of its answer."""
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, dict(r.getheaders()), r.read()


def ask(conn, body, path="/v1/chat/completions"):
    """One request on an open connection -> (status, parsed JSON); the connection is closed."""
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def at_once(app, port, bodies, late: float = 0.0):
    """Each body from its own client, all at once (the first `late` seconds after the others) -> [(status, parsed
    JSON)] in the same order."""
    conns, results = connected(app, port, len(bodies)), [None] * len(bodies)
    send = lambda i: time.sleep(late if i == 0 else 0) or results.__setitem__(i, ask(conns[i], bodies[i]))  # noqa: E731
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    return results


def recv_until(s, marker: bytes) -> bytes:
    """What socket s receives until `marker` has come; a server that closes first (recv: b"") fails, and one that
    sends nothing fails at the socket's timeout, never a loop that waits forever."""
    got = b""
    while marker not in got:
        chunk = s.recv(4096)
        assert chunk, f"the server closed the connection before {marker!r}: got {got[:300]!r}"
        got += chunk
    return got


def test_recv_until_fails_when_the_server_closes_first():
    """The stream tests read until an event has come: a server that closes first fails the test at once."""
    ours, theirs = socket.socketpair()
    theirs.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    theirs.close()
    ours.settimeout(TIMEOUT)
    with pytest.raises(AssertionError, match="closed the connection before b'data: '"):
        recv_until(ours, b"data: ")
    ours.close()


def raw_http(port, data: bytes):
    """Bytes sent as they are, then our side closed for writing -> (status, headers, body bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    return read_answer(s)


def read_answer(s):
    """Everything the server sends on socket s until it closes -> (status, headers, body bytes)."""
    got = b""
    while chunk := s.recv(65536):          # the server answers, then closes the connection
        got += chunk
    s.close()
    head, _, body = got.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    return int(status.split()[1]), dict(line.split(": ", 1) for line in lines), body


def no_connections(app):
    """Wait until the connections of earlier tests are closed (so that nobody else could join a batch)."""
    deadline = time.monotonic() + TIMEOUT
    while app.conns and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not app.conns


def post(port, path, body):
    status, out = request(port, "POST", path, body)
    assert status == 200, out
    return out


def events(port, path, body):
    """A server-sent event stream -> the parsed data of every event; it must end with [DONE]."""
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                                       {"Content-Type": "application/json"}), timeout=TIMEOUT) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        data = [line[6:] for line in r.read().decode().split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def chat(content, **kw):
    return {"model": DEMO, "messages": [{"role": "user", "content": content}], **kw}


def solo(app, prompt, **override):
    """The CLI's own path for one prompt alone: cli.run_batch with the server's flags -> (answer, NFE)."""
    ids = app.chat.encode(app.chat.render([{"role": "user", "content": prompt}]))
    args = app.args
    if "seed" in override:
        args = serve.argparse.Namespace(**vars(args) | {"seed": override.pop("seed")})
    (out,), stats = cli.run_batch(app.model, [ids], args, app.engine.device, **override)
    return app.chat.answer(out[len(ids):]), stats["nfe"]


def cli_answer(prompt):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "fastdllm.py"), "--model", DEMO, *FLAGS, "--no-stream",
                        "--prompt", prompt], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    answer, stats = r.stdout.strip().splitlines()[-2:]
    return answer, int(re.match(r"NFE (\d+)", stats)[1])


# ----------------------------------------------------------------------------------------------------------

def test_answers_equal_the_cli_streamed_or_not(server):
    app, port = server
    answer, nfe = cli_answer(PROMPT)
    assert answer == "45 + 23 = 68. The answer is 68."
    r = post(port, "/v1/chat/completions", chat(PROMPT))
    (c,) = r["choices"]
    assert r["object"] == "chat.completion" and r["model"] == DEMO
    assert c["message"] == {"role": "assistant", "content": answer} and c["finish_reason"] == "stop"
    n_prompt = len(app.chat.encode(PROMPT))
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 15, "total_tokens": n_prompt + 15}
    x = c["fastdllm"]
    assert x["nfe"] == nfe and x["gen_length"] == 32 and x["tokens_per_call"] == 16 / nfe   # 15 tokens + the end
    assert x["settings"] | {"threshold": 0.9} == x["settings"] and x["settings"]["cache"] == "dual"

    r = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 32})
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == answer

    chunks = events(port, "/v1/chat/completions", chat(PROMPT, stream=True, stream_options={"include_usage": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == answer
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["choices"][0]["fastdllm"]["nfe"] == nfe
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 15

    chunks = events(port, "/v1/completions", {"prompt": PROMPT, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer
    assert len([c for c in chunks if c["choices"][0]["text"]]) > 1        # the text came in pieces


def test_max_tokens_and_stop(server):
    """max_tokens 10: the canvas is rounded up to two blocks (16) and the answer cut to 10 tokens; a stop string
    cuts the text, the same streamed or not; token ids work as a prompt; a list of prompts gets a choice each."""
    app, port = server
    ids = app.chat.encode(PROMPT)
    (out,), _ = cli.run_batch(app.model, [ids], app.args, app.engine.device, gen_length=16)
    assert 0 not in out[len(ids):len(ids) + 10]       # no end token before the cut
    r = post(port, "/v1/chat/completions", chat(PROMPT, max_tokens=10))
    c = r["choices"][0]
    assert c["message"]["content"] == app.chat.answer(out[len(ids):len(ids) + 10])
    assert c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 10
    assert c["fastdllm"]["gen_length"] == 16
    for stop in (["="], "The", ["answer", " 68"]):
        r = post(port, "/v1/completions", {"prompt": PROMPT, "stop": stop})
        text = r["choices"][0]["text"]
        assert r["choices"][0]["finish_reason"] == "stop" and "45 + 23 = 68. The answer is 68.".startswith(text)
        chunks = events(port, "/v1/completions", {"prompt": PROMPT, "stop": stop, "stream": True})
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert post(port, "/v1/completions", {"prompt": PROMPT, "stop": "="})["choices"][0]["text"] == "45 + 23 "
    r = post(port, "/v1/completions", {"prompt": [ids, PROMPTS[1]]})
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == [solo(app, p)[0] for p in PROMPTS[:2]]


def test_concurrent_requests_batch_and_equal_solo(server):
    """Eight clients at once: four with the server's settings (different prompts and lengths, left-padded into
    one batch), three with one token per step (their own batch) and one sampled one (alone). Every answer and
    NFE equals the prompt decoded alone."""
    app, port = server
    cases = [(p, {}) for p in PROMPTS[:4]] + [(p, {"threshold": None}) for p in PROMPTS[4:7]] + \
            [(PROMPTS[7], {"temperature": 0.7, "seed": 3})]
    no_connections(app)
    # A window no test waits out: the worker waits while a connected client could still send (at_once connects all
    # eight first), so the batches are what was sent, whatever the arrival times.
    app.engine.window = 1e6
    try:
        results = at_once(app, port, [chat(p, **kw) for p, kw in cases], late=1.5)   # past the old 1 s window
    finally:
        app.engine.window = app.args.batch_window / 1000
    for (prompt, kw), (status, r) in zip(cases, results):
        assert status == 200, r
        c = r["choices"][0]
        answer, nfe = solo(app, prompt, **kw)
        assert (c["message"]["content"], c["fastdllm"]["nfe"]) == (answer, nfe), (prompt, kw)
    sizes = [r["choices"][0]["fastdllm"]["batch_size"] for _, r in results]
    assert sizes == [4] * 4 + [3] * 3 + [1]


def test_many_clients_streamed_and_not(server):
    app, port = server
    expected = {p: solo(app, p)[0] for p in PROMPTS}
    errors = []

    def client(i):
        try:
            p = PROMPTS[i % len(PROMPTS)]
            if i % 2:
                chunks = events(port, "/v1/chat/completions", chat(p, stream=True))
                text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            else:
                text = post(port, "/v1/chat/completions", chat(p))["choices"][0]["message"]["content"]
            assert text == expected[p]
        except Exception as e:          # noqa: BLE001 (collected and reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("threshold", [0.7, None])
def test_denoise_stream_one_event_per_step(server, threshold):
    """The page's stream: start, one step event per model call, whose committed cells are the model's
    (tokens_per_call x nfe of them) and whose filled cells are the early stop's end of text, each position once:
    together exactly the answer; and GET / is the page that reads it. (The fill was sent as committed, and the
    page guessed which were which.)"""
    app, port = server
    ev = events(port, "/v1/denoise/stream", chat(PROMPT, threshold=threshold))
    start, steps, done = ev[0], ev[1:-1], ev[-1]
    assert start["type"] == "start" and start["gen_length"] == start["positions"] == 32 and start["block_length"] == 8
    assert start["prompt"] == PROMPT and start["mask"] == "<|mdm_mask|>" and start["block_offset"] == 0
    assert [e["type"] for e in steps] == ["step"] * len(steps) and done["type"] == "done" and done["cut"] == []
    assert len(steps) == done["fastdllm"]["nfe"] and [e["step"] for e in steps] == list(range(1, len(steps) + 1))
    canvas = [app.cfg.mask_id] * 32
    for e in steps:
        assert e["committed"] and e["edited"] == [] and (e["filled"] == [] or e is steps[-1])
        for cell in e["committed"] + e["filled"]:
            assert canvas[cell["pos"]] == app.cfg.mask_id      # each position decided once
            canvas[cell["pos"]] = cell["id"]
            assert cell["text"] == app.token_text(cell["id"]) and cell["end"] == (cell["id"] in app.chat.stop_ids)
        assert e["masks_left"] == canvas.count(app.cfg.mask_id)
    assert all(c["end"] for c in steps[-1]["filled"]) and steps[-1]["filled"]     # the demo's answer ends early
    x = done["fastdllm"]
    assert sum(len(e["committed"]) for e in steps) == round(x["tokens_per_call"] * x["nfe"])
    assert app.chat.answer(canvas) == done["text"] == solo(app, PROMPT, threshold=threshold)[0]

    status, page = request(port, "GET", "/")
    assert status == 200 and "/v1/denoise/stream" in page
    assert "http://" not in page and "https://" not in page         # no external URL: it works offline
    status, info = request(port, "GET", "/v1/denoise/info")
    assert status == 200 and info["defaults"]["cache"] == "dual" and info["guide"] is None
    assert info["cache_modes"] == ["none", "prefix", "dual", "free"] and info["remasking_modes"] == ["low_confidence",
                                                                                                    "random"]
    assert set(info["settings"]) == {"cache", "block_length", "steps", "threshold", "factor", "temperature",
                                     "remasking"}
    status, models = request(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [DEMO]


BAD = [  # (body or raw bytes, status, param, code, words in the message)
    (b"{not json", 400, None, "invalid_json", "not valid JSON"),
    (b"[1, 2]", 400, None, "invalid_json", "JSON object"),
    (b'{"prompt": "\xff\xfe caf\xe9"}', 400, None, "invalid_json", "not valid JSON"),      # not UTF-8
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None, "invalid_json", "NaN"),
    ({"model": DEMO}, 400, "messages", "missing_field", "'messages' is required"),
    ({"messages": "hi"}, 400, "messages", "invalid_value", "non-empty list"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", "invalid_value", "content must be a string"),
    (chat(PROMPT, model="gpt-4"), 404, "model", "model_not_found", "does not exist"),
    (chat(PROMPT, max_tokens="ten"), 400, "max_tokens", "invalid_value", "integer"),
    (chat(PROMPT, max_tokens=0), 400, "max_tokens", "invalid_value", "integer >= 1"),
    (chat(PROMPT, max_tokens=100), 400, "max_tokens", "context_length_exceeded", "64 positions"),
    (chat(PROMPT * 3), 400, "messages", "context_length_exceeded", "default max_tokens 32"),
    (chat(PROMPT, n=99), 400, "n", "unsupported", "at most 8"),
    (chat(PROMPT, stream="yes"), 400, "stream", "invalid_value", "true or false"),
    (chat(PROMPT, temperature=-1), 400, "temperature", "invalid_value", "temperature must be >= 0"),
    (chat(PROMPT, cache="bogus"), 400, "cache", "invalid_value", "unknown cache mode"),
    (chat(PROMPT, threshold="high"), 400, "threshold", "invalid_value", "a number"),
    (chat(PROMPT, threshold=0.9, factor=1.0), 400, "threshold", "invalid_value", "not both"),
    (chat(PROMPT, guide=True), 400, "guide", "invalid_value", "no guide"),
    # Issue 39: the family's options name their field (generate() found them, with param null)
    (chat(PROMPT, top_k=5), 400, "top_k", "invalid_value", "top_k is a Dream option"),
    (chat(PROMPT, top_p=0.9), 400, "top_p", "invalid_value", "top_p is a Dream option"),
    (chat(PROMPT, remasking="entropy"), 400, "remasking", "invalid_value", "unknown remasking 'entropy' for llada"),
    (chat(PROMPT, logprobs=True), 400, "logprobs", "unsupported", "logprobs"),
    (chat(PROMPT, seed=2**70), 400, "seed", "invalid_value", "64 bits"),
    (chat(PROMPT, stop=[1]), 400, "stop", "invalid_value", "strings"),
    (chat("Tom has <|mdm_mask|> apples"), 400, "messages", "invalid_value", "mask token"),
    (chat(""), 400, "messages", "invalid_value", "empty"),
    (chat("Tom has \udc80 apples"), 400, "messages", "invalid_value", "UTF-8"),            # a lone surrogate
    ({"prompt": [5, 99999]}, 400, "prompt", "invalid_value", "outside the vocabulary"),
    ({"prompt": {"text": "x"}}, 400, "prompt", "invalid_value", "must be a string"),
    # Issue 25: each of these got no answer at all (a lone surrogate, a deep body, a 400-digit number) or was
    # silently ignored (unknown fields) or accepted with a message that said otherwise (threshold).
    (chat("Tom has \ud800 apples"), 400, "messages", "invalid_value", "surrogate"),
    ({"prompt": ["x\udbff"]}, 400, "prompt", "invalid_value", "surrogate"),
    (b"[" * 100000 + b"]" * 100000, 400, None, "invalid_json", "too deeply"),
    (b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None, "invalid_json", "too deeply"),
    (chat(PROMPT, temperature=10**400), 400, "temperature", "invalid_value", "a finite number"),
    ({"prompt": PROMPT, "treshold": 0.5}, 400, "treshold", "unknown_field", 'did you mean "threshold"'),
    ({"prompt": PROMPT, "messages": []}, 400, "messages", "unknown_field", "/v1/completions"),
    (chat(PROMPT, threshold=0), 400, "threshold", "invalid_value", "> 0 (above 1: one token per step)"),
    (chat(PROMPT, model=5), 400, "model", "invalid_value", "a string"),
    (b"", 400, None, "invalid_json", "empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "invalid_value", "role must be one of"),
    ({"messages": [{"role": "user", "content": "x", "mood": 1}]}, 400, "messages", "unknown_field", "mood"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, 400, "messages", "invalid_value", "name a string"),
    (chat(PROMPT, response_format={"type": "json_object"}), 400, "response_format", "unsupported", "text"),
    (chat(PROMPT, stream_options={"include_usage": "yes"}), 400, "stream_options", "invalid_value", "include_usage"),
    (chat(PROMPT, max_tokens=8.0), 400, "max_tokens", "invalid_value", "integer"),
    (chat(PROMPT, stream=True, remasking="bogus"), 400, "remasking", "invalid_value", "unknown remasking"),  # not a 200
]


@pytest.mark.parametrize("body,status,param,code,words", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_its_error(server, body, status, param, code, words):
    app, port = server
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    got, r = request(port, "POST", path, raw=body if isinstance(body, bytes) else None,
                     body=None if isinstance(body, bytes) else body)
    assert got == status, r
    assert set(r["error"]) == {"message", "type", "param", "code"} and r["error"]["type"] == "invalid_request_error"
    assert (r["error"]["param"], r["error"]["code"]) == (param, code) and words in r["error"]["message"], r


def test_http_errors_and_the_server_keeps_serving(server):
    app, port = server
    for method, path, status in (("GET", "/nope", 404), ("POST", "/v1/nope", 404), ("GET", "/v1/completions", 405),
                                 ("GET", "/v1/models/gpt-4", 404)):
        got, r = request(port, method, path, body={} if method == "POST" else None)
        assert got == status and r["error"]["message"], (path, r)
    # An oversized body is refused from its Content-Length, before it is read; no Content-Length at all is 411.
    for head, status, code in ((b"Content-Length: 99999999\r\n", 413, "request_too_large"),
                               (b"", 411, "length_required")):
        s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{")
        got = b""
        while chunk := s.recv(65536):          # the server answers, then closes the connection
            got += chunk
        s.close()
        first, _, body = got.decode().partition("\r\n\r\n")
        assert first.startswith(f"HTTP/1.1 {status}") and json.loads(body)["error"]["code"] == code
    assert post(port, "/v1/chat/completions", chat(PROMPT))["choices"][0]["message"]["content"] == solo(app, PROMPT)[0]


ODD_VALUES = [None, "", "x", "\ud800", -1, 0, 1, 2**64, 10**400, -1e300, 0.5, True, False, [], [1, "a"], {},
              {"a": [[]]}, [[[[[[[[]]]]]]]]]


# Every field of OpenAI's chat and completions requests, and ours (docs/serve.md).
FIELD_NAMES = ("model messages prompt max_tokens max_completion_tokens stop temperature top_p n stream stream_options "
               "seed best_of logprobs top_logprobs echo suffix user metadata store service_tier presence_penalty "
               "frequency_penalty logit_bias parallel_tool_calls tool_choice tools functions function_call "
               "response_format reasoning_effort verbosity modalities audio prediction web_search_options "
               "prompt_cache_key safety_identifier top_k cache threshold factor block_length steps remasking "
               "guide").split()


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_any_value_of_any_field_gets_an_answer(server, name):
    """Every field the server reads, with values of every JSON type and odd sizes, on both endpoints: each is
    answered (200, or a 4xx with OpenAI's error object), never a dropped connection or a 500. Issue 25: a
    400-digit temperature or a lone surrogate closed the connection with a traceback."""
    app, port = server
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", chat(PROMPT))):
        for value in ODD_VALUES:
            status, r = request(port, "POST", path, body | {name: value})
            assert status == 200 or 400 <= status < 500 and set(r["error"]) == {"message", "type", "param", "code"} \
                and r["error"]["message"], (path, name, value, status, r)
    assert post(port, "/v1/chat/completions", chat(PROMPT))["choices"][0]["message"]["content"] == solo(app, PROMPT)[0]


HEAD_ = b" HTTP/1.1\r\nHost: x\r\n"
RAW = [  # (request bytes, status, code, Allow) -- issue 25: PUT/OPTIONS/HEAD got http.server's 501 HTML page
    (b"PUT /v1/completions" + HEAD_ + b"Content-Length: 2\r\n\r\n{}", 405, "method_not_allowed", "POST"),
    (b"OPTIONS /v1/chat/completions" + HEAD_ + b"\r\n", 405, "method_not_allowed", "POST"),
    (b"HEAD /health" + HEAD_ + b"\r\n", 405, None, "GET"),                 # the headers only
    (b"DELETE /v1/models/demo" + HEAD_ + b"\r\n", 405, "method_not_allowed", "GET"),
    (b"BREW /coffee" + HEAD_ + b"\r\n", 404, "not_found", None),
    (b"POST /v1/models" + HEAD_ + b"Content-Length: 2\r\n\r\n{}", 405, "method_not_allowed", "GET"),
    (b"GARBAGE\r\n\r\n", 400, "bad_request", None),
    (b"GET / HTTP/2.0\r\n\r\n", 505, "http_version_not_supported", None),
    (b"GET /" + b"a" * 65532, 414, "request_uri_too_long", None),           # 65537 bytes, no end of line
    (b"GET /health" + HEAD_ + b"X: " + b"a" * 65534, 431, "request_header_fields_too_large", None),
    (b"GET /health" + HEAD_ + b"Content-Length: 3\r\n\r\nabc", 200, None, None),   # a body on a GET is skipped
    (b"POST /v1/completions" + HEAD_ + b"Content-Length: abc\r\n\r\n", 400, "bad_request", None),
    (b"POST /v1/completions" + HEAD_ + b"Content-Length: -5\r\n\r\n", 400, "bad_request", None),
    (b"POST /v1/completions" + HEAD_ + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400, "bad_request",
     None),
    (b"POST /v1/completions" + HEAD_ + b"Content-Length: 10\r\n\r\n{}", 400, "bad_request", None),  # short
    (b"POST /v1/completions" + HEAD_ + b"Content-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", 415,
     "unsupported_media_type", None),
    (b"POST /v1/completions" + HEAD_ + b"Content-Type: application/json; charset=latin-1\r\nContent-Length: 2"
     b"\r\n\r\n{}", 415, "unsupported_media_type", None),
    (b"POST /v1/completions" + HEAD_ + b"Content-Type: multipart/form-data\r\nContent-Length: 5\r\n\r\na=b&c",
     400, "invalid_json", None),
    (b"POST http://127.0.0.1/v1/completions?x=1" + HEAD_ + b"Content-Length: 19\r\n\r\n{\"prompt\": \"1 + 1\"}",
     200, None, None),                                                            # an absolute URI
]


@pytest.mark.parametrize("data,status,code,allow", RAW, ids=[f"{i}-{r[1]}" for i, r in enumerate(RAW)])
def test_odd_http_gets_a_json_answer(server, data, status, code, allow):
    app, port = server
    got, headers, body = raw_http(port, data)
    assert got == status and headers.get("Allow") == allow, (got, headers, body[:200])
    if data.startswith(b"HEAD"):
        assert body == b"" and int(headers["Content-Length"]) > 0
    elif code is not None:
        assert headers["Content-Type"] == "application/json" and json.loads(body)["error"]["code"] == code


def test_model_id_percent_encoded(server):
    """client.models.retrieve("demo/llada-arith") sends GET /v1/models/demo%2Fllada-arith: it was a 404."""
    app, port = server
    status, card = request(port, "GET", "/v1/models/" + urllib.parse.quote(app.name, safe=""))
    assert status == 200 and card["id"] == app.name


def test_lone_client_does_not_wait_for_the_window(server, monkeypatch):
    """A lone client waited the whole --batch-window on every request; now the worker waits only while
    another connection could still send a request to join the batch."""
    app, port = server
    no_connections(app)
    # A window no test could wait out: a worker that waited it would answer no request within the client's
    # TIMEOUT, so the answers below show the behaviour without reading a clock. While deciding, the worker asked
    # whether anybody else could still send a request, and was told no: that is why it started at once.
    monkeypatch.setattr(app.engine, "window", 1e6)
    asked = []
    monkeypatch.setattr(app.engine, "others", lambda real=app.engine.others: asked.append(real()) or asked[-1])
    for _ in range(2):
        r = post(port, "/v1/chat/completions", chat(PROMPT))
        assert r["choices"][0]["fastdllm"]["batch_size"] == 1
    assert asked and not any(asked)


def test_sampled_requests_draw_a_seed_and_n_answers(server):
    """Issue 25: a sampled request without a seed got the server's fixed seed (the same answer every time);
    now it gets a fresh one, reported in the answer, and sending it back repeats the answer. n > 1 was refused:
    now n answers, prompt tokens counted once (greedy: one batch of n equal answers)."""
    app, port = server
    body = {"prompt": PROMPTS[7], "temperature": 1.0, "max_tokens": 16}
    seeds = []
    for _ in range(2):
        c = post(port, "/v1/completions", body)["choices"][0]
        seeds.append(c["fastdllm"]["seed"])
        again = post(port, "/v1/completions", body | {"seed": seeds[-1]})["choices"][0]
        assert again["text"] == c["text"] and "seed" not in again["fastdllm"]
    assert seeds[0] != seeds[1]
    ids = app.chat.encode(PROMPTS[7])
    r = post(port, "/v1/completions", body | {"n": 3, "seed": 5})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and r["usage"]["prompt_tokens"] == len(ids)
    r = post(port, "/v1/completions", {"prompt": [PROMPTS[0], PROMPTS[1]], "n": 2})
    assert [c["text"] for c in r["choices"]] == [solo(app, p)[0] for p in PROMPTS[:2] for _ in range(2)]
    assert r["choices"][0]["fastdllm"]["batch_size"] == 4 and "seed" not in r["choices"][0]["fastdllm"]
    chunks = events(port, "/v1/chat/completions", chat(PROMPT, n=2, stream=True))
    for i in range(2):
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i)
        assert text == solo(app, PROMPT)[0]


def test_each_sampled_choice_reports_the_seed_that_repeats_it(server):
    """Issue 39: with n > 1 every choice reported the request's one seed, and sending it back with n=1 repeated
    none of them (the n were one batch, each row's noise its neighbours'). Now choice c is decoded alone with the
    request's seed + c (mod 2**64: a negative seed is torch's, -1 is 2**64 - 1) and reports it: each reported seed,
    sent back with n=1, gives that choice, which is the CLI's answer for that --seed."""
    app, port = server
    body, ids = {"prompt": PROMPTS[7], "temperature": 1.0, "max_tokens": 16}, app.chat.encode(PROMPTS[7])

    def alone(seed):      # the CLI's path, one row: what `--seed seed` answers
        (row,), _ = cli.run_batch(app.model, [ids], serve.argparse.Namespace(**vars(app.args) | {"seed": seed}),
                                  app.engine.device, gen_length=16, temperature=1.0)
        return app.chat.answer(row[len(ids):])
    for n, seed in ((3, None), (3, 5), (2, -1)):
        r = post(port, "/v1/completions", body | {"n": n} | ({} if seed is None else {"seed": seed}))
        got = [(c["fastdllm"]["seed"], c["text"]) for c in r["choices"]]
        assert len({s for s, _ in got}) == n and all(0 <= s < 2**64 for s, _ in got), got
        if seed is not None:
            assert [s for s, _ in got] == [(seed + c) % 2**64 for c in range(n)]
        for s, text in got:
            again = post(port, "/v1/completions", body | {"seed": s})["choices"][0]
            assert again["text"] == text == alone(s)
        assert all(c["fastdllm"]["batch_size"] == 1 for c in r["choices"])
    minus = post(port, "/v1/completions", body | {"seed": -1})["choices"][0]["text"]
    assert minus == post(port, "/v1/completions", body | {"seed": 2**64 - 1})["choices"][0]["text"]


def test_threshold_above_one_means_one_token_per_step(server):
    """generate() takes any threshold > 0 (above 1: one token per step); the server's message said (0, 1]."""
    app, port = server
    r = post(port, "/v1/chat/completions", chat(PROMPT, threshold=2.0))
    assert r["choices"][0]["fastdllm"]["settings"]["threshold"] == 2.0
    status, r = request(port, "POST", "/v1/chat/completions", chat(PROMPT, threshold=-0.5))
    assert status == 400 and "(0, 1]" not in r["error"]["message"] and "above 1" in r["error"]["message"]


def test_client_disconnect_mid_stream(server, monkeypatch):
    """A streaming client leaves after its first event (the decode slowed to 30 ms a step, so it leaves mid-
    decode): a client in the same batch still gets its whole answer, the batch stops once nobody is left,
    and the next request is served normally."""
    app, port = server
    run_batch = cli.run_batch
    expected = solo(app, PROMPTS[1], threshold=None)[0], solo(app, PROMPT)[0]

    def slow(model, rows, args, device, on_step=None, **kw):
        def step(x, stats):
            time.sleep(0.03)
            on_step(x, stats)
        return run_batch(model, rows, args, device, step, **kw)

    monkeypatch.setattr(cli, "run_batch", slow)
    log = []
    monkeypatch.setattr(app, "log", log.append)
    monkeypatch.setattr(app.engine, "log", log.append)
    no_connections(app)
    monkeypatch.setattr(app.engine, "window", 1e6)    # the batch closes once the connected client has sent
    body = json.dumps(chat(PROMPT, stream=True, threshold=None)).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    other, (conn,) = {}, connected(app, port, 1, also=[s])   # both known before a request: one batch of two
    t = threading.Thread(target=lambda: other.update(r=ask(conn, chat(PROMPTS[1], threshold=None))))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    t.start()
    recv_until(s, b"data: ")          # the headers, then the first event (the role chunk)
    s.close()
    t.join(TIMEOUT)
    status, r = other["r"]
    assert status == 200 and r["choices"][0]["message"]["content"] == expected[0]
    assert r["choices"][0]["fastdllm"]["batch_size"] == 2
    r = post(port, "/v1/chat/completions", chat(PROMPT))
    assert r["choices"][0]["message"]["content"] == expected[1]
    assert any("went away" in line for line in log), log


def test_guided_server():
    """--guide: requests are guided by default (FlashDLM). Issue 25: guided requests were never batched (eight
    at once each ran alone), though generate() decodes a guided batch with each row equal to its solo run;
    "guide": false fell back to one token per step instead of the CLI's default threshold; "accept" (a server
    flag, not a request field) was silently ignored."""
    with serving("--guide", os.path.join(ROOT, "demo", "qwen2-arith"), "--batch-window", "1000") as (app, port, _):
        app.engine.window = 1e6       # the batch closes once every connected client has sent (at_once), not by time
        results = at_once(app, port, [chat(p) for p in PROMPTS])
        app.engine.window = 1.0
        for p, (status, r) in zip(PROMPTS, results):
            c = r["choices"][0]
            assert (c["message"]["content"], c["fastdllm"]["nfe"]) == solo(app, p) and c["fastdllm"]["batch_size"] == 8
            assert c["fastdllm"]["settings"]["guide"] and c["fastdllm"]["guide_calls"] > 0
        assert results[0][1]["choices"][0]["message"]["content"] == "23 + 45 = 68. The answer is 68."
        for body in (chat(PROMPT, guide=False, threshold=0.9), chat(PROMPT, guide=False)):
            c = post(port, "/v1/chat/completions", body)["choices"][0]
            assert c["message"]["content"] == "45 + 23 = 68. The answer is 68."
            assert not c["fastdllm"]["settings"]["guide"]
            assert (c["fastdllm"]["settings"]["threshold"], c["fastdllm"]["nfe"]) == \
                (0.9, solo(app, PROMPT, guide=None, threshold=0.9)[1])
        status, r = request(port, "POST", "/v1/chat/completions", chat(PROMPT, threshold=0.9))
        assert status == 400 and "not both" in r["error"]["message"]
        status, r = request(port, "POST", "/v1/chat/completions", chat(PROMPT, accept="bogus"))
        assert status == 400 and r["error"]["param"] == "accept" and r["error"]["code"] == "unknown_field"


def test_close_stops_a_long_batch_with_503(monkeypatch):
    """A shutdown lets the running batch finish for its grace period, then stops it at its next step: its
    requests get a 503 (a stream: an error event, then [DONE]) instead of nothing."""
    run_batch = cli.run_batch

    def slow(model, rows, args, device, on_step=None, **kw):
        return run_batch(model, rows, args, device, lambda x, stats: (time.sleep(0.3), on_step(x, stats)), **kw)
    monkeypatch.setattr(cli, "run_batch", slow)
    with serving() as (app, port, httpd):
        (plain, streamed), results = connected(app, port, 2), {}
        bodies = {"plain": chat(PROMPT, threshold=None), "streamed": chat(PROMPT, threshold=None, stream=True)}
        threads = [threading.Thread(target=lambda c=c, k=k: results.update({k: raw_answer(c, bodies[k])}))
                   for c, k in ((plain, "plain"), (streamed, "streamed"))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT
        while sum(s == "waiting" for s in list(app.conns.values())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)       # until both are being decoded
        httpd.shutdown()
        serve.close(httpd, grace=0.5)
        for t in threads:
            t.join(TIMEOUT)
    assert results["plain"][0] == 503 and json.loads(results["plain"][2])["error"]["code"] == "unavailable"
    status, _, body = results["streamed"]
    assert status == 200 and b'"code": "unavailable"' in body and body.endswith(b"data: [DONE]\n\n")


def test_stop_scan_never_takes_back_text():
    """What a stream shows is always a prefix of the final answer, whatever the stop strings."""
    stops = ["ab", "b", "xyz", "The answer"]
    for final in ("12 + 3 = 15. The answer is 15.", "aab", "xxyxyz", "b", "no stop here", "The answe"):
        shown = ""
        for n in range(len(final) + 1):
            end, stopped = serve.stop_scan(final[:n], stops, final=False)
            assert final[:end].startswith(shown)
            shown = final[:end]
            if stopped:
                break
        end, _ = serve.stop_scan(final, stops, final=True)
        assert final[:end].startswith(shown)


def test_serve_py_command_and_ctrl_c():
    """`python apps/serve.py` as a user runs it: answers the README's curl request, then Ctrl-C stops it cleanly.
    Its own process group, killed whole on any failure; a server that never prints its URL fails in STARTUP s."""
    p = bounded.start([sys.executable, os.path.join(ROOT, "apps", "serve.py"), "--model", DEMO, *FLAGS, "--port", "0"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = bounded.read_line(p, p.stdout, STARTUP)
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", line)[1])
        r = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})
        assert r["choices"][0]["message"]["content"] == "45 + 23 = 68. The answer is 68."
        p.send_signal(signal.SIGINT)
        out, err, late = bounded.finish(p, timeout=TIMEOUT)
    finally:
        bounded.kill(p)
    assert not late and p.returncode == 0, err
    assert "stopped" in out and "Traceback" not in err


def test_compile_makes_one_compiled_that_every_batch_reuses(server):
    """The bug: `serve.py --compile` passed compile=True to every batch, so each batch compiled its graphs
    anew (on CUDA: captured them again). Now build() makes one fastdllm.Compiled for the server, and it answers
    the README's chat request with the answer and NFE of the server without --compile. One request: the CPU
    compiles the demo model's call in 10-60 s."""
    _, port = server
    body = {"messages": [{"role": "user", "content": PROMPT}]}
    eager = post(port, "/v1/chat/completions", body)
    with serving("--compile") as (app, compiled_port, _):
        status, compiled = ask(http.client.HTTPConnection("127.0.0.1", compiled_port, timeout=600), body)
        assert status == 200, compiled
        assert isinstance(app.args.compiled, cli.Compiled) and app.args.compiled.fn is not None
    answer = lambda r: (r["choices"][0]["message"]["content"], r["choices"][0]["fastdllm"]["nfe"])  # noqa: E731
    assert answer(compiled) == answer(eager) and answer(eager)[0] == "45 + 23 = 68. The answer is 68."


def test_sigterm_answers_every_request_in_flight():
    """Issue 25: SIGTERM with requests in flight left some of 12 clients without any answer (the process exited
    under its handler threads; once with status -6). Now the server stops accepting, answers each request
    (decoded, or 503 when it was still queued) and exits with status 0."""
    p = bounded.start([sys.executable, os.path.join(ROOT, "apps", "serve.py"), "--model", DEMO, *FLAGS, "--port", "0",
                       "--batch-window", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", bounded.read_line(p, p.stdout, STARTUP))[1])
        idle = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)   # could send: the worker waits
        clients = []
        for i in range(12):
            s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
            body = json.dumps(chat(PROMPTS[i % len(PROMPTS)])).encode()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                      + body)
            clients.append(s)
        p.send_signal(signal.SIGTERM)
        answers = [read_answer(s) for s in clients]
        out, err, late = bounded.finish(p, timeout=TIMEOUT)
        idle.close()
    finally:
        bounded.kill(p)
    for status, headers, body in answers:
        assert status in (200, 503) and ("choices" if status == 200 else "error") in json.loads(body), body
    assert not late and p.returncode == 0 and "stopped" in out and "Traceback" not in err, err


# ----------------------------------------------------------------------------------------------------------
# Issue 28: what a new user still tripped over (the start-up, the log, the shutdown, the wording)

def test_a_port_in_use_fails_at_once_naming_it_before_the_model_loads():
    """The bug: the model loaded first (minutes for an 8B one), then `[Errno 98] Address already in use`,
    naming neither the port nor --port."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "apps", "serve.py"), "--model", DEMO, *FLAGS, "--port",
                            str(port)], capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.splitlines() == [f"error: port {port} of 127.0.0.1 is in use (another server?): pass another "
                                     f"--port, or --port 0 for any free one"]       # and no "loaded ..." line


@pytest.mark.parametrize("flags,message", [
    (["--gen-length", "30", "--block-length", "8"], None),      # None: the CLI's own message for the same flags
    (["--gen-length", "16", "--block-length", "8", "--steps", "3"], None),
    (["--port", "99999"], "argument --port: expected a port in [0, 65535], got '99999' (see --help)"),
    (["--max-batch", "0"], "argument --max-batch: expected an integer >= 1, got '0' (see --help)"),
    (["--max-body", "-5"], "argument --max-body: expected an integer >= 1, got '-5' (see --help)"),
    (["--batch-window", "-1"], "argument --batch-window: expected a number of ms >= 0, got '-1' (see --help)"),
])
def test_server_flags_are_checked_as_the_clis_one_flag_at_a_time(flags, message):
    """The bugs: `--gen-length 30 --block-length 8` served a 32-position canvas where the CLI refuses the same
    flags; `--port 99999` and `--max-batch 0` got one line about four flags, naming no value."""
    if message is None:
        with pytest.raises(ValueError) as cli_error:
            args = cli.parse_args(["--model", DEMO, *flags, "--prompt", PROMPT])
            cli.check_early(cli.settings(args) | {"guide": args.guide}, cli.flag_name)
        message = str(cli_error.value)
    with pytest.raises(ValueError) as e:
        serve.parse_args(["--model", DEMO, *flags])
    assert str(e.value) == message


def test_without_gen_length_any_block_length_serves_as_before():
    """Without --gen-length a request's canvas is its max_tokens rounded up to whole blocks: a --block-length
    that does not divide the default 256 is still served (the CLI's check is of the rounded canvas)."""
    args = serve.parse_args(["--model", DEMO, "--block-length", "7"])
    assert args.fit_gen_length and args.block_length == 7


class Recorder:
    """sys.stderr that keeps each write() apart."""

    def __init__(self):
        self.writes, self.lock = [], threading.Lock()

    def write(self, text):
        with self.lock:
            self.writes.append(text)
        time.sleep(0.001)            # a thread switch here is where a line used to be split
        return len(text)

    def flush(self):
        pass


def test_log_lines_are_written_whole_and_the_favicon_is_no_news(monkeypatch):
    """The bug: under concurrency the log read `... | 0.050 s127.0.0.1 "POST /v1/completions HTTP/1.1" 200 -`
    then a blank line (print() writes a line and its newline apart). Every browser's GET /favicon.ico logged a
    404; now it is a 204 with no log line, and the page names an empty icon, so a browser does not ask."""
    err = Recorder()
    with serving() as (app, port, _):
        monkeypatch.setattr(sys, "stderr", err)            # the server's log from here on (not the load's line)
        app.args.quiet = False
        results = at_once(app, port, [chat(p) for p in PROMPTS])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.request("GET", "/favicon.ico")
        icon = conn.getresponse()
        assert (icon.status, icon.read()) == (204, b"")
        conn.request("GET", "/health")                     # the connection carries the next request
        assert conn.getresponse().status == 200
        conn.close()
        app.args.quiet = True
    assert all(status == 200 for status, _ in results)
    assert err.writes and all(w.endswith("\n") and w.count("\n") == 1 for w in err.writes), err.writes
    lines = [w[:-1] for w in err.writes]
    assert sum(re.fullmatch(r'127\.0\.0\.1 "POST /v1/chat/completions HTTP/1\.1" 200 -', ln) is not None
               for ln in lines) == len(PROMPTS)
    assert any(ln.startswith("batch ") for ln in lines) and any('"GET /health' in ln for ln in lines)
    assert not any("favicon" in ln for ln in lines), lines
    with open(serve.PAGE) as f:
        assert '<link rel="icon" href="data:,">' in f.read()


def test_shutdown_503_tells_clients_not_to_retry():
    """The bug: the openai client retries a 503 (as every 5xx) unless the answer says `x-should-retry:
    false`; by the retry the server had gone, and its user saw only `APIConnectionError: Connection error.`"""
    with serving() as (app, port, _):
        app.engine.stop()
        for body in (chat(PROMPT), chat(PROMPT, stream=True)):
            status, headers, raw = raw_answer(http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT), body)
            assert status == 503 and headers.get("x-should-retry") == "false", headers
            assert json.loads(raw)["error"] == {"message": "the server is shutting down", "type": "server_error",
                                                "param": None, "code": "unavailable"}
        status, headers, _ = raw_answer(http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT), chat(""))
        assert status == 400 and "x-should-retry" not in headers       # a client's own error: nothing to retry


@pytest.mark.parametrize("fields,param", [
    ({"temperature": -1}, "temperature"), ({"cache": "banana"}, "cache"), ({"threshold": 0.9, "factor": 1}, "threshold"),
    ({"steps": 5}, "steps"), ({"steps": 100}, "steps"), ({"max_completion_tokens": 16, "steps": 3}, "steps"),
    ({"editing_threshold": 0.5}, "editing_threshold"), ({"max_post_steps": 2}, "max_post_steps"),    # at decode time
    ({"top_k": 3, "cache": "none"}, "top_k")])
def test_every_refusal_of_a_setting_names_its_field(server, fields, param):
    """Issue 46: generate()'s refusals of a request's settings came back with `param: null`; every one names the
    field it refuses (the first the message names, of those sent), here and at decode time alike."""
    _, port = server
    for path in ("/v1/chat/completions", "/v1/denoise/stream"):
        status, r = request(port, "POST", path, chat(PROMPT, **fields))
        assert status == 400 and r["error"]["param"] == param and r["error"]["code"] == "invalid_value", r


@pytest.mark.parametrize("path,body,param,words,not_words", [
    ("/v1/completions", {"prompt": ""}, "prompt", "the prompt is empty (send some text or token ids)", "chat"),
    ("/v1/chat/completions", chat(""), "messages", "the prompt is empty (a chat needs a user message)", None),
    ("/v1/completions", {"prompt": [5], "max_tokens": 100}, "max_tokens", "the prompt (1 token) + 104 answer", None),
    ("/v1/completions", {"prompt": [5] * 60}, "prompt", "the prompt (60 tokens) + 32 answer", None),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["l"] * 17}, "stop", "a list of at most 16 strings (got a list "
     'of 17: ["l", "l", "l", "l", "l", "l", "l", "l", ...])', None),
])
def test_error_wording(server, path, body, param, words, not_words):
    """The bugs: "the prompt (1 tokens)"; an empty /v1/completions prompt told of a chat; 17 stop strings showed
    a value cut to `"l",`."""
    _, port = server
    status, r = request(port, "POST", path, body)
    assert status == 400 and r["error"]["param"] == param and words in r["error"]["message"], r
    assert not_words is None or not_words not in r["error"]["message"]


# ----------------------------------------------------------------------------------------------------------
# Issue 39: what a new user tripped over, round 2

def test_help_lists_every_flag_it_takes(capsys):
    """serve.py --help and bench.py run --help sent the reader to `fastdllm.py --help` for the decoding flags;
    they list them now, under their own, and not the CLI's prompt flags they refuse."""
    import bench
    for parse, own in ((lambda: serve.parse_args(["--help"]), ("--host", "--max-batch")),
                       (lambda: bench.main(["run", "--help"]), ("--caches", "--batch"))):
        with pytest.raises(SystemExit) as e:
            parse()
        text = " ".join(capsys.readouterr().out.split())
        assert e.value.code == 0 and "fastdllm.py --help" not in text, text
        for flag in ("--model", "--gen-length", "--block-length", "--steps", "--temperature", "--remasking", "--top-k",
                     "--seed", "--device", "--dtype", "--guide", "--accept"):
            assert f" {flag} " in text, (flag, text)
        assert "--prompt-file" not in text and "--interactive" not in text and "--trace" not in text
        assert all(f" {flag} " in text for flag in own), text


def test_a_large_finite_number_is_a_number(server):
    """`temperature: 1e300` was refused as "must be a number"; only what a float cannot hold (1e400 reads as
    infinity, a 400-digit integer) is refused, as such. 1e300 samples, as the CLI's --temperature 1e300 does."""
    app, port = server
    r = post(port, "/v1/completions", {"prompt": PROMPTS[7], "temperature": 1e300, "seed": 3, "max_tokens": 16})
    assert r["choices"][0]["text"] == solo_ids(app, PROMPTS[7], seed=3, gen_length=16, temperature=1e300)
    for value in (10**400, b"1e400"):
        body = json.dumps({"prompt": PROMPTS[7]})[:-1].encode() + b', "temperature": ' + (
            value if isinstance(value, bytes) else str(value).encode()) + b"}"
        status, r = request(port, "POST", "/v1/completions", raw=body)
        assert (status, r["error"]["param"]) == (400, "temperature") and "must be a finite number" in \
            r["error"]["message"], r


def solo_ids(app, prompt, seed, **override):
    """A completions prompt (raw text, no template) alone, the CLI's path -> its answer."""
    ids = app.chat.encode(prompt)
    (row,), _ = cli.run_batch(app.model, [ids], serve.argparse.Namespace(**vars(app.args) | {"seed": seed}),
                              app.engine.device, **override)
    return app.chat.answer(row[len(ids):])


def test_the_page_checks_query_is_read_as_the_page_reads_it():
    """`tools/page_check.py --query "threshold=none&step=9"` was a traceback (float("none")), after the server and
    the browser had started; the query's other fields were not sent to the API the page is compared with."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("page_check", os.path.join(ROOT, "tools", "page_check.py"))
    page_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page_check)
    assert page_check.page_query("threshold=none&step=9") == {"threshold": None}
    assert page_check.page_query("cache=none&max_tokens=16&block_length=4&threshold=0.5&speed=0") == dict(
        threshold=0.5, cache="none", max_tokens=16, block_length=4)
    r = bounded.run([sys.executable, os.path.join(ROOT, "tools", "page_check.py"), "--query", "threshold=abc"],
                    timeout=60)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr == ("error: page_check.py: argument --query: "
                                                               "threshold='abc' is not a value the page takes (see --help)\n")
