"""Compute stragglers by where the extra time went: one phase of one rank's step, against the same phase of its peers.

A CPU job's compute is noisy per rank on a busy machine: CPU taken from a thread (by the hypervisor, a sibling
hyperthread, a context switch's cold caches) counts as the thread's own, and healthy ranks beside a CPU hog took
1.3-1.5x their peers' CPU time for ~20 steps. So the whole-step rules ask for 60 % over 8 steps, or 9-20 % over
16-64 steps, and a rank burning 10 % of a step more in one module was named 30-130 steps after it started.
That noise falls on the whole step of the rank it hits, in proportion to where the time goes; a rank that does
more work in one part of its step (a busy loop in a module's forward, a slow hook, a costly per-step check)
grows that part alone. Each rank measures the CPU time of its training forwards (the model's call to
backward's start, the loss included) beside its whole compute (probe/step_timing.py); the rest is backward and
the optimizer step. This rule names a rank whose one phase stands out from its peers' same phase while its own
balance of phases moved too:

- per step, each rank's phase time over the median of that step's ranks (what the machine does at that
  moment cancels), its median over the last `window` steps;
- the phase at least `rel` over its peers' (leave-one-out), robust z over their spread, the flagged ranks a
  strict minority, each clear of every rank not flagged;
- its phase over its other phase at least `imbalance` over the same ratio of its peers' (a rank slowed as a
  whole keeps its balance; this is what keeps a busy machine's episodes out, and why two ranks may be named
  together here: two processes on one busy core are slowed as a whole, where the whole-step rules must take
  two ranks slow together for a shared cause);
- the excess at least `abs_s` and `wall_rel` of the step's wall time, in seconds.

A single step whose one phase is SPIKE_REL over its peers' (at SPIKE_Z, the same balance and floor) is a phase
spike: straggler.py looks for a period in each rank's spikes of one phase (a busy loop every Nth step).

On CUDA steps the phases are GPU spans (events on the training stream at each forward's start and backward's
call; the compute is the span to the end of backward), less the collectives waited for inside them; straggler.py
does not judge those yet (not measured on clean CUDA jobs).
The caller (straggler.py) adds that its peers wait for it and persistence (k of the last m evaluations).
Steps whose ranks report no forward phase (-1: older probes, a model the probe does not see called) are not
judged here.

Pure logic over plain step records: no torch, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainscout.consensus import vote_against_peers
from trainscout.consensus.leave_one_out import median

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import StepRecord


@dataclass(frozen=True)
class PhaseRule:
    window: int = 6
    rel: float = 0.3
    imbalance: float = 0.3
    abs_s: float = 0.002
    wall_rel: float = 0.04
    z: float = 6.0
    k: int = 4
    m: int = 5


PHASE = PhaseRule()
# a single step's phase this far over its peers' is a spike (straggler.py looks for a period in a rank's spikes)
SPIKE_REL = 0.5
# ... at this robust z: three peers' single steps give a rough spread (a 1.9x forward read z 5.9)
SPIKE_Z = 4.0
FORWARD, REST = "forward", "backward and optimizer step"


@dataclass(frozen=True)
class PhaseFlag:
    """A rank flagged this step: which phase, its windowed ratio to its peers' and its excess in seconds."""

    phase: str
    ratio: float
    excess_s: float
    compute_ratio: float = 1.0  # its whole compute over its peers', over the same window


