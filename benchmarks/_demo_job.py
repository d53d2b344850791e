"""The CPU workload every CPU benchmark runs: the demo job (tiny GPT, gloo DDP) under torchrun, bare or under
`trainscout run`, and what it leaves behind (rank 0's timing file, findings.jsonl).

One place builds these commands so that the overhead, latency and false-positive questions measure the same
job: a flag added here reaches every benchmark, and no benchmark drifts to a job of its own by accident.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from benchmarks._common import PYTHON, free_port, read_jsonl


def train_cmd(nproc: int | str, steps: int, *extra: str, port: str | None = None) -> list[str]:
    """`torchrun --nproc-per-node N -m trainscout.demo.train --steps S ...`, on a free rendezvous port."""
    return [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        port or str(free_port()),
        "-m",
        "trainscout.demo.train",
        "--steps",
        str(steps),
        *extra,
    ]


def under_trainscout(job: list[str], run_dir: Path, run_id: str, *options: str) -> list[str]:
    """The same job as a user attaches trainscout to it: `trainscout run --console plain ... -- JOB`."""
    return [
        PYTHON,
        "-m",
        "trainscout",
        "run",
        "--console",
        "plain",
        "--run-dir",
        str(run_dir),
        "--run-id",
        run_id,
        *options,
        "--",
        *job,
    ]


def step_seconds(timing: Path) -> list[float]:
    """Each step's wall time in seconds, in order, from rank 0's `--timing-file` (first column)."""
    if not timing.exists():
        return []
    return [float(line.split()[0]) for line in timing.read_text().splitlines() if line.strip()]


def step_spans(timing: Path) -> list[tuple[float, float]]:
    """(start, end) of each step on the monotonic clock, from rank 0's timing file (seconds, end)."""
    if not timing.exists():
        return []
    out = []
    for line in timing.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            seconds, end = float(parts[0]), float(parts[1])
            out.append((end - seconds, end))
    return out


class StopWhenFound:
    """A launch() sampler: Ctrl-C the run once findings.jsonl holds a finding `wanted` accepts (latency
    benchmarks stop there rather than train to the last step)."""

    def __init__(self, findings_path: Path, wanted: Callable[[dict], bool]) -> None:
        self.path, self.wanted, self.sent = findings_path, wanted, False

    def __call__(self, proc) -> None:
        if not self.sent and any(self.wanted(f) for f in read_jsonl(self.path)):
            proc.send_signal(signal.SIGINT)
            self.sent = True
