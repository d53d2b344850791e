"""Stragglers from per-step durations each rank measures itself: compute, data loading, checkpoint writes.

Data-parallel ranks do the same work per step and wait for each other, so wall time per step is equal
across them; what differs is how the step was spent. Per step, a statistical C3 vote (median, relative
AND absolute thresholds, robust z) flags the slow side, in two tiers:
- fast: each rank's median over its last 8 steps, 20 % above the median of its peers (a 30 % straggler
  is named in about 10 steps);
- fine: each rank's median over its last 64 steps of its time relative to the same step's peers (the
  step-to-step swings of a shared machine cancel), 9 % above its peers in 96 of the last 128 steps (a
  straggler of 12 % or more; a busy machine's episodes of 13-17 % last up to ~100 steps).
On CPU jobs one phase of a rank's compute (its forward, or backward and the optimizer step) over its peers'
same phase, its balance of phases moved with it, is judged apart (compute_phase.py): a busy machine slows a
rank as a whole, a rank doing more work in one part of its step grows that part alone.
Each rank is judged against its peers only (leave-one-out): with 4 ranks the class median and spread
would include the slow rank itself, and any healthy rank that is fast for its own reasons. An outlier
counts only if it stands clear of every other rank (half the threshold above the slowest of the rest: two
ranks slow together share a cause), its peers wait for it (its collective wait over the window is at
most its peers' median) and, in the fast tier, it is still slow over its last 3 steps (the window's
median lags the end of an episode) and was the slowest rank, clear of the others, in at least half the
window's steps (on a shared machine the ranks take turns being slow).
Persistence turns flags into a finding (6 of the last 8 evaluations; the fine tier's 96 of 128); regularly
spaced spikes (single steps at least 1.5x the peers') give an intermittent straggler with its period
(periodicity.py: a missed or a stray spike does not hide it).
Compute is the GPU time from the step's start to the end of backward where the job runs on CUDA (all
ranks report it), else CPU time. With two ranks there is no majority: a rank whose compute is slower, over
8 steps and over the last 32, AND who waits less for the other in the gradient sync (it arrives last) is
named, at lower confidence.
Only durations measured on one clock are compared, so no cross-host clock agreement is needed.
A rank that made point-to-point calls in a step is a pipeline stage: it is compared, by all of the above, only
with the same stage of the other pipeline replicas (its replica class, or the group its stage is sharded over;
three or more), in a detector of its own, which names a stage once.
A uniformly slow job has no outlier. Rank 0's own work between steps (evaluation, logging) is observed, not
named (side_work.py). Communication stragglers are comm_straggler.py's.
"""

from __future__ import annotations

from collections.abc import Mapping

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass

from trainscout.consensus import vote_against_peers, vote_statistical
from trainscout.consensus.leave_one_out import median, middle
from trainscout.detectors.comm_straggler import CommStragglerWatch
from trainscout.detectors.compute_phase import PHASE, PhaseFlag, PhaseWatch
from trainscout.detectors.interface import DetectorBase, JobView, Judgement, LinkProbe
from trainscout.detectors.periodicity import intermittent_period
from trainscout.detectors.side_work import MainRankSideWork
from trainscout.detectors.time_split import (
    BLOCKED,
    BLOCKED_SHARED_GPU,
    DATA,
    DATA_WORKERS,
    SPIKE_LOG,
    STARVED,
    PartWatch,
    blocked_s,
    data_s,
    starved_s,
    worker_wait_s,
)
from trainscout.findings import STRAGGLER, Finding
from trainscout.markers import GPU_UNMEASURED, P2P_WAIT
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import LinkRecord, NodeDigest, StepRecord


@dataclass(frozen=True)
class Metric:
    name: str  # StepRecord field
    label: str  # finding type
    rel: float
    abs_s: float


