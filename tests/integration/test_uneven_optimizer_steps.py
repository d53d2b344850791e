"""A replica that skips or repeats one optimizer step is named, and trainscout's own replay does not hold the job.

Four gloo DDP ranks train under `trainscout run`, unmodified; at step 30 rank 2 skips its optimizer step (or rank
1 steps twice). Its replicated state differs from its peers' from then on: the state check names it. Its step
count is one off its peers' too, so at the next replay it is not where they are: it waits in the job's next
gradient all-reduce, which they, waiting for it in the replay's broadcast, never enter. That broadcast used to
wait for the side group's timeout (a minute, then an inconclusive hang on trainscout's own group); it is
bounded to seconds now, replay is switched off, and training goes on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import free_port, of_kind, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parent / "slow_rank_job.py"
SIDE_GROUP_TIMEOUT_S = 60.0  # what a replay broadcast waited before


@pytest.mark.parametrize("mode,culprit", [("skip-step", 2), ("repeat-step", 1)])
def test_a_replica_off_by_one_optimizer_step_is_named_and_the_job_goes_on(tmp_path, mode, culprit):
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), str(JOB), mode, "90", str(tmp_path / "log")
    )
    env = {"TRAINSCOUT_REPLAY_EVERY": "10", "TRAINSCOUT_REPLAY_BUDGET": "0"}  # a replay every 10 steps
    t0 = time.monotonic()
    result = run_under_trainscout(tmp_path, mode, launch, env=env)
    elapsed = time.monotonic() - t0

    assert result.returncode == 0, result.describe()
    sdc = of_kind(result.findings, "sdc")
    assert sdc and sdc[0]["culprit_ranks"] == [culprit], result.describe()
    assert all(f["culprit_ranks"] == [culprit] for f in result.findings), result.describe()  # no hang, no other rank
    assert "did not join the replay" in result.output, result.describe()  # the replay at step 40 did not meet
    assert elapsed < SIDE_GROUP_TIMEOUT_S, result.describe()  # ... and did not hold the job for a minute
