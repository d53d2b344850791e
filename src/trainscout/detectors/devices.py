"""GPU health as a detector: NVML readings of the GPUs the ranks run on, compared within each replica class.

Wraps detectors/device_health.py (the rules) with the job's bookkeeping: which rank's process runs on which
GPU (a reading lists the pids on its GPU) and which GPUs must behave alike (those of one replica class).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainscout.detectors.device_health import XID, DeviceHealthDetector, GpuSample
from trainscout.detectors.interface import DetectorBase, JobView, Judgement
from trainscout.findings import HEALTH, Finding

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import NodeDigest


class DeviceWatch(DetectorBase):
    name = "devices"

    def __init__(self, rules: DeviceHealthDetector | None = None) -> None:
        self.rules = rules or DeviceHealthDetector()
        self.rank_gpu: dict[int, str] = {}  # rank -> "host:gpu index" of the GPU its process runs on
        self._new = False

    def observe(self, digest: NodeDigest, now: float) -> None:
        if not digest.devices:
            return
        pid_rank = {st.pid: st.rank for st in digest.ranks}
        for reading in digest.devices:
            key = f"{digest.host}:gpu{reading.index}"
            self.rules.add(GpuSample.from_reading(key, reading), now)
            for pid in reading.pids:
                if pid in pid_rank:
                    self.rank_gpu[pid_rank[pid]] = key
        self._new = True

    def judge(self, view: JobView) -> Judgement:
        """GPUs that deviate from the GPUs of their replica class, and device error events (a program's own
        XIDs go to events.jsonl)."""
        if not self._new:
            return Judgement()
        self._new = False
        classes: dict[str, list[str]] = {}
        placed: set[str] = set()
        for r in sorted(view.live):
            gpu, group = self.rank_gpu.get(r), view.ranks[r].state.replica_group if r in view.ranks else None
            if gpu is None or group is None or gpu in placed:
                continue
            placed.add(gpu)
            classes.setdefault(group, []).append(gpu)
        out = Judgement()
        for obs in self.rules.update(list(classes.values()), view.now):
            if obs.kind == XID and obs.evidence.get("cause") == "application":
                # a kernel of some process on the GPU failed (an illegal address, a device-side assert): NVML
                # does not say whose, and on a shared GPU every job there sees it. The failing rank's own error
                # names it (its crash carries the GPU's readings, this XID among them); blaming the GPU's ranks
                # named healthy ones.
                out.events.append(("device_event", {"gpu": obs.gpu, "summary": obs.summary, **obs.evidence}))
                continue
            out.findings.append(
                Finding(
                    kind=HEALTH,
                    summary=obs.summary,
                    culprit_ranks=sorted(r for r, g in self.rank_gpu.items() if g == obs.gpu)
                    if obs.attributable
                    else [],
                    status="attributed" if obs.attributable else "inconclusive",
                    confidence=0.9 if obs.attributable else 0.4,
                    devices=[obs.gpu],
                    pg=f"device:{obs.gpu}",
                    evidence={"type": obs.kind, "gpu": obs.gpu, **obs.evidence},
                )
            )
        return out

    def gpu_of(self, rank: int) -> str | None:
        return self.rank_gpu.get(rank)

    def summary(self, gpu: str) -> str | None:
        """The GPU's recent readings in one line, to attach to another finding about it."""
        return self.rules.summary(gpu)
