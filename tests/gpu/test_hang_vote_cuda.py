"""The hang vote on the CUDA paths: 4 gloo DDP ranks share the GPU (>= 3 replicas).

Rank 0 tokenizing in plain Python alone while the others wait in a barrier is work of its own, not a hang.
With a BatchNorm in the model DDP broadcasts its buffers from rank 0 before every forward: rank 2 asleep after
its step leaves rank 0 in that broadcast and ranks 1 and 3 one collective on; rank 2 is named all the same.
A kernel that never ends on rank 2's GPU leaves every rank inside the same all-reduce (rank 2 blocks on its GPU
there): its queue that never drains names it.
"""

from __future__ import annotations

import pytest
import torch
from job_runs import run_slow_rank_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_rank_0_preparing_data_alone_on_a_gpu_job_is_no_hang(tmp_path):
    options = ("--hang-timeout", "2", "--stall-timeout", "15")
    done, findings, events = run_slow_rank_job(tmp_path, "long-prep", 40, options=options)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert findings == [], findings
    waits = [e for e in events if e.get("kind") == "hang_vote_waits"]
    assert waits and all(e["ranks"] == [0] and e["doing"] == ["running code of its own"] for e in waits), events


def test_a_rank_asleep_behind_a_buffer_broadcast_on_a_gpu_job_is_named(tmp_path):
    options = ("--hang-timeout", "3", "--abort-on", "hang")
    done, findings, _ = run_slow_rank_job(tmp_path, "buffer-hang", 40, options=options)
    assert [(f["kind"], f["culprit_ranks"]) for f in findings] == [("hang", [2])], findings
    assert findings[0]["collective"] == "broadcast", findings


def test_a_rank_whose_gpu_kernel_never_ends_is_named(tmp_path):
    options = ("--hang-timeout", "3", "--abort-on", "hang")
    done, findings, _ = run_slow_rank_job(tmp_path, "gpu-hang", 40, options=options)
    assert [(f["kind"], f["culprit_ranks"]) for f in findings] == [("hang", [2])], findings
    assert "GPU has not finished its queued work" in findings[0]["summary"], findings
