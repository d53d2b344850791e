"""trainscout on real NCCL DDP jobs with CUDA state: no host sync in steady state, a NaN named at its step.

- sync_job.py runs under `trainscout run` with the default checks and counts, after warm-up, every
  synchronisation `torch.cuda.set_sync_debug_mode` reports; the job itself reads nothing from the device,
  so any report there would come from trainscout. Its own controls prove the recording sees syncs on the
  training thread and on the autograd engine's thread. The window ends before the first replay step
  (TRAINSCOUT_REPLAY_EVERY=100), which does synchronise (docs/gpu.md).
- a NaN injected into rank 1's local gradient at step 11 is reported by rank 1 at step 11, before DDP's
  reduction spreads it; rank 0 turns non-finite only at step 12. With two ranks the finding cannot
  attribute (no strict majority), so it is inconclusive and names rank 1 as the earliest in its evidence.
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

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NPROC = min(2, torch.cuda.device_count())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainscout(tmp_path, run_id, script, script_args, inject="", env=None, nproc=NPROC):
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
    ]
    if inject:
        cmd += ["--inject", inject]
    cmd += [
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(_port()),
        str(script),
        *script_args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    path = tmp_path / run_id / "findings.jsonl"
    findings = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return done, findings


@pytest.mark.skipif(NPROC < 1, reason="needs a CUDA device")
def test_steady_state_steps_cause_no_host_sync_from_trainscout(tmp_path):
    out = tmp_path / "sync-{rank}.json"
    done, findings = _trainscout(
        tmp_path,
        "sync",
        HERE / "sync_job.py",
        ["--warmup", "20", "--steps", "60", "--out", str(out)],
        env={"TRAINSCOUT_REPLAY_EVERY": "100", "TRAINSCOUT_REPLAY_BUDGET": "0"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert findings == []
    for rank in range(NPROC):
        report = json.loads(Path(str(out).replace("{rank}", str(rank))).read_text())
        before, after = report["before"], report["after"]
        # the recording works: a sync on the training thread and one in an autograd hook were both seen
        assert len(report["control"]) >= 2, report
        assert any("sync_job.py" in line for line in report["control"]), report
        # the probe was attached and its checks ran on CUDA during the window, with no error
        assert after["attached"] and after["state_check"] and after["error_text"] == "", report
        assert after["nonfinite_device_ok"] and after["nonfinite_counts_error"] == "", report
        assert after["nonfinite_device_checks"] - before["nonfinite_device_checks"] >= 60, report
        assert after["state_submitted"] > before["state_submitted"], report
        assert after["state_published"] > before["state_published"], report
        assert after["replays"] in (0, None), report
        # and nothing synchronised
        assert report["steady"] == [], report


@pytest.mark.skipif(NPROC < 1, reason="needs a CUDA device")
def test_fsdp2_steady_state_steps_cause_no_host_sync_from_trainscout(tmp_path):
    """FSDP2: the all-gather check hashes gathered parameters on the training stream and reads them back
    later; with the non-finite loss check that is all the probe does on CUDA there."""
    out = tmp_path / "sync-{rank}.json"
    done, findings = _trainscout(
        tmp_path, "sync-fsdp", HERE / "sync_job.py", ["--warmup", "20", "--steps", "60", "--out", str(out), "--fsdp"]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert findings == []
    for rank in range(NPROC):
        report = json.loads(Path(str(out).replace("{rank}", str(rank))).read_text())
        before, after = report["before"], report["after"]
        assert len(report["control"]) >= 2, report
        assert after["attached"] and after["error_text"] == "" and after["gather_error"] == "", report
        # the gather check ran on CUDA in the window: results submitted and published, none dropped
        assert after["gather_submitted"] > (before["gather_submitted"] or 0), report
        assert after["gather_published"] > before["gather_published"], report
        assert after["gather_dropped"] == 0, report
        assert after["nonfinite_device_checks"] - before["nonfinite_device_checks"] >= 60, report
        assert report["steady"] == [], report


@pytest.mark.skipif(NPROC < 2, reason="needs 2 CUDA devices")
def test_nan_in_one_ranks_cuda_gradient_is_reported_at_its_step_before_the_reduction(tmp_path):
    done, findings = _trainscout(
        tmp_path,
        "nan-grad",
        REPO / "examples" / "ddp_train.py",
        ["--steps", "40"],
        inject="nan:rank=1:step=10:where=grad",
    )
    log = tmp_path / "nan-grad" / "launcher.log"
    output = done.stdout + done.stderr + (log.read_text(errors="replace") if log.exists() else "")
    assert "rank 1: nan: NaN in the next gradient of" in output, output[-3000:]
    kinds = [f["kind"] for f in findings]
    assert kinds == ["nonfinite"], done.stdout[-3000:]
    f = findings[0]
    ev = f["evidence"]
    assert f["step"] == ev["origin_step"] == 11, f
    assert ev["first_nonfinite"]["1"].startswith("grad ") and ev["first_nonfinite"]["1"].endswith(" at step 11"), f
    assert ev["later_ranks"] == {"0": 12}, f
    assert f["status"] == "inconclusive" and f["culprit_ranks"] == [], f  # two ranks: no strict majority
