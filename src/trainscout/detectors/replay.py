"""Replay consensus: replicas that recomputed the same layer on the same input must agree bit for bit.

A replica whose output or gradient fingerprint differs from a strict majority while its parameters
match computed wrong: a suspected silent data corruption in that layer. The same rank deviating again
on a later replay of the same layer confirms a faulty device (a `health` finding). A replica whose
parameters themselves differ holds corrupted state: that is named as such and says nothing about the
device's arithmetic.
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence

from trainscout.consensus import vote_exact
from trainscout.detectors.interface import DetectorBase, JobView, Judgement, findings_only
from trainscout.findings import HEALTH, SDC, Finding
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import NodeDigest, ReplayRecord


SKIPPED = "skipped"  # a confirmation's layer that no replica could replay (all-zero records)
_TELLING = (SKIPPED, "agree", "attributed", "inconclusive")
KEEP_OUTCOMES = 1024  # the latest replays' outcomes, (step, layer) -> (status, outliers)


class ReplayDetector(DetectorBase):
    name = "replay"

    def __init__(self, wait_s: float = 5.0) -> None:
        self.wait_s = wait_s
        self._pending: dict[tuple[int, str, int], dict] = {}  # (step, layer, source rank) -> its records
        self._deviations: dict[tuple[int, str], list[int]] = {}  # (rank, layer) -> steps it deviated
        self.replays_compared = 0
        self.clean_layers: set[str] = set()
        self.outcomes: dict[tuple[int, str], tuple[str, list[int]]] = {}  # (step, layer) -> (status, outliers)

    def observe(self, digest: NodeDigest, now: float) -> None:
        for st in digest.ranks:
            if st.replays:
                self.add(st.rank, st.replays, now)

    def judge(self, view: JobView) -> Judgement:
        # At the end, a replay still waiting for its class (whose ranks have exited, so the class is empty) or for
        # wait_s is compared with the records that came: no more will (a 40-step job's last replays, which a
        # confirmation awaits, were left uncompared on a loaded machine)
        return findings_only(self.update(math.inf if view.final else view.waited_until, view.classes))

    def close(self) -> Judgement:
        return Judgement(counters={"replays_compared": self.replays_compared})

    def add(self, rank: int, records: list[ReplayRecord], now: float) -> None:
        """Records are grouped by the rank whose input was recomputed (`source`): one per group of replicas, as
        a pipeline stage's replicas replay their own layers, which another stage may name alike."""
        for rec in records:
            entry = self._pending.setdefault((rec.step, rec.layer, rec.source), {"ranks": {}, "t": now})
            entry["ranks"][rank] = (rec.output, rec.grads)
            entry.setdefault("params", {})[rank] = rec.params

    def update(self, now: float, replicas: Sequence[int] | Mapping[str, Sequence[int]]) -> list[Finding]:
        """Compare each replay once every replica reported it (or wait_s passed). `replicas`: each replica
        class's live ranks (a replay is awaited from the class of its source rank; before the classes are
        known, for wait_s), or one list of ranks for every replay."""
        findings: list[Finding] = []
        class_of: dict[int, Sequence[int]] = {}
        if isinstance(replicas, Mapping):
            class_of = {r: ranks for ranks in replicas.values() for r in ranks}
        for key in sorted(self._pending):
            step, layer, source = key
            entry = self._pending[key]
            members = class_of.get(source) if isinstance(replicas, Mapping) else replicas
            if (members is None or not all(r in entry["ranks"] for r in members)) and now - entry["t"] < self.wait_s:
                continue
            del self._pending[key]
            if all(v == (0, 0) for v in entry["ranks"].values()) and not any(entry.get("params", {}).values()):
                self.outcomes.setdefault((step, layer), (SKIPPED, []))  # no replica had the input: nothing compared
                continue
            if len(entry["ranks"]) < 2:
                continue
            self.replays_compared += 1
            verdict = vote_exact(entry["ranks"])
            self._note_outcome(step, layer, verdict.status, verdict.outliers)
            if verdict.status == "agree":
                self.clean_layers.add(layer)
                continue
            findings.extend(self._judge(verdict, entry["ranks"], entry.get("params", {}), step, layer))
        return findings

    def _note_outcome(self, step: int, layer: str, status: str, outliers) -> None:
        """What a confirmation reads of (step, layer), over every class that replayed it: the most telling
        status (inconclusive over attributed over agree) and every class's outliers."""
        before_status, before_outliers = self.outcomes.pop((step, layer), (SKIPPED, []))
        rank = max(_TELLING.index(before_status), _TELLING.index(status))
        self.outcomes[(step, layer)] = (_TELLING[rank], sorted({*before_outliers, *outliers}))
        if len(self.outcomes) > KEEP_OUTCOMES:  # a confirmation reads the one it scheduled, seconds later
            del self.outcomes[next(iter(self.outcomes))]

    def _judge(self, verdict, results, params, step: int, layer: str) -> list[Finding]:
        evidence = {
            "check": "replay",
            "layer": layer,
            "replay_step": step,
            "fingerprints": {str(r): [f"{o:016x}", f"{g:016x}"] for r, (o, g) in sorted(results.items())},
        }
        if verdict.status != "attributed":
            return [
                Finding(
                    kind=SDC,
                    status="inconclusive",
                    culprit_ranks=[],
                    step=step,
                    confidence=0.5,
                    summary=f"replicas recomputing layer {layer} at step {step} disagree and no strict "
                    "majority agrees: corruption detected, culprit unknown",
                    pg=f"replay:{layer}",
                    collective_seq=step,
                    evidence=evidence,
                )
            ]
        out: list[Finding] = []
        majority_params = {params.get(r) for r in results if r not in verdict.outliers}
        for r in verdict.outliers:
            maj_out, maj_grad = verdict.majority_value
            part = "outputs" if results[r][0] != maj_out else "gradients"
            if len(majority_params) == 1 and params.get(r) not in majority_params:
                out.append(
                    Finding(
                        kind=SDC,
                        culprit_ranks=[r],
                        step=step,
                        pg=f"state:{layer}",
                        confidence=0.9,
                        summary=(
                            f"rank {r} holds different parameters of layer {layer} than {len(results) - 1} "
                            f"replicas (replay at step {step}): replicated state corrupted"
                        ),
                        evidence={**evidence, "differs_in": "parameters", "check": "replay"},
                    )
                )
                continue
            steps = self._deviations.setdefault((r, layer), [])
            steps.append(step)
            if len(steps) == 1:
                out.append(
                    Finding(
                        kind=SDC,
                        culprit_ranks=[r],
                        step=step,
                        pg=f"replay:{layer}",
                        confidence=0.8,
                        summary=(
                            f"rank {r} computes layer {layer} wrong: its replay {part} differ from "
                            f"{len(results) - 1} replicas on the same input (step {step})"
                        ),
                        evidence={**evidence, "differs_in": part, "confirmed": False},
                    )
                )
            elif len(steps) == 2:
                out.append(
                    Finding(
                        kind=HEALTH,
                        culprit_ranks=[r],
                        step=step,
                        pg=f"replay:{layer}",
                        summary=(
                            f"rank {r}'s device is faulty: replay of layer {layer} deviated again "
                            f"(steps {steps[0]} and {steps[1]}); take it out of service"
                        ),
                        evidence={**evidence, "differs_in": part, "confirmed": True, "deviation_steps": list(steps)},
                    )
                )
        return out
