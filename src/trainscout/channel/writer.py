"""Probe side of the channel: creates the file and writes header fields and ring records."""

from __future__ import annotations

import mmap
import os
import struct
import time

import numpy as np

from trainscout.channel.layout import (
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    RECORD_DTYPE,
    RING_SLOTS,
    TOTAL_BYTES,
    channel_path,
)

# One ring record as plain bytes: a numpy field assignment per column cost ~15 us a record on the
# training thread (one record per collective issued from Python); packing the payload at once ~2 us.
_LOCK = struct.Struct("<Q")
_PAYLOAD = struct.Struct("<qqQQqq24s120s")  # pg_index .. desc, right after the lock
_PAYLOAD_FIELDS = ("pg_index", "seq", "entry_hash", "rolling_hash", "wall_ns", "step", "op", "desc")
_RECORD_FIELDS, _HEADER_FIELDS = RECORD_DTYPE.fields, HEADER_DTYPE.fields
assert _RECORD_FIELDS is not None and _HEADER_FIELDS is not None  # both are structured dtypes
assert _RECORD_FIELDS["lock"][1] == 0 and RECORD_DTYPE.itemsize == _LOCK.size + _PAYLOAD.size
assert [_RECORD_FIELDS[f][1] for f in _PAYLOAD_FIELDS] == [8, 16, 24, 32, 40, 48, 56, 80]
# Header integers are stored the same way: one struct store (~0.2 us) where a numpy field assignment took ~1 us,
# and the training thread sets several per step. Text fields go through numpy.
_INT_FIELDS = {
    name: (offset, struct.Struct("<" + {"<i8": "q", "<u8": "Q"}[dt.str]))
    for name, (dt, offset, *_) in _HEADER_FIELDS.items()
    if dt.str in ("<i8", "<u8")
}


_RING_HEAD_AT, _RING_HEAD = _INT_FIELDS["ring_head"]


class ChannelWriter:
    def __init__(self, run_id: str, rank: int, local_rank: int, world_size: int, attempt: int = 0) -> None:
        self.path = channel_path(run_id, rank)
        # A new file renamed over the old one, never the old one rewritten: after an elastic restart the agent
        # still holds the previous attempt's file (its exit record) until it has read it to the end.
        building = f"{self.path}.{os.getpid()}.new"
        fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, TOTAL_BYTES)
            self._mm = mmap.mmap(fd, TOTAL_BYTES)
        finally:
            os.close(fd)
        self.header = np.ndarray((), dtype=HEADER_DTYPE, buffer=self._mm, offset=0)
        self.ring = np.ndarray((RING_SLOTS,), dtype=RECORD_DTYPE, buffer=self._mm, offset=HEADER_BYTES)
        now = time.monotonic_ns()
        h = self.header
        h["pid"] = os.getpid()
        h["rank"] = rank
        h["local_rank"] = local_rank
        h["world_size"] = world_size
        h["start_wall_ns"] = time.time_ns()
        h["heartbeat_ns"] = now
        h["progress_ns"] = now
        h["step_ns"] = now
        h["attempt"] = attempt
        h["magic"] = MAGIC  # last: a reader trusts the file only once this is set
        os.replace(building, self.path)
        self._head = 0

    def set(self, field: str, value) -> None:
        spec = _INT_FIELDS.get(field)
        if spec is None:
            self.header[field] = value
        else:
            spec[1].pack_into(self._mm, spec[0], int(value))

    def append(
        self,
        pg_index: int,
        seq: int,
        entry_hash: int,
        rolling_hash: int,
        wall_ns: int,
        step: int,
        op: str,
        desc: str | bytes,
    ) -> None:
        off = HEADER_BYTES + (self._head % RING_SLOTS) * RECORD_DTYPE.itemsize
        mm = self._mm
        lock = (_LOCK.unpack_from(mm, off)[0] + 1) | 1
        _LOCK.pack_into(mm, off, lock)  # odd: being written
        _PAYLOAD.pack_into(
            mm,
            off + _LOCK.size,
            pg_index,
            seq,
            entry_hash,
            rolling_hash,
            wall_ns,
            step,
            op.encode()[:24],
            (desc if isinstance(desc, bytes) else desc.encode())[:120],
        )
        _LOCK.pack_into(mm, off, lock + 1)  # even: complete
        self._head += 1
        _RING_HEAD.pack_into(mm, _RING_HEAD_AT, self._head)

    def record_exit(self, how: str, code: int | None, signal: int | None, text: str) -> None:
        h = self.header
        if int(h["exit_state"]):
            return  # the first cause wins: a later atexit must not overwrite a recorded exception
        h["exit_code"] = -1 if code is None else int(code)
        h["exit_signal"] = 0 if signal is None else int(signal)
        h["exit_how"] = how.encode()[:16]
        h["exit_text"] = text.encode(errors="replace")[:480]
        h["exit_ns"] = time.monotonic_ns()
        h["exit_state"] = 1

    def close(self) -> None:
        try:
            self._mm.flush()
        except (ValueError, OSError):
            pass
