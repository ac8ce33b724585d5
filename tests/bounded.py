"""Subprocesses the tests start, every one bounded. Each runs in its own process group (start_new_session), and
when its time is up the whole group is killed (os.killpg): a child it started (the `head` of a shell pipe, the
python before it) cannot keep a pipe open, so the read that follows returns. Every read from one has a bound
too: a server that hangs before printing its first line fails its test instead of hanging the suite."""
import json
import os
import signal
import subprocess
import sys
import threading


def start(cmd, **kw) -> subprocess.Popen:
    """subprocess.Popen, as the leader of a new process group."""
    return subprocess.Popen(cmd, start_new_session=True, **kw)


def kill(p: subprocess.Popen):
    """SIGKILL to p's whole process group; nothing if it is already gone."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def finish(p: subprocess.Popen, input=None, timeout: float = 120):
    """p.communicate(input) for at most `timeout` s -> (stdout, stderr, timed_out). Past the bound the group is
    killed and what it wrote is returned (its pipes close with the group, so this read is bounded too)."""
    try:
        return (*p.communicate(input, timeout=timeout), False)
    except subprocess.TimeoutExpired:
        kill(p)
        return (*p.communicate(timeout=30), True)


def run(cmd, timeout: float, input=None, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=...), with the whole group killed at the
    timeout; then subprocess.TimeoutExpired is raised, as subprocess.run does, with what the command wrote."""
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) | kw
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    p = start(cmd, **kw)
    out, err, late = finish(p, input, timeout)
    if late:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def read_line(p: subprocess.Popen, stream, timeout: float) -> str:
    """stream.readline() from p's pipe, waited for at most `timeout` s; past it p's group is killed and
    TimeoutError raised (readline itself has no timeout, so it runs in a thread that the kill ends)."""
    got = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        kill(p)
        reader.join(30)
        raise TimeoutError(f"no line from {' '.join(map(str, p.args[:2]))} in {timeout:.0f} s: killed")
    return got[0]


def run_main(script, argv, stdin=None, cwd=None) -> tuple[int, str, str]:
    """`python script argv...` in THIS process -> (exit status, stdout, stderr): the script runs as __main__
    (runpy), with sys.argv, stdin and its folder first on sys.path as python sets them, in `cwd`; its status from
    SystemExit, anything else that escapes is status 1 with its traceback on stderr. For programs whose errors
    need no process of their own (a torch import is ~2 s of CPU a process)."""
    import contextlib
    import io
    import runpy
    import traceback
    saved = sys.argv, sys.stdin, list(sys.path), os.getcwd()
    sys.argv, sys.stdin = [str(script), *map(str, argv)], io.StringIO(stdin or "")
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        os.chdir(cwd or os.getcwd())
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except BaseException:
                code = 1
                print(traceback.format_exc(), file=sys.stderr)
    finally:
        (sys.argv, sys.stdin, sys.path[:], here) = saved
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


# One process for many runs of the programs (drive): the DRIVER reads {name: run_main's arguments} on stdin and
# prints {name: its result} as one JSON line.
DRIVER = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import bounded; "
          "print(json.dumps({n: bounded.run_main(*c) for n, c in json.loads(sys.stdin.read()).items()}))")


def drive(cases: dict, timeout: float = 240, **kw) -> dict:
    """cases {name: (script path, argv) or (script, argv, stdin text, working folder)} -> {name: (exit status,
    stdout, stderr)}, all run in one bounded process (kw: subprocess.Popen's, e.g. cwd, env). A case that hangs
    fails them all, by the timeout, instead of hanging the suite."""
    r = run([sys.executable, "-c", DRIVER], timeout=timeout, input=driver_input(cases), **kw)
    return driven(r.returncode, r.stdout, r.stderr)


def driver_input(cases: dict) -> str:
    """The DRIVER's stdin for `cases` (drive's), for a driver started beside other processes."""
    return json.dumps({name: [str(c[0]), [str(a) for a in c[1]], *(list(c[2:]) + [None, None])[:2]]
                       for name, c in cases.items()})


def driven(code: int, stdout: str, stderr: str) -> dict:
    """The DRIVER's results -> {name: (exit status, stdout, stderr)}; a driver that failed is an AssertionError."""
    if code or not stdout.strip() or "Traceback" in stderr:
        raise AssertionError(f"the driver failed (status {code}): {stderr[-2000:]}")
    return {name: tuple(v) for name, v in json.loads(stdout.strip().splitlines()[-1]).items()}
