"""
tools/page_check.py: the browser check of serve.py's live page (a documented script, not a CI test).

    python tools/page_check.py                        # every check (about 30 s); writes no file
    python tools/page_check.py --only cut,ctrl-enter  # some checks
    python tools/page_check.py --out docs/page.png    # every check, then the docs' screenshot
    python tools/page_check.py --out /tmp/p.png --query "threshold=0.5&step=2"

It starts `python apps/serve.py` on the demo model on a free port and opens the page in a real headless Chromium
(`apt-get install chromium`), driven over its DevTools protocol on a pipe (--remote-debugging-pipe: JSON
messages ending in a NUL byte), so it waits for the page in real time: a plain `--screenshot` fires on
Chromium's virtual clock, before a streamed response has arrived. The checks press Denoise (a real mouse click
or Ctrl+Enter), wait for the page to settle and compare what it shows with the server's own answer for the same
settings. Failures the demo server cannot produce on demand (a 500, a stream cut mid-way, a 2048-token answer)
come from a stand-in for `fetch` installed in the page (FAULTS below): it passes every other request through,
and cuts or replaces only the next one it is told to. The screenshot check compares the page at --query with the
API's answer, and saves it only where --out says. Each check prints PASS or FAIL with what it saw; the exit
status is 1 if any failed. Standard library only; every wait has a timeout.
"""
import argparse
import base64
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--remote-debugging-pipe"]
PROMPT = "Tom has 23 apples and buys 45 more. How many apples does he have?"

# Installed in the page before its own script. pageCheck.fault = {url, kind, ...} makes the next request to a
# URL containing `url` fail as `kind` says: "refuse" (no server), "status" (an HTTP error with `body`),
# "close" / "break" (the real stream's first `keep` events, then `tail`, then a clean end or a network error),
# "stream" (the events given). pageCheck.texts records every text drawn on a canvas and where it lies.
FAULTS = r"""
(() => {
  const realFetch = window.fetch.bind(window), enc = new TextEncoder();
  window.pageCheck = {fault: location.hash === "#no-info" ? {url: "/v1/denoise/info", kind: "refuse"} : null,
                      texts: []};
  window.fetch = async (url, opts) => {
    const f = window.pageCheck.fault;
    if (!f || !String(url).includes(f.url)) return realFetch(url, opts);
    window.pageCheck.fault = null;
    if (f.kind === "refuse") throw new TypeError("Failed to fetch");
    if (f.kind === "status")
      return new Response(f.body, {status: f.status, statusText: f.statusText, headers: {"Content-Type": f.type}});
    const events = f.kind === "stream" ? f.events :
      (await (await realFetch(url, opts)).text()).split("\n\n").filter(Boolean).slice(0, f.keep).map(e => e + "\n\n");
    return new Response(new ReadableStream({start(c) {
      events.forEach(e => c.enqueue(enc.encode(e)));
      if (f.tail) c.enqueue(enc.encode(f.tail));
      if (f.kind === "break") c.error(new TypeError("network error")); else c.close();
    }}), {status: 200, headers: {"Content-Type": "text/event-stream"}});
  };
  const fillText = CanvasRenderingContext2D.prototype.fillText;
  CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
    const w = this.measureText(text).width, a = this.textAlign;
    const left = a === "right" || a === "end" ? x - w : a === "center" ? x - w / 2 : x;
    window.pageCheck.texts.push({text: String(text), left, right: left + w, width: this.canvas.width});
    return fillText.call(this, text, x, y, ...rest);
  };
})();
"""
STATE = """({
  error: $("error").textContent, step: $("step").textContent, answer: $("answer").textContent,
  nfe: $("nfe").textContent, note: $("time-note").textContent, badge: $("model").textContent,
  busy: $("go").disabled, replaying: typeof run !== "undefined" && !!run && !!run.timer,
  tokens: document.querySelectorAll("#canvas .tok").length, trace: $("trace").height,
  scrub: Number($("scrub").value), frames: Number($("scrub").max),
  overflow: document.documentElement.scrollWidth - document.documentElement.clientWidth})"""
INK = """(() => {     // how far down the trace canvas anything is drawn, in pixels
  const c = $("trace");
  if (!c.width || !c.height) return 0;
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  for (let y = c.height - 1; y >= 0; y--)
    for (let x = 0; x < c.width; x++) if (d[(y * c.width + x) * 4 + 3]) return y + 1;
  return 0;
})()"""
WALK = """(() => {     // drag the slider over every frame and read the step line of each (and what it highlights)
  const s = $("scrub"), out = [];
  for (let k = 1; k <= Number(s.max); k++) {
    s.value = k; s.dispatchEvent(new Event("input"));
    out.push({line: $("step").textContent, new: document.querySelectorAll("#canvas .tok.new").length,
              edit: document.querySelectorAll("#canvas .tok.edit").length,
              draft: document.querySelectorAll("#canvas .tok.draft").length});
  }
  return out;
})()"""


