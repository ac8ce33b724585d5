"""examples/compare.py on two problems: a table row for every method (measured, or skipped with a note when its
file is missing), the same settings as the command line, and a picture that decodes."""
import importlib.util
import os

from tokenizers import Tokenizer

from conftest import ROOT
from test_png import read_png

spec = importlib.util.spec_from_file_location("compare", os.path.join(ROOT, "examples", "compare.py"))
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def test_compare_writes_the_tables_and_the_picture(tmp_path):
    compare.main(["-n", "2", "--out", str(tmp_path)])
    text = (tmp_path / "methods.md").read_text()
    rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| # |")]
    assert len(rows) == len(compare.ROWS)
    for number, ((_, name, example, _, _), row) in enumerate(zip(compare.ROWS, rows), 1):
        present = example is None or os.path.isfile(os.path.join(ROOT, "examples", example))
        assert row.startswith(f"| {number} | {name} |") and ("not run" not in row) == present
    buys = " ".join(text.split("## What each method buys here")[1].split())    # each method against its built-in row
    for number, (_, name, _, _, ref) in enumerate(compare.ROWS, 1):
        if ref is None:
            assert f"(#{number};" not in buys
        else:
            assert name in buys and f"(#{number}; in brackets #{ref}, {compare.ROWS[ref - 1][1]}):" in buys
    assert read_png((tmp_path / "methods.png").read_bytes())[:2] == (1400, 760)


def test_a_fork_runs_as_its_command_line_would():
    """prophet.py's hooks from its own cli.run call (handed the checkpoint's config and tokenizer, as cli.run
    hands them), with the CLI's other settings: no early stop of the CLI's (the fork stops), no threshold (it
    selects), its cache; the suffix tokenized by the demo's tokenizer (" The answer is": three tokens)."""
    kw, seeded = compare.settings(os.path.join(ROOT, "demo", "llada-arith"), "prophet.py", "--cache prefix")
    assert type(kw["stop"]).__name__ == "Prophet" and kw["propose"] is kw["stop"] and not seeded
    assert kw["threshold"] is None and not kw["stop_at_eos"] and kw["cache"] == "prefix"
    assert kw["stop"].suffix.tolist() == Tokenizer.from_file(os.path.join(ROOT, "demo", "llada-arith", "tokenizer.json")
                                                              ).encode(" The answer is", add_special_tokens=False).ids
    kw, seeded = compare.settings(os.path.join(ROOT, "demo", "llada-arith"), None, "")
    assert (kw["cache"], kw["threshold"], kw["stop_at_eos"], seeded) == ("dual", 0.9, True, True)
