"""What a fired fault leaves behind: one "trainscout-fault:" line on stderr and, when TRAINSCOUT_FAULT_LOG names
a file, one JSON line in it.

The stderr line lets a demo show cause next to effect; the JSON line lets benchmarks measure detection latency
from the moment a fault took effect (and count the occurrences of an intermittent one). Shared by the injector
and the drills whose hooks act later, inside forward, backward or data loading. Never raises.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import msgspec

LOG_PREFIX = "trainscout-fault:"

# A file path; when set, every fault that fires appends {"t", "rank", "kind", "step", "params"} as a JSON line.
FAULT_LOG_ENV = "TRAINSCOUT_FAULT_LOG"


def log_line(message: str) -> None:
    try:
        sys.stderr.write(f"{LOG_PREFIX} {message}\n")
        sys.stderr.flush()
    except Exception:  # a closed or broken stderr must not turn a log line into a crash
        pass


def record(rank: int, kind: str, step: int, params: Mapping[str, Any]) -> None:
    """Append the fault's JSON line to $TRAINSCOUT_FAULT_LOG, before the fault takes effect.

    Callers write it first because a fault may never return (hang, gil) or kill the process (SIGKILL):
    one os.write on an O_APPEND fd reaches the kernel at once (no Python buffer to lose) and keeps lines
    from several ranks whole. Never raises: a benchmark's bookkeeping must not change the fault.
    """
    try:
        path = os.environ.get(FAULT_LOG_ENV)
        if not path:
            return
        line = (
            json.dumps(
                {"t": time.time(), "rank": rank, "kind": kind, "step": step, "params": dict(params)}, default=str
            )
            + "\n"
        )
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except Exception:
        pass


class FaultRecord(msgspec.Struct):
    """One line `record` wrote (params may hold anything JSON-able, NaN included: Python's json writes it)."""

    t: float
    rank: int
    kind: str
    step: int
    params: dict = {}


def read_fault_log(path: str) -> list[dict]:
    """The fault log's records in order, as dicts. Every rank appends to the file and a fault can kill its
    process mid-line, so a line that is not a record of this shape is skipped, never raised on."""
    from trainscout.sinks.jsonl import read_objects  # here: ranks write the log and need none of the sinks

    out = []
    for doc in read_objects(path):  # (torn or non-JSON lines are skipped there)
        try:
            out.append(msgspec.structs.asdict(msgspec.convert(doc, FaultRecord)))
        except msgspec.ValidationError:  # JSON, but not a record
            continue
    return out
