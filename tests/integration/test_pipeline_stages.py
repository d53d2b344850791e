"""Pipeline stages under `trainscout run`: point-to-point calls are not collectives, and stages are not replicas.

Gloo counts a rank's sends and receives in its group's sequence number (the Flight Recorder's status does too,
its entries do not), so a middle stage (16 P2P calls a step) and an end stage (8) numbered the same barrier
differently: a healthy pipeline got an inconclusive desync and two stragglers (the first stage waiting in its
receives, read as time blocked outside collectives), and a hung middle stage an inconclusive hang.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import free_port, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parent / "pipeline_job.py"


def _launch(steps: int, heavy: float) -> list[str]:
    return torchrun_cmd("--nproc-per-node", "4", "--master-port", str(free_port()), str(JOB), str(steps), str(heavy))


def test_a_healthy_pipeline_names_nobody(tmp_path):
    result = run_under_trainscout(tmp_path, "pipeline-clean", _launch(250, 40))

    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()


def test_a_hung_middle_stage_is_named(tmp_path):
    options = ("--inject", "hang:rank=2:step=60", "--abort-on", "hang")
    result = run_under_trainscout(tmp_path, "pipeline-hang", _launch(400, 8), options=options)

    assert [(f["kind"], f["culprit_ranks"], f["status"]) for f in result.findings] == [("hang", [2], "attributed")], (
        result.describe()
    )
    assert result.findings[0]["collective"] == "barrier", result.describe()
