"""Runs tests/integration/slow_rank_job.py under `trainscout run`: 4 gloo ranks, on the GPU they share (or the CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).resolve().parents[1] / "integration" / "slow_rank_job.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_slow_rank_job(
    tmp_path: Path,
    mode: str,
    steps: int,
    device: str = "cuda",
    env: dict[str, str] | None = None,
    options: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess, list[dict], list[dict]]:
    """(the finished `trainscout run`, its findings, its events) for one MODE of the job; `options` go to
    `trainscout run`."""
    run_id = f"slow-rank-{mode}-{device}"
    cmd = [sys.executable, "-m", "trainscout", "run", "--run-dir", str(tmp_path), "--run-id", run_id, *options]
    cmd += ["--console", "plain", "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    cmd += ["--master-port", str(_port()), str(JOB), mode, str(steps), str(tmp_path / "job.log"), device]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, **(env or {})})
    run = tmp_path / run_id

    def lines(name: str) -> list[dict]:
        path = run / name
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    return done, lines("findings.jsonl"), lines("events.jsonl")
