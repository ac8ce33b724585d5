"""Subprocesses the tests start, every one bounded. Each runs in its own process group (start_new_session), and
when its time is up the whole group is killed (os.killpg): a child it started (the `head` of a shell pipe, the
python before it) cannot keep a pipe open, so the read that follows returns. Every read from one has a bound
too: a server that hangs before printing its first line fails its test instead of hanging the suite."""
import os
import signal
import subprocess
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
