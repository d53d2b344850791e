"""Replicated-state consensus: replicas must hold bit-identical parameters and optimizer state.

Each probe fingerprints the same byte range of the same tensor at the same step (a shared rotation);
the coordinator collects the fingerprints per (step, tensor, range) and, once every replica reported
(or a deadline passed), votes (C3 exact). A replica whose fingerprint differs from a strict majority
holds corrupted state: silent data corruption, named with the tensor and the step it was seen at.
"""

from __future__ import annotations

from trainscout.consensus import vote_exact
from trainscout.detectors.hpz import is_hpz_record
from trainscout.detectors.interface import DetectorBase, JobView, Judgement, findings_only
from trainscout.detectors.observations import rank_list
from trainscout.findings import SDC, Finding
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import NodeDigest, StateRecord

# Compared steps whose outcome is kept (what a checkpoint's trust and a confirmation read): a job compares a
# slot at every stride-th step, and keeping them all grew the coordinator by ~3 MiB an hour (a 1-hour soak) and
# its once-a-second trust pass with them. Forgetting older steps only ever claims less: a rotation of more
# slots than this is never verified (the budget's rotations have about 63; TRAINSCOUT_STATE_PERIOD is capped
# at this), and the steps kept all follow any dirty step forgotten.
HISTORY_STEPS = 4096


