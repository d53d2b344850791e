"""Python stacks of a rank, taken from outside the process.

py-spy reads the interpreter's memory, so it works on a rank that holds the GIL or sleeps in C; it
needs ptrace rights. The fallback signals the probe's faulthandler, which dumps all threads from a C
signal handler without needing the GIL, into a file the agent reads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from trainscout.channel.layout import stack_path

STACK_SIGNAL_OFFSET = 5  # must match trainscout.probe.probe.STACK_SIGNAL (SIGRTMIN + 5)


def capture(pid: int, run_id: str, rank: int, timeout_s: float = 5.0, prefer: str = "py-spy") -> tuple[str, str]:
    """Return (method, text); method is "py-spy", "faulthandler" or "none"."""
    if prefer == "py-spy":
        text = _py_spy(pid, timeout_s)
        if text:
            return "py-spy", text
    text = _faulthandler(pid, run_id, rank, timeout_s)
    if text:
        return "faulthandler", text
    return "none", ""


def profile(pid: int, seconds: float = 2.0, rate: int = 100) -> tuple[str, str]:
    """(method, collapsed stacks) of a live rank sampled for `seconds` at `rate` Hz from outside the process,
    sleeping and blocked threads included (`--idle`: a rank slowed by a sleep or a blocking read must show
    where it sleeps), without pausing it (`--nonblocking`). ("none", "") where py-spy cannot run."""
    exe = shutil.which("py-spy") or _beside_python("py-spy")
    if exe is None:
        return "none", ""
    fd, path = tempfile.mkstemp(prefix="trainscout-profile-", suffix=".txt")
    os.close(fd)
    try:
        cmd = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, round(seconds))),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nonblocking",
            "--idle",
            "--threads",
            "-o",
            path,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 10)
        if done.returncode != 0:
            return "none", ""
        with open(path) as fh:
            return "py-spy-record", fh.read()
    except (subprocess.TimeoutExpired, OSError):
        return "none", ""
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _py_spy(pid: int, timeout_s: float) -> str:
    exe = shutil.which("py-spy") or _beside_python("py-spy")
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError):
        return ""
    if done.returncode != 0:
        return ""
    return done.stdout.strip()


def _beside_python(name: str) -> str | None:
    import sys

    candidate = os.path.join(os.path.dirname(sys.executable), name)
    return candidate if os.access(candidate, os.X_OK) else None


def _faulthandler(pid: int, run_id: str, rank: int, timeout_s: float) -> str:
    import signal

    path = stack_path(run_id, rank)
    try:
        start = os.path.getsize(path)
        os.kill(pid, signal.SIGRTMIN + STACK_SIGNAL_OFFSET)
    except OSError:
        return ""
    deadline = time.monotonic() + timeout_s
    last = start
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            size = os.path.getsize(path)
        except OSError:
            return ""
        if size > start and size == last:  # stopped growing: the dump is complete
            with open(path, "rb") as fh:
                fh.seek(start)
                return fh.read().decode(errors="replace").strip()
        last = size
    return ""
