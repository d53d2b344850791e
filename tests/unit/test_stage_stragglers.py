"""Pipeline stages are judged against the same stage of the other pipeline replicas (detectors/straggler.py)."""

from __future__ import annotations

import random

import pytest

from trainscout.detectors.straggler import StragglerDetector
from trainscout.markers import ASYNC_WAIT, P2P_WAIT
from trainscout.wire.messages import StepRecord

# 2 stages x 3 data-parallel replicas, as a 6-rank torchrun places them (stage = rank % 2)
CLASSES = {"dp-stage0": [0, 2, 4], "dp-stage1": [1, 3, 5]}
WORLD = set(range(6))


def _feed(slow=lambda r, s: 0.0, *, busy=lambda r, s: 0.0, seed=0, steps=200, classes=CLASSES, stage0_off=0.004):
    """A busy machine: 130 ms steps, ~30 ms of compute, run-queue delays of 0-30 ms rotating between ranks, the
    rest waiting in sends and receives (bubbles) and the stage's gradient all-reduce. Stage 0 is off the CPU
    `stage0_off` a step of its own accord, stage 1 nearly never; `slow` adds a rank's own time off the CPU,
    `busy` its own compute."""
    rng = random.Random(seed)
    det, found = StragglerDetector(), []
    for s in range(1, steps):
        extra = {r: slow(r, s) for r in WORLD}
        wall = 0.130 + max(extra[r] + busy(r, s) for r in WORLD)
        for r in sorted(WORLD):
            cpu = 0.030 * (1 + rng.uniform(-0.1, 0.1)) + busy(r, s)
            runq = rng.uniform(0, 0.03)
            off = (stage0_off if r % 2 == 0 else 0.0) + rng.uniform(0, 0.002) + extra[r]
            if rng.random() < 0.02:
                off += rng.uniform(0.005, 0.03)  # a healthy spike (GC, the GIL held by another thread)
            wait = max(0.0, wall - cpu - runq - off)
            rec = StepRecord(
                step=s,
                wall_s=wall,
                cpu_s=cpu,
                data_s=0.0,
                ckpt_s=0.0,
                wait_s=wait,
                runq_s=runq,
                pg_wait={P2P_WAIT: 0.0, ASYNC_WAIT: wait},
            )
            det.add(r, [rec], 0.0)
        found += det.update(0.0, WORLD, classes=classes)
    return found


@pytest.mark.parametrize("seed", range(4))
def test_healthy_stages_give_nothing(seed):
    assert _feed(seed=seed) == []


def test_a_stage_whose_own_work_differs_from_the_other_stage_is_not_named():
    # stage 0 waits for its bubbles off the CPU 60 ms a step more than stage 1 (unmeasured waits): by design
    assert _feed(stage0_off=0.060) == []


@pytest.mark.parametrize("rank", [2, 5])
def test_a_stage_blocked_in_its_forward_is_named_against_its_replicas(rank):
    found = _feed(lambda r, s: 0.015 if r == rank and s >= 60 else 0.0)

    assert [(f.kind, f.culprit_ranks, f.evidence["type"]) for f in found] == [("straggler", [rank], "blocked")]
    assert 60 <= found[0].step <= 70


def test_a_stage_with_more_compute_is_named_against_its_replicas():
    found = _feed(busy=lambda r, s: 0.030 if r == 4 and s >= 60 else 0.0)

    assert [(f.kind, f.culprit_ranks, f.evidence["type"]) for f in found] == [("straggler", [4], "compute")]
    assert 60 <= found[0].step <= 75


def test_a_stage_slow_in_two_ways_is_named_once():
    found = _feed(
        lambda r, s: 0.015 if r == 4 and s >= 60 else 0.0, busy=lambda r, s: 0.030 if r == 4 and s >= 60 else 0.0
    )

    assert [(f.kind, f.culprit_ranks) for f in found] == [("straggler", [4])]


def test_stages_without_replicas_are_not_compared():
    # one pipeline replica: each stage is alone in its class, and the two stages do different work
    classes = {"a": [0], "b": [1], "c": [2], "d": [3], "e": [4], "f": [5]}
    assert _feed(lambda r, s: 0.015 if r == 2 and s >= 60 else 0.0, classes=classes) == []


def test_without_replica_classes_stages_are_not_judged():
    assert _feed(lambda r, s: 0.015 if r == 2 and s >= 60 else 0.0, classes={}) == []


def test_work_classes_are_replica_classes_and_for_sharded_ranks_their_shard_group():
    from test_detectors import obs, pg

    from trainscout.detectors.interface import JobView

    def shard(name, members):
        group = pg(1, name=name, members=members)
        group.role = "shard"
        return group

    # ranks 0-3: two pipeline stages sharded by FSDP2 over {0, 2} and {1, 3}; 4 and 5: DDP replicas; 6: neither
    ranks = {r: obs(r, [pg(1, members=range(7)), shard(f"s{r % 2}", [r % 2, r % 2 + 2])]) for r in range(4)}
    ranks |= {r: obs(r, [pg(1, members=range(7))]) for r in (4, 5, 6)}
    view = JobView(now=1.0, ranks=ranks, seen=ranks, live=set(ranks), members={}, classes={"ddp": [4, 5]})

    assert view.work_classes == {"ddp": [4, 5], "shard:s0": [0, 2], "shard:s1": [1, 3]}
