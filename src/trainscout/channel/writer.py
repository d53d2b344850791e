"""Probe side of the channel: creates the file and writes header fields and ring records."""

from __future__ import annotations

import mmap
import os
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


class ChannelWriter:
    def __init__(self, run_id: str, rank: int, local_rank: int, world_size: int) -> None:
        self.path = channel_path(run_id, rank)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
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
        h["magic"] = MAGIC  # last: a reader trusts the file only once this is set
        self._head = 0

    def set(self, field: str, value) -> None:
        self.header[field] = value

    def append(self, pg_index: int, seq: int, entry_hash: int, rolling_hash: int, wall_ns: int,
               step: int, op: str, desc: str) -> None:
        slot = self.ring[self._head % RING_SLOTS]
        lock = int(slot["lock"]) + 1
        slot["lock"] = lock | 1  # odd: being written
        slot["pg_index"] = pg_index
        slot["seq"] = seq
        slot["entry_hash"] = entry_hash
        slot["rolling_hash"] = rolling_hash
        slot["wall_ns"] = wall_ns
        slot["step"] = step
        slot["op"] = op.encode()[:24]
        slot["desc"] = desc.encode()[:120]
        slot["lock"] = (lock | 1) + 1  # even: complete
        self._head += 1
        self.header["ring_head"] = self._head

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
