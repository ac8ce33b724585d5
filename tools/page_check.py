"""
tools/page_check.py: the browser check of serve.py's live page (a documented script, not a CI test).

    python tools/page_check.py                    # -> docs/page.png
    python tools/page_check.py --out /tmp/p.png --query "threshold=0.5&step=2"

It starts `python serve.py` on the demo model on a free port, opens the page in a real headless Chromium
(`apt-get install chromium`), lets its JavaScript run the decode through POST /v1/denoise/stream, waits until
the page shows the stream's NFE and answer, checks them against POST /v1/chat/completions for the same
settings, and saves a screenshot. Chromium is driven over its DevTools protocol on a pipe
(--remote-debugging-pipe: JSON messages ending in a NUL byte), so it waits for the page in real time:
a plain `--screenshot` fires on Chromium's virtual clock, before a streamed response has arrived.
Standard library only; every wait has a timeout.
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

    def call(self, method: str, timeout: float = 30, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self.cmd, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:       # skip events until our answer comes
            while b"\0" not in self.buf:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chromium did not answer {method}")
                chunk = os.read(self.events, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str, width: int, height: int):
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)

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


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "page.png"), help="the screenshot (PNG)")
    p.add_argument("--query", default="threshold=0.9&step=4", help="page URL parameters: the form's fields, and "
                   "step=N to stop the replay at step N (speed=0 is added)")
    p.add_argument("--prompt", default="Tom has 23 apples and buys 45 more. How many apples does he have?")
    p.add_argument("--size", default="1100x860", help="window size WxH")
    args = p.parse_args()
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if exe is None:
        sys.exit("no chromium found: apt-get install chromium")
    width, height = map(int, args.size.split("x"))
    tmp = tempfile.mkdtemp()
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "serve.py"), "--model", "demo/llada-arith",
                               "--gen-length", "32", "--block-length", "8", "--port", "0", "--quiet"], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    browser = None
    try:
        base = re.search(r"http://[0-9.]+:\d+/", server.stdout.readline())[0]
        query = urllib.parse.parse_qs(args.query)
        settings = {"threshold": float(query.get("threshold", ["0.9"])[0])}
        want = post(base + "v1/chat/completions", {"messages": [{"role": "user", "content": args.prompt}], **settings})
        want = want["choices"][0]                                # also the server's warm-up decode
        url = base + "?" + urllib.parse.urlencode({"prompt": args.prompt}) + "&speed=0&" + args.query
        browser = Browser(exe, os.path.join(tmp, "profile"))
        browser.open(url, width, height)
        deadline = time.monotonic() + 30
        while browser.js("info === null") is not False and time.monotonic() < deadline:
            time.sleep(0.1)               # the form filled from GET /v1/denoise/info
        time.sleep(1.0)                   # let the browser settle, so that it does not slow the decode it times
        browser.js("go()")                # as pressing Denoise
        state = None
        while time.monotonic() < deadline:
            state = browser.js("({nfe: document.getElementById('nfe').textContent, "
                               "answer: document.getElementById('answer').textContent, "
                               "step: document.getElementById('step').textContent, "
                               "error: document.getElementById('error').textContent, "
                               "replayed: !!run && run.done && run.timer === null})")
            if state and (state["replayed"] or state["error"]):
                break
            time.sleep(0.1)
        print(f"page: {state}")
        assert state and not state["error"], f"the page shows an error: {state}"
        assert state["nfe"] == str(want["fastdllm"]["nfe"]), f"NFE on the page {state['nfe']}, API {want['fastdllm']}"
        assert state["answer"] == want["message"]["content"], f"answer on the page {state['answer']!r}"
        time.sleep(0.6)                                          # the highlight's pop animation
        png = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        with open(args.out, "wb") as f:
            f.write(png)
        print(f"wrote {args.out} ({len(png)} bytes) from {url}")
    finally:
        if browser:
            browser.close()
        server.terminate()
        server.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
