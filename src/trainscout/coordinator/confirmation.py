"""Triggered confirmation of numerical outliers: replay the suspect layers and hash the whole state, now.

A rank whose local loss or gradient norms left its peers' (detectors/numerics.py) is a statistical suspect.
Before its finding is emitted, every replica is asked to do two exact checks at the same step a few seconds
ahead: replay the suspect layers on identical inputs (a deviation that reproduces bit for bit is a device or
state computing wrong) and fingerprint the whole replicated state (a lasting corruption of its weights or
optimizer state). The finding then says which, or that nothing reproduced (a transient: named with the rank,
layer, statistic and step, at lower confidence). One confirmation runs at a time (the request the agents hand
to the probes is one file per node); suspects arriving meanwhile join the next one.

It reads what the exact detectors concluded at that step (detectors/replay.py `outcomes`, detectors/state.py
`step_clean` and `outliers_at`); the commands go out through the coordinator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from trainscout.detectors.numerics import LOSS_CALM_Z, NumericSuspect
from trainscout.detectors.replay import SKIPPED
from trainscout.findings import SDC, Finding
from trainscout.markers import GRAD_SYNC_LAYER

LEAD_S = 2.5  # seconds of training ahead the checks are scheduled: the request must reach every probe first
WAIT_S = 15.0  # after the scheduled step's time, how long the results may take before the finding goes out
REPLAY_ONLY_PATTERNS = ("persistent", "zero-params", "repeated-params")  # named only where reproduced
CONFIDENCE = {"reproduced": 0.95, "transient": 0.5, "unconfirmed": 0.6}


@dataclass
class Pending:
    findings: list[Finding]
    ranks: set[int]
    layers: list[str]
    step: int = -1
    request_id: int = -1
    deadline: float = 0.0
    replay: bool = True


@dataclass
class Confirmations:
    replay_layers: list[str] = field(default_factory=list)  # what the probes can replay (empty: replay off)
    current: Pending | None = None
    queued: Pending | None = None
    scheduled: int = 0

    def add(self, suspect: NumericSuspect, finding: Finding) -> None:
        """A suspect's finding waits for the next confirmation (merged with any other waiting)."""
        layers = self._layers_for(suspect)
        if self.queued is None:
            self.queued = Pending([finding], {suspect.rank}, layers)
        else:
            self.queued.findings.append(finding)
            self.queued.ranks.add(suspect.rank)
            self.queued.layers = [n for n in self.replay_layers if n in set(self.queued.layers) | set(layers)]

    def _layers_for(self, s: NumericSuspect) -> list[str]:
        """Every replayable layer: a layer computing wrong changes the gradients of the layers around it (a
        block scaled x3 showed only in its successor's norm), so the deviating norms do not say which one;
        a confirmation is rare and replays each once."""
        return list(self.replay_layers)

    def next_request(self, step: int | None, request_id: int, now: float, step_s: float) -> str | None:
        """Start the queued confirmation at `step` if none runs: the JSON payload for the agents, or None."""
        if self.current is not None or self.queued is None or step is None:
            return None
        p, self.queued = self.queued, None
        p.step, p.request_id = step, request_id
        p.replay = bool(self.replay_layers)
        p.deadline = now + LEAD_S + WAIT_S + max(0.0, step_s) * 4
        self.current = p
        self.scheduled += 1
        return json.dumps({"id": request_id, "step": step, "layers": p.layers, "state": True})

    def resolve(self, now: float, replay_outcomes: dict, state_clean: dict, state_outliers: dict) -> list[Finding]:
        """The waiting findings, completed, once the checks at the scheduled step were compared (or their
        time ran out); [] while they are still awaited."""
        p = self.current
        if p is None:
            return []
        outcomes = {layer: replay_outcomes.get((p.step, layer)) for layer in p.layers} if p.replay else {}
        state_done = p.step in state_clean
        if not (state_done and all(v is not None for v in outcomes.values())) and now < p.deadline:
            return []
        # a layer no replica could replay at that step (not called there) says nothing either way
        replayed = {layer: v for layer, v in outcomes.items() if v is None or v[0] != SKIPPED}
        self.current = None
        out = []
        for f in p.findings:
            rank = f.culprit_ranks[0]
            deviated = sorted(layer for layer, v in replayed.items() if v is not None and rank in v[1])
            state_bad = rank in state_outliers.get(p.step, set())
            checked = [
                f"replay of {', '.join(sorted(layer for layer, v in replayed.items() if v is not None))}"
                if any(v is not None for v in replayed.values())
                else "",
                "the whole replicated state" if state_done else "",
            ]
            checked_text = " and ".join(c for c in checked if c) or "nothing (no result came back)"
            if deviated or state_bad:
                outcome = "reproduced"
                what = []
                if deviated:
                    what.append(
                        f"replaying {', '.join(deviated)} on the same input gives different results on rank {rank}"
                    )
                if state_bad:
                    what.append(f"rank {rank}'s replicated state differs from its replicas'")
                text = f"confirmed at step {p.step}: " + "; ".join(what)
            elif state_done or any(v is not None for v in replayed.values()):
                outcome = "transient"
                text = (
                    f"not reproduced at step {p.step} ({checked_text} agree with the replicas): a transient "
                    "fault, or one outside what replay recomputes"
                )
            else:
                outcome = "unconfirmed"
                text = "no confirmation came back (replay off, or the job stopped first)"
            f.evidence["confirmation"] = {
                "outcome": outcome,
                "step": p.step,
                "layers_replayed": p.layers,
                "layers_deviating": deviated,
                "state_differs": state_bad,
            }
            f.confidence = CONFIDENCE[outcome]
            f.summary += f"; {text}"
            out.append(f)
        return out

    def abandon(self) -> list[Finding]:
        """At the end of the run: whatever still waits goes out as it is."""
        out = []
        for p in (self.current, self.queued):
            if p is None:
                continue
            for f in p.findings:
                f.evidence.setdefault("confirmation", {"outcome": "unconfirmed"})
                f.confidence = CONFIDENCE["unconfirmed"]
                f.summary += "; not confirmed (the run ended first)"
                out.append(f)
        self.current = self.queued = None
        return out