class ReplicaStateDetector(DetectorBase):
    name = "state"

    def __init__(self, wait_s: float = 5.0, keep_steps: int = 64) -> None:
        self.wait_s = wait_s
        self.keep_steps = keep_steps
        self._pending: dict[tuple, dict] = {}  # (group, step, tensor, start, end) -> {"ranks": {r: h}, "t": first}
        self._blamed: set[tuple[int, ...]] = set()
        self._named: dict[str, set[int]] = {}  # group -> ranks a strict majority of it named
        self.compared = 0
        self.max_step = 0
        self.step_clean: dict[int, bool] = {}  # step -> every range compared at that step agreed
        self.outliers_at: dict[int, set[int]] = {}  # step -> ranks a strict majority named at that step

    def observe(self, digest: NodeDigest, now: float) -> None:
        for st in digest.ranks:
            if st.state:  # the hpZ check's forward/backward weights are the hpZ detector's
                self.add(st.rank, st.replica_group, [r for r in st.state if not is_hpz_record(r)], now)

    def judge(self, view: JobView) -> Judgement:
        return findings_only(self.update(view.waited_until, dict(view.members), view.live))

    def close(self) -> Judgement:
        return Judgement(counters={"state_ranges_compared": self.compared})

    def add(self, rank: int, group: str | None, records: list[StateRecord], now: float) -> None:
        for rec in records:
            g = rec.group or group
            if not g:
                continue  # no known class of equal holders
            key = (g, rec.step, rec.tensor, rec.start, rec.end)
            entry = self._pending.setdefault(key, {"ranks": {}, "t": now})
            entry["ranks"][rank] = rec.digest
            self.max_step = max(self.max_step, rec.step)

    def _forget_old(self) -> None:
        """Keep the outcomes of the last HISTORY_STEPS compared steps (dropped in batches of a quarter)."""
        if len(self.step_clean) <= HISTORY_STEPS + HISTORY_STEPS // 4:
            return
        cutoff = sorted(self.step_clean)[-HISTORY_STEPS]
        self.step_clean = {s: c for s, c in self.step_clean.items() if s >= cutoff}
        self.outliers_at = {s: r for s, r in self.outliers_at.items() if s >= cutoff}

    def update(self, now: float, members_of: dict[str, list[int]], live: set[int]) -> list[Finding]:
        findings: list[Finding] = []
        for key in sorted(self._pending, key=lambda k: k[1]):
            group, step, tensor, start, end = key
            entry = self._pending[key]
            members = [m for m in members_of.get(group, []) if m in live or m in entry["ranks"]]
            complete = members and all(m in entry["ranks"] for m in members)
            if not complete and now - entry["t"] < self.wait_s and step > self.max_step - self.keep_steps:
                continue
            del self._pending[key]
            if len(entry["ranks"]) < 2:
                continue
            self.compared += 1
            verdict = vote_exact(entry["ranks"])
            if _check_of(tensor) == "replicated_state":
                self.step_clean[step] = self.step_clean.get(step, True) and verdict.status == "agree"
                self._forget_old()
            if verdict.status == "agree":
                continue
            if verdict.status != "attributed" and not complete and len(members) >= 3:
                # replicas settle on their own strides, so some steps are hashed by part of the class only: two
                # of four that differ say nothing of who is wrong (the one already named, most often); the step
                # is not clean, and a step the whole class hashed will tell
                continue
            if verdict.status != "attributed" and self._named.get(group, set()) & set(entry["ranks"]):
                # a replica already named stays different: with one peer left to compare it with (the others have
                # exited at the job's end), a disagreement with no majority says nothing new
                continue
            if verdict.status == "attributed":
                self.outliers_at.setdefault(step, set()).update(verdict.outliers)
                self._named.setdefault(group, set()).update(verdict.outliers)
            finding = self._finding(verdict, entry["ranks"], group, step, tensor, start, end)
            blame = tuple(finding.culprit_ranks) or tuple(sorted(entry["ranks"]))
            if blame in self._blamed:
                continue  # corrupted state stays corrupted: one finding per culprit set
            self._blamed.add(blame)
            findings.append(finding)
        return findings

    def _finding(self, verdict, digests, group, step, tensor, start, end) -> Finding:
        where = f"{tensor!r} bytes {start}-{end}"
        evidence = {
            "tensor": tensor,
            "byte_range": [start, end],
            "replica_group": group,
            "fingerprints": {str(r): f"{h:016x}" for r, h in sorted(digests.items())},
        }
        if verdict.status == "attributed":
            culprits = list(verdict.outliers)
            majority = ",".join(str(r) for r in sorted(digests) if r not in culprits)
            summary = (
                f"{rank_list(culprits)} holds different {where} than replicas {majority} "
                f"after step {step}: replicated state corrupted on {rank_list(culprits)}"
            )
            if _check_of(tensor) == "all_gather":
                summary = (
                    f"{rank_list(culprits)} received a different gathered {where} than ranks {majority} "
                    f"at step {step}: all-gather receivers disagree"
                )
            return Finding(
                kind=SDC,
                summary=summary,
                culprit_ranks=culprits,
                step=step,
                pg=group,
                evidence={**evidence, "check": _check_of(tensor)},
            )
        summary = (
            f"replicas disagree on {where} after step {step} and no strict majority agrees "
            f"({len(digests)} replicas): corruption detected, culprit unknown"
        )
        return Finding(
            kind=SDC,
            status="inconclusive",
            summary=summary,
            culprit_ranks=[],
            step=step,
            pg=group,
            confidence=0.5,
            evidence={**evidence, "check": _check_of(tensor)},
        )


def _check_of(tensor: str) -> str:
    return "all_gather" if tensor.startswith("gathered[") else "replicated_state"


def verified_window(step_clean: dict[int, bool], slots: int) -> tuple[int, int]:
    """(S, first): S is the largest compared step such that the clean steps since the last dirty one, up to
    S, visited every one of `slots` slots (step s checks slot s mod slots); `first` is the oldest of those
    slot checks, so the state is verified as of S by checks made at steps >= first. (-1, -1) if none."""
    if slots <= 0:
        return -1, -1
    best = (-1, -1)
    last_clean: dict[int, int] = {}  # slot -> latest clean step since the last dirty step
    for step in sorted(step_clean):
        if not step_clean[step]:
            last_clean.clear()
            continue
        last_clean[step % slots] = step
        if len(last_clean) == slots:
            best = (step, min(last_clean.values()))
    return best


def verified_step(step_clean: dict[int, bool], slots: int) -> int:
    """Largest step S as of which every slot was compared clean since the last disagreement (-1 if none)."""
    return verified_window(step_clean, slots)[0]