class PhaseWatch:
    def __init__(self, rule: PhaseRule = PHASE) -> None:
        self.rule = rule
        # rank -> recent (forward / step median, rest / step median, forward excess s, rest excess s)
        self._windows: dict[int, deque] = {}
        self.spikes: dict[int, PhaseFlag] = {}  # the last step's: one phase SPIKE_REL over its peers' that step

    def observe(self, recs: Mapping[int, StepRecord]) -> dict[int, PhaseFlag]:
        """One step's records (rank -> StepRecord): the ranks whose one phase stands out over the last `window`
        steps (and, in `spikes`, in this step alone)."""
        self.spikes = {}
        phases = {r: _phases(rec) for r, rec in recs.items()}
        if len(phases) < 3 or any(p is None for p in phases.values()):
            return {}
        fwd_mid = median([p[0] for p in phases.values()])  # type: ignore[index]
        rest_mid = median([p[1] for p in phases.values()])  # type: ignore[index]
        if fwd_mid <= 0 or rest_mid <= 0:
            return {}
        total_mid = median([p[0] + p[1] for p in phases.values()])  # type: ignore[index]
        now = {}
        for r, (fwd, rest) in phases.items():  # type: ignore[misc]
            now[r] = (fwd / fwd_mid, rest / rest_mid, fwd - fwd_mid, rest - rest_mid, (fwd + rest) / total_mid)
            w = self._windows.get(r)
            if w is None:
                w = self._windows[r] = deque(maxlen=self.rule.window)
            w.append(now[r])
        wall = median([rec.wall_s for rec in recs.values()])
        floor_s = max(self.rule.abs_s, self.rule.wall_rel * wall)
        # a single step: its value is its own, no median to steady it, so only a clear spike counts
        self.spikes = self._standouts(now, SPIKE_REL, floor_s, SPIKE_Z)
        full = {r: w for r, w in self._windows.items() if r in phases and len(w) == self.rule.window}
        if len(full) < 3:
            return {}
        levels = {r: tuple(median([x[i] for x in w]) for i in range(5)) for r, w in full.items()}
        return self._standouts(levels, self.rule.rel, floor_s)

    def _standouts(
        self, levels: dict[int, tuple], rel: float, floor_s: float, z: float | None = None
    ) -> dict[int, PhaseFlag]:
        """The ranks whose one phase is `rel` over its peers' (z, a strict minority, clear of the ranks not
        flagged), their balance of phases moved with it, by `floor_s` or more."""
        out: dict[int, PhaseFlag] = {}
        for phase, own, other in ((FORWARD, 0, 1), (REST, 1, 0)):
            values = {r: lv[own] for r, lv in levels.items()}
            verdict = vote_against_peers(values, rel_threshold=rel, abs_threshold=0.0, z_threshold=z or self.rule.z)
            if verdict.status != "attributed":
                continue
            for r in verdict.outliers:
                rest = [v for q, v in values.items() if q != r and q not in verdict.outliers]
                if values[r] < (1 + rel / 2) * max(rest):
                    continue  # not clear of every rank the vote left
                balance = levels[r][own] / max(levels[r][other], 1e-9)
                peers = median([lv[own] / max(lv[other], 1e-9) for q, lv in levels.items() if q != r])
                if balance < (1 + self.rule.imbalance) * peers:
                    continue  # slowed as a whole, in proportion: the machine's noise, or the whole-step rules'
                excess_s = levels[r][own + 2]
                if excess_s < floor_s:
                    continue
                peer_level = median(rest)
                ratio = values[r] / peer_level if peer_level > 0 else float("inf")
                if r not in out or ratio > out[r].ratio:
                    whole = median([lv[4] for q, lv in levels.items() if q != r])
                    out[r] = PhaseFlag(phase, ratio, excess_s, levels[r][4] / whole if whole > 0 else float("inf"))
        return out


def _phases(rec: StepRecord) -> tuple[float, float] | None:
    """(the forwards, the rest of the compute) of one step in the measure of its compute (CPU time, or on CUDA
    steps the GPU's span), or None where the forwards were not measured."""
    total = rec.cpu_s if rec.gpu_s == -1.0 else rec.gpu_s
    if rec.fwd_s < 0 or total <= 0:
        return None
    fwd = min(rec.fwd_s, total)  # the probe's own CPU inside a forward is taken from cpu_s only
    return fwd, total - fwd
