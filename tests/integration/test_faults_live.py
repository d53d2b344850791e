"""Each injected fault is named live, with the exact culprit rank, in a real 4-rank gloo DDP job.

`trainscout demo` runs the unmodified demo script under torchrun with one fault injected through the
environment; the demo stops the job once a hang, desync or early exit is found. The tests read
findings.jsonl as a user would and check kind, culprit, status and the collective that was named.
"""

from __future__ import annotations

import pytest

from conftest import of_kind, run_demo

pytestmark = pytest.mark.slow

WORLD = (0, 1, 2, 3)
# torchrun exits 1 when any worker failed, which includes workers stopped by the demo's abort.
FAILED_JOB_EXIT = 1


def _assert_demo_passed(result) -> None:
    """The demo's own status is its verdict (the fault was named); the stopped job's status is printed."""
    assert result.returncode == 0, result.describe()
    assert "trainscout: demo PASS: injected " in result.output, result.describe()
    assert f"the training job's exit status: {FAILED_JOB_EXIT}" in result.output, result.describe()


def _only(result, kind: str) -> dict:
    """The job's single finding, which must be of this kind (no noise from the consequences)."""
    assert [f["kind"] for f in result.findings] == [kind], result.describe()
    return result.findings[0]


def _assert_attributed(finding: dict, culprit: int, result) -> None:
    assert finding["status"] == "attributed", result.describe()
    assert finding["culprit_ranks"] == [culprit], result.describe()
    assert finding["hosts"], result.describe()
    assert len(finding["pids"]) == 1 and finding["pids"][0] > 0, result.describe()


def _assert_named_collective(finding: dict, result) -> int:
    seq = finding["collective_seq"]
    assert finding["pg"] == "0", result.describe()
    assert isinstance(seq, int) and seq > 0, result.describe()
    assert f"#{seq}" in finding["summary"], result.describe()
    return seq


def test_hang_names_the_rank_that_never_entered_the_collective(demo_hang):
    # the session's demo job, rank 2 hung at step 20 (a hang of rank 1 is named live in test_outputs.py, and
    # `python -m benchmarks latency faults` repeats hangs for their latency)
    result, rank, step = demo_hang, 2, 20

    _assert_demo_passed(result)
    f = _only(result, "hang")
    _assert_attributed(f, rank, result)
    assert f["step"] == step, result.describe()
    seq = _assert_named_collective(f, result)
    assert f["collective"] == "all_reduce", result.describe()
    ev = f["evidence"]
    others = [r for r in WORLD if r != rank]
    # every fault-free rank waits in exactly the collective named; the culprit stopped just before it
    assert sorted(ev["waiting_ranks"]) == others, result.describe()
    assert ev["positions"] == {str(rank): {"0": seq - 1}}, result.describe()
    assert ev["quiet_s"] >= 5.0, result.describe()
    assert "starved_ranks" not in ev, result.describe()  # it sleeps with the GIL free: not starved
    assert list(f["stacks"]) == [str(rank)], result.describe()
    stack = f["stacks"][str(rank)]
    assert "_fire" in stack and "inject" in stack, stack
    assert "train" in stack, stack  # the training loop that called the optimizer step


def test_findings_jsonl_lines_carry_status_and_schema_version(demo_hang):
    """A JSON reader of findings.jsonl (jq, a dashboard) must see the status and the schema version."""
    result = demo_hang
    assert len(result.raw_findings) == 1, result.describe()
    raw = result.raw_findings[0]
    for key in ("kind", "culprit_ranks", "status", "schema", "step", "pg", "collective_seq", "evidence"):
        assert key in raw, f"findings.jsonl line lacks {key!r}: {sorted(raw)}"
    assert raw["status"] == "attributed"


