"""Reads the launcher's own output: the failure report and the signals it sent its workers or received.

torchrun prints each failed worker's rank, exit code and pid: the only place a SIGKILLed rank's signal is known
(its parent, the launcher, reaped it). It also says which workers it sent a closing signal when it tore the job
down, and when it was itself told to stop: a rank's SIGTERM it did not send, in a job nobody stopped, came from
outside the job.
"""

from __future__ import annotations

import re

_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_CLOSING = re.compile(r"Sending process (\d+) closing signal")  # torchrun tearing its workers down
_RECEIVED = re.compile(r"Received (?:Signals\.)?\w+ death signal")  # torchrun itself told to stop


def worker_exits(text: str) -> list[tuple[int, int, int]]:
    """[(global rank, exit code, pid)] from torchrun's failure summary; negative codes are signals."""
    seen: dict[int, tuple[int, int, int]] = {}
    for m in _FAILURE.finditer(text):
        rank, code, pid = int(m.group(1)), int(m.group(2)), int(m.group(3))
        seen[rank] = (rank, code, pid)
    return sorted(seen.values())


def signalled_pids(text: str) -> set[int]:
    """The pids of workers the launcher said it sent a closing signal."""
    return {int(m.group(1)) for m in _CLOSING.finditer(text)}


def launcher_interrupted(text: str) -> bool:
    """The launcher said it received a terminating signal (the whole job was told to stop)."""
    return _RECEIVED.search(text) is not None
