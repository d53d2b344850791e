"""Is the training GPU still working through its queue? Looked at on the probe's ticks while the rank makes no progress.

A rank whose GPU hangs (a kernel that never ends: a spin, a deadlock in a custom kernel, a device that stopped)
blocks on that GPU at its next synchronisation, usually inside the gradient all-reduce its peers wait in too:
every member then shows the same sequence number and the hang vote has nobody behind. What tells it apart is
its queue: an event recorded behind the work queued on its training stream does not complete, where its peers'
streams, their work done, are idle while they wait on the host for its data.

While the rank makes no progress and its training thread waits (it neither computed nor moved since the last
tick: probe/activity.py), the probe's thread records one event on the training stream (the stream the loss was
computed on) and queries it on later ticks, never waiting: header `gpu_pending_ns` holds when it was recorded until
it completes, then 0 for the rest of that quiet spell (one event a spell: a drained queue reads 0 throughout, not
the age of a fresh event). On progress, or once the training thread works again, the look ends. Nothing runs on
the healthy path. Only a waiting training thread is looked at because CUDA forbids other threads' event queries
while a graph is captured (a capture in progress would be broken): a thread capturing a graph is busy launching
kernels; and the training stream's own capture status is checked first.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


class GpuQueue:
    def __init__(self, set_field: Callable[[str, int], None], stream_of: Callable[[], Any]) -> None:
        self._set = set_field
        self._stream_of = stream_of  # the training stream, or None (no CUDA loss seen)
        self._event: Any = None
        self._drained = False  # this quiet spell's event completed
        self._progress_seen: int | None = None
        self.broken = False

    def look(self, progress_ns: int, waiting: bool) -> None:
        """Publisher thread, each tick; `waiting`: the training thread neither computed nor moved since the last."""
        if progress_ns != self._progress_seen or not waiting:  # it issued a collective, or works: the look ends
            self._progress_seen = progress_ns
            self._drained = False
            self._clear()
            return
        stream = self._stream_of()
        torch = sys.modules.get("torch")
        if stream is None or torch is None or self.broken or self._drained:
            return
        try:
            if self._event is None:
                with torch.cuda.stream(stream):
                    if torch.cuda.is_current_stream_capturing():
                        return
                event = torch.cuda.Event()
                event.record(stream)
                self._event = event
                self._set("gpu_pending_ns", time.monotonic_ns())
            elif self._event.query():
                self._drained = True
                self._clear()
        except Exception:  # a CUDA error here is the job's to report, not ours: stop looking
            self.broken = True
            self._clear()

    def _clear(self) -> None:
        if self._event is not None:
            self._event = None
            self._set("gpu_pending_ns", 0)