METRICS = (
    # 60 % over the median of its peers within 8 steps: the training thread's CPU time for the same work is
    # not steady on a busy virtual machine (CPU taken by the hypervisor or a sibling counts as the thread's):
    # healthy ranks beside a CPU hog ran 1.3-1.52x their peers for ~20 steps, their peers waiting for them.
    # Smaller excesses are left to the mid (16-step) and fine (64-step) tiers, which such episodes do not fill.
    Metric("cpu_s", "compute", rel=0.6, abs_s=0.002),
    Metric("ckpt_s", "checkpoint_write", rel=0.5, abs_s=0.05),
)
# 64 steps: a healthy rank 0 ran 1.10-1.2x of its peers for ~40 steps on a loaded 2-core machine (its peers
# waiting for it) and was named by a 32-step median; any window short enough to name a 10 % straggler within
# ~40 steps names such a drift too, so the fine tier trades ~30 steps of latency for ignoring it.
# Ranks sharing one GPU compete for it, and its scheduler hands out the waiting: on the one-GPU machine with 4
# ranks a healthy rank ran 1.3x its peers' time to the end of backward for 30+ steps, another 1.45x (single
# steps 1.8x) for ~10. There the fast tier asks for 1.8x over 8 steps, and there is no mid tier ...
SHARED_GPU_COMPUTE = Metric("cpu_s", "compute", rel=0.8, abs_s=0.002)
FINE_WINDOW = 64
# ... but the scheduler's turns are episodes, tens of steps long; a rank slowed for good stays slow: there the
# fine tier (64-step medians, 96 of the last 128 evaluations) runs at 15 %. On recorded runs of 4 ranks on one
# H100 every 10 % delay in the forward (GPU-side 1.25-1.3x) was named 130-155 steps after onset, and no clean run
# was named at 10 % (demo jobs, lm_train with and without torch.compile, vision with and without SyncBatchNorm)
SHARED_GPU_FINE_REL = 0.15
TWO_RANK_WINDOW = 32  # 2 ranks: the slower one must also be slower over this many steps
TWO_RANK_REL = 0.2  # ... by this much (the 32 steps, not a higher threshold, keep busy-machine episodes out)
FINE_REL = 0.09
FINE_ABS_S = 0.001
# mid tier: 16-step medians of step-normalised compute, 20 % over the peers, 22 of the last 24 evaluations: a
# 30 % straggler in ~33 steps, while a ~20-step episode of a busy machine (its 16-step median stays over the
# threshold for about as many evaluations as the episode has steps) does not fill it
MID_WINDOW, MID_REL, MID_K, MID_M = 16, 0.2, 22, 24
PEER_Z = 5.0  # robust z of a rank's windowed value against its peers' median and MAD (leave-one-out)
# A busy machine makes one rank 13-15 % slower for a while: up to 56 steps in a row over a 1-hour clean run
# (25,000 steps) at load 18; a straggler stays slow. So the fine tier asks for 96 of the last 128 steps.
FINE_K, FINE_M = 96, 128
TWO_RANK_CONFIDENCE = 0.4
# Start-up is uneven (rank 0 sets up logging and checkpoints, first allocations, compiles): 1.36x for
# rank 0 over steps 2-14 of a healthy demo run, 1.4x for rank 2 over steps 10-16 of another (in CI, 2
# cores shared by 4 ranks and the test runner). Sustained-slowness windows are not judged before this.
WARMUP_STEPS = 20
PHASE_LOG = "compute-phase"  # the flag logs of phase spikes (compute_phase.py), one per phase
# 4 hits: at 3, phase spikes at z 4 named none of 50 clean CPU runs, but one healthy rank's burst (forward spikes
# at steps 104, 116, 118 of a 6-rank run) was a step from it, and a burst of 3 evenly spaced ones needs no more
PHASE_INTERMITTENT_MIN = 4
STILL_SLOW_STEPS = 3  # a flagged rank must still be slow over its last few steps, not only over the window
SLOWEST_SHARE = 0.5  # ... and the slowest rank, clear of every other, in at least this share of the window's steps


# A step in which a strict majority of its ranks were stopped whole (their probe threads woke this late: SIGSTOP
# of the job's process tree, a suspended job, a paused VM) is not judged: the ranks stopped inside their compute
# while the others had already entered the gradient sync look, to every rule, like the ranks their peers wait for
# (a time-sliced benchmark freezing the job every ~40 steps named one such rank an intermittent straggler in 3 of
# 8 clean runs). A rank stopped alone is not a job-wide freeze: its peers ran on, and it is judged as before.
FROZEN_S = 0.1


def frozen_together(recs: Mapping[int, StepRecord]) -> bool:
    """Whether a strict majority of the step's ranks were stopped whole for FROZEN_S or more during it."""
    return 2 * sum(1 for rec in recs.values() if rec.frozen_s >= FROZEN_S) > len(recs)


