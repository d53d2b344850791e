"""verdict.json, the --on-finding command runner, the exit status and the attempt bookkeeping, with plain data."""

from __future__ import annotations

import json
import sys

from trainscout.coordinator.attempts import AttemptTracker
from trainscout.findings import Finding
from trainscout.probe.checkpoints import record_certificate, write_certificate
from trainscout.runner.handoff import (
    EXIT_LOCALIZED,
    EXIT_OK,
    EXIT_UNEXPLAINED,
    Handoff,
    attempt_lines,
    exit_status,
)
from trainscout.sinks import verdict


def _finding(kind: str, ranks: list[int], status: str = "attributed", step: int = 5, attempt: int = 0) -> Finding:
    return Finding(
        kind=kind,
        summary=f"{kind} of {ranks}",
        culprit_ranks=ranks,
        status=status,
        step=step,
        hosts=[f"h{r}" for r in ranks],
        pids=[100 + r for r in ranks],
        devices=[f"h{r}:gpu{r}" for r in ranks],
        attempt=attempt,
    )


def test_exit_status_tells_success_localized_and_unexplained_apart():
    named = [_finding("hang", [2])]
    vague = [_finding("stall", [], status="inconclusive")]
    assert exit_status(0, named) == EXIT_OK
    assert exit_status(1, named) == EXIT_LOCALIZED
    assert exit_status(1, vague) == EXIT_UNEXPLAINED
    assert exit_status(7, []) == EXIT_UNEXPLAINED
    assert exit_status(1, [], interrupted_by=2) == 130
    assert exit_status(1, named, interrupted_by=2) == EXIT_LOCALIZED
    assert exit_status(7, named, mode="launcher") == 7


def test_verdict_accumulates_culprits_and_keeps_the_first_finding_first():
    findings = [
        _finding("crash", [1]),
        _finding("stall", [], status="inconclusive"),
        _finding("straggler", [3, 1]),
    ]
    v = verdict.build("r1", findings, None)
    assert [f["kind"] for f in v["findings"]] == ["crash", "straggler"]
    assert v["culprits"]["ranks"] == [1, 3]
    assert v["culprits"]["hosts"] == ["h1", "h3"]
    assert v["culprits"]["pids"] == [101, 103]
    assert v["culprits"]["devices"] == ["h1:gpu1", "h3:gpu3"]
    assert v["checkpoint"] is None


def _certify(tmp_path, run_dir, step: int, status: str) -> None:
    ckpt = tmp_path / f"step-{step}.pt"
    ckpt.write_bytes(b"x")
    cert = {"checkpoint": str(ckpt), "step": step, "saved_at": float(step), "run_dir": str(run_dir)}
    cert.update(status=status, reason="")
    path = write_certificate(cert, str(ckpt))
    assert path is not None
    record_certificate(str(run_dir), path, cert)


def test_the_verdict_names_the_newest_trusted_checkpoint_judged_against_later_findings(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert verdict.trusted_checkpoint(str(run_dir)) is None  # no certificate known
    for step in (10, 20, 30):
        _certify(tmp_path, run_dir, step, "certified")
    assert verdict.trusted_checkpoint(str(run_dir))["step"] == 30
    # an integrity finding at step 25, made after the saves: the checkpoint of step 30 is suspect now
    with open(run_dir / "findings.jsonl", "w") as fh:
        fh.write(json.dumps({"kind": "sdc", "step": 25, "summary": "rank 2 differs"}) + "\n")
    pick = verdict.trusted_checkpoint(str(run_dir))
    assert pick is not None and pick["step"] == 20 and pick["path"].endswith("step-20.pt")


def test_handoff_writes_the_verdict_and_runs_the_command_once_per_named_finding(tmp_path):
    out = tmp_path / "seen.txt"
    command = f"{sys.executable} -c \"import os; open('{out}', 'a').write(os.environ['TRAINSCOUT_VERDICT'] + chr(10))\""
    handoff = Handoff(str(tmp_path), "r1", command, env={}, checkpoint=lambda run_dir: None)
    findings = [_finding("stall", [], status="inconclusive")]
    assert handoff.on_finding(findings[0], findings) is False
    assert not (tmp_path / verdict.VERDICT_FILE).exists()
    findings.append(_finding("hang", [2]))
    assert handoff.on_finding(findings[-1], findings) is True
    findings.append(_finding("desync", [3]))
    assert handoff.on_finding(findings[-1], findings) is True
    assert handoff.runner is not None and handoff.runner.drain(30)
    assert out.read_text().splitlines() == [str(tmp_path / verdict.VERDICT_FILE)] * 2
    written = json.loads((tmp_path / verdict.VERDICT_FILE).read_text())
    assert [f["kind"] for f in written["findings"]] == ["hang", "desync"]
    assert (tmp_path / "on_finding.log").read_text().count("ended with exit code 0") == 2


def test_a_culprit_named_in_an_earlier_attempt_is_not_named_again_for_the_same_kind():
    attempts = AttemptTracker()
    first = _finding("crash", [1], attempt=0)
    assert attempts.earlier_blame(first) is None
    attempts.record(first)
    attempts.begin(1, 0.0)
    assert attempts.is_stale(0) and not attempts.is_newer(1) and attempts.is_newer(2)
    assert attempts.earlier_blame(_finding("crash", [1], attempt=1)) == 0
    assert attempts.earlier_blame(_finding("crash", [2], attempt=1)) is None  # another rank: a new fault
    assert attempts.earlier_blame(_finding("hang", [1], attempt=1)) is None  # another kind: a new fault


def test_attempt_lines_for_the_summary():
    lines = attempt_lines(
        [
            {"kind": "attempt_end", "attempt": 0, "findings": 1, "t": 0.0},
            {"kind": "attempt", "attempt": 1, "t": 0.0},
            {"kind": "repeat", "attempt": 1, "first_attempt": 0, "finding_kind": "crash", "culprits": [1]},
        ]
    )
    assert lines[0].startswith("attempt 0 ended") and lines[1].startswith("attempt 1 began")
    assert "not a new fault" in lines[2]


def test_a_fault_can_be_limited_to_one_restart_attempt():
    from trainscout.faults.spec import parse_faults

    (spec,) = parse_faults("crash:rank=1:step=10:how=exception:attempt=0")
    assert spec.attempt == 0
    assert spec.applies_to(1, attempt=0) and not spec.applies_to(1, attempt=1) and not spec.applies_to(2, attempt=0)
    assert parse_faults(spec.to_text()) == [spec]
    (every,) = parse_faults("crash:rank=1")
    assert every.attempt is None and every.applies_to(1, attempt=3)
