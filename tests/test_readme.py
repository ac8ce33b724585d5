"""The README's code is the code: every Python block of README.md runs as written, from the repository's root, on
the tiny models it names, and prints what its "# >>> " lines show; the block quoted from generate()'s loop is still
in fastdllm.py, word for word."""
import contextlib
import io
import os
import re
import textwrap

import pytest
import torch

from conftest import ROOT

with open(os.path.join(ROOT, "README.md")) as f:
    BLOCKS = re.findall(r"```python\n(.*?)```", f.read(), re.S)
LOOP = "for i in itertools.count():"


def test_the_readme_has_its_blocks():
    """The API block, the Fork-it block and the loop: a README edit that drops one fails here."""
    assert len(BLOCKS) == 3 and sum(b.startswith(LOOP) for b in BLOCKS) == 1


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_a_readme_block_runs_as_written(i, monkeypatch):
    code = BLOCKS[i]
    if code.startswith(LOOP):                       # quoted from generate(): it must still be the loop
        with open(os.path.join(ROOT, "fastdllm.py")) as f:
            assert textwrap.indent(code, " " * 8) in f.read()
        return
    monkeypatch.chdir(ROOT)
    scope, printed = {}, io.StringIO()
    with torch.inference_mode(False), contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md, Python block {i + 1}", "exec"), scope)
    out, stats = scope.get("out", scope.get("ids")), scope["stats"]
    assert stats["nfe"] >= 1 and not (out == scope["model"].config.mask_id).any()    # it decoded every position
    shown = [line[len("# >>> "):] for line in code.splitlines() if line.startswith("# >>> ")]
    assert shown and printed.getvalue().splitlines() == shown     # what the block says it prints, it prints


def test_the_install_line_names_the_torch_ci_tests():
    """Issue 39: the README's torch line pinned no version (and named only an index unreachable offline): it
    installs the torch CI installs, and keeps the CPU note."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = re.search(r"pip install -q (torch==\S+)", f.read())[1]
    install = re.search(r"```bash\n(.*?)```", readme, re.S)[1].splitlines()
    assert install[0] == f"pip install {ci}" and install[1] == "pip install -r requirements.txt"
    assert "CPU build" in readme.split("```bash")[0]