class Browser:
    """Headless Chromium, one page, commands over the DevTools pipe (fd 3: to Chromium, fd 4: from it)."""

    def __init__(self, exe: str, profile: str):
        reader, self.cmd = os.pipe()
        self.events, writer = os.pipe()
        # The child's fds 3 and 4 must be its pipe ends: moved above 9 first, so that they cannot be 3 or 4
        # already, then dup'ed into place just before exec.
        to_chrome, from_chrome = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (reader, writer))
        os.close(reader)
        os.close(writer)

        def fds():
            os.dup2(to_chrome, 3)
            os.dup2(from_chrome, 4)
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"], pass_fds=(3, 4),
                                     preexec_fn=fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self.buf, self.next_id, self.session = b"", 0, None
        self.exceptions = []          # the page's uncaught JavaScript errors, as Chromium reports them

    def call(self, method: str, timeout: float = 30, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self.cmd, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:       # keep the events we want until our answer comes
            while b"\0" not in self.buf:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chromium did not answer {method}")
                chunk = os.read(self.events, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("method") == "Runtime.exceptionThrown":
                d = reply["params"]["exceptionDetails"]
                self.exceptions.append(d.get("exception", {}).get("description") or d.get("text"))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, width: int, height: int):
        self.size = (width, height)
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Runtime.enable")
        self.call("Page.enable")          # else Chromium ignores the script below
        self.call("Page.addScriptToEvaluateOnNewDocument", source=FAULTS)

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self):
        try:
            self.session = None
            self.call("Browser.close", timeout=5)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Page:
    """The page as a user meets it: load it, fill the form, press Denoise, read what it shows."""

    def __init__(self, browser: Browser, base: str):
        self.browser, self.base, self.loads = browser, base, 0

    def load(self, query: str = "", hash_: str = ""):
        """A fresh page (`load` counts the loads: a URL that differs only in its #hash would not reload)."""
        self.loads += 1
        self.browser.call("Page.navigate", url=f"{self.base}?{query}&load={self.loads}{hash_}")
        self.wait("document.readyState === 'complete' && $('model').textContent !== 'connecting...'", 20)

    def js(self, expression: str):
        return self.browser.js(expression)

    def wait(self, expression: str, timeout: float):
        """Poll until `expression` is truthy; its last value either way."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(f"(() => {{ try {{ const $ = id => document.getElementById(id); return {expression}; }}"
                            f" catch (e) {{ return null; }} }})()")
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def set(self, **fields):
        for name, value in fields.items():
            self.js(f"(() => {{ const e = $({json.dumps(name)}); e.value = {json.dumps(str(value))}; "
                    f"e.dispatchEvent(new Event('change')); }})()")

    def fault(self, **spec):
        self.js(f"pageCheck.fault = {json.dumps(spec)}")

    def click(self):                 # a real mouse click in the middle of the Denoise button
        x, y = self.js("(() => { const r = $('go').getBoundingClientRect(); "
                       "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.browser.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def ctrl_enter(self):            # a real Ctrl+Enter in the prompt
        self.js("$('prompt').focus()")
        for kind in ("rawKeyDown", "keyUp"):
            self.browser.call("Input.dispatchKeyEvent", type=kind, modifiers=2, key="Enter", code="Enter",
                              windowsVirtualKeyCode=13)

    def state(self) -> dict:
        return self.js(STATE)

    def settle(self, timeout: float = 20) -> dict:
        """Wait until no decode is open and the replay has stopped; the page's state then."""
        self.wait("!$('go').disabled && !(typeof run !== 'undefined' && run && run.timer)", timeout)
        time.sleep(0.2)               # a last replay tick or the re-enabled button's own work
        self.wait("!$('go').disabled && !(typeof run !== 'undefined' && run && run.timer)", timeout)
        return self.state()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def truth(base: str, prompt: str, **settings) -> dict:
    """What the page must show for this prompt and these settings, from the server's own stream: the answer,
    the NFE, and the step line of every frame (each step, then the fill if the early stop filled any)."""
    body = {"messages": [{"role": "user", "content": prompt}], **settings}
    req = urllib.request.Request(base + "v1/denoise/stream", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().split("\n")
                  if line.startswith("data: {")]
    done = events[-1]
    n = done["fastdllm"]["nfe"]
    labels = [f"step {e['step']} of {n}" for e in events if e["type"] == "step"]
    labels += [f"after step {n}: cut at the end token"] if done["cut"] else []
    return {"answer": done["text"], "nfe": str(n), "labels": labels, "events": events}


def step_lines(want: dict) -> list:
    """The step line the page must show at each frame: the stream's own counts of each kind of change."""
    n, out = want["nfe"], []
    left = "masked" if want["events"][0]["mask"] is not None else "undecided"      # DiffusionGemma has no mask
    for e in want["events"]:
        if e["type"] == "step":
            counts = [f"{len(e['committed'])} committed"] + [f"{len(e[k])} {what}" for k, what in (
                ("drafted", "drafted"), ("edited", "edited"), ("filled", "filled with end of text")) if e.get(k)]
            out.append(" · ".join([f"step {e['step']} of {n}", *counts, f"{e['masks_left']} {left}"]))
        elif e["type"] == "done" and e["cut"]:
            out.append(f"after step {n}: cut at the end token · {len(e['cut'])} after it replaced · 0 {left}")
    return out


