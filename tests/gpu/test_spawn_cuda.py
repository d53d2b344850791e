"""Ranks the script spawns itself (torch.multiprocessing.spawn) on the CUDA paths: 4 gloo ranks share the GPU.

No rank has RANK in its environment; each gets its probe in its own init_process_group call.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

JOB = Path(__file__).resolve().parents[1] / "integration" / "spawn_job.py"


def _run(tmp_path: Path, name: str, steps: int, *options: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "trainscout", "run", "--run-dir", str(tmp_path), "--run-id", name, *options]
    cmd += ["--console", "plain", "--", sys.executable, str(JOB), str(steps), str(port), "cuda"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=dict(os.environ))
    path = tmp_path / name / "findings.jsonl"
    findings = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
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
