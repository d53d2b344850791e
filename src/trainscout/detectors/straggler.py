"""Stragglers from per-step durations each rank measures itself: compute, data loading, checkpoint writes.

Data-parallel ranks do the same work per step and wait for each other, so wall time per step is equal
across them; what differs is how the step was spent. Per step, a statistical C3 vote (median, relative
AND absolute thresholds, robust z) over the ranks' CPU time, data-loading time and checkpoint-write
time, on each rank's median over its last 8 steps (per-step noise averages out), flags the slow side;
persistence (6 of the last 8 evaluations) turns flags into a finding, and regularly
spaced spikes (single steps at least 1.5x the peers') into an intermittent straggler with its period. Only durations measured on one clock are
compared, so no cross-host clock agreement is needed. A uniformly slow job has no outlier.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from trainscout.consensus import vote_statistical
from trainscout.findings import STRAGGLER, Finding
from trainscout.wire.messages import StepRecord


@dataclass(frozen=True)
class Metric:
    name: str  # StepRecord field
    label: str  # finding type
    rel: float
    abs_s: float


METRICS = (
    # 30 %: healthy ranks on heavily oversubscribed cores showed persistent CPU-per-step differences up to
    # ~15-20 % for the same work; a straggler finding must not come from machine noise
    Metric("cpu_s", "compute", rel=0.3, abs_s=0.005),
    Metric("data_s", "data_loading", rel=0.5, abs_s=0.02),
    Metric("ckpt_s", "checkpoint_write", rel=0.5, abs_s=0.05),
)


class StragglerDetector:
    def __init__(self, k: int = 6, m: int = 8, wait_s: float = 5.0, intermittent_min: int = 5,
                 window: int = 8, spike_ratio: float = 1.5) -> None:
        self.k, self.m, self.wait_s = k, m, wait_s
        self.window, self.spike_ratio = window, spike_ratio
        self._windows: dict[tuple[int, str], deque] = {}
        self.intermittent_min = intermittent_min
        self._pending: dict[int, dict] = {}  # step -> {"ranks": {rank: StepRecord}, "t": first seen}
        self._flags: dict[tuple[int, str], deque] = {}  # (rank, metric) -> recent (step, flagged, ratio)
        self._flag_steps: dict[tuple[int, str], list[int]] = {}
        self._reported: set[tuple[int, str, str]] = set()
        self.steps_evaluated = 0
        self.trace: deque = deque(maxlen=400)  # recent (step, metric, samples, outliers), for diagnosis

    def add(self, rank: int, steps: list[StepRecord], now: float) -> None:
        for rec in steps:
            self._pending.setdefault(rec.step, {"ranks": {}, "t": now})["ranks"][rank] = rec

    def update(self, now: float, live: set[int]) -> list[Finding]:
        findings: list[Finding] = []
        for step in sorted(self._pending):
            entry = self._pending[step]
            if not live <= set(entry["ranks"]) and now - entry["t"] < self.wait_s:
                break  # steps are judged in order
            del self._pending[step]
            if step <= 1 or len(entry["ranks"]) < 3:
                continue  # the first step carries start-up; fewer than 3 ranks cannot attribute
            self.steps_evaluated += 1
            for metric in METRICS:
                findings.extend(self._judge(step, entry["ranks"], metric))
        return findings

    def _judge(self, step: int, recs: dict[int, StepRecord], metric: Metric) -> list[Finding]:
        samples = {r: getattr(rec, metric.name) for r, rec in recs.items()}
        if metric.label != "compute":
            # only ranks that loaded data / wrote a checkpoint this step are comparable (a rank-0-only
            # checkpoint is a design choice, not a straggler)
            samples = {r: x for r, x in samples.items() if x > 0}
            if len(samples) < 3:
                return []
        out = []
        # Spikes (for intermittent stragglers): one step, clearly slower than the peers of that step.
        spike = vote_statistical(samples, rel_threshold=max(metric.rel, self.spike_ratio - 1), abs_threshold=metric.abs_s)
        spikes = set(spike.outliers) if spike.status == "attributed" else set()
        # Sustained slowness: each rank's median over its last `window` steps, so per-step noise averages out.
        windowed = {}
        for r, x in samples.items():
            w = self._windows.setdefault((r, metric.label), deque(maxlen=self.window))
            w.append(x)
            if len(w) == self.window:
                windowed[r] = statistics.median(w)
        outliers: set[int] = set()
        median = 0.0
        if len(windowed) >= 3:
            verdict = vote_statistical(windowed, rel_threshold=metric.rel, abs_threshold=metric.abs_s)
            outliers = set(verdict.outliers) if verdict.status == "attributed" else set()
            median = statistics.median(windowed.values())
        self.trace.append((step, metric.label, {r: round(x, 5) for r, x in samples.items()}, sorted(outliers),
                           sorted(spikes)))
        for r in samples:
            if r in spikes:
                self._flag_steps.setdefault((r, metric.label), []).append(step)
            if r in windowed:
                hist = self._flags.setdefault((r, metric.label), deque(maxlen=self.m))
                ratio = windowed[r] / median if median > 0 else float("inf")
                hist.append((step, r in outliers, ratio))
                f = self._persistent(r, metric, hist, recs)
                if f is not None:
                    out.append(f)
            f = self._intermittent(r, metric, recs)
            if f is not None:
                out.append(f)
        return out

    def _persistent(self, rank, metric, hist, recs) -> Finding | None:
        flagged = [(s, ratio) for s, hit, ratio in hist if hit]
        key = (rank, metric.label, "persistent")
        if len(flagged) < self.k or key in self._reported:
            return None
        self._reported.add(key)
        ratio = float(np.median([r for _, r in flagged]))
        steps = [s for s, _ in flagged]
        if metric.label == "compute":
            summary = (f"rank {rank} is a compute straggler: it needs {ratio:.2f}x the CPU time of its peers per "
                       f"step (~{(ratio - 1) * 100:.0f}% slower, {len(steps)} of the last {len(hist)} steps); "
                       "its peers wait for it")
        else:
            what = "data loading" if metric.label == "data_loading" else "checkpoint writes"
            summary = (f"rank {rank} stalls in {what}: {ratio:.1f}x its peers' time per step "
                       f"({len(steps)} of the last {len(hist)} steps); its peers wait for it")
        return Finding(kind=STRAGGLER, summary=summary, culprit_ranks=[rank], step=steps[-1],
                       confidence=min(1.0, 0.5 + 0.1 * len(steps)),
                       evidence={"type": metric.label, "ratio": round(ratio, 3), "slowdown": round(ratio - 1, 3),
                                 "flagged_steps": steps, "basis": "per-step durations, statistical C3"})

    def _intermittent(self, rank, metric, recs) -> Finding | None:
        steps = self._flag_steps.get((rank, metric.label), [])
        key = (rank, metric.label, "intermittent")
        if len(steps) < self.intermittent_min or key in self._reported:
            return None
        gaps = np.diff(steps[-self.intermittent_min:])
        period = int(np.median(gaps))
        if period < 3 or np.any(np.abs(gaps - period) > period // 5):
            return None  # not regular, or (nearly) every step: the persistent rule covers that
        self._reported.add(key)
        recent = steps[-self.intermittent_min:]
        return Finding(kind=STRAGGLER, culprit_ranks=[rank], step=recent[-1], confidence=0.8,
                       summary=(f"rank {rank} is an intermittent {metric.label.replace('_', ' ')} straggler: "
                                f"slow every {period} steps (steps {', '.join(map(str, recent))})"),
                       evidence={"type": metric.label, "intermittent": True, "period": period,
                                 "flagged_steps": recent})
