"""Ranks the script spawns itself (torch.multiprocessing.spawn) on the CUDA paths: 4 gloo ranks share the GPU.

No rank has RANK in its environment; each gets its probe in its own init_process_group call.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from job_runs import JOBS, free_port, run_under_trainscout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(tmp_path: Path, name: str, steps: int, *options: str) -> tuple:
    job = [sys.executable, str(JOBS / "spawn_job.py"), str(steps), str(free_port()), "cuda"]
    done, findings, _ = run_under_trainscout(tmp_path, name, job, options=options)
    return done, findings


def test_spawned_cuda_ranks_hang_is_named(tmp_path):
    done, findings = _run(tmp_path, "spawn-hang", 60, "--inject", "hang:rank=2:step=20", "--abort-on", "hang")
    assert [(f["kind"], f["culprit_ranks"], f["step"]) for f in findings] == [("hang", [2], 20)], done.stdout[-3000:]


def test_spawned_cuda_ranks_corruption_is_named_and_a_clean_run_names_nobody(tmp_path):
    done, findings = _run(tmp_path, "spawn-sdc", 200, "--inject", "corrupt:rank=1:step=60")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert findings and all((f["kind"], f["culprit_ranks"]) == ("sdc", [1]) for f in findings), findings
    done, findings = _run(tmp_path, "spawn-clean", 200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert findings == [], findings