def test_gil_holding_rank_is_named_and_marked_starved(tmp_path):
    result = run_demo(tmp_path, "gil", fault="gil", rank=3, step=20, steps=100)

    _assert_demo_passed(result)
    f = _only(result, "hang")
    _assert_attributed(f, 3, result)
    seq = _assert_named_collective(f, result)
    ev = f["evidence"]
    assert ev["starved_ranks"] == [3], result.describe()
    assert sorted(ev["waiting_ranks"]) == [0, 1, 2], result.describe()
    # the culprit's last published position: behind the majority (its probe thread is starved of the
    # GIL, so a C++-issued collective it entered just before spinning may never have been published)
    assert list(ev["positions"]) == ["3"] and 0 < ev["positions"]["3"]["0"] < seq, result.describe()
    stack = f["stacks"].get("3", "")
    assert stack and "no stack could be captured" not in stack, result.describe()
    assert "_fire" in stack, stack  # the spinning loop, seen from outside a process holding the GIL


@pytest.mark.parametrize(
    "what,differs_in", [("shape", "shape"), ("dtype", "dtype"), ("op", "op"), ("reduce", "reduce op")]
)
def test_desync_names_the_rank_with_the_different_collective(tmp_path, what, differs_in):
    # 300 steps: a desync that does not stop the job (another reduce op) is seen once the Flight Recorder
    # entries before it are read (<= 2 s); the job must still run then for the abort to end it
    result = run_demo(tmp_path, f"desync-{what}", fault="desync", rank=2, step=20, steps=300, params=(f"what={what}",))

    _assert_demo_passed(result)
    f = _only(result, "desync")
    _assert_attributed(f, 2, result)
    _assert_named_collective(f, result)
    assert f["step"] == 20, result.describe()
    ev = f["evidence"]
    assert ev["differs_in"] == differs_in, result.describe()
    assert ev["pg"] == "0", result.describe()
    issued = {desc: sorted(ranks) for desc, ranks in ev["issued"].items()}
    assert sorted(issued.values()) == [[0, 1, 3], [2]], result.describe()


def test_desync_onto_another_process_group_is_named(tmp_path):
    result = run_demo(tmp_path, "desync-pg", fault="desync", rank=2, step=20, steps=100, params=("what=pg",))

    _assert_demo_passed(result)
    f = _only(result, "desync")
    _assert_attributed(f, 2, result)
    seq = _assert_named_collective(f, result)
    ev = f["evidence"]
    assert ev["desync"] == "process group", result.describe()
    assert sorted(ev["waiting_ranks"]) == [0, 1, 3], result.describe()
    assert ev["positions"] == {"2": {"0": seq - 1}}, result.describe()
    other = ev["culprit_group"]
    assert other["pg"] != "0" and other["seq"] >= 1, result.describe()


@pytest.mark.parametrize("how,rank", [("kill", 1), ("exception", 2)])
def test_crash_names_the_rank_that_died_first(tmp_path, how, rank):
    result = run_demo(tmp_path, f"crash-{how}", fault="crash", rank=rank, step=20, steps=100, params=(f"how={how}",))

    _assert_demo_passed(result)
    crashes = of_kind(result.findings, "crash")
    assert len(crashes) == 1, result.describe()
    assert len(result.findings) == 1, result.describe()  # the peers' failures are not findings of their own
    f = crashes[0]
    _assert_attributed(f, rank, result)
    ev = f["evidence"]
    if how == "kill":
        assert ev["signal"] == "SIGKILL", result.describe()
    else:
        assert ev["how"] == "exception", result.describe()
        assert "trainscout injected crash" in ev["message"], result.describe()
    collateral = ev.get("collateral") or {}
    assert str(rank) not in collateral, result.describe()
    assert set(collateral) <= {str(r) for r in WORLD if r != rank}, result.describe()


def test_early_exit_names_the_rank_that_left(tmp_path):
    result = run_demo(tmp_path, "exit", fault="exit", rank=2, step=20, steps=100)

    _assert_demo_passed(result)
    f = _only(result, "early_exit")
    _assert_attributed(f, 2, result)
    assert f["step"] == 20, result.describe()
    collateral = f["evidence"].get("collateral") or {}
    assert set(collateral) <= {"0", "1", "3"}, result.describe()
