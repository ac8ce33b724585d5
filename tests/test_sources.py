"""The repository speaks for itself: no file cites notes a reader of it does not have (a `spec/*.md`, a `shared/`
folder, a search tool's "stored copies" or "index"), and every "docs/official.md N" a comment cites is a section
of docs/official.md."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNFOLLOWABLE = re.compile(r"(shared/)?spec/[a-z_0-9]+\.md|shared/spec|search. tool|stored cop|not in the index")


def project_files():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    names = out.stdout.split() if out.returncode == 0 else [
        os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) for f in fs]
    return [n for n in names if n.endswith((".py", ".md")) and not n.startswith(("tests/golden/", ".git/"))
            and os.path.exists(os.path.join(ROOT, n))]


def test_no_file_cites_what_a_reader_does_not_have():
    hits = []
    for name in project_files():
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if UNFOLLOWABLE.search(line) and name != "tests/test_sources.py":
                    hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not hits, "cite the public source and docs/ instead:\n" + "\n".join(hits)


def test_every_cited_section_of_official_md_exists():
    with open(os.path.join(ROOT, "docs", "official.md"), encoding="utf-8") as f:
        sections = set(re.findall(r"^##+ (\d+(?:\.\d+)?)\.? ", f.read(), re.M))
    cited = {}
    for name in project_files():
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            text = f.read()
        for m in re.finditer(r"docs/official\.md\s+(\d+(?:\.\d+)?)((?:(?:,| and)\s+\d+(?:\.\d+)?)*)", text):
            for s in re.findall(r"\d+(?:\.\d+)?", m.group(1) + m.group(2)):
                cited.setdefault(s, name)
    assert cited, "no file cites docs/official.md by section"
    missing = {s: name for s, name in cited.items() if s not in sections}
    assert not missing, f"docs/official.md has no section {missing}"
