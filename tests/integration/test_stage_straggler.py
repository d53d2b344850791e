"""A slow pipeline stage is named against the same stage of the other pipeline replicas.

Its peers' waits for it were not measured (a pipeline schedule waits on isend / irecv handles), so every stage
read as blocked for its bubbles and stages were left out of the straggler vote. Waits on handles now count as
waits, and a stage is compared within its replica class (tests/integration/pipeline_dp_job.py: 2 stages x 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import free_port, start_under_trainscout, stop_once_found, torchrun_cmd

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parent / "pipeline_dp_job.py"
STOPPED = 3  # `trainscout run` interrupted after naming a culprit (0: the job ended by itself first)


@pytest.mark.parametrize("replicas", ["ddp", "fsdp"])
def test_a_slow_last_stage_is_named_and_no_other_rank(jobs, tmp_path, replicas):
    # rank 3: the last stage of pipeline replica 1, 30 ms a step in its forward from step 40 (the job's own sleep).
    # With FSDP2 the all-gather check compares each stage's gathered parameters within the stage (they compared
    # the two stages' different blocks: an inconclusive sdc at step 1, and later two healthy ranks named).
    options = ["--fsdp"] if replicas == "fsdp" else []
    launch = torchrun_cmd(
        "--nproc-per-node", "6", "--master-port", str(free_port()), str(JOB), "--steps", "400", "--slow", "3:40:30"
    )
    job = start_under_trainscout(jobs, tmp_path, f"stage-straggler-{replicas}", [*launch, *options])
    result = stop_once_found(job, lambda found: any(f["kind"] == "straggler" for f in found), timeout=240)

    assert result.returncode in (0, STOPPED), result.describe()
    assert [(f["kind"], f["culprit_ranks"], f["evidence"]["type"]) for f in result.findings] == [
        ("straggler", [3], "blocked")
    ], result.describe()
    assert 40 <= result.findings[0]["step"] <= 80, result.describe()
