"""Stragglers by where the step's time went: off the CPU of their own accord, or waiting for a core.

Each rank splits its step (probe/step_timing.py): wall = compute (training-thread CPU) + waiting in the
training's collectives + data loading + checkpoint writes + starved (runnable, no core) + the rest, time the
thread was off the CPU of its own accord: sleeping, blocked in I/O, on a lock, a pipe, a GIL another thread
held. A rank its peers wait for is slower in one of these parts. Compute, data and checkpoint times are
judged by straggler.py; this module judges the other two, each against the same part of its peers:

- blocked (off-CPU outside collectives): on healthy ranks it is small and steady, whatever the machine does
  (4 ranks on 2 busy cores beside a CPU hog: 8-step medians within 1 ms of each other, where compute and
  run-queue times swing by 20-60 ms), so a few milliseconds a step stand out within a few steps;
- starved (run-queue delay while working): on a shared machine it is the noisiest part of all, since the
  scheduler rotates whom it delays, so only a large share held for long is named (a rank pinned to a core
  that other work shares).

Per step, each rank's level over its last `window` steps (their median, or for the blocked part their
second-smallest value: blocked in nearly every step) is compared with the median of its peers' medians
(leave-one-out): the excess must be at least `abs_s` AND `rel` of the step's wall time AND `z` times the
class's usual spread of those medians (median absolute deviation across ranks, over the last SPREAD_STEPS
evaluations) AND stand clear of every other rank (two ranks slow together share a cause), except in the quiet
parts (blocked, data), where ranks over their peers together, a strict minority, are each named if clear of the
ranks not over (two ranks of six on a slow node or disk, each 5 ms over: both named +7..+12) AND its peers
must wait for it (its collective wait over the window is no longer than its peers' median; for the blocked
part, whose healthy values are steady, this is not asked: a rank's wait swings by tens of milliseconds a step
on a busy machine, which delayed a 4 ms straggler's verdict by 8 steps, and time blocked outside collectives
on one rank is time its peers spend waiting for it). Persistence:
flagged in `k` of the last `m` evaluations. Single steps far out (half a step's wall time, clear of the
rest) at a regular interval, `intermittent_min` times, give an intermittent straggler with its period;
smaller ones count only at an exactly regular interval.
Blocked time that comes in bursts not aligned with steps (a rank stopped 10 ms every 100 ms, a CPU quota that
throttles it once its share of a period is spent) is in no step's low order statistic and has no exact period:
it is judged on means over DUTY_WINDOW steps (duty rule): the mean excess over the peers' means at least
`abs_s`, `duty_rel` of a step and `z` times the spread of the ranks' means, clear of the rest, present in
every quarter of the window, its peers waiting for it over the window, in DUTY_RUN evaluations in a row, so
that a burst must last about 40 steps to count (a busy machine's bursts on healthy ranks last ~10).
Three or more ranks; two have no majority (straggler.py's arrival-order rule covers compute for them).

Pure logic over plain step records: no torch, no I/O.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from trainscout.consensus.leave_one_out import max_without, median, median_without
from trainscout.detectors.periodicity import LOOKBACK, beyond_chance, intermittent_period
from trainscout.findings import STRAGGLER, Finding

SPREAD_STEPS = 64
WARMUP_STEPS = 20
MAD_TO_SIGMA = 1.4826
# The duty rule: window means flagged this many evaluations in a row, each quarter of the window over its peers
# by half the threshold: a busy machine's burst on a healthy rank (~10 steps) fills at most three quarters, and a
# single spike in the fourth lasts one evaluation of the run, not all of them.
DUTY_RUN = 16
DUTY_PARTS = 4
DUTY_PART_SHARE = 0.5
# A progression of small spikes is named only where it costs its peers this share of their time on average
# (its excess over its period): a clean Hugging Face Trainer job had one rank blocked 4.5 ms of its 70 ms steps
# at steps 23, 69, 92, 115 (0.3 % of the job's time) by itself; 10 % of a step every 6th step costs 1.7 %.
SMALL_INTERMITTENT_MIN_COST = 0.005
SPIKE_LOG = 256  # each rank's spikes kept for its peers' base rate (periodicity.peers_rate)
# An intermittent finding says its peers wait for the rank: in at least this share of its progression's steps
# it waited no longer than the median of its peers (it arrived late). A healthy rank of a 4-rank job on a busy
# 2-core machine (the fault was on another rank) blocked 2.5-4 ms at steps 215, 218, 221, 224 (an exact progression
# at chance 2e-7 by its peers' rate), yet waited longer than its peers' median in two of the four: it was not the
# one they waited for.
WAITED_SHARE = 0.75
# Blocked time is steady near zero on healthy DDP ranks, but in an FSDP2 job on a busy CPU machine (11 collectives
# a step, gloo's threads competing for the cores) every rank's swings 0-30 ms from step to step: a healthy rank
# whose 6 steps happened to sit at 9-14 ms was named (2 of 5 clean 4-rank runs, one as "every 8 steps").
NOISE_STEPS = 64
NOISE_QUANTILE = 0.9  # against a level (a rank high in nearly every step of its window)


@dataclass(frozen=True)
class Part:
    """One part of the step's time and how it is judged."""

    label: str  # the finding's evidence.type
    window: int
    abs_s: float
    rel: float  # of the step's median wall time
    z: float
    k: int
    m: int
    spike_rel: float  # a single step this far over its peers (share of the wall time) is a spike
    spike_abs_s: float
    intermittent_min: int
    what: str  # how a person reads it
    arrival: bool  # also require that its peers wait for it (its collective wait is no longer than theirs)
    # smaller spikes (abs_s and rel, clear of the rest) at a regular interval, this many times (0: not judged):
    # a block of 10 % of a step every N steps stands out from healthy ranks' own spikes only by its regularity
    small_intermittent_min: int = 0
    # a rank's level over its window: its median (-1), or its `low`-th smallest value (0: its least), so that
    # only a part that is high in nearly every step of the window counts, not a burst that fills half of it
    low: int = -1
    # the duty rule (0: off): a rank's mean over this many steps, `duty_rel` of a step over its peers' means
    duty_window: int = 0
    duty_rel: float = 0.0
    # a level, or a single step, that its peers' own steps commonly reach (their NOISE_QUANTILE over their
    # last NOISE_STEPS steps) is not an outlier, however the rank's few steps compare with its peers' medians
    noise_floor: bool = False
    # several ranks over their peers together, a strict minority, each clear of the ranks not over, are each
    # named (two ranks of a slow node, two ranks reading from one slow disk); False: an outlier must stand clear
    # of every other rank. Only for parts that are quiet on healthy ranks: a busy core slows the ranks it
    # holds together, and its run-queue delays are not a fault of theirs
    minority: bool = False


