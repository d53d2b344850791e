"""Reads the launcher's own failure report: torchrun prints each failed worker's rank, exit code and pid.

That is the only place a SIGKILLed rank's signal is known (its parent, the launcher, reaped it).
"""

from __future__ import annotations

import re

_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")


def worker_exits(text: str) -> list[tuple[int, int, int]]:
    """[(global rank, exit code, pid)] from torchrun's failure summary; negative codes are signals."""
    seen: dict[int, tuple[int, int, int]] = {}
    for m in _FAILURE.finditer(text):
        rank, code, pid = int(m.group(1)), int(m.group(2)), int(m.group(3))
        seen[rank] = (rank, code, pid)
    return sorted(seen.values())
