"""
serve.py: fastdllm behind an OpenAI-compatible HTTP API, plus a live web page that shows a decode step by
step. Python's standard library only (http.server, json, queue, threading) on top of cli.run_batch(),
the CLI's own decoding path.

    python apps/serve.py --model demo/llada-arith --gen-length 32 --block-length 8
    curl -s 127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Tom has 23 apples and buys 45 more. How many apples does he have?"}]}'
    open http://127.0.0.1:8000/ for the page

Endpoints: GET / (the page), /v1/models, /v1/denoise/info; POST /v1/chat/completions, /v1/completions (both
OpenAI's, streamed or not), /v1/denoise/stream (one event per denoising step). docs/serve.md documents every
field, event and error.

How it runs: HTTP handler threads check a request (api.py: its fields) and turn each of its answers into a
Job; one worker thread owns the model and decodes waiting jobs with the same settings as ONE left-padded batch,
in which every row decodes exactly as it would alone (docs/serve.md, "Batching").
"""
import argparse
import contextlib
import errno
import itertools
import json
import os
import queue
import secrets
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)     # the method's modules (fastdllm.py, model.py, ...) live at the repository's root
import cli  # noqa: E402
import flags  # noqa: E402
import options  # noqa: E402
import denoise  # noqa: E402
from api import (CLIENT_GONE, ApiError, JsonHandler, check_fields, check_text, choice, chunk, envelope, field_named,
                 get, json_object, prompt_fields, quoted, shutting_down, stop_scan, tokens, usage)
from chat import decode  # noqa: E402


PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "web", "index.html")
# fastdllm.py flags that have no meaning for a server: its prompts come in requests.
CLI_ONLY = cli.PROMPT_FLAGS


class Cancelled(Exception):
    """Raised from on_step when every client of a batch has gone: the batch stops there."""


class Job:
    """One answer of a request (a prompt, or one of its n copies): its ids and decoding settings, the key of
    the batches it may join, and the request's queue its results go to."""

    def __init__(self, ids, max_tokens, kw, *, index, key, seed, shows_seed, guided, stops, out, want_steps, sent):
        self.ids, self.max_tokens, self.kw, self.index, self.key = ids, max_tokens, kw, index, key
        self.seed, self.shows_seed, self.guided, self.stops, self.out = seed, shows_seed, guided, stops, out
        self.want_steps, self.sent = want_steps, sent      # sent: the request's fields (an error's param)
        self.cancelled = False            # set by the handler when its client has gone
        self.queued = time.perf_counter()

    def put(self, kind: str, payload):
        self.out.put((self.index, kind, payload))

    def settings(self) -> dict:
        """The decoding settings its answer reports (a guided answer is one block)."""
        k = self.kw
        return {"cache": k["cache"], "threshold": k["threshold"], "factor": k["factor"],
                "block_length": k["gen_length"] if self.guided else k["block_length"], "steps": k["steps"],
                "temperature": k["temperature"], "guide": self.guided} | {n: k[n] for n in denoise.OWN if n in k}


class Request:
    """A parsed request: its jobs (n per prompt) and how to answer."""

    def __init__(self, kind, model, jobs, out, stream, include_usage, n):
        self.kind, self.model, self.jobs, self.out, self.stream = kind, model, jobs, out, stream
        self.include_usage = include_usage
        self.prompt_tokens = sum(len(j.ids) for j in jobs[::n])     # each prompt once, as OpenAI counts
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def cancel(self):
        """Its client has gone, or it has failed: its jobs leave every batch (a batch of only those stops)."""
        for job in self.jobs:
            job.cancelled = True


# ----------------------------------------------------------------------------------------------------------
# The worker: batches of jobs with the same settings, decoded by cli.run_batch