# Its level is the second-smallest of its last 6 steps, not their median: on a machine with more ranks than
# cores, healthy ranks had bursts of 2-20 ms blocked in half the steps of a window for ~10 steps (5 of 35
# clean runs named one), while a rank that blocks of its own accord does so in every step.
BLOCKED = Part(
    "blocked",
    window=6,
    low=1,
    abs_s=0.002,
    rel=0.04,
    z=6.0,
    k=3,
    m=4,
    spike_rel=0.5,
    spike_abs_s=0.02,
    intermittent_min=3,
    arrival=False,
    small_intermittent_min=4,
    what="off the CPU outside collectives (sleeping, blocked in I/O, on a lock or the GIL)",
    duty_window=32,
    duty_rel=0.05,
    noise_floor=True,
    minority=True,
)
# Several ranks on one GPU compete for it: which of them waits on its host for the GPU (a synchronising copy,
# an allocation) is the GPU's scheduling, not a fault, and on the one-GPU machine with 4 ranks healthy ranks took
# turns being 2-5 ms blocked over their peers for tens of steps. Only a block of half a step is named there.
BLOCKED_SHARED_GPU = Part(
    "blocked",
    window=5,
    abs_s=0.002,
    rel=0.5,
    z=6.0,
    k=4,
    m=5,
    spike_rel=1.0,
    spike_abs_s=0.02,
    intermittent_min=3,
    arrival=False,
    what=BLOCKED.what,
)
# Time inside DataLoader iteration is steady on healthy ranks with an in-process loader (the demo's: ~0.5 ms a
# batch): a blocking read of 5 ms a batch stands out like a blocked rank. Only ranks that loaded data in a step
# are compared (a rank-0-only loader is a design choice, not a straggler).
DATA = Part(
    "data_loading",
    window=5,
    abs_s=0.002,
    rel=0.04,
    z=6.0,
    k=4,
    m=5,
    spike_rel=0.5,
    spike_abs_s=0.02,
    intermittent_min=3,
    arrival=False,
    what="loading data (inside DataLoader iteration)",
    minority=True,
)
# With worker processes (num_workers > 0) the rank waits for a worker's batch, and a worker is scheduled like
# any process: with 4 ranks and their workers on 2 busy cores, healthy ranks waited 10-46 ms in about half the
# steps of 5-10-step episodes, each rank in turn, and beside a CPU hog one rank's worker lagged 9-65 ms in 12
# steps in a row: a 5-step median named 4 healthy ranks in one 300-step run. So a rank's level is its 4th
# smallest wait of 16 steps (slow in nearly all of them, as a slow disk or a slow transform is), its peers must
# wait for it, and it must hold for 12 of the last 16 evaluations: named about 25 steps after it began.
DATA_WORKERS = Part(
    "data_loading",
    window=16,
    low=3,
    abs_s=0.002,
    rel=0.04,
    z=6.0,
    k=12,
    m=16,
    spike_rel=0.5,
    spike_abs_s=0.02,
    intermittent_min=5,
    arrival=True,
    what="waiting for DataLoader workers' batches",
)
# Healthy ranks beside a CPU hog showed 8-step medians up to 58 ms over their peers' (1.4 steps): the scheduler
# rotates whom it delays within a few tens of steps, so only a long, large excess is a starved core. One healthy
# rank beside a hog was held back 22 ms a step (29 % of it) for ~45 steps: it must last about twice that.
STARVED = Part(
    "starved",
    window=16,
    abs_s=0.01,
    rel=0.3,
    z=6.0,
    k=56,
    m=64,
    spike_rel=10.0,
    spike_abs_s=10.0,
    intermittent_min=10**6,
    arrival=True,
    what="waiting for a CPU core (runnable, not running)",
)


