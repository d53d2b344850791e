"""Rank 0's evaluation between steps on the CUDA paths: 4 gloo DDP ranks share the GPU (>= 3 replicas).

The evaluation's kernels run on the GPU after the optimizer step, where the step's GPU span starts: the time
between steps is measured on the GPU too (an event at the first training forward), so rank 0 is not named
for it. Held up as long inside its training forward, rank 0 is named.
"""

from __future__ import annotations

import pytest
import torch
from job_runs import run_slow_rank_job

STEPS = 120


def _run(tmp_path, mode: str):
    return run_slow_rank_job(tmp_path, mode, STEPS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rank_0_evaluating_on_the_gpu_between_steps_names_nobody(tmp_path):
    done, findings, events = _run(tmp_path, "eval")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert findings == [], findings
    observed = [e for e in events if e.get("kind") == "main_rank_side_work"]
    assert observed and all(e["rank"] == 0 for e in observed), events[-20:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rank_0_held_up_inside_its_forward_on_the_gpu_is_named(tmp_path):
    done, findings, events = _run(tmp_path, "forward")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert findings and all(f["kind"] == "straggler" and f["culprit_ranks"] == [0] for f in findings), findings
    assert not [e for e in events if e.get("kind") == "main_rank_side_work"]