class Engine:
    """The one thread that owns the model. Handler threads submit() a request's jobs; each job gets ("step",
    {"ids": canvas, "final", "committed": by the model}) after each call of its answer if it wants them (denoise.py),
    then ("done", result) or ("error", ApiError). others() says whether another request could still come to join a
    batch (a connection not waiting for its answer)."""

    def __init__(self, model, args, log, others=lambda: False):
        self.model, self.args, self.log, self.others = model, args, log, others
        self.device = next(model.parameters()).device
        self.window = args.batch_window / 1000
        self.max_batch = args.max_batch
        self.jobs = queue.Queue()    # each item a request's jobs, so that they arrive together
        self.waiting = []            # jobs taken from the queue that did not fit the last batch
        self.stopping = self.aborting = False
        self.batches = 0
        self.thread = threading.Thread(target=self.loop, name="fastdllm-worker", daemon=True)

    def start(self):
        self.thread.start()

    def submit(self, jobs: list[Job]):
        if self.stopping or not self.thread.is_alive():
            raise shutting_down()
        self.jobs.put(jobs)

    def stop(self, grace: float = 5.0):
        """No new jobs; the batch being decoded may finish for `grace` seconds, then stops at its next step;
        every job not done is answered 503."""
        self.stopping = True
        self.jobs.put(None)
        if self.thread.is_alive():
            self.thread.join(grace)
            self.aborting = True
            self.thread.join(grace)

    def next_batch(self):
        """The oldest waiting job and every job with its settings that comes within the window while another
        request could still come (at most --max-batch); None once stopped."""
        self.waiting = [j for j in self.waiting if not j.cancelled]
        if not self.waiting:
            jobs = self.jobs.get()
            if jobs is None:
                return None
            self.waiting += jobs
            deadline = time.monotonic() + self.window
        else:
            deadline = time.monotonic()     # these have waited already: take only what is there now
        key = self.waiting[0].key
        while not self.stopping and sum(j.key == key for j in self.waiting) < self.max_batch:
            left = deadline - time.monotonic()
            wait = left > 0 and self.others()      # a lone client never waits for nobody
            try:
                jobs = self.jobs.get(timeout=min(left, 0.002)) if wait else self.jobs.get_nowait()
            except queue.Empty:
                if wait:
                    continue
                break
            if jobs is None:
                self.stopping = True
            else:
                self.waiting += [j for j in jobs if not j.cancelled]
        batch = [j for j in self.waiting if j.key == key][:self.max_batch]
        self.waiting = [j for j in self.waiting if j not in batch]
        return batch

    def loop(self):
        while not self.stopping and (batch := self.next_batch()) is not None:
            self.run(batch)
        while True:      # whatever is left is answered, not dropped
            try:
                self.waiting += self.jobs.get_nowait() or []
            except queue.Empty:
                break
        for job in self.waiting:
            job.put("error", shutting_down())

    def run(self, batch: list[Job]):
        try:
            self.decode(batch)
        except Cancelled:
            self.log(f"batch of {len(batch)} stopped: every client has gone")
        except ApiError as e:       # stopped by a shutdown
            for job in batch:
                job.put("error", e)
        except Exception as e:
            if len(batch) > 1:      # one bad row must not fail the others: decode each alone
                for job in batch:
                    self.run([job])
                return
            if isinstance(e, ValueError):   # generate()'s one-line messages about settings and prompts
                err = ApiError(400, str(e), field_named(str(e), batch[0].sent), "invalid_value")
            else:
                traceback.print_exc()
                err = ApiError(500, f"decoding failed: {type(e).__name__}: {e}", code="server_error")
            batch[0].put("error", err)

    def decode(self, batch: list[Job]):
        rows = [j.ids for j in batch]
        P = max(map(len, rows))                 # left padding puts every answer at canvas column P
        calls = denoise.Calls(len(batch))
        started = time.perf_counter()
        first, k = batch[0], batch[0].kw

        def on_step(x, stats):
            # A row's step event after each call of its answer, with its canvas and what the model committed in it
            # (read only when a client streams steps: docs/serve.md, "The per-step event stream").
            if self.aborting:
                raise shutting_down()
            if any(j.want_steps and not j.cancelled for j in batch):
                canvas, committed = x[:, P:].tolist(), calls.step(stats)
                for i, job in enumerate(batch):
                    if job.want_steps and not job.cancelled and committed[i] is not None:
                        job.put("step", {"ids": canvas[i], "final": stats["final"][i], "committed": committed[i]})
            if all(j.cancelled for j in batch):
                raise Cancelled

        guided = {} if first.guided else {"guide": None, "guide_model": None}     # "guide": false
        args = argparse.Namespace(**vars(self.args) | {"seed": first.seed} | guided)
        floats = {n: float(k[n]) for n in ("threshold", "factor") if k[n] is not None}     # 2**64 fits no tensor
        seeds = [j.seed for j in batch]     # DiffusionGemma's rows draw each from its own: each answer as alone
        outs, stats = cli.run_batch(self.model, rows, args, self.device, on_step, seeds=seeds, **k | floats)
        self.batches += 1
        for i, (job, out) in enumerate(zip(batch, outs)):
            # The "fastdllm" field of its answer: what its decode cost (docs/serve.md).
            nfe, made = stats["row_nfe"][i], denoise.made(stats, i, out[len(job.ids):], self.args.stop_ids,
                                                          self.model.config.mask_id < 0)
            cost = {"nfe": nfe, "tokens_per_call": round(made / max(nfe, 1), 3),
                    "gen_length": job.kw["gen_length"], "batch_size": len(batch), "batch_nfe": stats["nfe"],
                    "seconds": round(stats["seconds"], 4), "tokens_per_s": round(stats["tokens_per_s"], 1),
                    "queue_seconds": round(started - job.queued, 4), "settings": job.settings()}
            if job.guided:
                cost["guide_calls"] = stats["guide_calls"]
            if job.shows_seed:     # the seed that repeats this answer with n=1 (Request.parse)
                cost["seed"] = job.seed
            job.put("done", {"ids": out[len(job.ids):], "fastdllm": cost})
        self.log(f"batch {self.batches}: {len(batch)} request(s) | gen {k['gen_length']} | cache {k['cache']} | "
                 f"threshold {k['threshold']} | NFE {stats['nfe']} | {stats['seconds']:.3f} s")


