"""The period of a rank's slow spikes, robust to a missed spike and to a stray one.

A rank slow every N steps is seen as spikes at roughly s0, s0+N, s0+2N, ... On a shared machine a spike
can fall under the threshold (one slot of the progression stays empty) and a healthy rank can spike once
for its own reasons (one spike off the progression). Requiring the last few gaps to be all equal loses the
finding to either; here a progression is accepted when it explains most of what was seen.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MIN_PERIOD = 3  # spikes closer together are a persistently slow rank, the persistent rule's case
SLOT_SHARE = 2 / 3  # of the progression's slots between its first and last hit, at least this many hit
SPIKE_SHARE = 3 / 4  # of the spikes over that span, at least this many on the progression (a persistently
# slow rank spikes at most steps: every third of them is a progression)
MAX_SLACK = 2  # steps a spike may sit off its slot
LOOKBACK = 12  # spikes considered (bounds the search: anchors x periods x spikes, ~10k steps of arithmetic)


@dataclass(frozen=True)
class Period:
    period: int
    hits: list[int]  # the spikes on the progression, oldest first
    slots: int  # slots of the progression from its first hit to its last


def regular_period(
    spikes: Iterable[int], min_hits: int, exact: bool = False, ending_at: int | None = None
) -> Period | None:
    """Of the progressions (period >= MIN_PERIOD) with at least `min_hits` spikes on distinct slots, that
    fill SLOT_SHARE of their slots and hold SPIKE_SHARE of the spikes over their span, the one with the
    most hits net of empty slots (half the period gains stray spikes but leaves about half its slots empty;
    twice the period has half the hits); the shorter period wins a tie. None if there is none. `exact`: no
    step of slack (small spikes, which healthy ranks on a busy machine also show, count only when exactly
    regular). `ending_at`: only progressions whose last hit is that spike (the one just seen: a progression
    that ended long ago was judged when its last hit came, against its peers' rate then)."""
    recent = sorted(set(spikes))[-LOOKBACK:]
    best, best_score = None, None
    # any two neighbouring hits give the period; the anchor may be a hit whose next slot was missed
    periods = sorted({b - a for i, a in enumerate(recent) for b in recent[i + 1 :] if b - a >= MIN_PERIOD})
    for anchor in recent:
        for period in periods:
            found = _progression(recent, anchor, period, min_hits, exact)
            if found is None or (ending_at is not None and found.hits[-1] != ending_at):
                continue
            score = (2 * len(found.hits) - found.slots, -found.period)
            if best_score is None or score > best_score:
                best, best_score = found, score
    return best


def _progression(spikes: list[int], anchor: int, period: int, min_hits: int, exact: bool) -> Period | None:
    # a step boundary seen a step late (periods of 10 and more); never more than 2 steps, or a long "period"
    # fits any few scattered spikes (5 in 8,000 steps of a clean run fit 1347 +- 134)
    tolerance = 0 if exact else min(period // 10, MAX_SLACK)
    slots: dict[int, int] = {}
    for s in spikes:
        if s < anchor:
            continue
        slot = round((s - anchor) / period)
        if abs(s - anchor - slot * period) <= tolerance:
            slots.setdefault(slot, s)
    if len(slots) < min_hits:
        return None
    last_slot = max(slots)
    span_end = slots[last_slot] + tolerance
    in_span = sum(1 for s in spikes if anchor <= s <= span_end)
    if len(slots) < SLOT_SHARE * (last_slot + 1) or len(slots) < SPIKE_SHARE * in_span:
        return None
    hits = [slots[k] for k in sorted(slots)]
    return Period(period=round((hits[-1] - hits[0]) / last_slot), hits=hits, slots=last_slot + 1)


# A progression counts when random spikes at the rate its peers spike at, over the last RATE_WINDOW steps,
# had at most CHANCE of making one as full among the progressions the rank's own recent spikes offer.
RATE_WINDOW = 200
CHANCE = 1e-4
# Small spikes (an exact progression) are what healthy ranks show on a busy machine, in bursts the binomial
# model underrates: at 1e-4, chance progressions of 4 small spikes named a healthy rank in 2 of ~20 clean CPU
# runs of new job shapes (chances 1e-5 and 4e-6 there); a real 10 % block every 6th step reached 5e-6 at its
# 5th occurrence and 0 at its 6th. And it is asked of the job, not of one rank: a clean 4-rank run had one healthy
# rank's 4 ms blocks fall on 4 of 5 slots of an exact 22-step progression at 2.5e-6 for that rank (its peers
# spiked at ~1.3 % of steps, rank 0 at 5 %), so the chance is multiplied by the ranks compared (1e-5 there); 219
# recorded runs replayed: that finding goes, two detections of 10 % every 6th move by one occurrence.
SMALL_CHANCE = 3e-6


def peers_rate(
    rank: int, logs: Mapping[int, Iterable[int]], step: int, first_step: int, span_start: int | None = None
) -> float:
    """The median rate (spikes per step) of the other ranks' spikes over the last RATE_WINDOW steps, or since
    `span_start` (a progression's first hit) where that is longer ago: the rate over the span it was made in."""
    start = step - RATE_WINDOW if span_start is None else min(step - RATE_WINDOW, span_start - 1)
    since = max(first_step, start)
    counts = [sum(1 for s in steps if s > since) for r, steps in logs.items() if r != rank]
    return statistics.median(counts) / max(1, step - since) if counts else 0.0


def off_rate(found: Period, spikes: Iterable[int]) -> float:
    """The rate (spikes per step) of the rank's own spikes off the progression, over the progression's span: a
    rank spiking in half the steps of a burst lines some up at any short period by chance, and its peers'
    rate, however low, does not say so."""
    hits = set(found.hits)
    first, last = found.hits[0], found.hits[-1]
    off = sum(1 for s in set(spikes) if first <= s <= last and s not in hits)
    return off / max(1, last - first + 1 - len(hits))


def intermittent_period(
    rank: int,
    logs: Mapping[int, Sequence[int]],
    min_hits: int,
    first_step: int,
    size: int,
    exact: bool = False,
    rhythm_logs: Mapping[int, Iterable[int]] | None = None,
) -> Period | None:
    """The period of the progression ending at the rank's newest spike, if spikes at random could hardly have
    made it (at its peers' rate over its span, or at its own rate off it where that is higher) and the ranks
    keeping its rhythm are a strict minority of the `size` ranks compared (C3). A peer's rhythm is looked for
    in `rhythm_logs` where given (smaller spikes too: the same delay reaches a threshold on some steps and
    not on others), else in `logs`."""
    spikes = logs[rank]
    found = regular_period(spikes, min_hits, exact=exact, ending_at=spikes[-1])
    if found is None:
        return None
    rate = max(peers_rate(rank, logs, found.hits[-1], first_step, span_start=found.hits[0]), off_rate(found, spikes))
    # small spikes: any of the `size` ranks could have lined some up by chance (see SMALL_CHANCE)
    if not beyond_chance(found, rate, min(len(spikes), LOOKBACK), exact, ranks=size if exact else 1):
        return None
    peers = logs if rhythm_logs is None else rhythm_logs
    sharing = 1 + sum(1 for r, steps in peers.items() if r != rank and shares_period(found, steps, exact))
    return found if 2 * sharing < size else None


def shares_period(found: Period, spikes: Iterable[int], exact: bool = False) -> bool:
    """Whether a peer's spikes over `found`'s span keep the same rhythm: a progression of the same period, or
    of a divisor or twice it (where every other spike of one of the two stayed under the threshold), with at
    least half as many hits as `found` has, scaled to that period (a delay near a threshold reaches it on some
    steps only), and never fewer than 3 or one short of `found`'s (a peer at another phase has its newest hit
    up to a period later), filling its slots as any progression must. Every rank of a job slow every Nth step
    in turn (each at its own phase: round-robin work, loader workers refilling) is the job's rhythm, not one
    rank's fault; judged against its peers' spike rates alone, each rank's progression was beyond chance once
    the rhythm began on all at once."""
    period = found.period
    start, end = found.hits[0] - period, found.hits[-1]
    mine = sorted({s for s in spikes if start <= s <= end})
    periods = [period, 2 * period] + [period // k for k in (2, 3) if period % k == 0 and period // k >= MIN_PERIOD]
    for p in periods:
        need = max(min(3, len(found.hits) - 1), math.ceil(len(found.hits) / 2 * period / p))
        if any(_progression(mine, anchor, p, need, exact) is not None for anchor in mine):
            return True
    return False


def beyond_chance(found: Period, rate: float, spikes_seen: int, exact: bool = False, ranks: int = 1) -> bool:
    """Whether spikes at `rate` per step, at random, could hardly have made `found`: the binomial chance of
    its hits on its slots (a slot spans the progression's slack), times the progressions `spikes_seen` spikes
    offer (an anchor and a period each), and times `ranks` (any of the ranks compared could have made it), at
    most CHANCE (SMALL_CHANCE for an exact progression of small spikes). Where healthy ranks spike now and
    then (a real job's first step at each new sequence length on CUDA: ~80 ms on the driver, every rank in
    turn, ~10 times in 60 steps), three spikes fall on some progression by chance; a rank slow every Nth
    step is named once its hits are that unlikely (among quiet peers: at once)."""
    width = 1 if exact else 1 + 2 * min(found.period // 10, MAX_SLACK)
    slot = min(1.0, rate * width)
    chance = sum(
        math.comb(found.slots, k) * slot**k * (1 - slot) ** (found.slots - k)
        for k in range(len(found.hits), found.slots + 1)
    )
    return ranks * chance * max(1, math.comb(spikes_seen, 2)) <= (SMALL_CHANCE if exact else CHANCE)
