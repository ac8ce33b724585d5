"""
tools/gpu_prep.py: what tools/gpu_check.py's side-by-side phase needs on a GPU machine that reaches no network, made
on a machine that does, in two git-ignored folders of this checkout that travel with it to the GPU machine:

- .official/llada/: NVlabs/Fast-dLLM's LLaDA decode (generate.py) and model (model/) at the pinned commit
  (OFFICIAL_COMMIT), read from a clone of the public repository (--official DIR, a bare one will do; without it the
  repository is cloned from GitHub into a temporary folder). Its code is the official one, as it is: never committed.
- .whl/: the official code's environment as wheels: transformers 4.49.0 (its requirements.txt), the huggingface-hub
  and tokenizers releases that transformers 4.49 accepts, and einops; for CPython 3.12 on x86-64 Linux (--python-version),
  the GPU machine's. torch and the rest of what they need (numpy, pyyaml, regex, requests, safetensors, tqdm, ...)
  are there already. About 14 MB.

    python tools/gpu_prep.py --official ~/src/Fast-dLLM            # then, on the GPU machine (docs/benchmarks.md):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    python3 tools/gpu_check.py --out gpu.json --official-site /tmp/site

The wheels go to /tmp/site, not into the machine's Python: gpu_check.py puts them on the path of the official code's
process only (the machine's own transformers is a newer major release, which the official model code predates).
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flags import Parser  # noqa: E402

OFFICIAL_REPO = "https://github.com/NVlabs/Fast-dLLM"
OFFICIAL_COMMIT = "24cc59e75f20a6384bae8c905965bb090b96388e"     # its main branch, 2025-06-27
OFFICIAL_FILES = ("llada/generate.py", "llada/model")
WHEELS = ("transformers==4.49.0", "huggingface-hub==0.36.2", "tokenizers==0.21.4", "einops==0.8.2")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def git(repo: str, *args) -> str:
    out = subprocess.run(["git", f"--git-dir={repo}", *args], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"error: git {' '.join(args)} in {repo}: {out.stderr.strip()}")
    return out.stdout


def git_dir(path: str) -> str:
    """A clone's git directory: DIR/.git for a working clone, DIR itself for a bare one."""
    return os.path.join(path, ".git") if os.path.isdir(os.path.join(path, ".git")) else path


def copy_official(repo: str, dest: str) -> list[str]:
    """OFFICIAL_FILES at OFFICIAL_COMMIT from the git directory `repo` into dest (replaced) -> the files written."""
    if git(repo, "cat-file", "-t", OFFICIAL_COMMIT).strip() != "commit":
        raise SystemExit(f"error: {repo} has no commit {OFFICIAL_COMMIT}: fetch it (git fetch {OFFICIAL_REPO})")
    shutil.rmtree(dest, ignore_errors=True)
    written = []
    for path in git(repo, "ls-tree", "-r", "--name-only", OFFICIAL_COMMIT, *OFFICIAL_FILES).split():
        out = os.path.join(dest, path)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(subprocess.run(["git", f"--git-dir={repo}", "show", f"{OFFICIAL_COMMIT}:{path}"],
                                   capture_output=True, check=True).stdout)
        written.append(path)
    with open(os.path.join(dest, "COMMIT"), "w") as f:
        f.write(f"{OFFICIAL_REPO} {OFFICIAL_COMMIT}\n")
    return written


def download_wheels(dest: str, python_version: str) -> list[str]:
    """WHEELS for the GPU machine's Python into dest (emptied first: one version of each) -> their file names."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", python_version, *[a for p in PLATFORMS for a in ("--platform", p)], "-d", dest, *WHEELS]
    if subprocess.run(cmd).returncode:
        raise SystemExit(f"error: pip download of {', '.join(WHEELS)} failed (a package index must be reachable)")
    return sorted(os.listdir(dest))


def main(argv=None):
    p = Parser(prog="tools/gpu_prep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--official", default=None, help=f"a clone of {OFFICIAL_REPO} (default: cloned into a temporary "
                   f"folder)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default: %(default)s)")
    args = p.parse_args(argv)
    tmp = None
    try:
        if args.official is None:
            tmp = tempfile.mkdtemp(prefix="fast-dllm-")
            subprocess.run(["git", "clone", "-q", "--bare", OFFICIAL_REPO, tmp], check=True)
        files = copy_official(git_dir(args.official or tmp), os.path.join(ROOT, ".official"))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f".official/: {len(files)} files of {OFFICIAL_REPO} at {OFFICIAL_COMMIT[:7]}: {', '.join(files)}")
    wheels = download_wheels(os.path.join(ROOT, ".whl"), args.python_version)
    size = sum(os.path.getsize(os.path.join(ROOT, ".whl", w)) for w in wheels)
    print(f".whl/: {', '.join(wheels)} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
