"""examples/compare.py on two problems: a table row for every method (measured, or skipped with a note when its
file is missing), the same settings as the command line, the figure by matplotlib (PNG, PDF on request), the
tables alone without matplotlib, nothing written unless --out asks, and each row's progress from its start."""
import importlib.util
import os
import sys

import pytest
from tokenizers import Tokenizer

from conftest import ROOT

spec = importlib.util.spec_from_file_location("compare", os.path.join(ROOT, "examples", "compare.py"))
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)
DOCS = [os.path.join(ROOT, "docs", f) for f in ("methods.md", "methods.png")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of every row on two problems, into a temporary folder, with the PDF: (folder, stderr)."""
    out = tmp_path_factory.mktemp("compare")
    capture = pytest.MonkeyPatch()
    err = out / "stderr.txt"
    with open(err, "w") as f:
        capture.setattr(sys, "stderr", f)
        try:
            compare.main(["-n", "2", "--out", str(out), "--pdf"])
        finally:
            capture.undo()
    return out, err.read_text()


def test_compare_writes_the_tables(run):
    text = (run[0] / "methods.md").read_text()
    rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| # |")]
    assert len(rows) == len(compare.ROWS)
    for number, ((_, name, example, flags, _), row) in enumerate(zip(compare.ROWS, rows), 1):
        present = example is None or os.path.isfile(os.path.join(ROOT, "examples", example))
        present &= "int8" not in flags or importlib.util.find_spec("torchao") is not None
        assert row.startswith(f"| {number} | {name} |") and ("not run" not in row) == present
    buys = " ".join(text.split("## What each method buys here")[1].split())    # each method against its built-in row
    for number, (table, name, _, _, ref) in enumerate(compare.ROWS, 1):
        if ref is None:
            assert f"(#{number};" not in buys
        elif f"| {number} | {name} | " in text and "not run" not in rows[number - 1]:
            assert name in buys and f"(#{number}; in brackets #{ref}, {compare.ROWS[ref - 1][1]}):" in buys


def test_the_figure_is_matplotlibs_png_and_pdf(run):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install -r requirements-extras.txt")
    from PIL import Image                       # matplotlib's own dependency
    with Image.open(run[0] / "methods.png") as im:
        assert im.format == "PNG" and im.size == (1500, 750)
    assert (run[0] / "methods.pdf").read_bytes().startswith(b"%PDF-")
    assert f"wrote {run[0] / 'methods.md'}, {run[0] / 'methods.png'}, {run[0] / 'methods.pdf'}" in run[1]


def test_each_row_says_its_progress_from_its_start(run):
    """Issue 39: the first row was a minute of silence. Each row says so at its start (0 of its problems), after
    each tenth of them, then its result."""
    lines = run[1].splitlines()
    first = compare.ROWS[0][1]
    start = lines.index(f"[1/{len(compare.ROWS)}] {first}: 0/2 problems")
    assert lines[start + 1:start + 3] == [f"[1/{len(compare.ROWS)}] {first}: {i}/2 problems" for i in (1, 2)]
    assert lines[start + 3].startswith(f"{first}: {{'valid': ")


def test_by_default_nothing_is_written(monkeypatch, capsys, tmp_path):
    """Issue 39: a plain run rewrote the tracked docs/methods.md. Without --out the tables go to stdout and no file
    is touched (only docs/methods.md, .png are the project's, written by --out docs)."""
    monkeypatch.setattr(compare, "ROWS", compare.ROWS[:1])
    before = [os.stat(p).st_mtime_ns for p in DOCS]
    monkeypatch.chdir(tmp_path)
    compare.main(["-n", "1"])
    assert [os.stat(p).st_mtime_ns for p in DOCS] == before and os.listdir(tmp_path) == []
    out = capsys.readouterr().out
    assert out.startswith("# The methods on the demo task") and f"| 1 | {compare.ROWS[0][1]} |" in out
    with pytest.raises(SystemExit):
        compare.main(["-n", "1", "--pdf"])          # --pdf without --out: refused, nothing run
    assert "--pdf writes beside methods.md: add --out FOLDER" in capsys.readouterr().err


@pytest.mark.parametrize("where,why", [("missing/deeper", "does not exist"), ("a-file", "is not a folder")])
def test_an_out_that_cannot_be_written_is_refused_before_any_row(monkeypatch, capsys, tmp_path, where, why):
    """Issue 46: `--out <missing folder>` ran every row (7 minutes at -n 200), then failed with a traceback. The
    folder is checked first: one line, status 2, no row run."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(compare, "measure", lambda *a, **k: pytest.fail("a row ran before --out was checked"))
    out = tmp_path / where
    with pytest.raises(SystemExit) as e:
        compare.main(["-n", "1", "--out", str(out)])
    assert e.value.code == 2 and capsys.readouterr().err == (f"error: --out {out} {why}: create it (mkdir -p) or pick "
                                                              f"another; nothing was run\n")


def test_without_matplotlib_the_tables_are_written_and_one_line_says_how(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(compare, "ROWS", compare.ROWS[:1])
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # `import matplotlib` raises ImportError
    compare.main(["-n", "1", "--out", str(tmp_path)])
    assert os.listdir(tmp_path) == ["methods.md"]
    err = capsys.readouterr().err.splitlines()
    assert "no figure: matplotlib is not installed (pip install -r requirements-extras.txt)" in err
    assert err[-1] == f"wrote {tmp_path / 'methods.md'}"


def test_an_int8_row_without_torchao_is_skipped_with_the_reason(monkeypatch, without_torchao, tmp_path):
    monkeypatch.setattr(compare, "ROWS", [r for r in compare.ROWS if "--quantize" in r[3]][:1])
    compare.main(["-n", "1", "--out", str(tmp_path)])
    row = next(r for r in (tmp_path / "methods.md").read_text().splitlines() if r.startswith("| 1 |"))
    assert "not run: int8 weights (quantize='int8', --quantize int8) need torchao" in row


def test_a_fork_runs_as_its_command_line_would():
    """prophet.py's hooks from its own cli.run call (handed the checkpoint's config and tokenizer, as cli.run
    hands them), with the CLI's other settings: no early stop of the CLI's (the fork stops), no threshold (it
    selects), its cache; the suffix tokenized by the demo's tokenizer (" The answer is": three tokens). A row's
    --dtype and --quantize name the weights it loads."""
    demo = os.path.join(ROOT, "demo", "llada-arith")
    kw, seeded, weights = compare.settings(demo, "prophet.py", "--cache prefix")
    assert type(kw["stop"]).__name__ == "Prophet" and kw["propose"] is kw["stop"] and not seeded
    assert kw["threshold"] is None and not kw["stop_at_eos"] and kw["cache"] == "prefix"
    assert kw["stop"].suffix.tolist() == Tokenizer.from_file(os.path.join(demo, "tokenizer.json")
                                                              ).encode(" The answer is", add_special_tokens=False).ids
    kw, seeded, weights = compare.settings(demo, None, "")
    assert (kw["cache"], kw["threshold"], kw["stop_at_eos"], seeded) == ("dual", 0.9, True, True)
    assert str(weights) == "(torch.float32, None)"
    assert str(compare.settings(demo, None, "--quantize int8 --dtype bfloat16")[2]) == "(torch.bfloat16, 'int8')"