def without_replicas(f: Finding) -> Finding:
    """A suspect of a sharded job's shard group: no replica holds its state or can replay its layers, so it is
    named at once, at the confidence of an unconfirmed finding."""
    f.evidence["confirmation"] = {"outcome": "unconfirmed", "reason": "sharded: no replica to confirm against"}
    f.confidence = CONFIDENCE["unconfirmed"]
    f.summary += "; not confirmed: in a sharded job no replica holds its state or can replay its layers"
    return f


def _gradient_of(layer: str) -> str:
    """What the statistic measured: a layer's local gradient, or a bucket as it entered its reduction."""
    if layer.startswith(GRAD_SYNC_LAYER):
        return f"its gradient bucket {layer[len(GRAD_SYNC_LAYER) :]} as it entered the data-parallel reduction"
    return f"its local gradient of {layer}"


def numeric_finding(s: NumericSuspect) -> Finding:
    """The statistical finding a suspect becomes (completed by a confirmation)."""
    peers = "replicas" if s.confirmable else "data-parallel peers"  # a sharded job's shard group has no replica
    if s.statistic == "loss":
        what = (
            f"its local loss is {s.ratio:.2f}x its peers' median (robust z {s.z:+.1f}) in "
            f"{len(s.steps)} of the last steps"
        )
    elif s.pattern == "spike":
        calm = (
            "its loss agreed with theirs"
            if s.loss_z < LOSS_CALM_Z
            else f"its other layers' gradients agreed with theirs (its loss z {s.loss_z:+.1f}: not a hard batch)"
        )
        what = (
            f"{_gradient_of(s.layer)} was {s.ratio:.3g}x its peers' (robust z {s.z:+.1f}) at step "
            f"{s.step}, before the reduction, while {calm}"
        )
    elif s.pattern == "biased":
        side = "above" if s.ratio > 1 else "below"
        stat = "its local loss" if s.statistic == "loss" else f"the norm of {_gradient_of(s.layer)}"
        what = (
            f"{stat} is {side} its peers' median in {len(s.steps)} of the last steps, by {s.ratio:.3g}x in the "
            f"middle (robust z {s.z:+.1f} now: small against its batches' spread, but never on the other side)"
        )
    elif s.pattern == "zero-params":
        what = (
            f"{s.count} parameter(s) of {s.layer} have a local gradient of exactly 0 in {len(s.steps)} steps in a "
            "row, before the reduction, where a majority of its peers' have not (nor had its own before)"
        )
    elif s.pattern == "repeated-params":
        what = (
            f"the local gradient of {s.count} parameter(s) of {s.layer} at step {s.step} is bit for bit the one of "
            "its step before (a stale gradient), before the reduction, where a majority of its peers' is not"
        )
    elif s.pattern == "zero":
        what = (
            f"{_gradient_of(s.layer)} is exactly 0 in {len(s.steps)} steps in a row, before the reduction, where "
            "none of its peers' is (nor was its own before)"
        )
    else:
        what = (
            f"the norm of {_gradient_of(s.layer)} is {s.ratio:.3g}x its peers' (robust z {s.z:+.1f}) in "
            f"{len(s.steps)} of the last steps, before the reduction"
        )
    return Finding(
        kind=SDC,
        culprit_ranks=[s.rank],
        step=s.step,
        pg=f"numeric:{s.statistic}:{s.layer}",
        collective_seq=s.step if s.pattern == "spike" else None,
        summary=f"rank {s.rank} computes different numbers than its {peers}: {what}",
        evidence={
            "check": f"numeric_{s.statistic}",
            "statistic": s.statistic,
            "pattern": s.pattern,
            "layer": s.layer,
            "ratio": round(s.ratio, 4),
            "z": round(s.z, 2),
            "flagged_steps": s.steps,
            "layers": s.layers,
            "loss_z": round(s.loss_z, 2),
            **({"parameters": s.count} if s.count else {}),
            **({"coupled": True} if s.coupled else {}),
        },
    )


def is_observation(f: Finding) -> bool:
    """A persistent gradient-norm deviation that neither replay nor the state check reproduced is logged, not
    named: a rank's batches alone move its norms away from its peers' for a few steps (1.8x and 2.2x in 4 of
    5 steps, twice in a 1-hour clean run), while a device computing wrong reproduces, and a forward gone
    wrong also moves the loss (judged on its own). A rank coupled to others (tensor- or pipeline-parallel) is
    named only where replay reproduced the deviation on it: otherwise the deviation may be any of its model
    replica's ranks' (a flip on one pipeline stage moved the next stage's loss). A biased rank (loss or norm on
    one side of its peers' in nearly every step, by little) is named only where reproduced. Odd parameters (one gradient
    exactly 0, or repeating its step before) are named only where replay reproduced them too: a mixture of experts'
    router leaves an expert of a rank without a gradient now and then."""
    reproduced = f.evidence.get("confirmation", {}).get("outcome") == "reproduced"
    if f.evidence.get("coupled"):
        return not reproduced
    pattern = f.evidence.get("pattern")
    if pattern == "biased":  # a rank's own data biases its loss and norms too
        return not reproduced
    return f.evidence.get("statistic") == "grad_norm" and pattern in REPLAY_ONLY_PATTERNS and not reproduced
