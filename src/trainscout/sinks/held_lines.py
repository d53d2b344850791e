"""An append-only file that outlives a full disk: what cannot be written now is held in memory, in order, and
written with the next append (or at close) once there is space again.

The run folder may sit on a quota or a small filesystem that fills while the job trains. trainscout must not die
of that (its findings would die with it) nor stall: a line that does not fit is held (up to a bound; beyond it,
new lines are counted and dropped), the first failure is said once through `on_full`, and the return of space
through `on_space`. Writes are single unbuffered `os.write` calls on an O_APPEND descriptor, so a partial write
leaves the rest of the line at the head of the queue, and a reader never sees lines out of order.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

MAX_HELD_BYTES = 16 * 1024 * 1024


class HeldLines:
    def __init__(
        self,
        path: str,
        on_full: Callable[[str, OSError], None] | None = None,
        on_space: Callable[[str, int], None] | None = None,
        max_held_bytes: int = MAX_HELD_BYTES,
    ) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._held: deque[bytes] = deque()
        self._held_bytes = 0
        self._max = max_held_bytes
        self.on_full = on_full
        self.on_space = on_space
        self.full = False
        self.dropped = 0  # lines given up because the holding bound was reached
        self._held_since_full = 0

    @property
    def closed(self) -> bool:
        return self._fd is None

    @property
    def held(self) -> int:
        """Lines (or line remainders) waiting for space."""
        return len(self._held)

    def append(self, line: bytes) -> None:
        if self._fd is None:
            return
        if self._held_bytes + len(line) > self._max:
            self.dropped += 1
        else:
            self._held.append(line)
            self._held_bytes += len(line)
        self.drain()

    def drain(self) -> bool:
        """Write what is held; True when nothing is left."""
        while self._held and self._fd is not None:
            head = self._held[0]
            try:
                n = os.write(self._fd, head)
            except OSError as exc:
                if not self.full:
                    self.full = True
                    self._held_since_full = len(self._held)
                    if self.on_full is not None:
                        self.on_full(self.path, exc)
                else:
                    self._held_since_full = max(self._held_since_full, len(self._held))
                return False
            self._held_bytes -= n
            if n < len(head):
                self._held[0] = head[n:]
            else:
                self._held.popleft()
        if self.full:
            self.full = False
            if self.on_space is not None:
                self.on_space(self.path, self._held_since_full)
        return True

    def close(self) -> None:
        if self._fd is None:
            return
        self.drain()
        os.close(self._fd)
        self._fd = None


class FullFolderNotice:
    """One process's word on its run folder: said once when it fills, once when it has space again."""

    def __init__(self, warn: Callable[[str], None], info: Callable[[str], None]) -> None:
        self.warn, self.info = warn, info
        self.is_full = False

    def full(self, path: str, exc: OSError) -> None:
        if not self.is_full:
            self.is_full = True
            self.warn(
                f"the run folder is full ({exc.strerror or exc} writing {os.path.basename(path)}): findings still "
                "reach the terminal; what trainscout records is held in memory and written once there is space"
            )

    def space(self, path: str, lines: int) -> None:
        if self.is_full:
            self.is_full = False
            self.info(f"the run folder has space again: the held lines are written ({os.path.basename(path)}: {lines})")