class StragglerDetector(DetectorBase):
    name = "straggler"

    def __init__(
        self,
        k: int = 6,
        m: int = 8,
        wait_s: float = 5.0,
        intermittent_min: int = 5,
        window: int = 8,
        spike_ratio: float = 1.5,
        gpu_compute: bool = True,
    ) -> None:
        self.k, self.m, self.wait_s = k, m, wait_s
        self.shared_gpu = False  # several ranks of the job compute on one GPU (the coordinator says so)
        self.gpu_compute = gpu_compute  # judge CUDA jobs by their GPU-side spans (else: not their compute)
        self.cuda_job = False  # some rank reported a CUDA step
        self.window, self.spike_ratio = window, spike_ratio
        self._windows: dict[tuple[int, str], deque] = {}
        self._recent_compute: deque = deque(maxlen=max(window, MID_WINDOW))  # recent steps' compute samples
        self._fine: dict[int, _SlidingMedian] = {}  # rank -> step-normalised compute, last FINE_WINDOW steps
        self._fine_flags: dict[int, deque] = {}
        self._mid: dict[int, _SlidingMedian] = {}
        self._mid_flags: dict[int, deque] = {}
        self.phases = PhaseWatch()  # CPU jobs: one phase of a rank's compute (forward, or the rest) over its peers'
        self._phase_flags: dict[int, deque] = {}
        self._phase_last: dict[int, PhaseFlag] = {}  # rank -> its last flag (what its finding says)
        # parts of the step's time straggler.py's metrics do not cover (time_split.py)
        self.parts = [
            PartWatch(BLOCKED, blocked_s),
            PartWatch(DATA, data_s),
            PartWatch(DATA_WORKERS, worker_wait_s),
            PartWatch(STARVED, starved_s),
        ]
        self._waits: dict[int, deque] = {}  # rank -> collective wait, last FINE_WINDOW steps (arrival order)
        self._two_ratio: deque = deque(maxlen=TWO_RANK_WINDOW)  # 2 ranks: higher rank's compute / lower rank's
        self.intermittent_min = intermittent_min
        self._pending: dict[int, dict] = {}  # step -> {"ranks": {rank: StepRecord}, "t": first seen}
        self._flags: dict[tuple[int, str], deque] = {}  # (rank, metric) -> recent (step, flagged, ratio)
        # metric -> rank -> spike steps: the last LOOKBACK searched for a period, the rest the peers' base rate
        self._flag_log: dict[str, dict[int, deque]] = {}
        self._reported: set[tuple[int, str, str]] = set()
        self.steps_evaluated = 0
        self.compute_measure = "cpu"  # "gpu" once every rank reports GPU times
        self.comm = CommStragglerWatch()
        self._class_of: dict[int, str] = {}  # rank -> its replica class (the coordinator's, at the last pass)
        self._stages: dict[str, StragglerDetector] = {}  # pipeline stages: a replica class's own detector
        self._stages_named: set[int] = set()  # stages already named a straggler (by their class's detector)
        self.one_class = False  # compare every rank given as one class (a pipeline stage's replicas)
        self.side_work = MainRankSideWork()  # rank 0's evaluation and logging between steps: observed, not named
        self.trace: deque = deque(maxlen=400)  # recent (step, metric, samples, outliers), for diagnosis
        self.frozen_steps: list[int] = []  # steps left unjudged since the last pass: the job was stopped whole

    def observe(self, digest: NodeDigest, now: float) -> None:
        for st in digest.ranks:
            if st.steps:
                self.add(st.rank, st.steps, now)
            if st.links:
                self.add_links(st.rank, st.links, now)

    def judge(self, view: JobView) -> Judgement:
        self.shared_gpu = view.shared_gpu  # ranks competing for one GPU
        out = Judgement(
            findings=self.update(
                view.now, view.live, view.members, waited_until=view.waited_until, classes=view.work_classes
            )
        )
        out.events, self.side_work.observations = self.side_work.observations, []
        if self.frozen_steps:
            out.events.append(("job_frozen", {"steps": self.frozen_steps, "not_judged": "stragglers"}))
            self.frozen_steps = []
        wanted = self.comm.take_request()
        if wanted is not None:
            pg, members, before_s, now_s = wanted

            def scheduled(request_id: int, step: int, now: float) -> None:
                self.comm.scheduled(request_id, pg, members, step, before_s, now_s, now)

            out.asks.append(LinkProbe(pg, members, before_s, now_s, scheduled))
        return out

    def close(self) -> Judgement:
        return Judgement(events=[("straggler_trace", {"steps": self.trace_rows(), "waits": "per-step"})])

    def add(self, rank: int, steps: list[StepRecord], now: float) -> None:
        for rec in steps:
            self._pending.setdefault(rec.step, {"ranks": {}, "t": now})["ranks"][rank] = rec

    def add_links(self, rank: int, links: list[LinkRecord], now: float) -> None:
        self.comm.add_links(rank, links, now)

    def update(
        self,
        now: float,
        live: set[int],
        members: Mapping[str, list[int]] | None = None,
        waited_until: float | None = None,
        classes: Mapping[str, list[int]] | None = None,
    ) -> list[Finding]:
        """Judge the steps every live rank reported (or that waited long enough, up to `waited_until`: see
        JobView.waited_until); `members`: the process groups as the coordinator knows them (None: as the ranks'
        records show them); `classes`: ranks that do the same work (JobView.work_classes): pipeline stages are compared
        within theirs."""
        if classes is not None:
            self._class_of = {r: cls for cls, ranks in classes.items() for r in ranks}
        findings: list[Finding] = []
        waited = now if waited_until is None else waited_until
        for step in sorted(self._pending):
            entry = self._pending[step]
            if not live <= set(entry["ranks"]) and waited - entry["t"] < self.wait_s:
                break  # steps are judged in order
            del self._pending[step]
            if step <= 1:
                continue  # the first step carries start-up
            if frozen_together(entry["ranks"]):
                self.frozen_steps.append(step)
                continue
            # pipeline stages (point-to-point calls in the step) do different work by design: a stage is compared
            # with the same stage of the other pipeline replicas only (its replica class)
            recs = entry["ranks"]
            if not self.one_class:
                recs = {r: rec for r, rec in recs.items() if P2P_WAIT not in rec.pg_wait}
                if len(recs) < len(entry["ranks"]):
                    findings.extend(self._judge_stages(step, entry["ranks"], now))
            if len(recs) < 2:
                continue
            self.steps_evaluated += 1
            self.side_work.note(step, recs)
            compute_flagged = False
            for metric in METRICS:
                found, flagged = self._judge(step, recs, metric)
                findings.extend(found)
                compute_flagged |= flagged and metric.label == "compute"
            self.parts[0].part = BLOCKED_SHARED_GPU if self.shared_gpu and self.cuda_job else BLOCKED
            for watch in self.parts:
                findings.extend(watch.observe(step, recs))
                compute_flagged |= bool(watch.flagged)
            self.comm.observe(step, recs, compute_flagged, now, members)
        findings.extend(self.comm.judge(now))
        return self.side_work.keep(findings)

    def _judge_stages(self, step: int, ranks: dict[int, StepRecord], now: float) -> list[Finding]:
        """Pipeline stages: each against the same stage of the other pipeline replicas (its replica class, or the
        group its stage is sharded over; three or more), by every rule above, in a detector of its own that
        compares the ranks it is given as one class. Ranks of no known class, or of a class too small for a
        majority, are not judged."""
        pools: dict[str, dict[int, StepRecord]] = {}
        for r, rec in ranks.items():
            cls = self._class_of.get(r)
            if cls is not None and P2P_WAIT in rec.pg_wait:
                pools.setdefault(cls, {})[r] = rec
        out: list[Finding] = []
        for cls, recs in pools.items():
            if len(recs) < 3:
                continue
            stage = self._stages.get(cls)
            if stage is None:
                stage = self._stages[cls] = StragglerDetector(
                    self.k, self.m, self.wait_s, self.intermittent_min, self.window, self.spike_ratio, self.gpu_compute
                )
                stage.one_class = True
            stage.shared_gpu = self.shared_gpu
            for r, rec in recs.items():
                stage.add(r, [rec], now)
            found = stage.update(now, set(recs))
            # a stage's own detector is never judged: the steps it left unjudged go into this one's event
            self.frozen_steps.extend(s for s in stage.frozen_steps if s not in self.frozen_steps)
            stage.frozen_steps.clear()
            for f in found:
                # once named, a stage is not named again for another part of its time: a 30 ms sleep a step on a
                # stage of 6 ms of compute also raised its measured CPU time 1.2x, a second finding of the same
                # rank with a secondary cause
                if not set(f.culprit_ranks) <= self._stages_named:
                    self._stages_named.update(f.culprit_ranks)
                    out.append(f)
        return out

    # ---- per step ------------------------------------------------------------------------------
    def _samples(self, recs: dict[int, StepRecord], metric: Metric) -> dict[int, float]:
        if metric.label == "compute":
            # A CUDA job's host CPU time is not its compute (the host spins in synchronising calls, and a
            # host-bound rank 0 read 1.62x its peer on a clean 2-GPU FSDP2 job): judge GPU spans or nothing.
            self.cuda_job = self.cuda_job or any(rec.gpu_s >= 0 or rec.gpu_s == GPU_UNMEASURED for rec in recs.values())
            if not self.cuda_job:
                return {r: rec.cpu_s for r, rec in recs.items() if math.isfinite(rec.cpu_s)}
            if self.gpu_compute and all(rec.gpu_s >= 0 for rec in recs.values()):
                self.compute_measure = "gpu"
                return {r: rec.gpu_s for r, rec in recs.items() if math.isfinite(rec.gpu_s)}
            return {}  # GPU compute off, or a step whose GPU time some rank could not read
        # only ranks that loaded data / wrote a checkpoint this step are comparable (a rank-0-only
        # checkpoint is a design choice, not a straggler)
        return {r: x for r, rec in recs.items() if 0 < (x := getattr(rec, metric.name)) < math.inf}

    def _judge(self, step: int, recs: dict[int, StepRecord], metric: Metric) -> tuple[list[Finding], bool]:
        samples = self._samples(recs, metric)
        shared = self.shared_gpu and metric.label == "compute" and self.compute_measure == "gpu"
        if shared:
            metric = SHARED_GPU_COMPUTE
        if len(samples) == 2 and metric.label == "compute":
            return self._judge_two(step, recs, samples, metric), False
        if len(samples) < 3:
            return [], False
        step_waits: dict[int, float] = {}
        out = []
        phase_flagged = False
        phase_spikes: set[int] = set()
        if metric.label == "compute":
            step_waits = self._note_waits(recs)
            self._recent_compute.append(samples)
            # CUDA steps carry their forwards' GPU span too; it is not judged until measured on clean CUDA jobs
            if samples and not self.cuda_job:
                found, phase_flagged = self._judge_phases(step, recs, metric)
                out.extend(found)
                phase_spikes = set(self.phases.spikes)
        # Spikes (for intermittent stragglers): one step, clearly slower than the peers of that step.
        spike_rel = max(metric.rel, self.spike_ratio - 1)
        spikes: set[int] = set()
        if _may_stand_out(samples, spike_rel):
            spike = vote_statistical(samples, rel_threshold=spike_rel, abs_threshold=metric.abs_s)
            spikes = set(spike.outliers) if spike.status == "attributed" else set()
        # Compute: each step's value over that step's median, so what the whole machine does at that
        # moment (a noisy neighbour, a hog) cancels; the absolute margin is scaled the same way.
        level = median(samples.values()) if metric.label == "compute" else 0.0
        if level > 0:
            windowed = self._windowed({r: x / level for r, x in samples.items()}, metric)
            abs_margin = metric.abs_s / level
        else:
            windowed, abs_margin = self._windowed(samples, metric), metric.abs_s
        outliers: set[int] = set()
        voted: list[int] = []
        if len(windowed) >= 3 and _may_stand_out(windowed, metric.rel):
            verdict = vote_against_peers(
                windowed, rel_threshold=metric.rel, abs_threshold=abs_margin, z_threshold=PEER_Z
            )
            outliers = set(verdict.outliers) if verdict.status == "attributed" else set()
            voted = sorted(outliers)
            if metric.label == "compute":
                outliers = self._arrive_last(_clear_of_the_rest(windowed, outliers, metric.rel / 2), self.window)
                outliers = self._slowest_in_most_steps(self._still_slow(outliers, metric), metric.rel, self.window)
        if metric.label == "compute":  # what the vote said, what arrival order kept, and this step's waits
            # (rounded when written: most steps are never read)
            self.trace.append((step, metric.label, samples, sorted(outliers), sorted(spikes), voted, step_waits))
        for r in samples:
            if r in spikes:
                self._flag_log.setdefault(metric.label, {}).setdefault(r, deque(maxlen=SPIKE_LOG)).append(step)
            if r in windowed and step > WARMUP_STEPS:
                hist = self._flags.setdefault((r, metric.label), deque(maxlen=self.m))
                hit = r in outliers  # the ratio is read only for flagged steps (_persistent)
                if _record(hist, (step, hit, _ratio_to_peers(r, windowed) if hit else 1.0)):
                    f = self._persistent(r, metric, hist, self.k, "")
                    if f is not None:
                        out.append(f)
            f = self._intermittent(r, metric, len(samples)) if r in spikes else None
            if f is None and r in phase_spikes:
                # one phase of a step far over its peers' (a busy loop in a forward every Nth step: 1.4x the
                # step's compute, under the 1.5x spike, its forward 2.4x), in a log of its own per phase: healthy
                # ranks spike so in 0.2 % of their steps (50 clean CPU runs), far rarer than whole-step spikes, and
                # a fault every Nth step is in one place, where a busy machine's burst on a healthy rank is in either
                log = f"{PHASE_LOG}:{self.phases.spikes[r].phase}"
                self._flag_log.setdefault(log, {}).setdefault(r, deque(maxlen=SPIKE_LOG)).append(step)
                f = self._intermittent(r, metric, len(samples), log, PHASE_INTERMITTENT_MIN)
            if f is not None:
                out.append(f)
        fine_outliers = False
        if shared:
            found, fine_outliers = self._judge_fine(step, samples, metric, rel=SHARED_GPU_FINE_REL)
            out.extend(found)
        elif metric.label == "compute":
            found, fine_outliers = self._judge_fine(step, samples, metric)
            out.extend(found)
            found, mid_outliers = self._judge_fine(
                step, samples, metric, MID_WINDOW, MID_REL, MID_K, MID_M, self._mid, self._mid_flags, "mid"
            )
            out.extend(found)
            fine_outliers = fine_outliers or mid_outliers
        return out, bool(outliers) or fine_outliers or phase_flagged

    def _judge_phases(self, step: int, recs: dict[int, StepRecord], metric: Metric) -> tuple[list[Finding], bool]:
        """One phase of a rank's compute (its forward, or backward and the optimizer step) over its peers' same
        phase, its balance of phases moved with it (compute_phase.py), its peers waiting for it."""
        flags = self.phases.observe(recs)
        kept = self._arrive_last(set(flags), PHASE.window)
        out: list[Finding] = []
        if step <= WARMUP_STEPS:
            return out, bool(kept)
        for r in recs:
            hit = r in kept
            if hit:
                self._phase_last[r] = flags[r]
            hist = self._phase_flags.setdefault(r, deque(maxlen=PHASE.m))
            # the finding's ratio is its whole compute over its peers' (what they wait for), as every compute
            # finding's; the phase's own ratio goes beside it
            if not _record(hist, (step, hit, flags[r].compute_ratio if hit else 1.0)):
                continue
            f = self._persistent(
                r, metric, hist, PHASE.k, f"phase: {PHASE.window}-step medians of one phase's CPU time"
            )
            if f is None:
                continue
            last = self._phase_last[r]
            f.summary = (
                f"rank {r} is a compute straggler: its {last.phase} takes {last.ratio:.2f}x the CPU time of its peers' "
                f"(+{last.excess_s * 1e3:.1f} ms a step, {f.evidence['ratio']:.2f}x its whole compute; "
                f"{len(f.evidence['flagged_steps'])} of the last {len(hist)} steps), the rest of its step as theirs; "
                "its peers wait for it"
            )
            f.evidence.update(phase=last.phase, phase_ratio=round(last.ratio, 3), excess_s=round(last.excess_s, 6))
            out.append(f)
        return out, bool(kept)

    def _windowed(self, samples: dict[int, float], metric: Metric) -> dict[int, float]:
        """Each rank's median over its last `window` steps, so per-step noise averages out."""
        windowed = {}
        for r, x in samples.items():
            w = self._windows.setdefault((r, metric.label), deque(maxlen=self.window))
            w.append(x)
            if len(w) == self.window:
                windowed[r] = median(w)
        return windowed

    def _judge_fine(
        self,
        step: int,
        samples: dict[int, float],
        metric: Metric,
        window: int = FINE_WINDOW,
        rel: float = FINE_REL,
        k: int = FINE_K,
        m: int = FINE_M,
        medians=None,
        flags=None,
        tier: str = "fine",
    ) -> tuple[list[Finding], bool]:
        """Smaller, steadier slowdowns: time relative to the same step's peers, over `window` steps (the fine
        tier, FINE_WINDOW; the mid tier, MID_WINDOW)."""
        medians = self._fine if medians is None else medians
        flags = self._fine_flags if flags is None else flags
        median_now = median(samples.values())
        if median_now <= 0:
            return [], False
        norm = {}
        for r, x in samples.items():
            w = medians.get(r)
            if w is None:
                w = medians[r] = _SlidingMedian(window)
            w.append(x / median_now)
            if w.full():
                norm[r] = w.median()
        if len(norm) < 3 or step <= WARMUP_STEPS:
            return [], False
        voted: set[int] = set()
        if _may_stand_out(norm, rel):
            verdict = vote_against_peers(
                norm, rel_threshold=rel, abs_threshold=FINE_ABS_S / median_now, z_threshold=PEER_Z
            )
            voted = set(verdict.outliers) if verdict.status == "attributed" else set()
        outliers = self._arrive_last(_clear_of_the_rest(norm, voted, rel / 2), window)
        if tier == "mid":  # an episode of a busy machine can last this long; a straggler is slow alone
            outliers = self._slowest_in_most_steps(outliers, rel, window)
        out = []
        for r in norm:
            hist = flags.setdefault(r, deque(maxlen=m))
            hit = r in outliers
            if not _record(hist, (step, hit, _ratio_to_peers(r, norm) if hit else 1.0)):
                continue
            f = self._persistent(r, metric, hist, k, f"{tier}: {window}-step medians, step-normalised")
            if f is not None:
                out.append(f)
        return out, bool(outliers)

    def _note_waits(self, recs: dict[int, StepRecord]) -> dict[int, float]:
        """Add this step's collective waits to each rank's history, and return them."""
        gpu = self.compute_measure == "gpu"
        waits = {r: rec.gpu_wait_s if gpu else rec.wait_s for r, rec in recs.items()}
        for r, x in waits.items():
            self._waits.setdefault(r, deque(maxlen=FINE_WINDOW)).append(x)
        return waits

    def _arrive_last(self, outliers: set[int], window: int) -> set[int]:
        """Keep the outliers whose peers wait for them: a compute straggler arrives last at the collectives, so
        over the same window it waits no longer than the median of its peers. Time-sharing noise on a busy
        machine inflates a rank's CPU time for a while without making it the one the others wait for."""
        if not outliers:
            return outliers
        waits = self._recent_waits(window, full_only=True)
        return _keep_against_peers(outliers, waits, lambda own, peers: own <= peers)

    def _still_slow(self, outliers: set[int], metric: Metric) -> set[int]:
        """Keep the outliers whose last STILL_SLOW_STEPS steps are still slow (median, half the threshold over
        the median of the peers' same): the 8-step median lags the end of an episode, and a healthy rank
        1.3-1.5x for 12 steps stayed flagged for 4 steps after it was back to 0.9-1.1x, enough for 6 of 8."""
        if not outliers:
            return outliers
        last = {
            r: statistics.median(list(w)[-STILL_SLOW_STEPS:])
            for (r, label), w in self._windows.items()
            if label == metric.label and len(w) >= STILL_SLOW_STEPS
        }
        return _keep_against_peers(outliers, last, lambda own, peers: own >= (1 + metric.rel / 2) * peers)

    def _slowest_in_most_steps(self, outliers: set[int], rel: float, window: int) -> set[int]:
        """Keep the outliers that were, step by step, the slowest rank, clear of every other by half the
        threshold, in at least SLOWEST_SHARE of the window's steps. On a shared machine the ranks take turns
        being slow (4 ranks on 2 cores: two slow at any moment); a healthy rank stuck in the slow pair for ~17
        steps read 1.1-1.7x its peers' median, but in most of those steps another rank was as slow. A
        straggler is the slow one step after step (on 224 recorded runs this moved two detections by a step)."""
        if not outliers:
            return outliers
        kept = set()
        recent = list(self._recent_compute)[-window:]
        for r in outliers:
            steps = [s for s in recent if r in s and len(s) > 1]
            clear = sum(1 for s in steps if s[r] >= (1 + rel / 2) * max(v for q, v in s.items() if q != r))
            if not steps or clear >= SLOWEST_SHARE * len(steps):
                kept.add(r)
        return kept

    def _recent_waits(self, window: int, full_only: bool = False, measured_only: bool = False) -> dict[int, float]:
        """Each rank's median collective wait over its last `window` steps (arrival order: the last to arrive
        waits least). full_only: only ranks with `window` steps recorded; measured_only: also none unmeasured (-1)."""
        out = {}
        for r, w in self._waits.items():
            recent = list(w)[-window:]
            if not recent or (full_only or measured_only) and len(recent) < window:
                continue
            if measured_only and min(recent) < 0:
                continue
            out[r] = statistics.median(recent)
        return out

    def _judge_two(
        self, step: int, recs: dict[int, StepRecord], samples: dict[int, float], metric: Metric
    ) -> list[Finding]:
        """Two ranks: no majority. The slower one must also be the one that waits less (arrives last)."""
        windowed = self._windowed(samples, metric)
        self._note_waits(recs)
        waits = self._recent_waits(self.window, measured_only=True)  # -1: not measured, no order to read
        lo, hi = sorted(samples)
        if samples[lo] > 0:
            self._two_ratio.append(samples[hi] / samples[lo])
        if len(windowed) < 2 or len(waits) < 2 or step <= WARMUP_STEPS:
            return []
        (fast, c_fast), (slow, c_slow) = sorted(windowed.items(), key=lambda kv: kv[1])
        ratio = c_slow / c_fast if c_fast > 0 else float("inf")
        # Without a majority one noisy episode of a shared machine must not be enough: the slower rank
        # must also be slower over the last TWO_RANK_WINDOW steps (median of the per-step ratio), so a verdict
        # needs a slowdown that lasts; a 9-step 1.36x excursion of a healthy rank (2 ranks on 2 busy
        # cores) was once named within 8 steps.
        sustained = (
            len(self._two_ratio) == TWO_RANK_WINDOW
            and statistics.median(x if slow == hi else 1 / x for x in self._two_ratio) > 1 + TWO_RANK_REL
        )
        flagged = (
            c_slow - c_fast > TWO_RANK_REL * c_fast
            and c_slow - c_fast > metric.abs_s
            and waits[slow] < waits[fast]
            and sustained
        )
        self.trace.append((step, "compute-2", windowed, [slow] if flagged else [], waits))
        out = []
        for r in windowed:
            hist = self._flags.setdefault((r, metric.label), deque(maxlen=self.m))
            if not _record(hist, (step, flagged and r == slow, ratio if r == slow else 1.0)):
                continue
            f = self._persistent(r, metric, hist, self.k, "arrival order: 2 ranks, no majority")
            if f is not None:
                f.confidence = TWO_RANK_CONFIDENCE
                f.evidence["wait_s"] = {str(k): round(v, 6) for k, v in waits.items()}
                f.summary += (
                    f"; with 2 ranks there is no majority: the evidence is arrival order (it waits "
                    f"{waits[slow] * 1e3:.1f} ms in the gradient sync, its peer {waits[fast] * 1e3:.1f} ms)"
                )
                out.append(f)
        return out

    def trace_rows(self) -> list[list]:
        """The recent judgements, values rounded, for the run's events (diagnosis of a missed or a false call)."""
        return [
            [{r: round(x, 5) for r, x in v.items()} if isinstance(v, dict) else v for v in row] for row in self.trace
        ]

    # ---- findings --------------------------------------------------------------------------------
    def _persistent(self, rank, metric, hist, k: int, basis: str) -> Finding | None:
        key = (rank, metric.label, "persistent")
        # "k of the last m" needs m evaluations: k of the first k alone is one short episode
        if len(hist) < (hist.maxlen or 0) or key in self._reported:
            return None
        flagged = [(s, ratio) for s, hit, ratio in hist if hit]
        if len(flagged) < k:
            return None
        self._reported.add(key)
        ratio = float(statistics.median([r for _, r in flagged]))
        steps = [s for s, _ in flagged]
        if metric.label == "compute":
            measure = "time to the end of backward (GPU or host)" if self.compute_measure == "gpu" else "CPU time"
            summary = (
                f"rank {rank} is a compute straggler: it needs {ratio:.2f}x the {measure} of its peers per "
                f"step (~{(ratio - 1) * 100:.0f}% slower, {len(steps)} of the last {len(hist)} steps); "
                "its peers wait for it"
            )
        else:
            measure = "wall time"
            what = "data loading" if metric.label == "data_loading" else "checkpoint writes"
            summary = (
                f"rank {rank} stalls in {what}: {ratio:.1f}x its peers' time per step "
                f"({len(steps)} of the last {len(hist)} steps); its peers wait for it"
            )
        return Finding(
            kind=STRAGGLER,
            summary=summary,
            culprit_ranks=[rank],
            step=steps[-1],
            confidence=min(1.0, 0.5 + 0.1 * len(steps)),
            evidence={
                "type": metric.label,
                "ratio": round(ratio, 3),
                "slowdown": round(ratio - 1, 3),
                "measure": measure,
                "flagged_steps": steps,
                "basis": basis or "per-step durations, statistical C3",
            },
        )

    def _intermittent(
        self, rank, metric, size: int, log: str | None = None, min_hits: int | None = None
    ) -> Finding | None:
        key = (rank, metric.label, "intermittent")
        if key in self._reported or (rank, metric.label, "persistent") in self._reported:
            return None  # a rank named slow at every step is not news when it is also slow at some
        logs = self._flag_log.get(log or metric.label, {})
        # not regular, or (nearly) every step (the persistent rule's case), or as likely by chance (periodicity.py)
        found = intermittent_period(rank, logs, min_hits or self.intermittent_min, WARMUP_STEPS, size)
        if found is None:
            return None
        self._reported.add(key)
        recent = found.hits[-self.intermittent_min :]
        return Finding(
            kind=STRAGGLER,
            culprit_ranks=[rank],
            step=recent[-1],
            confidence=0.8,
            summary=(
                f"rank {rank} is an intermittent {metric.label.replace('_', ' ')} straggler: "
                f"slow every {found.period} steps (steps {', '.join(map(str, recent))})"
            ),
            evidence={"type": metric.label, "intermittent": True, "period": found.period, "flagged_steps": recent},
        )


