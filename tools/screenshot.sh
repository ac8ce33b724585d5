#!/usr/bin/env bash
# The browser check of the live page (not a CI test): start serve.py on the demo model, load the page in a real
# headless Chromium (its JavaScript runs the decode through POST /v1/denoise/stream) and save a screenshot.
#   tools/screenshot.sh [out.png]          (default docs/page.png; needs chromium: apt-get install chromium)
# The page is opened at ?run=1&speed=0&step=3: it decodes at once and stops the replay at step 3 of 4, so the
# shot shows masks, the tokens that step committed and the final stats. Fails if the page never got its answer.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/page.png}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
[ -n "$browser" ] || { echo "no chromium found: apt-get install chromium" >&2; exit 2; }
tmp="$(mktemp -d)"
OMP_NUM_THREADS=1 timeout 120 python serve.py --model demo/llada-arith --gen-length 32 --block-length 8 \
    --port 0 --quiet > "$tmp/server.out" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -rf "$tmp"' EXIT
for _ in $(seq 100); do grep -q "^serving" "$tmp/server.out" && break; sleep 0.1; done
url="$(grep -o 'http://[0-9.:]*/' "$tmp/server.out")"
[ -n "$url" ] || { cat "$tmp/server.out" >&2; exit 1; }
page="${url}?run=1&speed=0&step=3&threshold=0.7"
# Chromium's virtual time runs ahead of a stream that is slow to start, so the server's first (warm-up) decode
# is done before the browser comes.
curl -sf "${url}v1/completions" -d '{"prompt": "A box has 50 books. Sam takes 12. How many books are left?"}' >/dev/null
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --hide-scrollbars --window-size=1100,880 --virtual-time-budget=8000)
for attempt in 1 2 3; do
    rm -rf "$tmp/profile"
    timeout 60 "$browser" "${flags[@]}" --user-data-dir="$tmp/profile" --screenshot="$tmp/page.png" "$page" \
        2>"$tmp/chromium.log" || true
    rm -rf "$tmp/profile"
    timeout 60 "$browser" "${flags[@]}" --user-data-dir="$tmp/profile" --dump-dom "$page" > "$tmp/dom.html" \
        2>>"$tmp/chromium.log" || true
    # The rendered page must hold the stats and the answer the stream delivered, not just the empty form.
    grep -q 'id="nfe">[0-9]' "$tmp/dom.html" && break
    echo "attempt $attempt: the page shows no NFE yet" >&2
done
[ -s "$tmp/page.png" ] || { echo "chromium wrote no screenshot:" >&2; tail "$tmp/chromium.log" >&2; exit 1; }
grep -q 'id="nfe">[0-9]' "$tmp/dom.html" || { echo "the decode never reached the page" >&2; exit 1; }
grep -o 'id="step">[^<]*' "$tmp/dom.html"
grep -o 'id="answer"[^<]*' "$tmp/dom.html"
cp "$tmp/page.png" "$out"
echo "wrote $out ($(wc -c < "$out") bytes) from $page"