def final_ids(events: list) -> list:
    """The answer's ids as the stream's changes leave them, every kind in its order."""
    ids = [None] * events[0]["positions"]
    for e in events[1:]:
        for kind in ("committed", "drafted", "edited", "filled", "cut"):
            for c in e.get(kind, []):
                ids[c["pos"]] = c["id"]
    return ids


def long_answer(gen: int = 2048, steps: int = 1024) -> list:
    """A made-up stream of a 2048-position answer, one token per step for 1024 steps and then the fill: tokens
    of every kind (non-ASCII, a newline, a 300-character one), and an answer text with no space to wrap at."""
    pieces = ["12", "+", "日本語", "\n", "🙂", "x" * 300, "é", "=", "42"]
    cells = [{"pos": p, "id": 7, "text": pieces[p % len(pieces)], "end": False} for p in range(steps)]
    fill = [{"pos": p, "id": 0, "text": "<|endoftext|>", "end": True} for p in range(steps, gen)]
    text = "".join(c["text"] for c in cells).replace("\n", "")
    settings = {"cache": "dual", "threshold": None}
    events = [{"type": "start", "id": "x", "model": "m", "prompt": "p", "prompt_tokens": 1, "gen_length": gen,
               "positions": gen, "max_tokens": gen, "block_length": 64, "block_offset": 0, "mask": "<|mdm_mask|>",
               "settings": settings}]
    events += [{"type": "step", "step": k + 1, "committed": [c], "edited": [], "filled": fill if k == steps - 1 else [],
                "masks_left": 0 if k == steps - 1 else gen - k - 1, "final": gen} for k, c in enumerate(cells)]
    events.append({"type": "done", "text": text, "finish_reason": "stop", "cut": [],
                   "usage": {"prompt_tokens": 1, "completion_tokens": steps, "total_tokens": steps + 1},
                   "fastdllm": {"nfe": steps, "tokens_per_call": 1.0, "gen_length": gen, "batch_size": 1,
                                "seconds": 10.0, "tokens_per_s": 102.4, "settings": settings}})
    return ["data: " + json.dumps(e, ensure_ascii=False) + "\n\n" for e in events] + ["data: [DONE]\n\n"]


# -- the checks: each takes the page and the server's address, and returns a list of problems (empty: PASS) --
CHECKS = {}


def check(name):
    def register(fn):
        CHECKS[name] = fn
        return fn
    return register


def problems_after_failure(s: dict, expect: str) -> list:
    """A failed decode: a clear message, an empty canvas and stats, and a page ready for the next try."""
    out = []
    if expect.lower() not in s["error"].lower():
        out.append(f"the message should say {expect!r}: {s['error']!r}")
    if s["busy"] or s["replaying"]:
        out.append("the page is still busy")
    if s["tokens"] or s["trace"] or s["nfe"] != "-" or s["step"].startswith(("step", "after", "all")):
        out.append(f"a canvas, trace or stats are left over: {s['tokens']} tokens, trace {s['trace']} px, "
                   f"NFE {s['nfe']}, {s['step']!r}")
    if s["answer"] in ("decoding...", "") or s["answer"].startswith("decoded"):
        out.append(f"the answer box says {s['answer']!r}")
    return out


def last_frame(own: Page, want: dict) -> list:
    """The page's last frame holds the stream's final ids, and the page ran what the stream did (same_run)."""
    ids = [None if i is None else int(i) for i in own.js(CANVAS)]
    out = [] if ids == final_ids(want["events"]) else [
        f"the last frame's ids {ids} are not the stream's {final_ids(want['events'])}"]
    return out + same_run(own, want)


def same_run(page: Page, want: dict) -> list:
    s, out = page.state(), []
    if s["error"]:
        out.append(f"an error: {s['error']!r}")
    if (s["answer"], s["nfe"]) != (want["answer"], want["nfe"]):
        out.append(f"answer {s['answer']!r} NFE {s['nfe']}, the server's {want['answer']!r} NFE {want['nfe']}")
    labels = [f["line"].split(" · ")[0] for f in page.js(WALK)]
    if labels != want["labels"]:
        out.append(f"the frames are {labels}, the server's {want['labels']}")
    return out


@check("ctrl-enter")
def ctrl_enter(page, base):
    """Ctrl+Enter while a decode streams. It used to start a second stream past the disabled button, and both
    wrote into one run: the trace read steps 3..16, fill, 1..16, fill."""
    want = truth(base, PROMPT, threshold=None)
    page.load("threshold=off&speed=0")
    page.ctrl_enter()
    page.ctrl_enter()                 # the server waits --batch-window 300 ms: the first stream is still open
    page.settle()
    return same_run(page, want)