def _keep_against_peers(outliers: set[int], values: dict[int, float], passes) -> set[int]:
    """The outliers whose value passes `passes(own, median of the others')`; one without a value, or without
    peers to compare with, is kept (no evidence against it)."""
    kept = set()
    for r in outliers:
        peers = [v for q, v in values.items() if q != r]
        if r not in values or not peers or passes(values[r], statistics.median(peers)):
            kept.add(r)
    return kept


def _clear_of_the_rest(values: dict[int, float], outliers: set[int], gap: float) -> set[int]:
    """Keep the outliers that stand clear of every other rank: at least `gap` (relative) above the slowest of
    the rest. Two ranks slow together (two processes on one busy core) share a cause; leave-one-out would
    still put one of them 30 % over a median made of the other and two fast ranks."""
    kept = set()
    for r in outliers:
        rest = [v for q, v in values.items() if q != r and q not in outliers]
        if not rest or values[r] >= (1 + gap) * max(rest):
            kept.add(r)
    return kept


def _ratio_to_peers(rank: int, values: dict[int, float]) -> float:
    """The rank's value over the median of the others': the slowdown a person reads ("1.3x its peers")."""
    peers = statistics.median(v for r, v in values.items() if r != rank)
    return values[rank] / peers if peers > 0 else float("inf")