# ----------------------------------------------------------------------------------------------------------
# The application: requests -> jobs -> responses

class App:
    def __init__(self, args, model, chat, guide, log=None):
        self.args, self.model, self.chat, self.guide, self.cfg = args, model, chat, guide, model.config
        self.name = args.served_name or args.model
        self.log_lock = threading.Lock()
        self.log = log or self.write_log
        self.conns = {}               # open connection -> "idle" | "reading" (a request) | "waiting" (its answer)
        others = lambda: any(s != "waiting" for s in list(self.conns.values()))   # could still send a request
        self.engine = Engine(model, args, self.log, others)
        self.created = int(time.time())
        self.texts = {}               # token id -> its text, for the event stream
        # An unguided request on a guided server ("guide": false) gets the CLI's default threshold, not none.
        self.threshold = cli.CLI_DEFAULTS["threshold"] if args.guide else args.threshold
        self.accepts = denoise.accepts(model, args.block_length)    # what a request may set on this model (info)

    def write_log(self, line: str):     # whole, in one write: print() writes the newline apart from its line
        if not self.args.quiet:
            with self.log_lock:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()

    def token_text(self, t: int) -> str:
        if t not in self.texts:
            self.texts[t] = decode(self.chat.tok, [t], skip_special_tokens=False)
        return self.texts[t]

    def settings(self, body: dict):
        """The decoding settings of a request: the server's flags, overridden by the fields a request may set
        (docs/serve.md). -> (generate() keyword arguments without gen_length, guided)."""
        a = self.args
        guided = get(body, "guide", self.guide is not None)
        if guided and self.guide is None:
            raise ApiError(400, "this server has no guide: start it with --guide to use guided decoding", "guide",
                           "invalid_value")
        # threshold / factor: null = off. As in the CLI, choosing one rule (or the guide) drops the other's default.
        threshold, factor = body.get("threshold"), body.get("factor")
        if "threshold" not in body:
            threshold = None if factor is not None or guided else self.threshold
        if "factor" not in body:
            factor = None if threshold is not None and "threshold" in body else a.factor
        kw = {n: get(body, n, getattr(a, n)) for n in ("block_length", "steps", "cache", "temperature", "remasking",
                                                      "top_p", "top_k")}
        kw["top_p"] = None if kw["top_p"] == 1 else kw["top_p"]       # top_p 1 means "off"
        # LLaDA2.1's editing (null: off, and the server's other two with it); another model's generate() refuses it.
        ed, edit = denoise.EDITING, body["editing_threshold"] if "editing_threshold" in body else a.editing_threshold
        if ed[0] in self.accepts["settings"] or any(body.get(n) is not None for n in ed):
            kw |= {n: get(body, n, None if edit is None else getattr(a, n)) for n in ed[1:]} | {ed[0]: edit}
        own = [n for n in denoise.GEMMA_OWN if n in body or hasattr(a, n)]       # DiffusionGemma's (null: off), if set
        kw |= {n: body[n] if n in body else getattr(a, n) for n in own}
        for field in ("remasking", "top_p", "top_k"):     # the family's own options, named by their field
            try:      # (the server's flags were checked at start)
                options.check_family(self.cfg, **{"remasking": None, field: kw[field] if field in body else None})
            except ValueError as e:
                raise ApiError(400, str(e), field, "invalid_value") from None
        return kw | dict(block_length=kw["block_length"] or None, threshold=threshold, factor=factor,
                         temperature=float(kw["temperature"]), alg_temp=a.alg_temp), guided

    def gen_length(self, n_prompt: int, body: dict, kw: dict, guided: bool, param: str):
        """max_tokens -> (max_tokens, gen_length): the canvas is max_tokens rounded up to a whole number of
        blocks (generate() needs a multiple), and the answer is cut back to max_tokens tokens."""
        limit = self.cfg.max_seq_len
        unit = 1 if guided or kw["block_length"] is None else kw["block_length"]
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(name)
        if max_tokens is None:       # the server's --gen-length; without one, 256 fitted to the positions (the CLI's)
            max_tokens = self.args.gen_length
            if self.args.fit_gen_length and n_prompt + max_tokens > limit:
                max_tokens = (limit - n_prompt) // unit * unit
            if max_tokens < 1:
                raise ApiError(400, f"the prompt ({tokens(n_prompt)}) leaves no room for a block of {unit} answer "
                               f"tokens in the model's {limit} positions: shorten it", param, "context_length_exceeded")
        gen = -(-max_tokens // unit) * unit
        if n_prompt + gen > limit:
            asked = f"max_tokens {max_tokens}" if name in body else f"the server's default max_tokens {max_tokens}"
            rounded = f" rounded up to a multiple of block_length {unit}" if gen != max_tokens else ""
            raise ApiError(400, f"the prompt ({tokens(n_prompt)}) + {gen} answer positions ({asked}{rounded}) exceed "
                           f"the model's {limit} positions: lower max_tokens or shorten the prompt",
                           name if name in body else param, "context_length_exceeded")
        return max_tokens, gen

    def check_ids(self, ids: list[int], param: str):
        cfg = self.cfg
        if not ids:
            why = "a chat needs a user message" if param == "messages" else "send some text or token ids"
            raise ApiError(400, f"the prompt is empty ({why})", param, "invalid_value")
        bad = next((t for t in ids if not 0 <= t < cfg.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {quoted(bad)} is outside the vocabulary [0, {cfg.vocab_size})", param,
                           "invalid_value")
        if cfg.mask_id in ids:
            raise ApiError(400, f"the prompt contains the mask token (id {cfg.mask_id}), which is reserved for the "
                           f"answer: remove it", param, "invalid_value")

    def parse(self, kind: str, body: dict) -> Request:
        """A request body -> Request, or an ApiError: every check that can be made before decoding is made
        here, so that one bad prompt never reaches a batch."""
        check_fields(body, PATHS[kind], ("messages", "prompt") if kind == "denoise" else
                     ("messages",) if kind == "chat" else ("prompt",))
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(404, f"the model {json.dumps(model)[:80]} does not exist: this server serves "
                           f"{json.dumps(self.name)} (GET /v1/models)", "model", "model_not_found")
        n, limit = get(body, "n", 1), 1 if kind == "denoise" else self.args.max_batch
        if n > limit:      # the n answers to a prompt: one batch when greedy (one stream: one answer)
            raise ApiError(400, f"'n' must be at most {limit} (--max-batch; a denoise stream: 1)", "n", "unsupported")
        stream = kind == "denoise" or get(body, "stream", False)
        stop = get(body, "stop", [])
        stops = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        kw, guided = self.settings(body)
        # A sampled answer draws its noise for its whole batch, so it is decoded alone: choice c with the request's
        # seed + c (mod 2**64, as torch takes a negative seed), reported where the client cannot know it (a drawn
        # seed, or n > 1), so that sending it back with n=1 repeats that choice. A request without a seed gets a
        # fresh one (--seed, if given, is the server's default).
        # DiffusionGemma always samples, each row from its own generator (cli.run_batch): its answers batch.
        uniform = self.cfg.mask_id < 0
        sampled = kw["temperature"] > 0 or kw["remasking"] == "random" or bool(kw["alg_temp"]) or uniform
        drawn = sampled and body.get("seed") is None
        seed = self.args.seed if not drawn or self.args.seed_given else secrets.randbits(63)
        seed = get(body, "seed", seed)
        prompts, param = prompt_fields(kind, body)      # a chat's messages are one prompt
        prompts = [self.chat.render(q) if param == "messages" else q for q in prompts]
        rows = [self.chat.encode(check_text(q, param)) if isinstance(q, str) else q for q in prompts]
        out, jobs, group = queue.Queue(), [], uuid.uuid4().hex
        for i, ids in enumerate(rows):
            self.check_ids(ids, param)
            max_tokens, gen = self.gen_length(len(ids), body, kw, guided, param)
            k = kw | {"gen_length": gen}
            try:   # the model-free checks of generate(), here so that a bad setting is a 400 before any batch
                grid = self.cfg.family in cli.GRID and not guided        # steps and blocks per block, or canvas
                cli.check_early(k | ({"guide": True} if guided else {}), grid=grid)
                if (k["steps"] or 0) > self.cfg.max_seq_len:     # (a tensor of that many steps is allocated)
                    raise ValueError(f"steps must be at most the model's {self.cfg.max_seq_len} positions (got "
                                     f"{k['steps']}); every step commits at least one token")
            except ValueError as e:
                raise ApiError(400, str(e), field_named(str(e), body), "invalid_value") from None
            key = ("sampled", group, i) if sampled > uniform else (guided, *sorted(k.items()))    # alone, or together
            jobs += [Job(ids, max_tokens, k, index=i * n + c, key=key + (c,) * (sampled > uniform),
                         seed=(seed + c) % 2**64 if sampled else seed, shows_seed=drawn or sampled and n > 1,
                         guided=guided, stops=stops, out=out, want_steps=stream, sent=tuple(body)) for c in range(n)]
        include_usage = bool(get(body, "stream_options", {}).get("include_usage"))
        return Request(kind, self.name, jobs, out, stream, include_usage, n)

    # -- answers ---------------------------------------------------------------------------------------------

    def finish(self, job: Job, ids: list[int]):
        """(text, finish_reason, completion_tokens) of a decoded answer: cut at max_tokens, at the first end
        token (not counted, nor anything after it) and at the first stop string; stripped as the CLI prints."""
        ids = ids[:job.max_tokens]
        end = next((i for i, t in enumerate(ids) if t in self.chat.stop_ids), None)
        text = self.chat.answer(ids)
        cut, stopped = stop_scan(text, job.stops, final=True)
        reason = "stop" if stopped or end is not None else "length"
        return text[:cut], reason, len(ids) if end is None else end


# ----------------------------------------------------------------------------------------------------------
# HTTP

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/denoise/stream": "denoise"}
PATHS = {kind: path for path, kind in ROUTES.items()}
GETS = ("/", "/index.html", "/favicon.ico", "/v1/models", "/v1/denoise/info", "/health")   # and /v1/models/{name}


class Handler(JsonHandler):
    """The routes, and the answers from the worker's events: JSON, OpenAI's stream, our per-step stream."""
    server_version = "fastdllm-serve"

    @property
    def app(self) -> App:
        return self.server.app

    @property
    def max_body(self) -> int:
        return self.app.args.max_body

    def allow(self, path: str) -> str | None:
        return "POST" if path in ROUTES else "GET" if path in GETS or path.startswith("/v1/models/") else None

    def log_message(self, fmt, *args):
        self.app.log(f"{self.address_string()} {fmt % args}")

    def handle_one_request(self):
        try:
            super().handle_one_request()
        finally:
            self.app.conns[self.request] = "idle"

    def parse_request(self):
        self.app.conns[self.request] = "reading"      # a request has come: a shutdown waits for its answer
        return super().parse_request()

    def do_GET(self):
        path, app = self.route(), self.app
        try:
            self.read_body()          # a body sent with a GET is read and dropped
        except ApiError as e:
            return self.send_error_json(e, close=True)
        card = {"id": app.name, "object": "model", "created": app.created, "owned_by": "fastdllm",
                "max_model_len": app.cfg.max_seq_len}
        answers = {"/v1/models": lambda: {"object": "list", "data": [card]}, f"/v1/models/{app.name}": lambda: card,
                   "/v1/denoise/info": lambda: denoise.info(app), "/health": lambda: {"status": "ok"}}
        if path in ("/", "/index.html"):
            with open(PAGE, "rb") as f:
                self.send(200, f.read(), "text/html; charset=utf-8", headers={"Cache-Control": "no-store"})
        elif path == "/favicon.ico":    # no icon (the page names an empty one): "no content", not a 404
            self.send_response(204)
            self.end_headers()
        elif path in answers:
            self.send_json(200, answers[path]())
        elif path.startswith("/v1/models/"):
            self.send_error_json(ApiError(404, f"the model {path[len('/v1/models/'):]!r} does not exist", "model",
                                          "model_not_found"))
        else:
            self.refuse()

    def do_POST(self):
        path = self.route()
        try:
            raw = self.read_body()
        except ApiError as e:
            return self.send_error_json(e, close=True)
        if path not in ROUTES:
            return self.refuse()
        try:
            req = self.app.parse(ROUTES[path], json_object(raw))
            self.app.engine.submit(req.jobs)
            self.app.conns[self.request] = "waiting"     # after: a batcher that sees nobody else finds the jobs queued
        except ApiError as e:
            return self.send_error_json(e)
        try:
            if req.kind == "denoise":
                self.denoise_stream(req)
            elif req.stream:
                self.openai_stream(req)
            else:
                self.answer(req)
        except CLIENT_GONE:    # the client went away: its jobs are dropped, everyone else is served as before
            req.cancel()
            self.close_connection = True
            self.app.log(f"{self.address_string()} went away during {path}")

    def events(self, req: Request):
        """(index, kind, payload) from the worker until every job of `req` is done or has failed."""
        left = len(req.jobs)
        while left:
            try:
                index, kind, payload = req.out.get(timeout=1.0)
            except queue.Empty:
                if self.app.engine.thread.is_alive():
                    continue
                index, kind, payload = None, "error", shutting_down()
            left -= kind != "step"
            yield index, kind, payload
            if kind == "error":
                return

    def answer(self, req: Request):
        results = {}
        for index, kind, payload in self.events(req):
            if kind == "error":
                req.cancel()
                return self.send_error_json(payload)
            results[index] = payload
        choices, completion = [], 0
        for job in req.jobs:
            r = results[job.index]
            text, reason, n = self.app.finish(job, r["ids"])
            completion += n
            choices.append(choice(req.kind, job.index, text, reason, r["fastdllm"]))
        self.send_json(200, envelope(req, choices) | {"usage": usage(req.prompt_tokens, completion)})

    def sse_start(self, req: Request):
        """The worker's events for a streamed request, once the first has come: a request that fails before its
        first step (generate()'s own checks of the settings) gets its 4xx, not a stream -> the events, or None."""
        events = self.events(req)
        first = next(events)
        if first[1] == "error":
            req.cancel()
            return self.send_error_json(first[2])
        self.start_events()
        return itertools.chain([first], events)

    def openai_stream(self, req: Request):
        """OpenAI's chunks: the text as it is decided (left to right: the part before the first mask), each
        piece once; the last chunk of a choice has its finish_reason and our "fastdllm" field."""
        app, mask_id = self.app, self.app.cfg.mask_id
        jobs = {j.index: j for j in req.jobs}
        views = {i: app.chat.stream() for i in jobs}       # new_text(decided ids) -> the text they add
        texts, shown = dict.fromkeys(jobs, ""), dict.fromkeys(jobs, "")
        completion, events = 0, self.sse_start(req)
        if events is None:
            return
        if req.kind == "chat":
            for job in req.jobs:
                self.sse(chunk(req, job.index, "", role=True))
        for index, kind, payload in events:
            if kind == "error":
                self.sse(payload.body())
                break
            job = jobs[index]
            if kind == "step":   # the decided text, less a tail that could still become a stop string
                ids = payload["ids"][:job.max_tokens]
                final = min(ids.index(mask_id) if mask_id in ids else len(ids), payload["final"])
                texts[index] += views[index](ids[:final], final=final == len(ids))
                visible = texts[index][:stop_scan(texts[index], job.stops, final=False)[0]]
            else:                # done: exactly the text of the non-streamed answer
                visible, reason, n = app.finish(job, payload["ids"])
                completion += n
            if not visible.startswith(shown[index]):      # cannot happen: decided tokens never change
                app.log(f"warning: streamed text {shown[index]!r} is not a prefix of {visible!r}")
            piece, shown[index] = visible[len(shown[index]):], visible
            if piece:
                self.sse(chunk(req, job.index, piece))
            if kind == "done":
                self.sse(chunk(req, job.index, "", reason, payload["fastdllm"]))
        else:    # every choice done: OpenAI's usage chunk (no choices) when stream_options asks for it
            if req.include_usage:
                self.sse(envelope(req, [], chunk=True) | {"usage": usage(req.prompt_tokens, completion)})
        self.sse(b"[DONE]")

    def denoise_stream(self, req: Request):
        """Our per-step stream for the page: "start", a "step" per model call of the answer, "done" (denoise.py)."""
        events = self.sse_start(req)
        if events is not None:
            for event in denoise.events(self.app, req, events):
                self.sse(event)
            self.sse(b"[DONE]")


class Server(ThreadingHTTPServer):
    daemon_threads = True               # close() waits for the answers; an idle keep-alive never blocks it
    request_queue_size = 128            # listen() backlog: socketserver's 5 resets a burst of clients

    def process_request(self, request, client_address):
        self.app.conns[request] = "idle"       # counted from its accept on (the batcher and close() see it)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        self.app.conns.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], CLIENT_GONE):
            super().handle_error(request, client_address)


def close(server: Server, grace: float = 5.0):
    """Stop serving without dropping anyone (SIGTERM, Ctrl-C): stop listening (a connection the kernel has
    already accepted is still served), let the batch being decoded finish (after `grace` s it stops with a
    503), answer queued requests with a 503, wait for every answer to be written, close idle connections."""
    app = server.app
    with contextlib.suppress(OSError):
        while select.select([server.socket], [], [], 0)[0]:
            server.process_request(*server.get_request())
    server.server_close()
    app.engine.stop(grace)
    deadline = time.monotonic() + grace
    while app.conns and time.monotonic() < deadline:
        for conn, state in list(app.conns.items()):
            with contextlib.suppress(OSError, ValueError):       # (closed meanwhile)
                if state == "idle" and not select.select([conn], [], [], 0)[0]:    # no request on its way
                    conn.shutdown(socket.SHUT_RD)      # its handler reads the end and finishes
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------------------------
# Command line

def parse_args(argv=None):
    """The server's own flags, and every decoding flag of fastdllm.py as the server's defaults (cli.add_flags and
    cli.finish_args: the names, defaults and checks are the CLI's)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = cli.new_parser(description="Serve a LLaDA / Dream checkpoint with Fast-dLLM decoding: an OpenAI-compatible "
                       "API and a live page of the decode (docs/serve.md).", epilog="The decoding flags are the "
                       "server's defaults; a request may set some of them (docs/serve.md). --seed, if given, is the "
                       "seed of sampled requests that send none.")
    own = p.add_argument_group("the server")
    own.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine "
                     "only; 0.0.0.0 is every interface, with no authentication)")
    own.add_argument("--port", type=flags.checked(int, lambda n: 0 <= n < 65536, "a port in [0, 65535]"), default=8000,
                     help="port; 0 = any free one (default: %(default)s)")
    own.add_argument("--served-name", help="the model name clients pass and /v1/models lists (default: --model)")
    at_least_1 = flags.checked(int, lambda n: n >= 1, "an integer >= 1")      # a wrong value: named, with its flag
    own.add_argument("--batch-window", type=flags.checked(float, lambda ms: 0 <= ms < float("inf"), "a number of ms "
                     ">= 0"), default=20.0, help="ms to wait for more requests to batch with the first, while another "
                     "connection could send one (default: %(default)s)")
    own.add_argument("--max-batch", type=at_least_1, default=8, help="most requests in one batch (default: "
                     "%(default)s)")
    own.add_argument("--max-body", type=at_least_1, default=1 << 20, help="largest body in bytes (default: "
                     "%(default)s)")
    own.add_argument("--quiet", action="store_true", help="no request and batch log on stderr")
    cli.add_flags(p.add_argument_group("decoding (fastdllm.py's flags)"), omit=CLI_ONLY)
    for flag in CLI_ONLY:
        p.add_argument(flag, action=flags.Refused, why="is a fastdllm.py option with no meaning for the server: prompts "
                       "come in requests")
    args = p.parse_args(argv)
    args.seed_given = any(a.split("=")[0] == "--seed" for a in argv)    # else a sampled request gets a fresh seed
    args.prompt = "(requests)"      # cli.finish_args insists on a prompt; the server's come in requests
    args = cli.finish_args(p, args)
    args.prompt = None
    cli.check_flags(args, whole_blocks=True)      # the CLI's checks: `--gen-length 30 --block-length 8` is refused
    return args


def build(args) -> App:
    """Load the model (and the guide) as the CLI's main() does, and the App around them; its worker not yet
    started."""
    model, chat, _, _ = cli.load_all(args)     # the CLI's checks and loading; "loaded ... in s" on stderr
    return App(args, model, chat, args.guide_model)


def listen(host: str = "127.0.0.1", port: int = 0) -> Server:
    """The server's socket, listening (port 0: a free one), or one line why not. main() listens before it loads the
    model (a request meanwhile waits for it): a port in use fails in a second, not after an 8B model's minutes."""
    try:
        return Server((host, port), Handler)
    except OSError as e:
        why = ("is in use (another server?): pass another --port, or --port 0 for any free one" if e.errno ==
               errno.EADDRINUSE else f"cannot be listened on ({e.strerror or e}): check --host and --port")
        raise ValueError(f"port {port} of {host} {why}") from None


def make_server(app: App, host: str = "127.0.0.1", port: int = 0, server: Server | None = None) -> Server:
    """The HTTP server around app (`server`, one listen() made, else a new one); starts the worker."""
    server = server or listen(host, port)
    server.app = app
    app.engine.start()
    return server


def main(argv=None):
    args = parse_args(argv)
    server = listen(args.host, args.port)      # the port first (a second), then the model (minutes)
    app = make_server(build(args), server=server).app
    host, port = server.server_address[:2]
    if host not in ("127.0.0.1", "localhost"):
        print(f"warning: listening on {host}: anyone who can reach port {port} can use the model (no "
              f"authentication)", file=sys.stderr)
    # SIGTERM and Ctrl-C end serve_forever (shutdown() from another thread: it waits for the loop), then close()
    # answers everyone; a second signal changes nothing. Set before the line that tells clients where to go.
    stop = lambda signum, frame: threading.Thread(target=server.shutdown, daemon=True).start()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"serving {app.name} at http://{host}:{port}/ (the page; the API under /v1) | Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    finally:
        close(server)
        print("stopped", flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:   # as the CLI: one line, status 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:            # Ctrl-C while the model loads
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
