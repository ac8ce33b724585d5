"""The suite's own guards: a test that hangs fails by its time limit (tests/conftest.py) instead of stalling CI."""
import os
import sys

import bounded
from conftest import ROOT


def test_a_hanging_test_fails_by_its_time_limit(tmp_path):
    """A test that sleeps forever (and one that waits on a lock forever), in a pytest of its own with this
    suite's conftest and a 2 s limit: both fail, named, and the run ends by itself."""
    (tmp_path / "test_hang.py").write_text("import threading, time\n\n"
                                           "def test_sleeps():\n    time.sleep(1e6)\n\n"
                                           "def test_waits():\n    lock = threading.Lock()\n    lock.acquire()\n    lock.acquire()\n")
    env = dict(os.environ, FASTDLLM_TEST_TIMEOUT="2", PYTHONPATH=os.path.join(ROOT, "tests"))   # our conftest: -p
    r = bounded.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", str(tmp_path)],
                    timeout=120, cwd=str(tmp_path), env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "2 failed" in r.stdout and r.stdout.count("ran past its time limit, 2 s") >= 2, r.stdout
