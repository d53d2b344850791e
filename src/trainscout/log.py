"""trainscout's own diagnostic log: one logger tree, one format, and every line says which process, rank and step.

Every process of a run (the supervisor, the coordinator, each node's agent, each rank's probe) appends to
`runs/<id>/trainscout.log`:

    2026-12-03T12:40:01.512Z probe      rank=2 step=812 WARNING trainscout.probe: state check off: ...
    2026-12-03T12:40:02.004Z coordinator rank=- step=812 INFO    trainscout.console: link probe at step 820

Findings are not logged here (findings.jsonl holds them); what is: warnings and notes the console shows, the
probe's internal errors (each also reaches the console through the agent), and errors the agent and the
coordinator survive. Lines are short single writes to a file opened for appending, so processes can share it.
A process outside a run (no run folder) logs nowhere unless `setup` is given a folder.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

LOG_FILE = "trainscout.log"
ROOT = "trainscout"
_FORMAT = "%(utc)s %(role)-11s rank=%(rank)s step=%(step)s %(levelname)-7s %(name)s: %(message)s"


class _Context(logging.Filter):
    """Stamps each record with the process's role, rank and current step (read when the line is written)."""

    def __init__(self, role: str, rank: int | None, step: Callable[[], int | None] | None) -> None:
        super().__init__()
        self.role, self.rank, self.step = role, rank, step

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        record.rank = "-" if self.rank is None else self.rank
        try:
            step = self.step() if self.step is not None else None
        except Exception:  # a step reader must never cost a log line
            step = None
        record.step = "-" if step is None else step
        t = record.created
        record.utc = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
        return True


def setup(
    role: str,
    run_dir: str | None,
    *,
    rank: int | None = None,
    step: Callable[[], int | None] | None = None,
    level: str = "INFO",
) -> logging.Logger:
    """Route the `trainscout` logger tree of this process to the run's log file (once; a second call replaces
    the first's handler, as after a fork). Without a writable run folder nothing is written."""
    root = logging.getLogger(ROOT)
    root.setLevel(level.upper())
    root.propagate = False  # the training script's own logging configuration never sees our lines
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    if run_dir and os.path.isdir(run_dir):
        try:
            handler: logging.Handler = logging.FileHandler(os.path.join(run_dir, LOG_FILE), mode="a", delay=True)
        except OSError:
            handler = logging.NullHandler()
    else:
        handler = logging.NullHandler()
    handler.addFilter(_Context(role, rank, step))
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    return root


def get(name: str) -> logging.Logger:
    """The logger of one part (`get("probe")` is `trainscout.probe`); silent until `setup` ran."""
    logger = logging.getLogger(f"{ROOT}.{name}")
    root = logging.getLogger(ROOT)
    if not root.handlers:
        root.addHandler(logging.NullHandler())  # not Python's last-resort stderr handler: stay silent
        root.propagate = False
    return logger
