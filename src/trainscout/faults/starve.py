"""The starve fault: from step S on, this rank shares its CPU with busy-looping processes and runs slower.

Models a noisy neighbour, a mis-set cgroup or a runaway process on the rank's core: nothing in the rank itself
changes, it simply gets a fraction of a CPU. The rank's threads are pinned to the CPU it runs on now, and
`hogs` child processes spin on that same CPU. The hogs must never outlive the rank, even one killed with
SIGKILL: they ask the kernel for SIGKILL when their parent dies (PR_SET_PDEATHSIG), check that the parent is
still the rank every few million iterations (where prctl is missing), and are killed at exit (atexit) or by
close().
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
from typing import Any

from trainscout.faults.schedule import StepSchedule

# Runs with -I -S: no site, no PYTHONPATH, so the probe's sitecustomize bootstrap never loads into a hog.
_HOG = """
import ctypes, os, signal, sys
parent, cpu = int(sys.argv[1]), int(sys.argv[2])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != parent:  # the rank died before the prctl took hold
    sys.exit(0)
os.sched_setaffinity(0, {cpu})
n = 0
while True:
    n += 1
    if not n & 0x3FFFFF and os.getppid() != parent:
        break
"""


def current_cpu() -> int:
    """The CPU this thread runs on now (glibc sched_getcpu, else /proc), else the first one it may use."""
    allowed = os.sched_getaffinity(0)
    cpu: int | None = None
    try:
        import ctypes

        cpu = ctypes.CDLL(None, use_errno=True).sched_getcpu()
    except Exception:
        try:
            with open("/proc/self/stat") as fh:  # field 39: the CPU last run on (after the ")" of comm)
                cpu = int(fh.read().rsplit(")", 1)[1].split()[36])
        except Exception:
            cpu = None
    return cpu if cpu in allowed else min(allowed)


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # 0: the calling thread


class CpuStarver:
    def __init__(self, params: dict[str, Any], start: int) -> None:
        if not hasattr(os, "sched_setaffinity"):
            raise ValueError("this platform has no sched_setaffinity")
        self.hogs_wanted = int(params["hogs"])
        self.schedule = StepSchedule(start)
        self.cpu: int | None = None
        self.hogs: list[subprocess.Popen] = []
        self._saved_affinity: dict[int, set[int]] = {}

    def arm(self) -> str:
        return f"{self.hogs_wanted} busy-looping process(es) share this rank's CPU from step {self.schedule.start}"

    def on_step(self, step: int) -> None:
        if self.cpu is None and self.schedule.fires_after(step):
            self._start()

    def _start(self) -> None:
        cpu = self.cpu = current_cpu()
        # Every thread of the rank, not only the caller: sched_setaffinity(0) pins one thread (Linux), and the
        # compute may run on others (intra-op pools). Threads created later inherit the creator's mask.
        for tid in _thread_ids():
            try:
                self._saved_affinity[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {cpu})
            except OSError:  # the thread ended meanwhile
                pass
        atexit.register(self.close)
        # PR_SET_PDEATHSIG fires when the thread that forked dies: the probe calls on_step_end from the
        # training thread, which lives as long as the rank.
        for _ in range(self.hogs_wanted):
            self.hogs.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _HOG, str(os.getpid()), str(cpu)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    close_fds=True,
                )
            )

    def close(self) -> None:
        """Kill the hogs and give the rank's threads their CPUs back."""
        for hog in self.hogs:
            try:
                hog.send_signal(signal.SIGKILL)
                hog.wait(timeout=5)
            except Exception:
                pass
        self.hogs.clear()
        for tid, cpus in self._saved_affinity.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass
        self._saved_affinity.clear()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
