"""Per-step timings of a rank: wall time, CPU time, time in data loading and in checkpoint writes.

Ranks of a data-parallel job run the same work per step, so a rank that needs more CPU per step is a
compute straggler, one that spends its step waiting for data is data-loader stalled, one that spends
it in `torch.save` is checkpoint-write stalled. Wall time is equal on all ranks (they wait for each
other), CPU time and the two waits are not. One record per step; the coordinator compares ranks.
"""

from __future__ import annotations

import time

STEP_PG_INDEX = -4


class StepTiming:
    def __init__(self, append) -> None:
        self.append = append
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        self.data_s = 0.0
        self.ckpt_s = 0.0
        self.io_cpu_s = 0.0  # CPU spent inside data loading and checkpoint writes: not "compute"
        self.last_wall_s = 0.0
        self.total_wall_s = 0.0  # from the first step's end: what per-step costs are compared against

    def after_step(self, step: int) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        data_us, ckpt_us = int(self.data_s * 1e6), int(self.ckpt_s * 1e6)
        compute_cpu = max(0.0, cpu - self._cpu - self.io_cpu_s)
        self.append(STEP_PG_INDEX, step, int(compute_cpu * 1e9), int((wall - self._wall) * 1e9),
                    time.time_ns(), step, "step", f"{data_us}:{ckpt_us}")
        self.last_wall_s = wall - self._wall
        if step > 1:
            self.total_wall_s += self.last_wall_s
        self._wall, self._cpu = wall, cpu
        self.data_s = self.ckpt_s = self.io_cpu_s = 0.0

    def add_checkpoint(self, wall_s: float, cpu_s: float) -> None:
        self.ckpt_s += wall_s
        self.io_cpu_s += cpu_s

    def wrap_dataloader(self, module) -> None:
        """Time every batch fetched from a torch DataLoader (single- and multi-process iterators)."""
        cls = module._BaseDataLoaderIter
        real = cls.__next__
        timing = self

        def __next__(it):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return real(it)
            finally:
                timing.data_s += time.perf_counter() - t0
                timing.io_cpu_s += time.process_time() - c0

        __next__.__wrapped__ = real  # type: ignore[attr-defined]
        cls.__next__ = __next__
