"""
results.py: a benchmark's result file (apps/bench.py --json): the machine and software it ran on (environment), the
file written whole (write_json), and its measured rows read back, each checked, for `bench.py compare`
(measured_rows).
"""
import json
import os
import platform
import subprocess
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment(device, dtype) -> dict:
    device = torch.device(device)
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):   # Linux names the CPU model here (platform.processor() often is "")
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    return dict(date=time.strftime("%Y-%m-%d %H:%M %Z"), torch=torch.__version__, python=platform.python_version(),
                device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                cuda=torch.version.cuda, dtype=str(dtype).replace("torch.", ""), threads=torch.get_num_threads(),
                omp_num_threads=os.environ.get("OMP_NUM_THREADS"), cpu=cpu, cpu_count=os.cpu_count(), commit=commit)


def write_json(path: str, **parts):
    """Written to a new temporary file beside it and renamed, so an interrupted run leaves the last complete
    state and no other file is touched."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(parts, f, indent=1)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)     # as open() would have made it (mkstemp's is 0600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


MEASURED = {"batch": int, "cache": str, "rule": str, "stop": str, "nfe": int, "seconds": (int, float), "ids_sha1": str}


def measured_rows(path: str) -> list[dict]:
    """A --json result's measured rows (those not n/a); anything else is one line naming the file."""
    what = f"{path} is not a bench.py --json file"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} not found: pass a file written by bench.py --json") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder: pass a file written by bench.py --json") from None
    except PermissionError:
        raise ValueError(f"cannot read {path}: permission denied") from None
    except ValueError as e:      # not UTF-8, not JSON
        raise ValueError(f"{what} (not JSON: {e})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{what}: it has no list of rows")
    measured = [r for r in rows if "error" not in r]
    if not measured:
        raise ValueError(f"{path} has no measured rows ({f'all {len(rows)} are n/a' if rows else 'it has none'}): "
                         f"nothing to compare")
    for i, r in enumerate(measured):
        for k, kind in MEASURED.items():
            if not isinstance(r.get(k), kind) or isinstance(r.get(k), bool) or k == "seconds" and not r[k] > 0:
                raise ValueError(f"{what}: row {i + 1} has {k}={r.get(k)!r}")
    return measured