@check("clicks")
def clicks(page, base):
    """Three quick clicks on Denoise: one decode, shown once."""
    want = truth(base, PROMPT, threshold=0.9)
    page.load("speed=0")
    for _ in range(3):
        page.click()
    page.settle()
    return same_run(page, want)


# The legend's end-of-text swatch, and the colours of the end cells at the frame on show: in the canvas (those
# not highlighted as committed this step) and in the trace's row of that frame.
END_COLOURS = """(() => {
  const bg = e => getComputedStyle(e).backgroundColor.replace(/ /g, "");
  const legend = [...document.querySelectorAll(".legend span")].find(s => s.textContent.trim() === "end of text");
  const spans = [...document.querySelectorAll("#canvas .tok")], t = run.trace, k = run.drawn;
  const g = $("trace").getContext("2d"), y = Math.floor((k - 1) * t.pitch + t.top + t.ch / 2);
  const trace = spans.map((s, p) => s.textContent === "EOS" && !s.classList.contains("new") ?
    g.getImageData(Math.floor(t.left + (p + 0.5) * t.cw), y, 1, 1).data.slice(0, 3).join(",") : null);
  return {swatch: bg(legend.querySelector("i")), highlighted: spans.filter(s => s.classList.contains("new")).length,
          canvas: spans.filter(s => s.textContent === "EOS" && !s.classList.contains("new")).map(bg),
          trace: trace.filter(Boolean).map(c => `rgb(${c})`)};
})()"""


def fill(threshold):
    """The early stop sets the positions after a finished answer to end of text within the step that ended it.
    The page counted them as committed ("step 16 of 16 · 17 committed" one token per step) and drew them
    yellow, as committed this step, where the legend says end of text is grey. The stream says which cells the
    model committed and which the stop filled; they must agree with generate()'s own count (tokens_per_call x NFE
    tokens committed by the model), and the page must show them so."""
    def run_check(page, base):
        want = truth(base, PROMPT, threshold=threshold)
        steps, x = [e for e in want["events"] if e["type"] == "step"], want["events"][-1]["fastdllm"]
        committed, filled = (sum(len(e[k]) for e in steps) for k in ("committed", "filled"))
        last = len(steps[-1]["committed"])
        label = f"step {x['nfe']} of {x['nfe']} · {last} committed" + \
            f" · {len(steps[-1]['filled'])} filled with end of text" * bool(steps[-1]["filled"]) + " · 0 masked"
        page.load(f"threshold={threshold or 'off'}&speed=0")
        page.click()
        s = page.settle()
        out = [] if s["step"] == label else [f"the last step reads {s['step']!r}, not {label!r}"]
        if not filled:
            out.append("the server's stream has no fill to check (the demo's answer should end early)")
        if committed != round(x["tokens_per_call"] * x["nfe"]) or committed + filled != 32:
            out.append(f"the stream commits {committed} and fills {filled} of 32 positions; generate() committed "
                       f"{x['tokens_per_call'] * x['nfe']:.0f}")
        time.sleep(0.7)               # the cells' colour transition
        c = page.js(END_COLOURS)
        if c["highlighted"] != last:
            out.append(f"{c['highlighted']} cells are highlighted as committed this step, not {last}")
        for where in ("canvas", "trace"):
            if not c[where] or set(c[where]) != {c["swatch"]}:
                out.append(f"the {where}'s end cells are {sorted(set(c[where]))}, the legend's swatch {c['swatch']}")
        return out + same_run(page, want)
    return run_check


CHECKS["fill-one-per-step"] = fill(None)
CHECKS["fill-threshold"] = fill(0.9)


@check("labels")
def labels(page, base):
    """The trace's step labels from "step 10" up were cut at the canvas's left edge ("tep 10")."""
    page.load("threshold=off&speed=0")
    page.click()
    page.settle()
    texts = page.js("pageCheck.texts")
    out = sorted({f"{t['text']!r} spans x {t['left']:.1f}..{t['right']:.1f} of a {t['width']} px canvas"
                  for t in texts if t["left"] < 0 or t["right"] > t["width"]})
    if not any(t["text"] == "step 16" for t in texts):
        out.append(f"no label 'step 16' was drawn: {sorted({t['text'] for t in texts})}")
    return out


@check("error-clears")
def error_clears(page, base):
    """An error after a good decode left that decode's canvas (and step line) on show, as if it were this
    request's."""
    page.load("speed=0")
    page.click()
    first = page.settle()
    page.set(prompt="")
    page.click()
    out = problems_after_failure(page.settle(), "the prompt is empty")
    if first["answer"] in page.state()["answer"]:
        out.append("the previous answer is still shown")
    page.set(prompt=PROMPT)          # and the page still works
    page.click()
    page.settle()
    return out + same_run(page, truth(base, PROMPT, threshold=0.9))


