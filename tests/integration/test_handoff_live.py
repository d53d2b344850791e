"""Handing a fault over: elastic restarts, verdict.json, the --on-finding command, exit status, a quiet console.

Real torchrun jobs of the unmodified demo script on 127.0.0.1 (gloo, CPU) under `trainscout run` / `demo`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import PY, free_port, of_kind, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

CRASH_RANK = 1


def _elastic_launch(steps: int) -> list[str]:
    return torchrun_cmd(
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "1",
        "--master-port",
        str(free_port()),
        str(Path(__file__).with_name("elastic_train.py")),
        "--steps",
        str(steps),
    )


def test_elastic_restart_keeps_one_run_names_attempts_and_does_not_blame_again(tmp_path):
    """Rank 1 crashes in attempt 0 only; torchrun restarts every worker once and the job then finishes."""
    result = run_under_trainscout(
        tmp_path,
        "elastic",
        _elastic_launch(40),
        options=("--inject", f"crash:rank={CRASH_RANK}:step=10:how=exception:attempt=0"),
        timeout=240,
    )

    assert result.returncode == 0, result.describe()  # the second attempt succeeded: the job did
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [result.run_path.name], (
        "one run folder for both attempts"
    )
    crashes = of_kind(result.findings, "crash")
    assert len(crashes) == 1, result.describe()
    assert crashes[0]["culprit_ranks"] == [CRASH_RANK] and crashes[0]["status"] == "attributed", result.describe()
    assert crashes[0]["attempt"] == 0, result.describe()
    assert [f for f in result.findings if f["attempt"] != 0] == [], result.describe()  # attempt 1 ran clean
    assert len(result.findings) == 1, result.describe()
    attempts = [e["attempt"] for e in result.events if e["kind"] == "attempt"]
    assert attempts == [1], result.describe()
    summary = (result.run_path / "summary.md").read_text()
    assert "attempt 1 began" in summary, summary
    verdict = json.loads((result.run_path / "verdict.json").read_text())
    assert verdict["culprits"]["ranks"] == [CRASH_RANK], verdict
    assert [f["kind"] for f in verdict["findings"]] == ["crash"], verdict


def test_a_localized_fault_writes_the_verdict_runs_the_command_and_exits_3(tmp_path):
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), "-m", "trainscout.demo.train", "--steps", "60"
    )
    hook = f"{PY} -c \"import os, shutil; shutil.copy(os.environ['TRAINSCOUT_VERDICT'], 'seen.json')\""
    result = run_under_trainscout(
        tmp_path,
        "localized",
        launch,
        options=("--inject", "hang:rank=2:step=15", "--abort-on", "hang", "--on-finding", f"cd {tmp_path} && {hook}"),
    )

    assert result.returncode == 3, result.describe()
    assert "trainscout exits 3 (fault localized" in result.output, result.describe()
    verdict = json.loads((result.run_path / "verdict.json").read_text())
    assert verdict["culprits"]["ranks"] == [2], verdict
    assert verdict["culprits"]["hosts"] and verdict["culprits"]["pids"], verdict
    assert verdict["findings"][0]["kind"] == "hang", verdict
    assert verdict["checkpoint"] is None, verdict  # the demo saves no checkpoint
    assert json.loads((tmp_path / "seen.json").read_text()) == verdict, "the command read the verdict"
    log = (result.run_path / "on_finding.log").read_text()
    assert "ended with exit code 0" in log, log


def test_a_failed_job_with_nobody_named_exits_4(tmp_path):
    result = run_under_trainscout(tmp_path, "exit7", [PY, "-c", "import sys; sys.exit(7)"])

    assert result.returncode == 4, result.describe()
    assert result.findings == [], result.describe()
    assert not (result.run_path / "verdict.json").exists()


def test_the_demo_hang_keeps_the_teardown_tracebacks_off_the_terminal(demo_hang):
    result = demo_hang

    assert result.returncode == 0, result.describe()
    assert [f["kind"] for f in result.findings] == ["hang"], result.describe()
    assert "collecting stacks from" in result.output, result.output
    assert "Traceback" not in result.output and "SignalException" not in result.output, result.output
    log = (result.run_path / "launcher.log").read_text()
    assert "Traceback" in log, log[-3000:]
