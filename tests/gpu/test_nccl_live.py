"""trainscout on a real NCCL DDP job (2 GPUs): an injected hang is detected, a clean run stays silent, a GPU
slowed on its own stream is named.

With two ranks a hang is detected but cannot be attributed (no strict majority): the finding is
inconclusive and lists the lagging rank as evidence. The slowed GPU is a spin kernel on rank 1's current
stream every step: its host is as fast as ever, so CPU time shows nothing; the probe's CUDA events do
(time to the end of backward, and the gradient-sync wait after it). With two ranks the finding rests on
arrival order (the slow GPU waits less for its peer) and says so with lower confidence.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

REPO = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, run_id, inject="", steps=40, script_args=(), env=None):
    cmd = [
        sys.executable,
        "-m",
        "trainscout",
        "run",
        "--run-dir",
        str(tmp_path),
        "--run-id",
        run_id,
        "--console",
        "plain",
        "--abort-on",
        "hang,desync",
    ]
    if inject:
        cmd += ["--inject", inject]
    cmd += [
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_port()),
        str(REPO / "examples" / "ddp_train.py"),
        "--steps",
        str(steps),
        *script_args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    path = tmp_path / run_id / "findings.jsonl"
    findings = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return done, findings


def test_nccl_hang_is_detected_with_two_ranks(tmp_path):
    done, findings = _run(tmp_path, "hang", inject="hang:rank=1:step=10")
    assert len(findings) == 1, done.stdout[-3000:]
    f = findings[0]
    assert f["kind"] == "hang" and f["status"] == "inconclusive" and f["culprit_ranks"] == []
    assert f["evidence"]["lagging_ranks"] == [1]


def test_nccl_clean_run_has_no_finding(tmp_path):
    done, findings = _run(tmp_path, "clean", steps=60)
    assert done.returncode == 0, done.stdout[-3000:]
    assert findings == []


def test_gpu_spin_straggler_is_named_by_arrival_order(tmp_path):
    done, findings = _run(
        tmp_path, "gpuslow", inject="gpuslow:rank=1:step=30:ms=10", steps=200, script_args=("--hidden", "2048")
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert [(f["kind"], f["culprit_ranks"], f["evidence"]["type"]) for f in findings] == [
        ("straggler", [1], "compute")
    ], json.dumps(findings, indent=1) + done.stdout[-3000:]
    f = findings[0]
    assert f["evidence"]["measure"] == "time to the end of backward (GPU or host)", f
    assert f["evidence"]["basis"].startswith("arrival order") and f["confidence"] < 0.5, f
    assert f["evidence"]["ratio"] > 1.2, f
    waits = f["evidence"]["wait_s"]
    assert waits["1"] < waits["0"], f  # the slow GPU arrives last and waits least


def test_gpu_job_without_slowdown_has_no_straggler(tmp_path):
    done, findings = _run(tmp_path, "gpuclean", steps=200, script_args=("--hidden", "2048"))
    assert done.returncode == 0, done.stdout[-3000:]
    assert findings == [], json.dumps(findings, indent=1)
