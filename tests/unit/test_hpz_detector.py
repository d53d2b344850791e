"""ZeRO++ hpZ: the detector's verdicts on plain records, the byte ranges of secondary partitions, and the
fix's version and layout guards (against the DeepSpeed installed here, when there is one)."""

from __future__ import annotations

import importlib.util
import types

import pytest

from trainscout.detectors.hpz import HpzRaceDetector, is_hpz_record, parse_record_name, record_name
from trainscout.findings import HPZ_RACE
from trainscout.probe.hpz_check import chunk_ranges
from trainscout.probe.hpz_fix import HpzFix, parse_version, version_supported
from trainscout.wire.messages import StateRecord


def rec(step: int, phase: str, param: str, owner: int, start: int, end: int, digest: int, mode: str = "event"):
    return StateRecord(step=step, tensor=record_name(phase, param, owner, mode), start=start, end=end, digest=digest)


def step_records(
    step: int,
    ranks: list[int],
    *,
    group: list[int],
    bad_owner: int | None = None,
    bad_receivers: tuple[int, ...] = (),
    mode: str = "event",
    params=("w1", "w2"),
):
    """Forward and backward records of one step: each param cut into one range per group member."""
    out: dict[int, list[StateRecord]] = {r: [] for r in ranks}
    for p_i, param in enumerate(params):
        for m, owner in enumerate(group):
            start, end = 64 * m, 64 * (m + 1)
            digest = 1000 * step + 10 * p_i + m
            for r in ranks:
                out[r].append(rec(step, "fwd", param, owner, start, end, digest, mode))
                bwd = digest + 7 if owner == bad_owner and r in bad_receivers else digest
                out[r].append(rec(step, "bwd", param, owner, start, end, bwd, mode))
    return out


def feed(det: HpzRaceDetector, per_rank: dict[int, list[StateRecord]], now: float = 0.0) -> None:
    for r, records in per_rank.items():
        det.add(r, records, now)


def test_record_names_round_trip_and_other_tensors_are_not_hpz():
    name = record_name("bwd", "blocks.0.fc1.weight", 3, "unsafe")
    assert parse_record_name(name) == ("bwd", 3, "unsafe", "blocks.0.fc1.weight")
    assert parse_record_name("gathered[0]Linear.weight") is None
    assert parse_record_name("hpz|sideways|1|event|w") is None
    assert is_hpz_record(StateRecord(step=1, tensor=name, start=0, end=4, digest=1))
    assert not is_hpz_record(StateRecord(step=1, tensor="head.weight", start=0, end=4, digest=1))


def test_clean_steps_give_no_finding():
    det = HpzRaceDetector()
    for step in (1, 2, 3):
        feed(det, step_records(step, [0, 1, 2, 3], group=[0, 1]))
    assert det.update(1.0) == []
    assert det.steps_judged == 2  # step 3 waits until some rank reports a later step (or the wait runs out)
    assert det.update(100.0) == []
    assert det.steps_judged == 3 and det.compared > 0


def test_corrupted_secondary_names_its_owner_at_its_step():
    det = HpzRaceDetector()
    feed(det, step_records(4, [0, 1], group=[0, 1]))
    feed(det, step_records(5, [0, 1], group=[0, 1], bad_owner=1, bad_receivers=(0, 1), mode="unsafe"))
    feed(det, step_records(6, [0, 1], group=[0, 1]))
    found = det.update(1.0)
    assert len(found) == 1
    f = found[0]
    assert f.kind == HPZ_RACE and f.culprit_ranks == [1] and f.step == 5
    assert f.evidence["receivers"] == [0, 1]
    assert f.evidence["params"] == ["w1", "w2"] and f.evidence["ranges_total"] == 2
    assert f.evidence["fix_mode"] == "unsafe" and "TRAINSCOUT_HPZ_FIX=event" in f.summary


def test_owner_is_named_even_when_only_one_receiver_saw_it():
    det = HpzRaceDetector()
    # two secondary groups {0,1} and {2,3}: rank 3's partition was unfilled when rank 2 gathered it
    per_rank = step_records(2, [0, 1], group=[0, 1])
    per_rank.update(step_records(2, [2, 3], group=[2, 3], bad_owner=3, bad_receivers=(2,)))
    feed(det, per_rank)
    found = det.update(100.0)
    assert [f.culprit_ranks for f in found] == [[3]]
    assert found[0].evidence["receivers"] == [2]
    assert found[0].evidence["fix_mode"] == "event"  # the fix was on: not the known race
    assert "not the known copy/all-gather race" in found[0].summary


