"""Shared fixtures: the golden checkpoints and outputs of the official code (docs/official.md, tests/golden),
loaded once per session, a helper that gives a checkpoint folder a tiny word-level tokenizer, and every test's
time limit."""
import faulthandler
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading

import pytest

# The golden runs were recorded with torch's AVX2 CPU kernels. AVX-512's round some results differently in the last
# bits (measured on an AVX-512 machine: LLaDA2's logits 1.3e-5 from the recorded ones where AVX2 gives < 1e-5, and one
# LLaDA2.1 decode with edits and one sampled SDAR decode then take another token at a near-tie: docs/parity.md). So
# on x86 the suite, and the programs it starts, run the AVX2 kernels: the same bits on every machine. Their compiled
# graphs keep a cache of their own: graphs cached under the other kernels failed an index check when reused. Both
# must be set before torch is imported.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    # oneDNN, left to the CPU, packs bf16 for AVX-512 kernels that the AVX2 pin then refuses ("pack_vnni2 is only
    # supported when avx512 is supported": a bf16 attention on a VM with avx512_bf16), so it is pinned too. (MKL's
    # float32 matmuls pick their own path: the golden comparisons allow for that noise.)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    user = getattr(os, "getuid", lambda: 0)()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_fastdllm_tests_{os.environ['ATEN_CPU_CAPABILITY']}_{user}"))
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "apps"))      # the server, the lm-eval model, the benchmark

from model import load_model  # noqa: E402

# The test models are tiny: on small shared CPUs OpenMP's thread hand-off costs more than the math (measured
# 20x slower per matmul with 2 threads than with 1 on our 2-core CI VM), so the suite runs single-threaded,
# and so do the CLI subprocesses it starts (OMP_NUM_THREADS in their environment).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Every test has a time limit: one that hangs fails, named, with every thread's stack printed, and the suite goes
# on (SIGALRM in the main thread). If even that cannot interrupt it, faulthandler ends the run a minute later with
# the stacks, so that CI never waits forever. FASTDLLM_TEST_TIMEOUT: seconds (default 600).
TEST_TIMEOUT = float(os.environ.get("FASTDLLM_TEST_TIMEOUT", 600))


@pytest.fixture(autouse=True)
def time_limit(request):
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"{request.node.nodeid} ran past its time limit, {TEST_TIMEOUT:g} s "
                           f"(FASTDLLM_TEST_TIMEOUT)")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT)
    faulthandler.dump_traceback_later(TEST_TIMEOUT + 60, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


def read_golden(name: str):
    with open(os.path.join(GOLDEN, name)) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def llada_golden():
    return read_golden("llada-golden.json")


@pytest.fixture(scope="session")
def dream_golden():
    return read_golden("dream-golden.json")


@pytest.fixture(scope="session")
def flashdlm_golden():
    return read_golden("flashdlm-golden.json")


@pytest.fixture(scope="session")
def qwen2():
    """The causal guide checkpoint (Qwen2.5-1.5B-Instruct layout), the same ids as dream-tiny."""
    return load_model(os.path.join(GOLDEN, "qwen2-tiny"), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def llada():
    return load_model(os.path.join(GOLDEN, "llada-tiny"), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def dream():
    return load_model(os.path.join(GOLDEN, "dream-tiny"), device="cpu", dtype=torch.float32)


def rows_as_alone(model, rows: list, alone=None, **kw):
    """A left-padded batch of prompts of different lengths, each row against its solo decode, by value: the same ids
    (a block-diffusion row's answer as long as alone, the rest of the row its pad id), the same model calls
    (stats["row_nfe"]), tokens committed and answer length. alone(row) -> (ids, stats): the solo decode (default
    generate() on the row). -> the batch's (ids, stats)."""
    from fastdllm import generate, pad_prompts
    ids, am = pad_prompts(rows, 0)
    out, stats = generate(model, ids, attention_mask=am, **kw)
    for r, row in enumerate(rows):
        solo, one = alone(row) if alone else generate(model, torch.tensor([row]), **kw)
        mine = out[r, ids.shape[1] - len(row):]
        assert mine[:solo.shape[1]].tolist() == solo[0].tolist(), f"row {r} ({len(row)} tokens): not its solo ids"
        assert (mine[solo.shape[1]:] == model.config.pad_id).all(), f"row {r}: past its answer, not its pad id"
        keys = ("row_nfe", "row_committed", "row_length")
        assert [stats[k][r] for k in keys] == [one[k][0] for k in keys], f"row {r} ({len(row)} tokens): {keys}"
    return out, stats


def copy_checkpoint(name: str, dest) -> str:
    """A writable copy of a golden checkpoint folder (tests never modify tests/golden)."""
    out = os.path.join(str(dest), name)
    shutil.copytree(os.path.join(GOLDEN, name), out)
    return out


def write_tokenizer(model_dir: str, specials: dict[int, str]):
    """A word-level tokenizer.json over the config's vocab: token i is "w{i}", except `specials`, which are
    registered as special tokens at the checkpoint's own ids (mask, eos, ...). Id 0 must not be special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    n = cfg.get("embedding_size") or cfg["vocab_size"]
    vocab = {specials.get(i, f"w{i}"): i for i in range(n)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))   # unknown words -> id 0, never a special
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()   # joins words with spaces
    tok.add_special_tokens(list(specials.values()))
    tok.save(os.path.join(model_dir, "tokenizer.json"))


@pytest.fixture
def without_torchao(monkeypatch):
    """torchao made unimportable, as where it is not installed: None in sys.modules for it and every submodule
    already imported (`import` then raises ImportError)."""
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)


def serving(argv: list):
    """apps/serve.py's server for `argv` in this process, on a free port: yields (app, port); stopped after."""
    import serve
    app = serve.build(serve.parse_args([*argv, "--port", "0", "--quiet"]))
    httpd = serve.make_server(app, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield app, httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()
        app.engine.stop()