def blocked_s(rec) -> float | None:
    """Time off the CPU outside collectives, data loading and checkpoint writes (None: not measurable)."""
    if rec.runq_s < 0 or rec.wall_s <= 0:
        return None
    off = rec.wall_s - rec.wait_s - rec.cpu_s - rec.runq_s - rec.data_s - rec.ckpt_s
    # the probe's own thread held the GIL this long: the training thread's wait for it is trainscout's doing
    off -= min(max(off, 0.0), rec.probe_thread_s)
    # below zero is a reading error (a wait and a run-queue delay that overlap, counted twice): on a crowded
    # machine ranks read -10 ms in some steps, and a steady healthy rank beside them would look high
    return max(0.0, off)


def data_s(rec) -> float | None:
    """Time loading data in the training process itself (None: it loaded nothing there this step)."""
    own = rec.data_s - rec.data_workers_s
    return own if own > 0 else None


def worker_wait_s(rec) -> float | None:
    """Time waiting for DataLoader worker processes' batches (None: no worker's batch this step)."""
    return rec.data_workers_s if rec.data_workers_s > 0 else None


def starved_s(rec) -> float | None:
    return rec.runq_s if rec.runq_s >= 0 and rec.wall_s > 0 else None


class PartWatch:
    """Judges one part of the step's time across the ranks of a data-parallel job."""

    def __init__(self, part: Part, extract) -> None:
        self.part = part
        self.extract = extract
        self._windows: dict[int, deque] = {}
        self._waits: dict[int, deque] = {}
        self._walls: deque = deque(maxlen=part.window)
        self._spread: deque = deque(maxlen=SPREAD_STEPS)
        self._flags: dict[int, deque] = {}
        # every rank's spikes, big and small: the last LOOKBACK are searched for a period, the rest give the
        # rate its peers spike at (base rate)
        self._spike_log: dict[int, deque] = {}
        self._small_log: dict[int, deque] = {}
        self._late: dict[int, dict[int, bool]] = {}  # rank -> {its spike steps: it waited no longer than its peers}
        self._first_step = -1  # the first step judged for spikes (the base rate's window starts there at most)
        self._reported: set[tuple[int, str]] = set()
        self._duty: dict[int, deque] = {}  # (value, wait) per step over the duty window
        self._duty_spread: deque = deque(maxlen=SPREAD_STEPS)
        self._duty_run: dict[int, int] = {}
        self._recent: dict[int, deque] = {}  # each rank's last NOISE_STEPS values (noise_floor parts)
        self.trace: deque = deque(maxlen=64)  # recent evaluations that flagged someone
        self.flagged: set[int] = set()  # ranks flagged at the last step (a slow transport is then not suspected)

    def observe(self, step: int, recs: dict) -> list[Finding]:
        p = self.part
        values = {}
        for r, rec in recs.items():
            v = self.extract(rec)
            if v is not None:
                values[r] = v
        if len(values) < 3:
            return []
        walls = sorted(rec.wall_s for rec in recs.values())
        self._walls.append(walls[len(walls) // 2])
        for r, v in values.items():
            self._windows.setdefault(r, deque(maxlen=p.window)).append(v)
            self._waits.setdefault(r, deque(maxlen=p.window)).append(recs[r].wait_s)
            if p.duty_window:
                self._duty.setdefault(r, deque(maxlen=p.duty_window)).append((v, recs[r].wait_s))
            if p.noise_floor:
                self._recent.setdefault(r, deque(maxlen=NOISE_STEPS)).append(v)
        # a usual step's wall time: the spike's own step is as long for every rank (they waited for it)
        out = self._spike(step, values, median(self._walls), {r: recs[r].wait_s for r in values})
        if p.duty_window:
            out += self._judge_duty(step, set(values), median(self._walls))
        windowed = {r: median(w) for r, w in self._windows.items() if r in values and len(w) == p.window}
        # a suspect's own level may be a low order statistic (high in nearly every step); its peers' stays their
        # median: a steady rank beside peers whose values scatter both ways is not higher than they are
        own = {r: _level(self._windows[r], p.low) for r in windowed}
        if len(windowed) < 3:
            return out
        centre = median(windowed.values())
        spread = median(abs(v - centre) for v in windowed.values())
        sigma = MAD_TO_SIGMA * median(self._spread) if len(self._spread) >= p.window else 0.0
        self._spread.append(spread)
        if step <= WARMUP_STEPS or len(self._spread) < p.window:
            return out
        level = median(self._walls)
        flagged = set()
        ordered = sorted(windowed.values())  # each rank's peers are all but itself: read off one sorted copy
        waits: dict[int, float] | None = None
        threshold = max(p.abs_s, p.rel * level, p.z * max(sigma, 1e-4))
        excesses = {r: v - median_without(ordered, windowed[r]) for r, v in own.items()}
        over = {r for r, excess in excesses.items() if excess >= threshold}
        # with `minority`, the ranks over their peers together, a strict minority, are each judged against the rest
        together = over if p.minority and 1 < len(over) and 2 * len(over) < len(windowed) else set()
        slowest_rest = max(v for q, v in windowed.items() if q not in together) if together else 0.0
        for r in over:
            v, excess = own[r], excesses[r]
            slowest_other = slowest_rest if together else max_without(ordered, windowed[r])
            if v - slowest_other < excess / 2:
                continue  # not clear of the rest: ranks slow together share a cause
            if v <= self._peers_floor(r, together):
                continue  # its peers' own steps commonly reach this level
            if p.arrival:
                if waits is None:
                    waits = {q: median(self._waits[q]) for q in windowed}
                    waits_ordered = sorted(waits.values())
                if waits[r] > median_without(waits_ordered, waits[r]):
                    continue  # its peers do not wait for it
            flagged.add(r)
        self.flagged = flagged
        if flagged:
            self.trace.append((step, sorted(flagged), {r: round(v * 1e3, 2) for r, v in windowed.items()}))
        for r in windowed:
            hist = self._flags.setdefault(r, deque(maxlen=p.m))
            hist.append((step, r in flagged, own[r] - median_without(ordered, windowed[r])))
            f = self._persistent(r, hist, level)
            if f is not None:
                out.append(f)
        return out

    def _peers_recent(self, rank: int, together: set[int] | frozenset[int] = frozenset()) -> list[float]:
        """Its peers' values over their last NOISE_STEPS steps, pooled (noise_floor parts only), leaving out the
        ranks over their peers with it."""
        return [v for q, d in self._recent.items() if q != rank and q not in together for v in d]

    def _peers_floor(self, rank: int, together: set[int] | frozenset[int] = frozenset()) -> float:
        """What its peers' single steps commonly reach (0 where the part asks for no floor, or too few steps)."""
        if not self.part.noise_floor:
            return 0.0
        pooled = sorted(self._peers_recent(rank, together))
        if len(pooled) < NOISE_STEPS:
            return 0.0
        return pooled[min(len(pooled) - 1, int(NOISE_QUANTILE * len(pooled)))]

    def _peers_reaching(self, rank: int, value: float) -> float:
        """The share of its peers' recent steps at `value` or more: the rate a spike that size comes at by chance
        (the spike logs hold only spikes clear of every other rank, which a busy machine's noise seldom is)."""
        pooled = self._peers_recent(rank)
        return sum(1 for v in pooled if v >= value) / len(pooled) if pooled else 0.0

    def _persistent(self, rank: int, hist: deque, level: float) -> Finding | None:
        p = self.part
        if len(hist) < p.m or (rank, "persistent") in self._reported:
            return None
        hits = [(s, x) for s, hit, x in hist if hit]
        if len(hits) < p.k:
            return None
        self._reported.add((rank, "persistent"))
        excess = statistics.median(x for _, x in hits)
        steps = [s for s, _ in hits]
        share = excess / level if level > 0 else 0.0
        return Finding(
            kind=STRAGGLER,
            culprit_ranks=[rank],
            step=steps[-1],
            confidence=min(1.0, 0.5 + 0.1 * len(steps)),
            summary=(
                f"rank {rank} is a straggler: it spends {excess * 1e3:.1f} ms a step more than its peers "
                f"{p.what} ({share * 100:.0f}% of a step, {len(steps)} of the last {len(hist)} steps); "
                "its peers wait for it"
            ),
            evidence={
                "type": p.label,
                "excess_s": round(excess, 6),
                "share_of_step": round(share, 3),
                "ratio": round(1 + share, 3),
                "flagged_steps": steps,
                "basis": f"{p.window}-step medians of time {p.label}, statistical C3 against its peers",
            },
        )

    def _judge_duty(self, step: int, present: set[int], level: float) -> list[Finding]:
        """The duty rule (see the module's docstring): a part high on average, in bursts, not in every step."""
        p = self.part
        full = {r: w for r, w in self._duty.items() if r in present and len(w) == p.duty_window}
        if len(full) < 3:
            return []
        size = p.duty_window // DUTY_PARTS
        means, parts, waits = {}, {}, {}
        for r, w in full.items():
            values = [v for v, _ in w]
            means[r] = sum(values) / len(values)
            parts[r] = [sum(values[i * size : (i + 1) * size]) / size for i in range(DUTY_PARTS)]
            waits[r] = sum(x for _, x in w) / len(w)
        ordered = sorted(means.values())
        centre = median(ordered)
        spread = median(abs(v - centre) for v in ordered)
        sigma = MAD_TO_SIGMA * median(self._duty_spread) if len(self._duty_spread) >= p.window else 0.0
        self._duty_spread.append(spread)
        if step <= WARMUP_STEPS + p.duty_window or len(self._duty_spread) < p.window:
            return []
        parts_sorted = [sorted(v[i] for v in parts.values()) for i in range(DUTY_PARTS)]
        waits_sorted = sorted(waits.values())
        out = []
        for r, mean in means.items():
            excess = mean - median_without(ordered, mean)
            bar = max(p.abs_s, p.duty_rel * level, p.z * max(sigma, 1e-4))
            hit = (
                excess >= bar
                and mean - max_without(ordered, mean) >= excess / 2  # clear of the rest
                and all(
                    parts[r][i] - median_without(parts_sorted[i], parts[r][i]) >= DUTY_PART_SHARE * bar
                    for i in range(DUTY_PARTS)
                )
                and waits[r] <= median_without(waits_sorted, waits[r])  # its peers wait for it
            )
            run = self._duty_run[r] = self._duty_run.get(r, 0) + 1 if hit else 0
            if run < DUTY_RUN or (r, "persistent") in self._reported or (r, "intermittent") in self._reported:
                continue
            self._reported.add((r, "persistent"))
            share = excess / level if level > 0 else 0.0
            out.append(
                Finding(
                    kind=STRAGGLER,
                    culprit_ranks=[r],
                    step=step,
                    confidence=0.7,
                    summary=(
                        f"rank {r} is a straggler: it spends {excess * 1e3:.1f} ms a step more than its peers "
                        f"{p.what} on average over its last {p.duty_window} steps ({share * 100:.0f}% of a step, "
                        f"in bursts rather than every step, held for {run} steps); its peers wait for it"
                    ),
                    evidence={
                        "type": p.label,
                        "excess_s": round(excess, 6),
                        "share_of_step": round(share, 3),
                        "ratio": round(1 + share, 3),
                        "duty": True,
                        "basis": f"{p.duty_window}-step means of time {p.label}, statistical C3 against its peers",
                    },
                )
            )
        return out

    def _spike(self, step: int, values: dict[int, float], wall: float, waits: dict[int, float]) -> list[Finding]:
        p = self.part
        if step <= WARMUP_STEPS or p.intermittent_min > LOOKBACK:
            return []
        if self._first_step < 0:
            self._first_step = step - 1
        out = []
        ordered = sorted(values.values())
        waits_ordered = sorted(waits.values())
        for r, v in values.items():
            excess = v - median_without(ordered, v)
            if v - max_without(ordered, v) < excess / 2 or excess < max(p.abs_s, p.rel * wall):
                continue
            big = excess >= max(p.spike_abs_s, p.spike_rel * wall)
            self._small_log.setdefault(r, deque(maxlen=SPIKE_LOG)).append(step)
            late = self._late.setdefault(r, {})
            late[step] = waits[r] <= median_without(waits_ordered, waits[r])
            if len(late) > SPIKE_LOG:
                del late[next(iter(late))]  # the oldest: steps come in order
            if big:
                self._spike_log.setdefault(r, deque(maxlen=SPIKE_LOG)).append(step)
            if (r, "intermittent") in self._reported or (r, "persistent") in self._reported:
                continue
            found, need, log, exact = None, p.intermittent_min, self._spike_log, False
            if big:
                found = intermittent_period(r, log, need, self._first_step, len(values), rhythm_logs=self._small_log)
            if found is None and p.small_intermittent_min:
                need, log, exact = p.small_intermittent_min, self._small_log, True
                found = intermittent_period(
                    r, log, need, self._first_step, len(values), exact=True, rhythm_logs=self._small_log
                )
                if found is not None and excess < SMALL_INTERMITTENT_MIN_COST * found.period * wall:
                    found = None  # too small and too rare to cost the job anything: not a fault worth naming
            if found is None:
                continue
            if p.noise_floor and not beyond_chance(
                found, self._peers_reaching(r, v), min(len(log[r]), LOOKBACK), exact
            ):
                continue  # its peers' own steps reach this often enough to line up by chance
            if sum(late.get(s, True) for s in found.hits) < WAITED_SHARE * len(found.hits):
                continue  # not the rank its peers waited for in those steps
            self._reported.add((r, "intermittent"))
            recent = found.hits[-need:]
            out.append(
                Finding(
                    kind=STRAGGLER,
                    culprit_ranks=[r],
                    step=recent[-1],
                    confidence=0.8,
                    summary=(
                        f"rank {r} is an intermittent straggler: every {found.period} steps it spends "
                        f"{excess * 1e3:.0f} ms {p.what} (steps {', '.join(map(str, recent))}); its peers wait "
                        "for it"
                    ),
                    evidence={
                        "type": p.label,
                        "intermittent": True,
                        "period": found.period,
                        "flagged_steps": recent,
                        "excess_s": round(excess, 6),
                    },
                )
            )
        return out


def _level(window, low: int) -> float:
    return median(window) if low < 0 else sorted(window)[low]
