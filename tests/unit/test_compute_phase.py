"""The compute-phase rule on plain step records: one phase of one rank's CPU time (its forward, or backward and
the optimizer step) over its peers', its balance of phases moved with it, its peers waiting for it."""

from __future__ import annotations

import random

import pytest

from trainscout.detectors.compute_phase import FORWARD, REST, PhaseWatch
from trainscout.detectors.straggler import StragglerDetector
from trainscout.wire.messages import StepRecord

WORLD = (0, 1, 2, 3)
FWD, REST_S, WALL = 0.003, 0.007, 0.043  # the demo's 4 ranks on 2 cores: ~10 ms of compute in a 43 ms step


def _records(step, fwd, rest, waits, rng, noise):
    out = {}
    for r in WORLD:
        f, b = fwd(r, step), rest(r, step)
        out[r] = StepRecord(
            step=step,
            wall_s=WALL,
            cpu_s=(f + b) * (1 + rng.uniform(-noise, noise)),
            fwd_s=f * (1 + rng.uniform(-noise, noise)),
            data_s=0.0,
            ckpt_s=0.0,
            wait_s=waits(r, step),
            pg_wait={"0": waits(r, step)},
        )
    return out


def _feed(det, steps, fwd, rest, waits=lambda r, s: 0.02, seed=0, noise=0.1):
    rng = random.Random(seed)
    found = []
    for s in steps:
        for r, rec in _records(s, fwd, rest, waits, rng, noise).items():
            det.add(r, [rec], 0.0)
        found += [(f, s) for f in det.update(0.0, set(WORLD))]
    return found


def _waits_for(slow: int, onset: int):
    """Its peers wait for the slow rank from the onset on (it arrives last at the gradient sync)."""
    return lambda r, s: 0.001 if r == slow and s >= onset else 0.02


def test_a_busy_loop_in_one_ranks_forward_is_named_within_ten_steps():
    # 4.3 ms (10 % of the step) burnt in rank 2's forward from step 60: its forward reads ~2.4x its peers'
    fwd = lambda r, s: FWD + (0.0043 if r == 2 and s >= 60 else 0.0)  # noqa: E731
    found = _feed(StragglerDetector(), range(1, 200), fwd, lambda r, s: REST_S, _waits_for(2, 60))
    assert [(f.culprit_ranks, f.evidence["type"], f.evidence["phase"]) for f, _ in found] == [([2], "compute", FORWARD)]
    finding, step = found[0]
    assert 60 < step <= 70 and finding.evidence["phase_ratio"] > 2.0
    assert 1.3 < finding.evidence["ratio"] < 1.6  # its whole compute: 14.3 of 10 ms
    assert "forward" in finding.summary and 3.5e-3 < finding.evidence["excess_s"] < 5e-3


def test_extra_work_after_the_forward_is_named_as_that_phase():
    rest = lambda r, s: REST_S + (0.005 if r == 1 and s >= 40 else 0.0)  # noqa: E731
    found = _feed(StragglerDetector(), range(1, 200), lambda r, s: FWD, rest, _waits_for(1, 40))
    assert [(f.culprit_ranks, f.evidence["phase"]) for f, _ in found] == [([1], REST)]


def test_a_rank_slowed_as_a_whole_keeps_its_balance_and_is_not_named_by_phase():
    # a busy machine's episode: rank 3 at 1.5x in both phases for 25 steps, its peers waiting for it
    slow = lambda r, s: 1.5 if r == 3 and 80 <= s < 105 else 1.0  # noqa: E731
    watch = PhaseWatch()
    rng = random.Random(1)
    for s in range(1, 200):
        recs = _records(s, lambda r, s: FWD * slow(r, s), lambda r, s: REST_S * slow(r, s), _waits_for(3, 80), rng, 0.1)
        assert watch.observe(recs) == {}


def test_the_forward_alone_must_move_its_balance_not_only_its_level():
    # rank 0's forward 1.4x its peers' but its rest 1.4x too: no phase flag, whatever its level
    watch = PhaseWatch()
    for s in range(1, 50):
        recs = {
            r: StepRecord(
                step=s,
                wall_s=WALL,
                cpu_s=(FWD + REST_S) * (1.4 if r == 0 else 1),
                fwd_s=FWD * (1.4 if r == 0 else 1),
                data_s=0.0,
                ckpt_s=0.0,
            )
            for r in WORLD
        }
        assert watch.observe(recs) == {}


