"""A pipeline stage computing wrong is named by replaying its layers on the same stage of the other pipeline
replicas (tests/integration/pipeline_dp_job.py: 2 stages x 3, DDP over each stage's replicas).

Replay needed its replicas to span the job; a stage's replicas are a third of it, so replay was off and a wrong
stage went unnamed (its next stage's loss moved, and that healthy rank was only logged). Each stage's replicas now
replay over a side group of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import free_port, stop_once_found, torchrun_cmd, trainscout_cmd, unique_run_id

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parent / "pipeline_dp_job.py"
STOPPED = 3  # `trainscout run` interrupted after naming a culprit (0: the job ended by itself first)
EVERY_10 = {"TRAINSCOUT_REPLAY_EVERY": "10", "TRAINSCOUT_REPLAY_BUDGET": "0"}  # a scheduled replay every 10 steps


def test_a_first_stage_computing_wrong_is_named_by_its_stages_replay(jobs, tmp_path):
    # rank 2: the first stage of pipeline replica 1 negates its first layer's output from step 30 (the job's own)
    launch = torchrun_cmd(
        "--nproc-per-node", "6", "--master-port", str(free_port()), str(JOB), "--steps", "300", "--flip", "2:30"
    )
    run_id = unique_run_id("stage-replay")
    args = trainscout_cmd("run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain")
    job = jobs([*args, "--", *launch], tmp_path, run_id, env=EVERY_10)
    result = stop_once_found(job, lambda found: any(f["kind"] == "sdc" for f in found), timeout=240)

    assert result.returncode in (0, STOPPED), result.describe()
    named = [(f["kind"], f["culprit_ranks"]) for f in result.findings]
    # its replay deviates (sdc), and again at the next replay of that layer (a faulty device: health)
    assert named and all(n in (("sdc", [2]), ("health", [2])) for n in named), result.describe()
    first = result.findings[0]
    assert (first["kind"], first["evidence"]["check"]) == ("sdc", "replay") and first["step"] >= 30, result.describe()
