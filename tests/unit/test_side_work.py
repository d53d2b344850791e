"""Rank 0's own work between steps is observed, not named (detectors/side_work.py), on plain step records."""

from __future__ import annotations

import random

import pytest

from trainscout.detectors.straggler import StragglerDetector
from trainscout.wire.messages import StepRecord

WORLD = (0, 1, 2, 3)


def _feed(extra, between_known=True, seed=0, steps=range(1, 160)):
    """A 4-rank job, 40 ms steps; extra(r, s) -> (seconds, "between" | "inside", "sleep" | "busy"): where a
    rank spends extra time in step s (between steps, or inside the training step) and how (off or on the CPU).
    Returns (findings, side-work observations)."""
    rng = random.Random(seed)
    det, found = StragglerDetector(), []
    for s in steps:
        added = {r: extra(r, s) for r in WORLD}
        wall = 0.040 + max(x for x, _, _ in added.values())
        for r in WORLD:
            x, where, how = added[r]
            cpu = 0.012 * (1 + rng.uniform(-0.1, 0.1)) + (x if how == "busy" else 0.0)
            runq = rng.uniform(0, 0.01)
            off = 0.0005 + (x if how == "sleep" else 0.0)
            wait = max(0.0, wall - cpu - runq - off)
            between = 0.001 * (1 + rng.uniform(-0.2, 0.2)) + (x if where == "between" else 0.0)
            rec = StepRecord(
                step=s,
                wall_s=wall,
                cpu_s=cpu,
                data_s=0.0,
                ckpt_s=0.0,
                wait_s=wait,
                runq_s=runq,
                between_s=between if between_known else -1.0,
            )
            det.add(r, [rec], 0.0)
        found += det.update(0.0, set(WORLD))
    return found, det.side_work.observations


def _every_10th(rank, where, how, seconds=0.3):
    return lambda r, s: (seconds, where, how) if r == rank and s % 10 == 0 and s > 20 else (0.0, "", "")


@pytest.mark.parametrize("how", ["sleep", "busy"])
def test_rank_0_evaluating_every_10_steps_between_steps_is_observed_not_named(how):
    found, observed = _feed(_every_10th(0, "between", how))
    assert found == []
    assert len(observed) == 1
    kind, fields = observed[0]
    assert kind == "main_rank_side_work" and fields["rank"] == 0 and 0.29 < fields["excess_s"] < 0.31
    assert "every 10 steps" in fields["summary"] and "rank 0 is an intermittent" in fields["instead_of"]


@pytest.mark.parametrize("how", ["sleep", "busy"])
def test_rank_0_slowed_inside_its_step_every_10_steps_is_named(how):
    found, observed = _feed(_every_10th(0, "inside", how))
    assert [(f.culprit_ranks, f.evidence.get("period")) for f in found] == [([0], 10)]
    assert observed == []


def test_another_rank_slow_between_steps_is_named():
    found, observed = _feed(_every_10th(2, "between", "sleep"))
    assert [(f.culprit_ranks, f.evidence.get("period")) for f in found] == [([2], 10)]
    assert observed == []


def test_rank_0_slow_between_steps_at_every_step_is_named():
    # not what evaluation or checkpoints look like: a slow optimizer-step wrapper, a hook after the step
    found, observed = _feed(lambda r, s: (0.01, "between", "sleep") if r == 0 and s > 20 else (0.0, "", ""))
    assert [(f.culprit_ranks, f.evidence["type"]) for f in found] == [([0], "blocked")]
    assert observed == []


def test_without_the_time_between_steps_nothing_is_exempted():
    found, observed = _feed(_every_10th(0, "between", "sleep"), between_known=False)
    assert [(f.culprit_ranks, f.evidence.get("period")) for f in found] == [([0], 10)]
    assert observed == []


def test_rank_0_evaluating_and_slowed_inside_its_step_is_named_for_the_slowdown():
    def both(r, s):
        if r != 0 or s <= 20:
            return (0.0, "", "")
        return (0.3, "between", "sleep") if s % 10 == 0 else (0.01, "inside", "sleep")

    found, _ = _feed(both)
    assert [f.culprit_ranks for f in found if not f.evidence.get("intermittent")] == [[0]]
