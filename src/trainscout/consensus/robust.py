"""Robust statistics for the statistical C3 vote: which member of an equivalence class is slow.

The coordinator's straggler and replay detectors call `vote_statistical` with one timing per member of an
equivalence class (ranks of one process group, peers of one replay) for one interval. Timings are noisy, so
an outlier must be slow relative to the class (relative threshold), slow in absolute terms (absolute
threshold: 3x of 1 ms is no straggler) and far outside the spread of its peers (robust z over median/MAD).
`Persistence` then requires the same member to be flagged in k of its last m observations, so that a
single noisy interval never produces a finding.

Pure logic: no torch, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from trainscout.consensus.c3 import AGREE, ATTRIBUTED, INCONCLUSIVE, Verdict

# Scales a MAD to a standard deviation for normally distributed data.
MAD_TO_SIGMA = 1.4826
# Identical timings give MAD == 0 and an infinite z; flooring MAD at this fraction of the median keeps z
# finite while still letting a clearly slow member stand out among peers that agree exactly.
MAD_FLOOR_FRACTION = 1e-3
# Floor for a median of 0 (all samples 0), where the relative floor would be 0 too.
MAD_FLOOR_ABS = 1e-12


def median_mad(x) -> tuple[float, float]:
    """Median and (unscaled) median absolute deviation of a non-empty 1-D sample."""
    values = (
        [float(v) for v in np.asarray(x, dtype=np.float64).reshape(-1)]
        if isinstance(x, np.ndarray)
        else [float(v) for v in x]
    )
    if not values:
        raise ValueError("median_mad of an empty sample")
    median = statistics.median(values)
    return median, statistics.median([abs(v - median) for v in values])


def vote_statistical(
    samples: Mapping[int, float],
    *,
    rel_threshold: float,
    abs_threshold: float,
    z_threshold: float = 5.0,
    min_members: int = 3,
) -> Verdict:
    """Vote on timings (member id -> seconds, or any "larger is slower" measure); flags the slow side only.

    A member is an outlier when x - median exceeds rel_threshold * median AND abs_threshold AND its robust
    z exceeds z_threshold (z is skipped below `min_members`, where it means nothing).
    agree: no outlier. attributed: outliers exist and the normal members are a strict majority.
    inconclusive: suspects exist but there are fewer than `min_members` members, or the normal members are
    not a strict majority; the suspects are then listed in evidence, never as outliers.
    Non-finite samples raise ValueError: the caller decides what a missing timing means.
    Plain Python, not numpy: the coordinator votes every step on a handful of values, where numpy's
    per-call cost is ten times the work.
    """

    def against_class(member, v, median, mad):
        return median, mad

    return _vote(samples, against_class, rel_threshold, abs_threshold, z_threshold, min_members)


def vote_against_peers(
    samples: Mapping[int, float],
    *,
    rel_threshold: float,
    abs_threshold: float,
    z_threshold: float = 5.0,
    min_members: int = 3,
    exact_below: int = 32,
) -> Verdict:
    """Like vote_statistical, but each member is judged against its peers only (leave-one-out).

    With few members the class median and MAD include the suspect (and any healthy member that is fast
    for its own reasons), which shrinks the gap and inflates the spread: with 4 ranks at 0.8, 1.0, 1.0 and
    1.3 the slow one has z = 2 against all, but stands 30 % above a tight group of peers. Below
    `exact_below` members the peers' median and MAD are computed exactly; above, one member barely moves
    them and the class statistics stand in. The ratio in the evidence is the member over its peers' median.
    """
    items = list(samples.items())

    def against_peers(member, v, median, mad):
        if len(items) >= exact_below:
            return median, mad
        peers = [x for m, x in items if m != member]
        return median_mad(peers) if peers else (v, 0.0)

    return _vote(samples, against_peers, rel_threshold, abs_threshold, z_threshold, min_members)


def _vote(samples, reference, rel_threshold, abs_threshold, z_threshold, min_members) -> Verdict:
    """The shared vote: `reference(member, value, class median, class MAD)` gives the centre and spread a
    member is judged against."""
    n = len(samples)
    items = [(int(m), float(v)) for m, v in samples.items()]
    if not all(math.isfinite(v) for _, v in items):
        raise ValueError("timing samples must be finite")
    if n == 0:
        return Verdict(AGREE, (), None, {"n": 0})
    median, mad = median_mad([v for _, v in items])
    evidence: dict[str, Any] = {"n": n, "median": median, "mad": mad}
    suspects = []
    for member, v in items:
        if v <= median:
            continue  # never slower than the centre of any reference
        centre, spread = reference(member, v, median, mad)
        scale = MAD_TO_SIGMA * max(spread, MAD_FLOOR_FRACTION * abs(centre), MAD_FLOOR_ABS)
        excess = v - centre
        # All three conditions: relative alone flags microsecond jitter, absolute alone flags 1% of a long
        # step, z alone flags anything when peers agree exactly. Below min_members a spread is meaningless
        # (with 2 members z is always 0.67), so a clear relative and absolute gap alone makes the class
        # disagree; such a verdict is inconclusive below anyway.
        if (
            excess > rel_threshold * centre
            and excess > abs_threshold
            and (n < min_members or excess / scale > z_threshold)
        ):
            # the ratio is what a person reads ("rank 13 is 2.1x slower"); undefined for a centre <= 0
            suspects.append((member, v / centre if centre > 0 else None, excess / scale))
    if not suspects:
        return Verdict(AGREE, (), median, evidence)
    suspects.sort()  # suspects in ascending member order
    suspect_ids = [m for m, _, _ in suspects]
    evidence["ratios"] = {m: r for m, r, _ in suspects}
    evidence["z"] = {m: z for m, _, z in suspects}
    # Too few members for a median to mean anything, or no strict majority of normal members: detect only.
    if n < min_members or 2 * len(suspect_ids) >= n:
        evidence["suspects"] = suspect_ids
        return Verdict(INCONCLUSIVE, (), None, evidence)
    return Verdict(ATTRIBUTED, tuple(suspect_ids), median, evidence)


class Persistence:
    """Confirms a member only after it was an outlier in at least k of the last m observations it took part in.

    Only members with a hit still inside their window are tracked, so the per-observation cost follows the
    number of suspects, not the size of the class.
    """

    def __init__(self, k: int, m: int) -> None:
        if not 1 <= k <= m:
            raise ValueError(f"need 1 <= k <= m, got k={k}, m={m}")
        self.k = k
        self.m = m
        self._windows: dict[int, deque[bool]] = {}

    def observe(self, outliers: Iterable[int], observed: Iterable[int]) -> set[int]:
        """Record one observation and return every tracked member with >= k hits in its last m observations.

        `observed` are the members that took part; an outlier always counts as taking part. Members not
        observed this time keep their window unchanged.
        """
        hit = _int_set(outliers)
        seen = _int_set(observed) | hit
        for member, window in list(self._windows.items()):
            if member in seen and member not in hit:
                window.append(False)
                # A window without hits behaves exactly like no window: drop it to keep the state small.
                if not any(window):
                    del self._windows[member]
        for member in hit:
            self._windows.setdefault(member, deque(maxlen=self.m)).append(True)
        return {member for member, window in self._windows.items() if sum(window) >= self.k}

    def forget(self, member: int) -> None:
        """Drop a member's history (it left the class, or its finding was emitted and acknowledged)."""
        self._windows.pop(member, None)


def _int_set(members: Iterable[int]) -> set[int]:
    # numpy arrays arrive from the vectorised paths; tolist() yields plain ints in one C call.
    if isinstance(members, np.ndarray):
        return set(members.reshape(-1).tolist())
    return {int(m) for m in members}