@check("reveal")
def reveal(page, base):
    """The answer and its stats showed as soon as the stream ended, while the replay was still at step 1 (and
    the trace showed every step). Switching the replay to live mid-run finishes it at once."""
    want = truth(base, PROMPT, threshold=0.9)
    page.load("speed=1200")
    page.click()
    page.wait("!$('go').disabled", 10)                       # the stream has ended
    s, ink = page.state(), page.js(INK)
    out = []
    if s["scrub"] >= s["frames"] or s["step"].startswith("after"):
        out.append(f"the replay should still be short of its end: {s['step']!r}")
    if s["nfe"] != "-" or want["answer"] in s["answer"]:
        out.append(f"the answer or the stats show at {s['step']!r}: NFE {s['nfe']}, {s['answer']!r}")
    page.set(speed=0)
    if page.wait("$('nfe').textContent !== '-'", 3) is not True:
        out.append("after switching to live the stats did not show within 3 s")
    page.settle()
    full = page.js(INK)                                      # the trace of every step, once the replay ended
    if ink > full * (s["scrub"] + 0.5) / s["frames"]:
        out.append(f"at {s['step']!r} the trace is drawn {ink} px down of its {full}: steps not yet replayed")
    return out + same_run(page, want)


@check("settings-mid-run")
def settings_mid_run(page, base):
    """Settings changed during a decode apply to the next one; this one keeps the settings it started with."""
    page.load("speed=250")
    page.click()
    page.set(threshold="0.5", cache="none", block_length=4)
    s = page.settle()
    out = [] if s["note"] == "dual cache · threshold 0.9" else [f"this run shows {s['note']!r}"]
    out += same_run(page, truth(base, PROMPT, threshold=0.9))
    page.set(speed=0)
    page.click()
    page.settle()
    return out + same_run(page, truth(base, PROMPT, threshold=0.5, cache="none", block_length=4))


@check("non-ascii")
def non_ascii(page, base):
    """A prompt outside the demo tokenizer's alphabet decodes like the API's answer."""
    prompt = "Ça coûte 12 € + 30 €, combien? 日本 🙂"
    page.load("speed=0")
    page.set(prompt=prompt)
    page.click()
    page.settle()
    return same_run(page, truth(base, prompt, threshold=0.9))


# Failures: name -> (URL query, how the next POST /v1/denoise/stream fails or None, what the message must say).
# Each must end in that message, an empty canvas and stats, and a page ready for the next try. Before, a cut
# stream sat on "decoding..." with no message, and an error event left the canvas up.
ERROR_EVENT = {"type": "error", "error": {"message": "decoding failed: RuntimeError: out of memory"}}
FAILURES = {
    "http-400": ("max_tokens=1000", None, "exceed the model's 64 positions"),       # the real server's 400
    "http-500": ("", {"kind": "status", "status": 500, "statusText": "Internal Server Error", "type":
                      "application/json", "body": json.dumps({"error": {"message": "decoding failed: boom"}})},
                 "the server answered 500 Internal Server Error: decoding failed: boom"),
    "http-502-html": ("", {"kind": "status", "status": 502, "statusText": "Bad Gateway", "type": "text/html",
                           "body": "<html><body>Bad Gateway</body></html>"},       # a proxy's error page
                      "the server answered 502 Bad Gateway"),
    "cut": ("", {"kind": "close", "keep": 3},                                  # start, two steps, a clean end
            "the stream ended before the answer was done"),
    "broken": ("", {"kind": "break", "keep": 3}, "the connection to the server broke"),
    "error-event": ("", {"kind": "close", "keep": 2, "tail": f"data: {json.dumps(ERROR_EVENT)}\n\ndata: [DONE]\n\n"},
                    "the server stopped the decode: decoding failed: RuntimeError: out of memory"),
    "garbled": ("", {"kind": "close", "keep": 2, "tail": 'data: {"type": "step", \n\n'}, "unreadable event"),
}


def failure(query, fault, expect):
    def run_check(page, base):
        page.load("speed=0&" + query)
        if fault:
            page.fault(url="/v1/denoise/stream", **fault)
        page.click()
        return problems_after_failure(page.settle(), expect)
    return run_check


for name, spec in FAILURES.items():
    CHECKS[name] = failure(*spec)


@check("long")
def long(page, base):
    """A 2048-position answer in 1024 steps, with a 300-character token and unbroken text: shown in full
    within a generous minute, without widening the page. The page used to redraw the whole trace per step."""
    events = long_answer()
    page.load("speed=0")
    page.fault(url="/v1/denoise/stream", kind="stream", events=events)
    t0 = time.monotonic()
    page.click()
    s = page.settle(timeout=60)
    print(f"    long: settled in {time.monotonic() - t0:.1f} s")
    out = [] if not s["busy"] and not s["replaying"] else ["still busy after 60 s"]
    if s["frames"] != 1024 or s["nfe"] != "1024" or s["answer"] != json.loads(events[-2][6:])["text"]:
        out.append(f"{s['frames']} frames, NFE {s['nfe']}, an answer of {len(s['answer'])} characters")
    if s["overflow"] > 0:
        out.append(f"the page is {s['overflow']} px wider than the window")
    return out


