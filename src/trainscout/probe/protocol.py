"""Protocol fingerprint of one collective, and the rolling hash chained over a process group's stream.

Members of a process group must issue the same sequence of collectives; equal sequence numbers must
mean equal signatures. The signature keeps only what every member agrees on: for gather the
per-rank input, for scatter the per-rank output, for all-to-all only the dtypes (splits may differ).
"""

from __future__ import annotations

import functools
import hashlib

# A collective record's flags (the ring's `rolling_hash` slot, which the agent fills in for itself):
from trainscout.markers import NATIVE_HASH  # noqa: F401  (re-exported: what a native collective chains as)

NATIVE = 1  # issued outside Python (DDP's C++ reducer, functional collectives, compiled code)
DETAIL = 2  # the Flight Recorder's description of a NATIVE collective already placed in the ring

_PER_RANK_INPUT = {"gather"}
_PER_RANK_OUTPUT = {"scatter"}


def op_name(profiling_name: str) -> str:
    """'gloo:all_reduce' / 'nccl:all_reduce' -> 'all_reduce'."""
    return profiling_name.rsplit(":", 1)[-1]


def signature(op: str, in_sizes, in_dtypes, out_sizes, out_dtypes, extra: str = "") -> tuple:
    core: tuple
    if op in _PER_RANK_INPUT:
        core = (op, _shape(in_sizes), tuple(in_dtypes))
    elif op in _PER_RANK_OUTPUT:
        core = (op, _shape(out_sizes), tuple(out_dtypes))
    elif "all_to_all" in op or "alltoall" in op:
        core = (op, tuple(in_dtypes))
    else:
        core = (op, _shape(in_sizes), tuple(in_dtypes), _shape(out_sizes), tuple(out_dtypes))
    return core + ((extra,) if extra else ())


def describe(op: str, in_sizes, in_dtypes, extra: str = "") -> str:
    parts = [f"{d}{list(s)}" for d, s in zip(in_dtypes, in_sizes)]
    text = f"{op} {' '.join(parts[:3])}{' ...' if len(parts) > 3 else ''}"
    return f"{text} {extra}".strip()


@functools.lru_cache(maxsize=4096)  # the same few signatures recur every step
def entry_hash(sig: tuple) -> int:
    return int.from_bytes(hashlib.blake2b(repr(sig).encode(), digest_size=8).digest(), "little")


# What every member chains for a NATIVE collective, described or not: the probe describes those from
# Flight Recorder reads that come at different moments on each rank, so only where they sit in the stream
# is compared through the chain; their descriptions are compared record by record where members have them.


def chain(previous: int, entry: int) -> int:
    """Rolling hash: equal values at equal seq mean equal streams up to that seq (up to collisions)."""
    data = previous.to_bytes(8, "little") + entry.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _shape(sizes) -> tuple:
    return tuple(tuple(s) for s in sizes)
