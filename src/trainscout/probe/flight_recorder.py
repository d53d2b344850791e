"""Reads torch's Flight Recorder, the one place that sees every collective of a rank.

Python wrappers around torch.distributed miss the all-reduces DDP issues from C++ and the functional
collectives of DTensor; the Flight Recorder logs them all, on gloo and NCCL alike. A status-only dump
costs tens of microseconds, a full dump grows with the buffer, so the publisher asks for entries only
when a sequence number moved.
"""

from __future__ import annotations

import pickle
import sys


def _c10d():
    return sys.modules.get("torch._C._distributed_c10d")


def available() -> bool:
    c = _c10d()
    return c is not None and hasattr(c, "_dump_fr_trace")


def dist_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def status() -> dict[str, int]:
    """pg id -> last enqueued collective sequence number."""
    raw = pickle.loads(_c10d()._dump_fr_trace(includeCollectives=False, includeStackTraces=False))
    out = {}
    for pg_id, st in (raw.get("pg_status") or {}).items():
        out[str(pg_id)] = int(st.get("last_enqueued_collective", -1))
    return out


def entries() -> tuple[list[dict], dict]:
    """All buffered entries (oldest first) and the pg config {name: {"desc", "ranks"}}."""
    raw = pickle.loads(_c10d()._dump_fr_trace(includeCollectives=True, includeStackTraces=False))
    return raw.get("entries") or [], raw.get("pg_config") or {}
