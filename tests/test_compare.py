"""examples/compare.py on two problems: a table row for every method (measured, or skipped with a note when its
file is missing), the same settings as the command line, and a picture that decodes."""
import importlib.util
import os

from conftest import ROOT
from test_png import read_png

spec = importlib.util.spec_from_file_location("compare", os.path.join(ROOT, "examples", "compare.py"))
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def test_compare_writes_the_table_and_the_picture(tmp_path):
    compare.main(["-n", "2", "--out", str(tmp_path)])
    rows = [r for r in (tmp_path / "methods.md").read_text().splitlines() if r.startswith("| ") and "---" not in r]
    assert len(rows) == 1 + len(compare.ROWS)
    for (name, example, _), row in zip(compare.ROWS, rows[1:]):
        present = example is None or os.path.isfile(os.path.join(ROOT, "examples", example))
        assert row.startswith(f"| {name} |") and ("not run" not in row) == present
    assert read_png((tmp_path / "methods.png").read_bytes())[:2] == (960, 640)


def test_a_fork_runs_as_its_command_line_would():
    """prophet.py's hooks from its own cli.run call, with the CLI's other settings: no early stop of the CLI's
    (the fork stops), no threshold (it selects), its cache."""
    kw, seeded = compare.settings(os.path.join(ROOT, "demo", "llada-arith"), "prophet.py", "--cache prefix")
    assert type(kw["stop"]).__name__ == "Prophet" and kw["propose"] is kw["stop"] and not seeded
    assert kw["threshold"] is None and not kw["stop_at_eos"] and type(kw["cache"]).__name__ == "PrefixCache"
    kw, seeded = compare.settings(os.path.join(ROOT, "demo", "llada-arith"), None, "")
    assert (kw["cache"], kw["threshold"], kw["stop_at_eos"], seeded) == ("dual", 0.9, True, True)
