"""
api.py: serve.py's HTTP API without the model: what a request may send and what it gets back, as docs/serve.md
documents them.
- Requests: the table of every field (OpenAI's, the OpenAI fields we ignore or refuse, ours) and its check,
  the JSON body, the chat messages and prompt fields, a prompt's text.
- Answers: the error shape (ApiError: OpenAI's), the choices, the stream chunks and their envelope, usage,
  and the stop-string scan that decides how much of an answer may be shown.
- HTTP: JsonHandler, http.server's handler made total: it reads the body (Content-Length, encoding, size) and
  answers every refusal, http.server's own included, as an ApiError's JSON.

Not here: anything that needs the model, its config or its tokenizer (the decoding settings of a request, its
canvas size, token ids, the answer's text: serve.App), the batching (serve.Engine), the routes and the streams
(serve.Handler).
"""
import difflib
import json
import math
import re
import traceback
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler


class ApiError(Exception):
    """An error answered as OpenAI does: HTTP status + {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def shutting_down() -> ApiError:
    # x-should-retry: false, else the openai client retries a 503 and shows "Connection error." once the server
    # has gone (openai/openai-python, src/openai/_base_client.py, _should_retry: the header decides first).
    return ApiError(503, "the server is shutting down", code="unavailable", headers={"x-should-retry": "false"})


# ----------------------------------------------------------------------------------------------------------
# Reading a request

def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v):      # a number a setting can hold, a float's: not 1e400 (JSON's reader makes it inf), nor 10**400
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:    # an integer too large for a float
        return False


STR, BOOL, OBJ, LIST = [(lambda v, t=t: isinstance(v, t), what) for t, what in
                        ((str, "a string"), (bool, "true or false"), (dict, "an object"), (list, "a list"))]
NUM, COUNT = (is_num, "a finite number"), (lambda v: is_int(v) and v >= 1, "an integer >= 1")
# Every field a request may send -> (check, what it must be); null is the same as leaving a field out. The
# prompt fields are checked by prompt_fields; threshold > 0 as generate() accepts (above 1: one token a step).
FIELDS = {
    "model": STR, "messages": None, "prompt": None, "max_tokens": COUNT, "max_completion_tokens": COUNT,
    "stop": (lambda v: isinstance(v, str) or isinstance(v, list) and len(v) <= 16 and all(isinstance(s, str)
             for s in v), "a string or a list of at most 16 strings"),
    "temperature": NUM, "top_p": NUM, "n": COUNT, "stream": BOOL,
    "seed": (lambda v: is_int(v) and -2**63 <= v < 2**64, "an integer of 64 bits"),
    "stream_options": (lambda v: isinstance(v, dict) and set(v) <= {"include_usage", "include_obfuscation"} and
                       all(isinstance(x, (bool, type(None))) for x in v.values()), '{"include_usage": true}'),
    # ours (docs/serve.md)
    "top_k": (is_int, "an integer"), "cache": STR, "remasking": STR, "guide": BOOL,
    "threshold": (lambda v: is_num(v) and v > 0, "a number > 0 (above 1: one token per step) or null"),
    "factor": (lambda v: is_num(v) and v > 0, "a number > 0 or null"),
    "block_length": (lambda v: is_int(v) and v >= 0, "an integer >= 0 (0 = one block)"), "steps": COUNT,
    "editing_threshold": (lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] or null"),      # LLaDA2.1's
    "max_post_steps": (lambda v: is_int(v) and v >= 0, "an integer >= 0"), "num_to_transfer": COUNT,
    "entropy_bound": (lambda v: is_num(v) and v > 0, "a number > 0"),                   # DiffusionGemma's
    "t_min": (lambda v: is_num(v) and v >= 0, "a number >= 0 or null"), "t_max": (is_num, "a number or null"),
    "stability_threshold": (lambda v: is_int(v) and v >= 0, "an integer >= 0 or null"),
    "confidence_threshold": (lambda v: is_num(v) and v > 0, "a number > 0 or null"),
}
# The request fields a refusal of the settings may name (generate()'s gen_length is max_tokens's canvas).
SETTINGS = ("max_tokens", "temperature", "seed", "top_k", "top_p", "cache", "remasking", "guide", "threshold",
            "factor", "block_length", "steps", "editing_threshold", "max_post_steps", "num_to_transfer",
            "entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold")
# OpenAI fields that do not apply to a diffusion LM: accepted (with OpenAI's type) and ignored.
IGNORED = {"user": STR, "metadata": OBJ, "store": BOOL, "service_tier": STR, "presence_penalty": NUM,
           "frequency_penalty": NUM, "logit_bias": OBJ, "parallel_tool_calls": BOOL, "prompt_cache_key": STR,
           "safety_identifier": STR, "reasoning_effort": STR, "verbosity": STR, "modalities": LIST,
           "tool_choice": (lambda v: isinstance(v, (str, dict)), "a string or an object")}
NO_LOGPROBS = "logprobs are not available: a diffusion LM commits tokens in parallel, in no left-to-right order"
NO_TOOLS, NO_ECHO = "tool calls are not supported", "echo and suffix are not supported"
# OpenAI fields we cannot honour -> (the values that ask for nothing, the 400 `unsupported` message otherwise).
UNSUPPORTED = {"best_of": ((1,), "'best_of' must be 1: one answer per prompt"), "logprobs": ((False, 0), NO_LOGPROBS),
               "top_logprobs": ((), NO_LOGPROBS), "echo": ((False,), NO_ECHO), "suffix": ((), NO_ECHO),
               "tools": (([],), NO_TOOLS), "functions": (([],), NO_TOOLS),
               "response_format": (({"type": "text"},), 'only text answers: response_format must be {"type": "text"}')}
MESSAGE_KEYS = {"role", "content", "name", "refusal", "tool_calls", "function_call", "audio", "annotations"}
ROLES = ("system", "developer", "user", "assistant")
SURROGATE = re.compile("[\ud800-\udfff]")


def get(body: dict, name: str, default):
    """body[name], or `default` when it is absent or null (check_fields has checked its type)."""
    v = body.get(name)
    return default if v is None else v


def tokens(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"


def quoted(v, width: int = 60) -> str:
    """A request's value quoted in an error message (ASCII, short): a long one is cut with "...", and a long
    list shows its length and its first items whole (`a list of 17: ["l", "l", ...]`)."""
    try:
        text = json.dumps(v)
    except (ValueError, RecursionError):
        return type(v).__name__
    if len(text) <= width:
        return text
    if isinstance(v, list):
        items = []
        for item in v:
            piece = quoted(item, width // 2)
            if len(", ".join(items + [piece])) > width - 20:
                break
            items.append(piece)
        return f"a list of {len(v)}: [{', '.join(items + ['...'])}]"
    return text[:width - 3] + "..."


def check_fields(body: dict, path: str, takes: tuple):
    """Every field of the body is one we read (or an OpenAI field we may ignore) and of its type: an unknown
    field is a 400 naming it, never silently ignored (a typo like "treshold" would decode at the default).
    takes: the prompt fields of this endpoint."""
    known = {k: c for k, c in (FIELDS | IGNORED).items() if k not in ("messages", "prompt") or k in takes}
    for name, v in body.items():
        if name in UNSUPPORTED:
            off, message = UNSUPPORTED[name]
            if v is not None and not any(type(v) is type(o) and v == o for o in off):
                raise ApiError(400, message, name, "unsupported")
            continue
        if name not in known:
            near = difflib.get_close_matches(name, list(known), 1)
            hint = f": did you mean {json.dumps(near[0])}?" if near else " (docs/serve.md lists the fields)"
            raise ApiError(400, f"unknown field {quoted(name)} for {path}{hint}", name, "unknown_field")
        check = known[name]
        if check is not None and v is not None and not check[0](v):
            raise ApiError(400, f"'{name}' must be {check[1]} (got {quoted(v)})", name, "invalid_value")


def field_named(message: str, sent) -> str | None:
    """The request field a one-line refusal of the settings is about, its `param`: every refusal names the setting
    it refuses (docs/errors.md), so the first field the message names, preferring those the request sent (`sent`)."""
    words = {}
    for m in re.finditer(r"\w+", message):
        words.setdefault("max_tokens" if m[0] == "gen_length" else m[0], m.start())
    named = sorted((words[f], f) for f in SETTINGS if f in words)
    field = next((f for _, f in named if f in sent), named[0][1] if named else None)
    return "max_completion_tokens" if field == "max_tokens" and "max_completion_tokens" in sent else field


def json_object(raw: bytes) -> dict:
    def not_json(name):       # Python's json reads NaN and Infinity, which JSON does not have
        raise ValueError(f"{name} is not a JSON number")
    if not raw.strip():
        raise ApiError(400, "the body is empty: send a JSON object", None, "invalid_json")
    try:
        body = json.loads(raw, parse_constant=not_json)
    except RecursionError:
        raise ApiError(400, "the body nests arrays or objects too deeply", None, "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    return body


def message_text(m, i: int) -> dict:
    """One chat message -> {"role", "content"}; content may be a string or OpenAI's list of text parts."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a 'role' string and a 'content'", "messages",
                       "invalid_value")
    unknown = next((k for k in m if k not in MESSAGE_KEYS), None)
    if unknown is not None:
        raise ApiError(400, f"messages[{i}] has the unknown field {quoted(unknown)}", "messages", "unknown_field")
    if m["role"] not in ROLES or not isinstance(m.get("name", ""), (str, type(None))):
        raise ApiError(400, f"messages[{i}]: the role must be one of {', '.join(ROLES)} and the name a string "
                       f"(got {quoted(m['role'])}, {quoted(m.get('name'))})", "messages", "invalid_value")
    content = m.get("content")
    if isinstance(content, list):      # [{"type": "text", "text": "..."}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages", "invalid_value")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string (got {quoted(content)})", "messages",
                       "invalid_value")
    return {"role": m["role"], "content": content}


