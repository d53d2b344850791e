"""The demo's verdict: its exit status says whether the injected fault was named with its kind and exact rank."""

from __future__ import annotations

import pytest

from trainscout.demo.verdict import expected_kind, judge
from trainscout.faults.spec import KINDS, parse_faults
from trainscout.findings import Finding


def _finding(kind: str, ranks: list[int], status: str = "attributed") -> Finding:
    return Finding(kind=kind, summary="", culprit_ranks=ranks, status=status)


def test_the_injected_hang_named_on_its_rank_passes_whatever_the_stopped_job_returned():
    v = judge(parse_faults("hang:rank=2:step=20"), [_finding("hang", [2])], job_exit=1)
    assert v.ok is True
    assert "PASS" in v.lines[0] and "a hang finding naming rank 2" in v.lines[0]
    assert "exit status: 1" in v.lines[-1]


@pytest.mark.parametrize(
    "findings,why",
    [
        ([], "no finding"),
        ([_finding("hang", [1])], "another rank"),
        ([_finding("hang", [1, 2])], "more ranks than the injected one"),
        ([_finding("stall", [])], "another kind"),
        ([_finding("hang", [2], status="inconclusive")], "not attributed"),
    ],
)
def test_anything_but_the_injected_kind_on_exactly_the_injected_rank_fails(findings, why):
    v = judge(parse_faults("hang:rank=2:step=20"), findings, job_exit=1)
    assert v.ok is False, why
    assert "FAIL" in v.lines[0] and "expected a hang finding naming rank 2" in v.lines[0]


def test_each_of_several_injected_faults_must_be_named():
    specs = parse_faults("crash:rank=1:step=20;desync:rank=3:step=10")
    assert judge(specs, [_finding("crash", [1]), _finding("desync", [3])], 1).ok is True
    v = judge(specs, [_finding("crash", [1])], 1)
    assert v.ok is False
    assert [line.split()[1] for line in v.lines[:2]] == ["PASS:", "FAIL:"]


def test_extra_findings_are_shown_but_do_not_fail_a_named_fault():
    v = judge(parse_faults("corrupt:rank=2:step=20"), [_finding("sdc", [2]), _finding("nonfinite", [2])], 0)
    assert v.ok is True


def test_a_clean_exit_is_an_early_exit_and_a_non_zero_one_a_crash():
    (clean,) = parse_faults("exit:rank=2:step=20")
    (failing,) = parse_faults("exit:rank=2:step=20:code=3")
    assert expected_kind(clean) == "early_exit"
    assert expected_kind(failing) == "crash"


def test_every_fault_kind_has_an_expected_finding_kind_or_a_reason_it_is_not_judged():
    from trainscout.findings import KINDS as FINDING_KINDS

    for kind in KINDS:
        (spec,) = parse_faults(f"{kind}:rank=0:step=1")
        v = judge([spec], [], 0)
        if expected_kind(spec) is None:
            assert v.ok is None and "is not judged: " in v.lines[0], kind
        else:
            assert expected_kind(spec) in FINDING_KINDS, kind
            assert v.ok is False, kind  # nothing found: the injected fault was missed


def test_a_sleeping_rank_must_be_named_as_a_straggler():
    specs = parse_faults("slow:rank=1:step=0:ms=300")
    assert judge(specs, [_finding("straggler", [1])], 0).ok is True
    v = judge(specs, [], 0)
    assert v.ok is False and "slow ms=300" in v.lines[0]


def test_no_fault_passes_only_a_clean_job_with_no_finding():
    assert judge([], [], 0).ok is True
    assert judge([], [_finding("straggler", [3])], 0).ok is False
    assert judge([], [], 1).ok is False  # the job itself failed


def test_a_uniform_slowdown_on_every_rank_must_be_clean():
    specs = parse_faults("slow:rank=all:step=0:ms=30")
    v = judge(specs, [], 0)
    assert v.ok is True and "PASS" in v.lines[0]
    assert judge(specs, [_finding("straggler", [0])], 0).ok is False


def test_other_faults_on_every_rank_are_not_judged():
    v = judge(parse_faults("crash:rank=all:step=5"), [_finding("crash", [3])], 1)
    assert v.ok is None and "no single culprit" in v.lines[0]


def test_a_pause_on_one_rank_is_a_hang_only_when_longer_than_the_hang_timeout():
    (long,) = parse_faults("pause:rank=1:step=20:seconds=10")
    (short,) = parse_faults("pause:rank=1:step=20:seconds=2")
    assert judge([long], [_finding("hang", [1])], 1, hang_timeout_s=5).ok is True
    assert judge([long], [], 0, hang_timeout_s=5).ok is False
    v = judge([short], [], 0, hang_timeout_s=5)
    assert v.ok is None and "pause seconds=2 on rank 1" in v.lines[0] and "not a hang" in v.lines[0]


@pytest.mark.parametrize(
    "fault,kind",
    [
        ("delay", "straggler"),
        ("delay:how=data:every=3", "straggler"),
        ("starve", "straggler"),
        ("gradnoise:how=activation", "sdc"),
        ("outflip:how=patch", "sdc"),
    ],
)
def test_the_drills_expect_the_finding_of_what_they_break(fault, kind):
    specs = parse_faults(f"{fault}:rank=1:step=30")
    assert expected_kind(specs[0]) == kind
    assert judge(specs, [_finding(kind, [1])], 0).ok is True
    assert judge(specs, [_finding(kind, [2])], 0).ok is False


def test_a_delay_on_every_rank_must_be_clean():
    specs = parse_faults("delay:rank=all:step=5:ms=40")
    assert judge(specs, [], 0).ok is True
    assert judge(specs, [_finding("straggler", [0])], 0).ok is False
