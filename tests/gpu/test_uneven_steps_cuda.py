"""A replica one optimizer step off its peers, on the CUDA paths: 4 gloo DDP ranks share the GPU (>= 3 replicas).

Rank 2 skips its optimizer step at step 30. The state check names it; at the next replay (every 10 steps here)
it is one step off its peers, so the replay's broadcast meets no one: it gives up within seconds, each replica
having first waited for its own queued GPU work, and training goes on (before, the job was held for the side
group's one-minute timeout and a hang on trainscout's own group was named beside the SDC).
"""

from __future__ import annotations

import time

import pytest
import torch
from job_runs import run_slow_rank_job

SIDE_GROUP_TIMEOUT_S = 60.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replica_that_skips_an_optimizer_step_on_the_gpu_is_named_and_the_job_goes_on(tmp_path):
    t0 = time.monotonic()
    env = {"TRAINSCOUT_REPLAY_EVERY": "10", "TRAINSCOUT_REPLAY_BUDGET": "0"}  # a replay every 10 steps
    done, findings, _ = run_slow_rank_job(tmp_path, "skip-step", 90, env=env)
    elapsed = time.monotonic() - t0
    said = done.stdout[-3000:] + done.stderr[-3000:]

    assert done.returncode == 0, said
    assert findings and findings[0]["kind"] == "sdc", findings
    assert all(f["culprit_ranks"] == [2] for f in findings), findings  # no hang, no healthy rank
    assert "did not join the replay" in done.stdout + done.stderr, said  # the replay at step 40 did not meet
    assert elapsed < SIDE_GROUP_TIMEOUT_S + 30, said  # start-up on the GPU included
