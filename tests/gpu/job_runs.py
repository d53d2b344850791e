"""Runs a test job under `trainscout run` (4 gloo ranks, on the GPU they share or the CPU) and reads what it found:
tests/integration/slow_rank_job.py by mode, or any job command (spawn_job.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

JOBS = Path(__file__).resolve().parents[1] / "integration"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_under_trainscout(
    tmp_path: Path,
    run_id: str,
    job: list[str],
    env: dict[str, str] | None = None,
    options: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess, list[dict], list[dict]]:
    """(the finished `trainscout run [options] -- JOB`, its findings, its events)."""
    cmd = [sys.executable, "-m", "trainscout", "run", "--run-dir", str(tmp_path), "--run-id", run_id, *options]
    cmd += ["--console", "plain", "--", *job]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, **(env or {})})
    run = tmp_path / run_id

    def lines(name: str) -> list[dict]:
        path = run / name
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    return done, lines("findings.jsonl"), lines("events.jsonl")


def run_slow_rank_job(
    tmp_path: Path,
    mode: str,
    steps: int,
    device: str = "cuda",
    env: dict[str, str] | None = None,
    options: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess, list[dict], list[dict]]:
    """run_under_trainscout for one MODE of slow_rank_job.py under torchrun; `options` go to `trainscout run`."""
    job = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port())]
    job += [str(JOBS / "slow_rank_job.py"), mode, str(steps), str(tmp_path / "job.log"), device]
    return run_under_trainscout(tmp_path, f"slow-rank-{mode}-{device}", job, env=env, options=options)
