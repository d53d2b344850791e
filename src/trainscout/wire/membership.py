"""A process group's members as runs of evenly spaced ranks: the world group of 100k ranks is one run.

Groups of real layouts (tensor-parallel blocks, pipeline stages, data-parallel replicas at a fixed stride)
are arithmetic progressions, so a membership travels in a few integers whatever the group's size; any other
list still round-trips exactly (as more runs). Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Sequence

MAX_RANKS = 1 << 22  # a run claiming more members than any job has is malformed, not expanded


def pack_members(members: Sequence[int]) -> list[tuple[int, int, int]]:
    """Sorted, de-duplicated `members` as (first, stride, count) runs; unpack_members gives them back."""
    ranks = sorted(set(map(int, members)))
    if len(ranks) >= 2:  # the usual case, one progression, checked at C speed (a world group of 100k ranks)
        stride = ranks[1] - ranks[0]
        # the span test first: a list spanning far more ranks than it holds would otherwise build that whole range
        if ranks[-1] - ranks[0] == stride * (len(ranks) - 1) and ranks == list(range(ranks[0], ranks[-1] + 1, stride)):
            return [(ranks[0], stride, len(ranks))]
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(ranks):
        if i + 1 == len(ranks):
            runs.append((ranks[i], 1, 1))
            break
        stride = ranks[i + 1] - ranks[i]
        j = i + 1
        while j + 1 < len(ranks) and ranks[j + 1] - ranks[j] == stride:
            j += 1
        runs.append((ranks[i], stride, j - i + 1))
        i = j + 1
    return runs


def unpack_members(runs: Sequence[Sequence[int]]) -> list[int]:
    """The sorted member list `pack_members` encoded; malformed runs (count < 1 or beyond MAX_RANKS, stride < 1,
    a negative first rank) are skipped, and expansion stops at MAX_RANKS members in all."""
    out: list[int] = []
    for first, stride, count in runs:
        if 1 <= count <= MAX_RANKS and stride >= 1 and first >= 0:
            # the bound is on the whole list: many runs each within MAX_RANKS would otherwise expand without limit
            count = min(count, MAX_RANKS - len(out))
            out.extend(range(first, first + stride * count, stride))
    return sorted(set(out))