def prompt_fields(kind: str, body: dict) -> tuple[list, str]:
    """The request's prompts, checked -> (prompts, the field they came from). From "messages" (chat, and
    denoise when it sends them): one prompt, its list of {"role", "content"}; from "prompt": each prompt's
    text or token ids."""
    if kind == "chat" or kind == "denoise" and "messages" in body:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' is required: a non-empty list of {\"role\", \"content\"} objects",
                           "messages", "missing_field" if msgs is None else "invalid_value")
        return [[message_text(m, i) for i, m in enumerate(msgs)]], "messages"
    p = body.get("prompt")
    if p is None:
        raise ApiError(400, "'prompt' is required" + (" (or 'messages')" if kind == "denoise" else ""), "prompt",
                       "missing_field")
    ids = lambda q: isinstance(q, list) and q and all(is_int(t) for t in q)
    if isinstance(p, str) or ids(p):      # one prompt: text or token ids
        p = [p]
    if not isinstance(p, list) or not p or not all(isinstance(q, str) or ids(q) for q in p):
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of those (one answer "
                       "each)", "prompt", "invalid_value")
    if kind == "denoise" and len(p) > 1:
        raise ApiError(400, "/v1/denoise/stream takes one prompt", "prompt", "invalid_value")
    return p, "prompt"


