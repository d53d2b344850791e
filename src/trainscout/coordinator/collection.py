"""The coordinator's garbage collection: the young generations as usual, the full one on a schedule of its own.

Most of a coordinator's memory is every rank's last report, replaced at each digest: at 12,800 ranks about a
million objects, each living about a second. CPython starts a full collection whenever the objects that outlived
the young collections reach a quarter of those the last full one left, so with this churn it ran every second
or two, each time walking every live object: 40 % of the coordinator's CPU at 12,800 ranks (measured,
benchmarks/scale.py), and passes of seconds at 100k ranks. The reports hold no reference cycles (reference
counting frees them), so a full collection only reclaims the odd cycle (an exception's traceback); here it runs
no more often than every FULL_EVERY_S and than its own duration times FULL_DUTY_INVERSE.
"""

from __future__ import annotations

import gc
import time

FULL_EVERY_S = 60.0
FULL_DUTY_INVERSE = 100  # at most 1 % of the time in full collections
NEVER = 1 << 30  # young collections between full ones: none starts by itself


class Collection:
    def __init__(self) -> None:
        self._saved: tuple[int, int, int] | None = None
        self._next_full = 0.0

    def __enter__(self) -> Collection:
        self._saved = gc.get_threshold()
        gen0, gen1, _ = self._saved
        gc.set_threshold(gen0, gen1, NEVER)
        self._next_full = time.monotonic() + FULL_EVERY_S
        return self

    def __exit__(self, *_exc) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    def maybe_full(self, now: float) -> float:
        """A full collection if one is due; returns the seconds it took (0.0 when none ran)."""
        if now < self._next_full or not gc.isenabled():
            return 0.0
        start = time.monotonic()
        gc.collect()
        took = time.monotonic() - start
        self._next_full = now + max(FULL_EVERY_S, FULL_DUTY_INVERSE * took)
        return took
