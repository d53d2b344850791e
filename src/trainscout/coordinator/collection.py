"""The coordinator's garbage collection: none by itself while it runs, a full one on a schedule of its own.

Most of a coordinator's memory is every rank's last report, replaced at each digest: at 10k ranks about a
million objects, each living about a second. CPython's collector, left to itself, ran a young collection every
700 new containers, each walking the reports still alive (0.12 ms of every 8-rank digest's 0.25 ms at 10k
ranks), and a full one whenever the survivors reached a quarter of the live objects, every second or two,
walking all of them (40 % of the coordinator's CPU at 12,800 ranks; benchmarks/scale.py measures both). The
reports hold no reference cycles: reference counting frees them, and the collector only reclaims the odd cycle
(an exception's traceback). So it does not run by itself here; a full collection runs no more often than every
FULL_EVERY_S and than its own duration times FULL_DUTY_INVERSE, and says what it found.
"""

from __future__ import annotations

import gc
import time

FULL_EVERY_S = 60.0
FULL_DUTY_INVERSE = 100  # at most 1 % of the time in full collections


class Collection:
    def __init__(self) -> None:
        self._was_enabled = False
        self._next_full = 0.0
        self.found = 0  # unreachable objects the last full collection freed

    def __enter__(self) -> Collection:
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._next_full = time.monotonic() + FULL_EVERY_S
        return self

    def __exit__(self, *_exc) -> None:
        if self._was_enabled:
            gc.enable()

    def maybe_full(self, now: float) -> float:
        """A full collection if one is due; returns the seconds it took (0.0 when none ran). Nothing where the
        collector was off before (the embedding program's choice)."""
        if not self._was_enabled or now < self._next_full:
            return 0.0
        start = time.monotonic()
        self.found = gc.collect()
        took = time.monotonic() - start
        self._next_full = now + max(FULL_EVERY_S, FULL_DUTY_INVERSE * took)
        return took