def check_text(text: str, param: str) -> str:
    """A prompt's text, refused if it holds a lone surrogate ("\\ud800" in JSON, or a byte that was not
    UTF-8): that is no text, and the tokenizer refuses it."""
    if not text.isascii() and (bad := SURROGATE.search(text)):
        raise ApiError(400, f"the prompt is not valid UTF-8 text: it holds a lone surrogate "
                       f"{bad[0].encode('unicode_escape').decode()} (send UTF-8)", param, "invalid_value")
    return text


def stop_scan(text: str, stops: list[str], final: bool):
    """How much of `text` may be shown, given the stop strings -> (end, stopped). The answer ends before the
    first stop string; while decoding goes on (final=False), a tail that could still grow into a stop string
    is held back, so what has been shown is always a prefix of the final answer."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if final:
        return (len(text), False) if cut is None else (cut, True)
    longest = max(map(len, stops), default=0)
    hold = next((i for i in range(max(0, len(text) - longest + 1), len(text))
                 if any(s.startswith(text[i:]) for s in stops)), len(text))
    return (cut, True) if cut is not None and cut <= hold else (hold, False)


# ----------------------------------------------------------------------------------------------------------
# Answers. `req` is a serve.Request: its kind ("chat", "completion" or "denoise"), id, created and model name.

def dumps(obj) -> bytes:
    """JSON in UTF-8; a lone surrogate quoted from a request has no UTF-8, so then \\u escapes."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(obj).encode()


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice(kind: str, index: int, text: str, reason: str, extra: dict) -> dict:
    c = {"index": index}
    c |= {"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text}
    return c | {"logprobs": None, "finish_reason": reason, "fastdllm": extra}


def chunk(req, index: int, piece: str, reason=None, extra=None, role=False) -> dict:
    """One streamed chunk of one choice: chat chunks carry a delta (the first one the role), completion
    chunks the text; the last one of a choice has its finish_reason and the "fastdllm" field."""
    if req.kind == "chat":
        c = {"index": index, "delta": {"role": "assistant", "content": ""} if role else
             {"content": piece} if piece else {}}
    else:
        c = {"index": index, "text": piece}
    c |= {"logprobs": None, "finish_reason": reason}
    if extra is not None:
        c["fastdllm"] = extra
    return envelope(req, [c], chunk=True)


def envelope(req, choices: list, chunk: bool = False) -> dict:
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj + (".chunk" if chunk and req.kind == "chat" else ""),
            "created": req.created, "model": req.model, "choices": choices}


# ----------------------------------------------------------------------------------------------------------
# HTTP: http.server's handler, answering every refusal as an ApiError

CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class JsonHandler(BaseHTTPRequestHandler):
    """http.server's request handler made total: every request gets an answer, and every refusal (a body that
    cannot be read, a method the path does not take, http.server's own: a malformed request line, a header
    too long) is an ApiError's JSON. serve.Handler adds the routes: allow() and do_GET / do_POST."""
    protocol_version = "HTTP/1.1"      # keep-alive for JSON answers; a stream closes its connection at the end
    timeout = 60                       # seconds a client may take to send its request
    max_body = 1 << 20                 # largest request body in bytes (serve.py: --max-body)

    def allow(self, path: str) -> str | None:
        """The method `path` takes, or None: no such path."""
        return None

    def handle_one_request(self):
        """http.server's, made total: whatever a request holds, its client gets an answer (a bug in serve.py
        is a 500, its traceback on stderr), never a dropped connection."""
        self.answered = False
        try:
            super().handle_one_request()
        except CLIENT_GONE:
            self.close_connection = True
        except Exception:
            traceback.print_exc()
            self.close_connection = True
            if not self.answered:
                self.send_error_json(ApiError(500, "serve.py failed (its stderr has why)", code="server_error"), True)

    def send_response(self, code, message=None):
        self.answered = True
        super().send_response(code, message)

    def log_request(self, code="-", size="-"):
        if getattr(self, "path", "").split("?")[0] != "/favicon.ico":   # every browser asks for it: not news
            super().log_request(code, size)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals, as JSON: a method we have no do_ for (405 with Allow, or 404), a
        malformed request line (400, 505), a request line or header too long (414, 431)."""
        if code == HTTPStatus.NOT_IMPLEMENTED and self.command:
            try:
                self.read_body()      # read (and dropped), so that the connection can carry the next request
            except ApiError:
                return self.refuse(close=True)
            return self.refuse()
        if self.request_version == "HTTP/0.9":      # a line too malformed to name its version: answer in 1.1
            self.request_version = self.protocol_version
        status = HTTPStatus(code)
        self.send_error_json(ApiError(code, message or status.phrase, None, status.name.lower()), close=True)

    def send_json(self, status: int, obj, close: bool = False, headers: dict | None = None):
        self.send(status, dumps(obj), "application/json", close, headers)

    def send(self, status: int, data: bytes, content_type: str, close: bool = False, headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if close:                      # the body was not read: the connection cannot carry another request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":     # the answer to a HEAD is its headers
            self.wfile.write(data)

    def send_error_json(self, e: ApiError, close: bool = False, headers: dict | None = None):
        self.send_json(e.status, e.body(), close, e.headers | (headers or {}))

    def route(self) -> str:
        """The path asked for: without the query, %-escapes decoded (the openai client sends the model id a/b as
        a%2Fb); of an absolute URI (http://host/path), its path."""
        path = self.path.split("?")[0]
        if "://" in path:
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        return urllib.parse.unquote(path)

    def refuse(self, close: bool = False):
        """A method the path does not take (405, with the one it takes in Allow), or no such path (404)."""
        path = self.route()
        allow = self.allow(path)
        if allow is None:
            return self.send_error_json(ApiError(404, f"no such endpoint: {path}", None, "not_found"), close)
        self.send_error_json(ApiError(405, f"{path} takes {allow}", None, "method_not_allowed"), close,
                             {"Allow": allow})

    def read_body(self) -> bytes:
        """The request's body, read whole (a method other than POST may send none); a body we cannot read is an
        ApiError, and the caller closes the connection: its next request would start inside this body."""
        h, limit, lengths = self.headers, self.max_body, self.headers.get_all("Content-Length") or []
        if "chunked" in h.get("Transfer-Encoding", "").lower() or not lengths and self.command == "POST":
            raise ApiError(411, "send the body with a Content-Length header (chunked encoding is not supported)",
                           None, "length_required")
        if not lengths:
            return b""
        encoding, charset = h.get("Content-Encoding", "identity").strip().lower(), h.get_content_charset("utf-8")
        if encoding != "identity" or charset not in ("utf-8", "utf8", "us-ascii", "ascii"):
            raise ApiError(415, f"send the body as uncompressed UTF-8 JSON (not Content-Encoding {encoding!r}, "
                           f"charset {charset!r})", None, "unsupported_media_type")
        n = lengths[0].strip()
        if len(set(lengths)) > 1 or not (n.isascii() and n.isdigit()):
            raise ApiError(400, f"Content-Length must be one whole number of bytes (got {', '.join(lengths)[:60]!r})",
                           None, "bad_request")
        if int(n) > limit:
            raise ApiError(413, f"the request body ({n} bytes) exceeds the server's --max-body ({limit} bytes)",
                           None, "request_too_large")
        try:
            raw = self.rfile.read(int(n))
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within {self.timeout} s", None, "request_timeout") from None
        if len(raw) < int(n):
            raise ApiError(400, f"the body ended after {len(raw)} of its {n} bytes (Content-Length)", None,
                           "bad_request")
        return raw

    def sse(self, obj):
        data = obj if isinstance(obj, bytes) else dumps(obj)
        self.wfile.write(b"data: " + data + b"\n\n")
        self.wfile.flush()

    def start_events(self):
        """The head of a server-sent event stream (each event then one sse()); the stream's end is the
        connection's end."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