# What of the canvas card lies outside its content box (the trace grid, a block of the token canvas), and how far
# the page is wider than the window.
FITS = """(() => {
  const card = $("trace").parentElement, st = getComputedStyle(card), box = card.getBoundingClientRect();
  const lo = box.left + parseFloat(st.borderLeftWidth) + parseFloat(st.paddingLeft);
  const hi = box.right - parseFloat(st.borderRightWidth) - parseFloat(st.paddingRight);
  const out = [$("trace"), $("step"), ...document.querySelectorAll("#canvas .block")].map(e => [e, e.getBoundingClientRect()])
    .filter(([e, r]) => r.width && (r.left < lo - 0.5 || r.right > hi + 0.5))
    .map(([e, r]) => `${e.id || e.className} spans x ${r.left.toFixed(0)}..${r.right.toFixed(0)}, the card's content ` +
                     `${lo.toFixed(0)}..${hi.toFixed(0)}`);
  const over = document.documentElement.scrollWidth - document.documentElement.clientWidth;
  return over > 0 ? out.concat([`the page is ${over} px wider than the window`]) : out;
})()"""
# The trace's rows whose label column holds no ink (each row's label, "step k", is drawn left of its cells).
UNLABELLED = """(() => {
  const t = run.trace, c = $("trace"), rows = Math.round(c.height / t.pitch), out = [];
  const d = c.getContext("2d").getImageData(0, 0, Math.max(1, t.left - 2), c.height).data, w = Math.max(1, t.left - 2);
  for (let k = 1; k <= rows; k++) {
    let ink = false;
    for (let y = (k - 1) * t.pitch; y < k * t.pitch && !ink; y++)
      for (let x = 0; x < w && !ink; x++) ink = d[(y * w + x) * 4 + 3] > 0;
    if (!ink) out.push(k);
  }
  return out;
})()"""


@check("narrow")
def narrow(page, base):
    """A 390 px window (a phone): the trace grid and the token canvas stay inside their card during a decode and
    after it, and once the replay has ended every step still shows its label (below 12 px a row the rows were
    drawn without labels: only the current step's showed, and steps 1-3 vanished once it moved on). A server
    without a guide shows no guide checkbox (its [hidden] lost to label.check's display)."""
    width, height = page.browser.size
    page.browser.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1, mobile=False)
    try:
        want = truth(base, PROMPT, threshold=0.9)
        page.load("speed=300")
        page.click()
        out, deadline = set(), time.monotonic() + 20
        while page.js("$('go').disabled || !!(run && run.timer)") and time.monotonic() < deadline:
            out.update(f"during the decode: {x}" for x in page.wait(FITS, 0) or [])
            time.sleep(0.05)
        page.settle()
        out = sorted(out) + [f"after it: {x}" for x in page.wait(FITS, 0) or []]
        rows = page.wait(UNLABELLED, 0)
        if rows:
            out.append(f"the trace's rows {rows} show no label")
        if page.js("getComputedStyle($('guide-box')).display") != "none":
            out.append("the guide checkbox shows on a server without a guide")
        return out + same_run(page, want)
    finally:
        page.browser.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                          mobile=False)


@check("no-info")
def no_info(page, base):
    """The server could not be reached when the page loaded: say so, and let Denoise try again."""
    page.load(hash_="#no-info")
    s = page.state()
    out = [] if "cannot reach the server" in s["error"] else [f"the message is {s['error']!r}"]
    page.click()
    page.settle()
    return out + same_run(page, truth(base, PROMPT, threshold=0.9))


# How each step's canvas shows on the page: its highlighted cells, and the ids its cells hold (from their titles).
CANVAS = """[...document.querySelectorAll("#canvas .tok")]
  .map(s => (s.title.match(/\\(id (\\d+)\\)/) || [])[1] || null)"""


