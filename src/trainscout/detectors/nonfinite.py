"""Non-finite origin: the rank(s) whose local loss or gradients turned NaN/Inf at the earliest step.

After a gradient all-reduce every replica holds NaN, so the origin is the minority that was non-finite
one step before the rest (or the only one). Once other replicas report a later first step, or have
passed the origin step with finite values, the origin is named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from trainscout.detectors.interface import DetectorBase, JobView, Judgement, findings_only
from trainscout.detectors.observations import RankObs, rank_list
from trainscout.findings import NONFINITE, Finding

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import NodeDigest


class NonFiniteDetector(DetectorBase):
    name = "nonfinite"

    def __init__(self, wait_s: float = 3.0) -> None:
        self.wait_s = wait_s
        self.first_seen: float | None = None
        self.done = False
        self._ranks: Mapping[int, RankObs] = {}
        self._reported = False  # some rank's digest carried a non-finite event (until then a pass walks nothing)

    def observe(self, digest: NodeDigest, now: float) -> None:
        self._reported = self._reported or any(st.nonfinite for st in digest.ranks)

    def judge(self, view: JobView) -> Judgement:
        self._ranks = view.ranks
        if not self._reported:
            return Judgement()  # a walk over every rank each pass: tens of ms at 100k ranks, for nothing
        return findings_only(self.update(view.waited_until, self._ranks))

    def close(self) -> Judgement:
        """The job ended: nothing more will come to settle the origin (peers held at its step by a loss scaler
        that skips every step never pass it), so decide on what was reported."""
        return findings_only(self.update(math.inf, self._ranks) if self._reported else [])

    def update(self, now: float, ranks: Mapping[int, RankObs]) -> list[Finding]:
        if self.done:
            return []
        first: dict[int, tuple[int, str]] = {}
        for r, o in ranks.items():
            if o.state.nonfinite:
                ev = min(o.state.nonfinite, key=lambda e: e.step)
                first[r] = (ev.step, ev.what)
        if not first:
            return []
        if self.first_seen is None:
            self.first_seen = now
        origin_step = min(s for s, _ in first.values())
        origins = sorted(r for r, (s, _) in first.items() if s == origin_step)
        others = [r for r in ranks if r not in origins]
        # the others must have shown they were finite at origin_step: a later first step, or past it
        settled = all((r in first) or ranks[r].state.step >= origin_step for r in others)
        if not settled and now - self.first_seen < self.wait_s:
            return []
        self.done = True
        later = {str(r): first[r][0] for r in others if r in first}
        evidence = {
            "origin_step": origin_step,
            "first_nonfinite": {str(r): f"{w} at step {s}" for r, (s, w) in first.items()},
            "later_ranks": later,
        }
        what = first[origins[0]][1]
        if others and len(origins) * 2 < len(ranks):
            summary = (
                f"{rank_list(origins)} turned non-finite first ({what}) at step {origin_step}, before any "
                f"reduction; {rank_list(others)} " + ("followed later" if later else "were still finite")
            )
            return [
                Finding(kind=NONFINITE, summary=summary, culprit_ranks=origins, step=origin_step, evidence=evidence)
            ]
        summary = (
            f"{rank_list(origins)} turned non-finite at the same step {origin_step} ({what}); no minority to blame"
        )
        return [
            Finding(
                kind=NONFINITE,
                status="inconclusive",
                summary=summary,
                culprit_ranks=[],
                step=origin_step,
                confidence=0.4,
                evidence=evidence,
            )
        ]
