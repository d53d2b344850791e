"""Agent side of the channel: maps a rank's file read-only and copies out consistent records."""

from __future__ import annotations

import mmap
import os

import numpy as np

from trainscout.channel.layout import HEADER_BYTES, HEADER_DTYPE, MAGIC, RECORD_DTYPE, RING_SLOTS, TOTAL_BYTES


class ChannelReader:
    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.inode = st.st_ino  # a restarted rank's probe renames a new file over this path
            if st.st_size < TOTAL_BYTES:
                raise ValueError(f"{path}: channel file too small (probe still creating it?)")
            self._mm = mmap.mmap(fd, TOTAL_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._header = np.ndarray((), dtype=HEADER_DTYPE, buffer=self._mm, offset=0)
        self._ring = np.ndarray((RING_SLOTS,), dtype=RECORD_DTYPE, buffer=self._mm, offset=HEADER_BYTES)
        self.read_head = 0  # records consumed so far
        self.lost = 0  # records overwritten before we read them

    def replaced(self) -> bool:
        """Whether the path now names another file than the one mapped (a new attempt's, or none)."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except OSError:
            return False

    def ready(self) -> bool:
        return int(self._header["magic"]) == MAGIC

    def header(self) -> np.void:
        return self._header.copy()[()]

    def new_records(self) -> np.ndarray:
        """Records written since the last call, oldest first; slots caught mid-write are retried once."""
        head = int(self._header["ring_head"])
        if head <= self.read_head:
            return self._ring[:0].copy()
        start = self.read_head
        if head - start > RING_SLOTS - 1:  # the writer lapped us: keep the newest, count the loss
            self.lost += head - start - (RING_SLOTS - 1)
            start = head - (RING_SLOTS - 1)
        idx = np.arange(start, head) % RING_SLOTS
        before = self._ring["lock"][idx].copy()
        out = self._ring[idx].copy()
        after = self._ring["lock"][idx]
        good = (before == after) & (before % 2 == 0) & (before > 0)
        if not good.all():
            out = out[good]  # torn slots are rare (writer lapping): drop rather than trust them
            self.lost += int((~good).sum())
        self.read_head = head
        return out

    def close(self) -> None:
        try:
            self._mm.close()
        except (ValueError, BufferError):
            pass