def test_two_of_six_ranks_burning_cpu_in_their_forward_are_both_named():
    six = tuple(range(6))
    watch = PhaseWatch()
    rng = random.Random(3)
    flagged: list[set] = []
    for s in range(1, 60):
        recs = {
            r: StepRecord(
                step=s,
                wall_s=WALL,
                cpu_s=(FWD + REST_S + (0.0043 if r in (1, 4) and s >= 30 else 0.0)) * (1 + rng.uniform(-0.1, 0.1)),
                fwd_s=(FWD + (0.0043 if r in (1, 4) and s >= 30 else 0.0)) * (1 + rng.uniform(-0.1, 0.1)),
                data_s=0.0,
                ckpt_s=0.0,
            )
            for r in six
        }
        flagged.append(set(watch.observe(recs)))
    assert all(f == set() for f in flagged[:29]) and all(f == {1, 4} for f in flagged[40:]), flagged


def test_two_of_six_ranks_slowed_as_a_whole_are_not_named_by_phase():
    six = tuple(range(6))
    watch = PhaseWatch()
    for s in range(1, 60):
        slow = {r: 1.6 if r in (2, 5) and s >= 30 else 1.0 for r in six}
        recs = {
            r: StepRecord(
                step=s, wall_s=WALL, cpu_s=(FWD + REST_S) * slow[r], fwd_s=FWD * slow[r], data_s=0.0, ckpt_s=0.0
            )
            for r in six
        }
        assert watch.observe(recs) == {}


def test_two_ranks_slow_together_are_not_named_by_phase():
    fwd = lambda r, s: FWD + (0.0043 if r in (1, 2) and s >= 60 else 0.0)  # noqa: E731
    found = _feed(StragglerDetector(), range(1, 120), fwd, lambda r, s: REST_S)
    assert found == []


def test_an_excess_under_the_absolute_floor_is_not_named():
    # 1 ms more forward on a 43 ms step: 2.3 % of the step, under both 2 ms and 4 % of it
    fwd = lambda r, s: 0.0008 + (0.001 if r == 2 and s >= 30 else 0.0)  # noqa: E731
    watch = PhaseWatch()
    rng = random.Random(2)
    for s in range(1, 100):
        assert watch.observe(_records(s, fwd, lambda r, s: REST_S, _waits_for(2, 30), rng, 0.05)) == {}


@pytest.mark.parametrize("seed", range(5))
def test_noisy_healthy_ranks_give_no_phase_finding(seed):
    found = _feed(StragglerDetector(), range(1, 300), lambda r, s: FWD, lambda r, s: REST_S, seed=seed, noise=0.3)
    assert found == []


def test_records_without_a_forward_phase_are_not_judged_by_it():
    watch = PhaseWatch()
    for s in range(1, 40):
        recs = {
            r: StepRecord(step=s, wall_s=WALL, cpu_s=0.01 * (3 if r == 2 else 1), data_s=0.0, ckpt_s=0.0) for r in WORLD
        }
        assert watch.observe(recs) == {}


def test_a_busy_loop_in_a_forward_every_sixth_step_is_an_intermittent_straggler():
    # 4.3 ms every 6th step: 1.4x that step's compute (under the 1.5x spike), its forward ~2.4x its peers'
    fwd = lambda r, s: FWD + (0.0043 if r == 2 and s >= 60 and s % 6 == 0 else 0.0)  # noqa: E731
    waits = lambda r, s: 0.001 if r == 2 and s >= 60 and s % 6 == 0 else 0.02  # noqa: E731
    found = _feed(StragglerDetector(), range(1, 200), fwd, lambda r, s: REST_S, waits, noise=0.05)
    assert [(f.culprit_ranks, f.evidence["type"], f.evidence.get("period")) for f, _ in found] == [([2], "compute", 6)]
    assert found[0][1] <= 60 + 6 * 4  # at its 4th occurrence (PHASE_INTERMITTENT_MIN)
