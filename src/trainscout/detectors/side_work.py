"""Work the job's main rank does between steps every N steps: a script's choice, not a fault.

Scripts evaluate, log and save on rank 0 only, every N steps, between an optimizer step and the next forward,
and the other ranks wait for it in the next gradient sync: rank 0 reads as an intermittent straggler, though
nothing is wrong with it. Each rank reports the time between its optimizer step and its next training forward,
less data loading, checkpoint writes, collective waits and the probe's own checks (StepRecord.between_s). An
intermittent straggler finding on the main rank whose flagged steps are explained by that time (in most of
them it exceeds its peers' by MIN_S, and over them its median excess is at least half of the median time its
peers waited for it) is an observation, not a finding.

What it costs: a fault that slows rank 0 every N steps between steps only (nothing in forward, backward, data
loading or the optimizer step) is not named on rank 0; on any other rank it is, and so is one that slows rank 0
between steps at every step. A rank starved of CPU, a slow device or a delay inside the training step slows
the step itself and stays named on rank 0 too.

Pure logic over plain step records: no torch, no I/O.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from trainscout.findings import STRAGGLER, Finding

MAIN_RANK = 0
KEEP_STEPS = 4096  # steps remembered: an intermittent finding's flagged steps span up to ~12 periods
SHARE = 0.5  # the main rank's time between steps over its peers' covers at least this much of their wait
MIN_S = 0.002  # ... and exceeds theirs by at least this much (healthy ranks differ by ~1 ms between steps)
EXPLAINED_SHARE = 0.75  # ... in at least this share of the finding's flagged steps (those with records)
MIN_STEPS = 3  # ... and at least this many steps had records


class MainRankSideWork:
    """Remembers, per step, how much longer the main rank spent between steps than its peers, and how much
    longer its peers waited; decides whether a straggler finding on the main rank is that."""

    def __init__(self) -> None:
        self._excess: dict[int, tuple[float, float]] = {}  # step -> (between-steps excess, peers' extra wait)
        self._order: deque = deque()
        self.observations: list[tuple[str, dict[str, Any]]] = []  # events for events.jsonl, taken by the caller

    def note(self, step: int, recs: dict) -> None:
        main = recs.get(MAIN_RANK)
        if main is None or main.between_s < 0:
            return
        peers = [rec for r, rec in recs.items() if r != MAIN_RANK and rec.between_s >= 0]
        if not peers:
            return
        between = main.between_s - statistics.median(rec.between_s for rec in peers)
        waited = statistics.median(rec.wait_s for rec in peers) - main.wait_s
        if all(rec.gpu_wait_s >= 0 for rec in (main, *peers)):  # CUDA: the GPU waits where the host may not
            waited = max(waited, statistics.median(rec.gpu_wait_s for rec in peers) - main.gpu_wait_s)
        if step not in self._excess:
            self._order.append(step)
            if len(self._order) > KEEP_STEPS:
                self._excess.pop(self._order.popleft(), None)
        self._excess[step] = (between, waited)

    def keep(self, findings: list[Finding]) -> list[Finding]:
        """The findings to emit; a straggler finding explained by the main rank's side work becomes an
        observation (self.observations)."""
        kept = []
        for f in findings:
            seen = self._explained(f)
            if seen is None:
                kept.append(f)
                continue
            explained, excess_s = seen
            where = f"every {f.evidence.get('period')} steps"
            self.observations.append(
                (
                    "main_rank_side_work",
                    {
                        "rank": MAIN_RANK,
                        "type": f.evidence.get("type"),
                        "steps": f.evidence.get("flagged_steps"),
                        "excess_s": round(excess_s, 6),
                        "explained_steps": explained,
                        "summary": (
                            f"rank {MAIN_RANK} spends {excess_s * 1e3:.0f} ms more than its peers between steps "
                            f"(after the optimizer step, before the next training forward) {where}, and its "
                            "peers wait for it: work of the job's main rank outside training (evaluation, "
                            "logging, saving), not named as a fault"
                        ),
                        "instead_of": f.summary,
                    },
                )
            )
        return kept

    def _explained(self, f: Finding) -> tuple[int, float] | None:
        """(explained flagged steps, median between-steps excess) when the finding is the main rank's side work."""
        # intermittent only: evaluation, checkpoints and periodic logging come every N steps; a healthy script's
        # per-step work on rank 0 (a printed loss) is far below a straggler's threshold, and a rank 0 slowed
        # between steps at every step (a slow optimizer-step wrapper, a hook after the step) is named
        if f.kind != STRAGGLER or f.culprit_ranks != [MAIN_RANK] or not f.evidence.get("intermittent"):
            return None
        known = [self._excess[s] for s in f.evidence.get("flagged_steps") or () if s in self._excess]
        if len(known) < MIN_STEPS:
            return None
        explained = [b for b, _ in known if b >= MIN_S]
        if len(explained) < EXPLAINED_SHARE * len(known):
            return None
        # medians over the steps: a wait swings by several ms a step on a busy machine
        if statistics.median(b for b, _ in known) < SHARE * statistics.median(w for _, w in known):
            return None
        return len(explained), statistics.median(explained)
