"""
tools/load.py: many clients against a running serve.py, for the throughput of batching (docs/serve.md).

    python apps/serve.py --model demo/llada-arith --gen-length 32 --block-length 8 --quiet &   # then:
    python tools/load.py --port 8000 --clients 8 --requests 8

Each client sends its requests one after another (chat, four demo questions in turn); prints requests/s, the
mean batch size the server reports, and how many different answers each question got (1 = batch-invariant).
"""
import json
import os
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a script from anywhere
from flags import Parser, integer  # noqa: E402  (standard library only)

QUESTIONS = ["Tom has 23 apples and buys 45 more. How many apples does he have?",
             "A box has 50 books. Sam takes 12. How many books are left?",
             "Mia has 81 cards and sells 29. How many cards does she have left?",
             "A box has 34 apples. Tom adds 19. How many apples are there?"]


def main():
    p = Parser(prog="tools/load.py", description="concurrent chat requests against serve.py")
    p.add_argument("--port", type=integer(1, 65535), default=8000, help="serve.py's port on 127.0.0.1 (default: "
                   "%(default)s)")
    p.add_argument("--clients", type=integer(1), default=8, help="default: %(default)s")
    p.add_argument("--requests", type=integer(1), default=8, help="per client (default: %(default)s)")
    args = p.parse_args()
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    sizes, answers, errors = [], {}, []

    def client(c):
        for i in range(args.requests):
            q = QUESTIONS[(c + i) % len(QUESTIONS)]
            body = json.dumps({"messages": [{"role": "user", "content": q}]}).encode()
            try:
                with urllib.request.urlopen(urllib.request.Request(url, body), timeout=120) as r:
                    choice = json.load(r)["choices"][0]
                size, content = choice["fastdllm"]["batch_size"], choice["message"]["content"]
            except (OSError, ValueError, LookupError, TypeError) as e:   # no server, or not serve.py's answer
                errors.append(repr(e))
                continue
            sizes.append(size)
            answers.setdefault(q, set()).add(content)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    n = len(sizes)
    if not n:      # not one answer: a number of requests/s would say nothing
        print(f"error: none of the {len(errors)} requests got an answer (the first: {errors[0]}): is serve.py "
              f"running on port {args.port}?", file=sys.stderr)
        sys.exit(2)
    print(f"{n} requests from {args.clients} clients in {dt:.2f} s = {n / dt:.1f} requests/s | mean batch "
          f"{sum(sizes) / max(n, 1):.2f} | answers per question {[len(a) for a in answers.values()]} | "
          f"errors {len(errors)}")


if __name__ == "__main__":
    main()
