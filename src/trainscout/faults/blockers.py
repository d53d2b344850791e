"""Ways to hold up the calling thread for a given time, each a different real cause of a slow rank.

The delay fault uses them so that detection can be shown not to depend on how a rank is slowed: asleep in
time.sleep, burning CPU in Python, blocked in the kernel on a pipe read (as on a slow disk or socket), waiting
for a lock another thread holds (as on contended allocator or logging locks), or with the host free and the GPU
stream busy. Each blocker has `block(seconds)` and `close()`; helper threads are daemons, started once, so a
blocker never keeps a finished job alive.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any


class SleepBlocker:
    """The rank sleeps (off-CPU, in a sleep call)."""

    def block(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:
        pass


class BusyBlocker:
    """The rank computes: Python arithmetic until `seconds` of wall time have passed (its CPU time grows)."""

    def block(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        x = 1
        while time.perf_counter() < deadline:
            for _ in range(200):  # check the clock every few microseconds, not every operation
                x = (x * 1103515245 + 12345) & 0x7FFFFFFF

    def close(self) -> None:
        pass


class PipeBlocker:
    """The rank blocks in os.read on a pipe, in the kernel and off-CPU; a helper thread writes one byte when
    the time is up, like a disk or a socket answering late."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        self._deadlines: queue.Queue[float | None] = queue.Queue()
        self._helper = threading.Thread(target=self._answer, name="trainscout-fault-pipe", daemon=True)
        self._helper.start()

    def _answer(self) -> None:
        while True:
            deadline = self._deadlines.get()
            if deadline is None:
                return
            try:
                time.sleep(max(0.0, deadline - time.monotonic()))
            finally:  # whatever happens, the blocked read must end
                os.write(self._write_fd, b"\0")

    def block(self, seconds: float) -> None:
        if not self._helper.is_alive():  # nobody would ever answer: blocking would hang the rank
            raise RuntimeError("the pipe's helper thread is gone")
        self._deadlines.put(time.monotonic() + seconds)
        os.read(self._read_fd, 1)

    def close(self) -> None:
        self._deadlines.put(None)
        self._helper.join(timeout=5)
        if not self._helper.is_alive():
            os.close(self._read_fd)
            os.close(self._write_fd)


class LockBlocker:
    """The rank waits on a threading.Lock that a helper thread takes just before and holds for the delay."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = threading.Event()
        self._holds: queue.Queue[float | None] = queue.Queue()
        self._helper = threading.Thread(target=self._hold, name="trainscout-fault-lock", daemon=True)
        self._helper.start()

    def _hold(self) -> None:
        while True:
            seconds = self._holds.get()
            if seconds is None:
                return
            with self._lock:
                self._held.set()  # from here the rank's acquire below must wait the full hold
                time.sleep(seconds)

    def block(self, seconds: float) -> None:
        if not self._helper.is_alive():
            raise RuntimeError("the lock's helper thread is gone")
        self._held.clear()
        self._holds.put(seconds)
        # Wait until the helper holds the lock, so the acquire really blocks instead of winning the race.
        if not self._held.wait(timeout=seconds + 5.0):
            raise RuntimeError("the lock's helper thread did not take the lock")
        with self._lock:
            pass

    def close(self) -> None:
        self._holds.put(None)
        self._helper.join(timeout=5)


_SPIN_CYCLES_PER_MS: dict[int, float] = {}  # per CUDA device: clock rates differ between GPUs


def spin_gpu(ms: float) -> None:
    """A spin kernel of about `ms` on the current CUDA stream; the host returns at once."""
    import torch

    device = torch.cuda.current_device()
    cycles = _SPIN_CYCLES_PER_MS.get(device)
    if cycles is None:
        cycles = _SPIN_CYCLES_PER_MS[device] = _calibrate_spin()
    torch.cuda._sleep(int(cycles * ms))


def _calibrate_spin() -> float:
    """Spin cycles per millisecond on the current device, at its working clock."""
    import torch

    # An idle GPU runs at a fraction of its clock and ramps up under load: calibrated cold, spins came out
    # 2.5x too short on an H200. Spin first, then keep the fastest of two measurements.
    torch.cuda._sleep(20_000_000)
    rates = []
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        rates.append(10_000_000 / max(start.elapsed_time(end), 1e-3))
    return max(rates)


class GpuBlocker:
    """The GPU is busy, not the host: a spin kernel on the current stream (the host waits only where it syncs)."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("no CUDA")
        spin_gpu(0.0)  # calibrate now, not inside the first delayed forward

    def block(self, seconds: float) -> None:
        spin_gpu(seconds * 1000.0)

    def close(self) -> None:
        pass


def make_blocker(how: str) -> Any:
    """The blocker for delay's `how` (data uses the pipe, in the DataLoader)."""
    makers = {
        "sleep": SleepBlocker,
        "busy": BusyBlocker,
        "read": PipeBlocker,
        "data": PipeBlocker,
        "lock": LockBlocker,
        "gpu": GpuBlocker,
    }
    if how not in makers:
        raise ValueError(f"unknown how={how!r}; valid: {', '.join(makers)}")
    return makers[how]()