@check("edits")
def edits(page, base):
    """LLaDA2.1 edits the block's committed tokens (T2T). On a tiny LLaDA2.1 (tools/checkpoint.py --release) the page
    ended at "-197 masked", its fill row over the whole canvas, 20 trace rows for NFE 36: the stream sent an event
    only for a call that left a mask, and the page drew each position as committed once. On a server of its own:
    a frame per call, each frame's step line the stream's counts (committed, edited, filled, masked), its edited
    cells highlighted as edited, its committed ones as committed, and the last frame the stream's final ids."""
    tmp = tempfile.mkdtemp()
    made = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint.py"), os.path.join(tmp, "l21"),
                           "--release", "inclusionAI/LLaDA2.1-mini"], capture_output=True, text=True, timeout=120)
    if made.returncode:
        return [f"tools/checkpoint.py failed: {made.stderr.strip()[-300:]}"]
    server = serve(os.path.join(tmp, "l21"), "--gen-length", "32", "--threshold", "0.7", "--editing-threshold", "0.5")
    own = Page(page.browser, address(server))
    try:
        want = truth(own.base, "Hello")
        own.load("prompt=Hello&speed=0")
        own.click()
        s = own.settle()
        out = [f"the page shows an error: {s['error']!r}"] if s["error"] else []
        steps = [e for e in want["events"] if e["type"] == "step"]
        if not (len(steps) == int(want["nfe"]) == s["frames"] - bool(want["events"][-1]["cut"])):
            out.append(f"{s['frames']} frames for {len(steps)} step events and NFE {want['nfe']}")
        if not any(e["edited"] for e in steps):
            out.append("the stream has no edit to check (the tiny LLaDA2.1 should edit at 0.5)")
        frames, lines = own.js(WALK), step_lines(want)
        if [f["line"] for f in frames] != lines:
            bad = next(i for i, (f, w) in enumerate(zip([f["line"] for f in frames] + [None] * len(lines), lines))
                       if f != w)
            out.append(f"frame {bad + 1} reads {frames[bad]['line'] if bad < len(frames) else None!r}, the stream's "
                       f"{lines[bad]!r} ({len(frames)} frames, {len(lines)} lines)")
        for k, (f, e) in enumerate(zip(frames, steps), 1):
            if (f["new"], f["edit"]) != (len(e["committed"]), len(e["edited"])):
                out.append(f"frame {k} highlights {f['new']} committed and {f['edit']} edited, the stream's "
                           f"{len(e['committed'])} and {len(e['edited'])}")
                break
        return out + last_frame(own, want)
    finally:
        server.terminate()
        server.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)


def drafts(events: list) -> list:
    """Per step event, how many positions show a draft after it (their last change a `drafted` one)."""
    last, out = {}, []
    for e in events[1:]:
        if e["type"] == "step":
            last |= {c["pos"]: kind for kind in ("committed", "drafted", "edited", "filled") for c in e[kind]}
            out.append(sum(kind == "drafted" for kind in last.values()))
    return out


@check("gemma")
def gemma(page, base):
    """DiffusionGemma has no mask: each step samples its canvas anew, the page drafts the step's argmax, and a canvas
    is committed once it ends. On a server of its own (a tiny release, tools/checkpoint.py --release, its steps cut to 3
    in its generation_config.json; --seed, so that each run draws alike; 300 tokens: two canvases of 256): the
    threshold control hidden and the entropy bound's shown, a frame per call (then the cut), each frame's step line
    the stream's counts (committed, drafted, undecided), as many cells drafted as the stream leaves drafted, the last
    frame the stream's final ids, the answer and NFE the API's."""
    tmp = tempfile.mkdtemp()
    folder = os.path.join(tmp, "dg")
    made = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint.py"), folder, "--release",
                           "google/diffusiongemma-26B-A4B-it"], capture_output=True, text=True, timeout=120)
    if made.returncode:
        return [f"tools/checkpoint.py failed: {made.stderr.strip()[-300:]}"]
    with open(os.path.join(folder, "generation_config.json")) as f:
        generation = json.load(f) | {"max_denoising_steps": 3}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    server = serve(folder, "--gen-length", "300", "--seed", "5")
    own = Page(page.browser, address(server))
    try:
        want = truth(own.base, "w5 w6 w7", entropy_bound=0.1)
        own.load("prompt=w5%20w6%20w7&speed=0")
        controls = own.js('[$("threshold-box").hidden, $("bound-box").hidden, $("draft-key").hidden]')
        out = [] if controls == [True, False, False] else [f"threshold, entropy bound, draft key hidden: {controls}"]
        own.click()
        s = own.settle()
        out += [f"the page shows an error: {s['error']!r}"] if s["error"] else []
        steps = [e for e in want["events"] if e["type"] == "step"]
        if not any(e["drafted"] for e in steps) or not any(e["committed"] for e in steps):
            out.append("the stream drafts or commits nothing to check")
        frames, lines = own.js(WALK), step_lines(want)
        if [f["line"] for f in frames] != lines:
            out.append(f"the frames read {[f['line'] for f in frames]}, the stream's {lines}")
        if [f["draft"] for f in frames[:len(steps)]] != drafts(want["events"]):
            out.append(f"drafted cells per frame {[f['draft'] for f in frames]}, the stream's {drafts(want['events'])}")
        return out + last_frame(own, want)
    finally:
        server.terminate()
        server.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)


def server_down(page: Page, server: subprocess.Popen) -> list:
    """The server stopped after the page loaded: pressing Denoise says so."""
    page.load("speed=0")
    server.terminate()
    server.wait(20)
    page.click()
    return problems_after_failure(page.settle(), "cannot reach the server")


# The page's URL parameters (apps/web/index.html): the form's fields as the API's request fields, and the replay's.
def number(low, kind=float, above=False):
    """A URL parameter's value: a `kind` >= low (above: > low), else ValueError."""
    def parse(v: str):
        if not (kind(v) > low if above else kind(v) >= low):
            raise ValueError(v)
        return kind(v)
    return parse


QUERY = {"threshold": lambda v: None if v in ("none", "off") else number(0, above=True)(v), "cache": str,
         "editing_threshold": lambda v: None if v in ("none", "off") else number(0)(v),
         "max_tokens": number(1, int), "block_length": number(1, int), "guide": lambda v: {"1": True, "0": False}[v],
         "prompt": str, "step": number(0, int), "speed": number(0, int)}


