"""Results computed on the GPU, read on the host later, with no host-device synchronisation.

The probe's per-step checks on CUDA tensors (replicated-state fingerprints, non-finite flags) run as
kernels on the training stream. Reading their results at once (`.item()`, `int(t)`) would stall the host
until the GPU drained its queue, every check step. Instead each result vector is copied into pinned
host memory with `non_blocking=True` and a CUDA event is recorded behind the copy; the records are
published once `event.query()` says the copy landed, a step or more later. Nothing here waits.

`InFlight` is the bookkeeping (a bounded FIFO judged in order, no torch); `DeviceResults` adds the
buffers and events. A result whose slot ring is full is dropped and counted, never waited for.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any


class InFlight:
    """A bounded FIFO of submitted results; `ready()` pops, in submission order, those whose copy landed.

    Results complete in stream order, so the first one not done ends the scan. `depth` bounds the
    host memory held and how far the host may run ahead of the GPU before checks are skipped.
    """

    def __init__(self, depth: int) -> None:
        self.depth = max(1, depth)
        self._queue: deque[tuple[Callable[[], bool], Any]] = deque()
        self.dropped = 0
        self.submitted = 0
        self.completed = 0

    def has_room(self) -> bool:
        return len(self._queue) < self.depth

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, is_done: Callable[[], bool], payload: Any) -> None:
        if not self.has_room():
            raise RuntimeError("InFlight is full: check has_room() first")
        self._queue.append((is_done, payload))
        self.submitted += 1

    def ready(self) -> list[Any]:
        out = []
        while self._queue and self._queue[0][0]():
            out.append(self._queue.popleft()[1])
        self.completed += len(out)
        return out

    def drop(self) -> None:
        """Count a result that was not taken because the ring was full."""
        self.dropped += 1


class DeviceResults:
    """A ring of (device buffer, pinned host buffer, event) slots for small result vectors.

    Use: `slot = take(device, n)`; write n values into `slot.device[:n]` with kernels on the current
    stream; `submit(slot, n, payload)`; later `ready()` returns `(payload, host_values)` pairs whose
    copy completed. `take` returns None when every slot is still in flight (the caller skips that check).
    """

    def __init__(self, dtype, depth: int = 8) -> None:
        self.dtype = dtype
        self.inflight = InFlight(depth)
        self._free: list[_Slot] = []
        self._slots = 0

    def take(self, device, n: int):
        if not self.inflight.has_room():
            self.inflight.drop()
            return None
        for i, slot in enumerate(self._free):
            if slot.device.device == device and slot.device.numel() >= n:
                return self._free.pop(i)
        if self._free:
            self._free.pop(0)  # too small or another device: let it go, grow a new one
        return _Slot(device, max(n, 16), self.dtype)

    def give_back(self, slot) -> None:
        """Return a slot that was taken but not submitted."""
        self._free.append(slot)

    def submit(self, slot, n: int, payload: Any) -> None:
        import torch

        views = slot.views.get(n)
        if views is None:  # slicing costs ~2 us of host time each: once per (slot, length)
            views = slot.views[n] = (slot.host[:n], slot.device[:n])
        views[0].copy_(views[1], non_blocking=True)
        slot.event.record(torch.cuda.current_stream(slot.device.device))
        self.inflight.push(slot.event.query, (slot, n, payload))

    def ready(self) -> list[tuple[Any, Any]]:
        """(payload, numpy array of the n values) for every landed result, in order."""
        out = []
        for slot, n, payload in self.inflight.ready():
            values = slot.host_np[:n].copy()  # host memory: no device access (numpy: ~100x cheaper than tolist)
            self._free.append(slot)
            out.append((payload, values))
        return out

    def wait(self, timeout_s: float) -> list[tuple[Any, Any]]:
        """Everything in flight, polling up to timeout_s (exit paths only: never in steady state)."""
        deadline = time.monotonic() + timeout_s
        out = self.ready()
        while len(self.inflight) and time.monotonic() < deadline:
            time.sleep(0.001)
            out += self.ready()
        return out

    @property
    def pending(self) -> int:
        return len(self.inflight)


class _Slot:
    # aux: whatever else the check needs per slot (e.g. an input table it rewrites only when the slot is
    # taken again, i.e. after the copies behind its last event completed)
    __slots__ = ("device", "host", "host_np", "event", "aux", "views")

    def __init__(self, device, n: int, dtype) -> None:
        import torch

        self.device = torch.empty(n, dtype=dtype, device=device)
        self.host = torch.empty(n, dtype=dtype, pin_memory=True)
        self.host_np = self.host.numpy()
        self.event = torch.cuda.Event()
        self.aux = None
        self.views: dict = {}  # n -> (host[:n], device[:n])
