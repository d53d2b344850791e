"""A member's peers' median and maximum, read from one sorted copy of the whole class.

Judging each member against the others by sorting the others anew costs O(n^2 log n) a step: seconds at 10k
ranks, hours at 100k. Leaving one value out of a sorted list moves the middle by at most one place, so each
member's peers' median and maximum are an index away. Pure functions, no I/O.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence


def middle(ordered: Sequence[float]) -> float:
    """The median of sorted, non-empty `ordered` (statistics.median's result without its per-call overhead:
    detectors take several per step)."""
    h = len(ordered) // 2
    return ordered[h] if len(ordered) % 2 else (ordered[h - 1] + ordered[h]) / 2


def median(values: Iterable[float]) -> float:
    """The median of non-empty `values`, by one sort."""
    return middle(sorted(values))


def median_without(ordered: Sequence[float], value: float) -> float:
    """The median of sorted `ordered` with one occurrence of `value` (which it holds) left out."""
    i = bisect.bisect_left(ordered, value)
    n = len(ordered) - 1
    if n <= 0:
        raise ValueError("no peers left")

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    h = n // 2
    return at(h) if n % 2 else (at(h - 1) + at(h)) / 2


def max_without(ordered: Sequence[float], value: float) -> float:
    """The largest of sorted `ordered` with one occurrence of `value` (which it holds) left out."""
    if len(ordered) < 2:
        raise ValueError("no peers left")
    return ordered[-2] if value == ordered[-1] else ordered[-1]