def page_query(text: str) -> dict:
    """--query: the page's URL parameters -> the request fields they set (the replay's step and speed set none;
    threshold none or off is null), each value checked: one line naming a bad one."""
    fields = {"threshold": 0.9}
    for key, values in urllib.parse.parse_qs(text, keep_blank_values=True).items():
        if key not in QUERY:
            raise argparse.ArgumentTypeError(f"unknown page parameter {key!r}: use {', '.join(QUERY)}")
        try:
            value = QUERY[key](values[-1])
        except (ValueError, KeyError):
            raise argparse.ArgumentTypeError(f"{key}={values[-1]!r} is not a value the page takes") from None
        if key not in ("step", "speed"):
            fields[key] = value
    return fields


def screenshot(page: Page, base: str, args) -> list:
    """The page at --query's settings, its NFE and answer checked against /v1/chat/completions -> args.out."""
    settings = {k: v for k, v in page_query(args.query).items() if k != "prompt"}
    prompt = page_query(args.query).get("prompt", args.prompt)
    want = post(base + "v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **settings})
    want = want["choices"][0]
    query = urllib.parse.urlencode({"prompt": prompt}) + "&speed=0&" + args.query
    page.load(query)
    time.sleep(1.0)                   # let the browser settle, so that it does not slow the decode it times
    page.click()
    s = page.settle()
    print(f"page: {s}")
    out = [f"the page shows an error: {s['error']!r}"] if s["error"] else []
    if (s["nfe"], s["answer"]) != (str(want["fastdllm"]["nfe"]), want["message"]["content"]):
        out.append(f"NFE {s['nfe']} answer {s['answer']!r} on the page, the API's {want['fastdllm']['nfe']} "
                   f"{want['message']['content']!r}")
    if args.out:
        time.sleep(0.6)               # the highlight's pop animation
        png = base64.b64decode(page.browser.call("Page.captureScreenshot", format="png")["data"])
        with open(args.out, "wb") as f:
            f.write(png)
        print(f"wrote {args.out} ({len(png)} bytes) from {page.base}?{query}")
    return out


def serve(model: str, *flags) -> subprocess.Popen:
    """`python apps/serve.py` on a free port, quiet; address() reads where it listens."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "apps", "serve.py"), "--model", model, "--port", "0",
                             "--quiet", *flags], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})


def address(server: subprocess.Popen) -> str:
    line = server.stdout.readline()
    found = re.search(r"http://[0-9.]+:\d+/", line)
    if not found:
        raise RuntimeError(f"serve.py did not start (it printed {line!r}; exit status {server.poll()})")
    return found[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.error = lambda message: p.exit(2, f"error: page_check.py: {message} (see --help)\n")     # one line, no usage
    p.add_argument("--out", help="save the screenshot check's page as this PNG (default: none; docs/page.png is "
                   "the one docs/serve.md shows)")
    p.add_argument("--only", help=f"comma-separated checks to run: {','.join(CHECKS)},screenshot,server-down")
    p.add_argument("--query", default="threshold=0.9&step=4", type=lambda q: page_query(q) and q,
                   help="page URL parameters of the screenshot: the form's fields (threshold: a number or none), and "
                   "step=N to stop the replay at step N (speed=0 is added)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--size", default="1100x860", help="window size WxH")
    args = p.parse_args()
    names = args.only.split(",") if args.only else [*CHECKS, "screenshot", "server-down"]
    unknown = set(names) - {*CHECKS, "screenshot", "server-down"}
    if unknown:
        sys.exit(f"no such check: {', '.join(sorted(unknown))} (choose from {', '.join(CHECKS)}, screenshot, "
                 f"server-down)")
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if exe is None:
        sys.exit("no chromium found: apt-get install chromium")
    width, height = map(int, args.size.split("x"))
    tmp = tempfile.mkdtemp()
    # A batch window of 300 ms keeps each stream open long enough for a second press to land during it.
    server = serve("demo/llada-arith", "--gen-length", "32", "--block-length", "8", "--batch-window", "300")
    browser, failed = None, []
    try:
        base = address(server)
        browser = Browser(exe, os.path.join(tmp, "profile"))
        browser.open(width, height)
        page = Page(browser, base)
        for name in names:
            seen = len(browser.exceptions)
            if name == "screenshot":
                problems = screenshot(page, base, args)
            elif name == "server-down":
                problems = server_down(page, server)
            else:
                problems = CHECKS[name](page, base)
            problems += [f"uncaught JavaScript error: {e}" for e in browser.exceptions[seen:]]
            print(f"{'FAIL' if problems else 'PASS'} {name}" + "".join(f"\n    {x}" for x in problems), flush=True)
            failed += [name] if problems else []
    finally:
        if browser:
            browser.close()
        server.terminate()
        server.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(names) - len(failed)} of {len(names)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