def _record(hist: deque, entry: tuple) -> bool:
    """Append (step, flagged, ratio); True when "k of the last m" may have changed: a flagged entry, or the
    history just filled. An unflagged entry into a full history only pushes an older one out."""
    judge = entry[1] or len(hist) == (hist.maxlen or 0) - 1
    hist.append(entry)
    return bool(judge)


def _may_stand_out(values: dict[int, float], rel: float) -> bool:
    """False when no vote with relative threshold `rel` can flag anyone, so it need not run: every member's
    centre (the class median, or its peers') is at least the smallest value, and the largest value is within
    `rel` of it. Most steps of a healthy job end here. Non-finite or non-positive values go to the vote."""
    lo, hi = min(values.values()), max(values.values())
    # a hair under the bound: at exactly (1 + rel) x, the vote's own ratio (hi / lo) can round above it
    return not (lo > 0 and hi <= (1 + rel) * lo * (1 - 1e-9))


class _SlidingMedian:
    """The last `size` values in arrival order and sorted, so a window's median costs no sort per step."""

    def __init__(self, size: int) -> None:
        self.values: deque = deque(maxlen=size)
        self.sorted: list[float] = []

    def append(self, x: float) -> None:
        if len(self.values) == self.values.maxlen:
            del self.sorted[bisect.bisect_left(self.sorted, self.values[0])]
        self.values.append(x)
        bisect.insort(self.sorted, x)

    def full(self) -> bool:
        return len(self.values) == self.values.maxlen

    def median(self) -> float:
        return middle(self.sorted)
