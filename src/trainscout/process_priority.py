"""The monitoring processes may run at a lower CPU priority than the job they watch (`--monitor-nice`).

A data-parallel step waits for its slowest rank, so a monitor that takes a core from one rank for a few
milliseconds delays every rank by as much. At a lower priority the kernel runs the monitor in the idle
moments a busy job leaves (ranks waiting in collectives) rather than preempting a rank. The price: under
load it sees fast sequences of exits (a kill, then the launcher stopping the rest) late.
"""

from __future__ import annotations

import os


def lower_priority(nice: int) -> None:
    """Add `nice` (0-19) to this process's niceness; never a reason to fail."""
    if nice > 0:
        try:
            os.nice(nice)
        except OSError:
            pass