def test_a_forward_that_disagrees_alone_is_not_blamed_on_hpz():
    """A receiver whose primary gather already differed from the majority is the all-gather check's case."""
    det = HpzRaceDetector()
    per_rank = step_records(1, [0, 1, 2], group=[0, 1, 2])
    per_rank[2] = [
        StateRecord(step=r.step, tensor=r.tensor, start=r.start, end=r.end, digest=r.digest + 1) for r in per_rank[2]
    ]  # rank 2 gathered other bytes in forward AND backward
    feed(det, per_rank)
    found = det.update(100.0)
    assert len(found) == 1 and found[0].culprit_ranks == [0, 1, 2]  # its backward differs from the primary value
    assert found[0].evidence["receivers"] == [2]


def test_steps_are_judged_in_order():
    det = HpzRaceDetector(wait_s=5.0)
    feed(det, step_records(3, [0, 1], group=[0, 1], bad_owner=0, bad_receivers=(0, 1)))
    feed(det, {0: step_records(4, [0], group=[0, 1])[0]})  # rank 1 has not reported past step 3 yet
    assert det.update(1.0) == []
    feed(det, {1: step_records(4, [1], group=[0, 1])[1]})
    found = det.update(1.5)
    assert [(f.step, f.culprit_ranks) for f in found] == [(3, [0])]


@pytest.mark.parametrize(
    "numel,elem,world,group,expected",
    [
        (8, 4, 2, 2, [(0, 0, 16), (1, 16, 32)]),
        (7, 4, 2, 2, [(0, 0, 16), (1, 16, 28)]),  # padded to 8: member 1 holds 3 real elements
        (10, 2, 4, 2, [(0, 0, 12), (1, 12, 20)]),  # 12 / 2 = 6 elements each; bf16 boundary at byte 12
        (9, 2, 2, 2, [(0, 0, 8), (1, 8, 18)]),  # boundary at byte 10 rounds down to the word at 8
        (3, 4, 8, 4, [(0, 0, 8), (1, 8, 12)]),  # members 2 and 3 hold only padding
    ],
)
def test_chunk_ranges(numel, elem, world, group, expected):
    assert chunk_ranges(numel, elem, world, group) == expected


def test_version_guard():
    assert parse_version("0.19.8") == (0, 19, 8)
    assert parse_version("0.19.8+cu130") == (0, 19, 8)
    assert parse_version("1.0") == (1, 0, 0)
    assert parse_version("dev") is None
    assert version_supported("0.19.8") and version_supported("0.14.0")
    assert not version_supported("0.13.9") and not version_supported("0.20.0") and not version_supported("?")


def test_unknown_layout_is_left_alone_with_a_message():
    said = []
    fix = HpzFix("event", said.append)
    fix.patch_partition(types.ModuleType("deepspeed.runtime.zero.partition_parameters"))  # no Init in it
    fix.patch_coordinator(types.ModuleType("deepspeed.runtime.zero.partitioned_param_coordinator"))
    assert fix.state.startswith("left-alone") and len(said) == 2
    assert all("DeepSpeed's own host stall stays" in text for text in said)


def test_bad_mode_is_refused_and_off_patches_nothing():
    with pytest.raises(ValueError):
        HpzFix("sometimes")
    fix = HpzFix("off")

    class Hooks:
        def on_import(self, name, callback):
            raise AssertionError("mode off must not hook DeepSpeed")

    fix.install(Hooks())
    assert fix.state == "left-alone: TRAINSCOUT_HPZ_FIX=off"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_installed_deepspeed_layout_is_recognised(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero import partition_parameters, partitioned_param_coordinator

    init_cls = partition_parameters.Init
    coord_cls = partitioned_param_coordinator.PartitionedParameterCoordinator
    real_sec, real_init = init_cls.__dict__["_partition_param_sec"], coord_cls.__init__
    fix = HpzFix("event")
    try:
        fix.patch_coordinator(partitioned_param_coordinator)
        fix.patch_partition(partition_parameters)
        expected = "installed" if version_supported(fix.version) else "left-alone"
        assert fix.state.startswith(expected), fix.state
        assert init_cls._partition_param_sec.__wrapped__ is real_sec
    finally:
        init_cls._partition_param_sec = real_sec
        coord_cls.__init__ = real_init
