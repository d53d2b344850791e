"""The local gradient as it enters its reduction: the norm of each bucket a rank hands to a data-parallel
all-reduce (a DDP communication hook's bucket) or reduce-scatter (FSDP2's unsharded gradient), read in the
collective's wrapper just before the call.

The per-parameter norms (nonfinite.py) read `.grad`, which a communication hook never writes: what a hook, or
a wrapper of the collective, does to a bucket before it is reduced (compression gone wrong, an injected fault)
leaves no trace there, and after FSDP2's backward `.grad` holds the reduced shard. The k-th gradient reduction
of a step carries the same parameters on every replica, so its norm is compared across them like a layer's
(evidence layers `grad-sync.K`, detectors/numerics.py); in a sharded class these are the gradients compared.

Only reductions issued inside a backward pass, on a group an integration declared data-parallel (`replicate`
or `shard`), count: a tensor-parallel reduction holds parts, not replicas, and DDP's own reducer (no hook)
calls the collective from C++, where the per-parameter norms already saw its input. An all-reduce counts only
when issued asynchronously, as a communication hook must (it returns a future): SyncBatchNorm's backward
all-reduces its channel statistics synchronously on the same group, and those are no gradient.

CPU: one float64 norm a bucket at the call. CUDA: the norm is queued on the stream before the collective, the
step's norms are copied to pinned memory behind an event at the step's end, and read once that event has
completed, with the rest of the step's evidence, a few steps later (no host sync on the training path). A large
bucket is read in sampled runs (SAMPLE_RUN, below).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

# collective -> the argument holding what the rank contributes
REDUCTION_INPUTS = {
    "all_reduce": "tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
}
DATA_PARALLEL_ROLES = ("replicate", "shard")
# A large bucket is read in runs of SAMPLE_RUN contiguous elements, one run every SAMPLE_STRIDE runs (1/64 of its
# elements and of its bytes), its sum of squares scaled back up: a second full read of the gradients each step
# would cost as much as the rest of the per-step evidence. Runs, not single elements 256 bytes apart: a memory
# read fetches whole sectors, so single elements cost a quarter to a half of a full read. On an H100, 607M float32
# elements: 0.057 ms in runs, 0.32 as single elements, 0.80 whole (bfloat16: 0.048, 0.23, 0.42); the estimate
# within 0.1 %. Every replica samples the same positions; noise or a scale over a layer's worth of elements (a
# few thousand or more) moves the estimate as it moves the whole.
SAMPLE_STRIDE = 64
SAMPLE_RUN = 16  # elements: 64 bytes of float32
SAMPLED_ABOVE = 1 << 16  # elements; smaller buckets are read whole
_KEPT_STEPS = 64


class GradSyncNorms:
    def __init__(self, role_of: Callable[[str], str | None], on_error: Callable[[str], None]) -> None:
        self._role_of = role_of
        self._on_error = on_error
        self._host: list[float] = []  # this step's sums of squares (CPU buckets)
        self._device: list = []  # this step's norms (CUDA buckets, 0-d tensors still on the device)
        self._ready: dict[int, np.ndarray] = {}  # step -> sums of squares
        self._landing: dict[int, tuple] = {}  # step -> (event, pinned norms, device norms kept alive)
        self._torch: Any = None  # imported on first use: the probe loads before the job imports torch
        self.broken = False
        self.observed = 0

    def observe(self, name: str, group_name: str, bound) -> None:
        """A collective about to be issued (the tap's wrapper, inside its fail-open guard)."""
        arg = REDUCTION_INPUTS.get(name)
        if arg is None or self.broken:
            return
        torch = self._torch
        if torch is None:
            import torch

            self._torch = torch
        if torch._C._current_graph_task_id() == -1:
            return  # not in a backward pass: not a gradient
        if name == "all_reduce" and not bound.get("async_op"):
            return  # a layer's own statistics (SyncBatchNorm's backward): a hook's bucket is reduced asynchronously
        if self._role_of(group_name) not in DATA_PARALLEL_ROLES:
            return
        value = bound.get(arg)
        tensors = list(value) if isinstance(value, (list, tuple)) else [value]
        if not tensors or not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
            return
        try:
            if tensors[0].device.type == "cuda":
                norms = [_norm(torch, t, torch.float32) for t in tensors]
                self._device.append(norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms)))
            else:
                sumsq = 0.0
                for t in tensors:
                    sumsq += float(_norm(torch, t, torch.float64)) ** 2
                self._host.append(sumsq)
            self.observed += 1
        except Exception as exc:  # fail open: lose this evidence, never the collective
            self._fail(exc)

    def end_step(self, step: int) -> None:
        """The optimizer step `step` ended: what its backward passes reduced belongs to it."""
        if self._host:
            self._ready[step] = np.asarray(self._host, dtype=np.float64)
            self._host = []
        if self._device:
            try:
                torch = self._torch
                norms = torch.stack(self._device)
                pinned = torch.empty(norms.shape, dtype=norms.dtype, pin_memory=True)
                pinned.copy_(norms, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._landing[step] = (event, pinned, norms)
            except Exception as exc:
                self._fail(exc)
            self._device = []
        for held in (self._ready, self._landing):
            for old in [s for s in held if s <= step - _KEPT_STEPS]:
                del held[old]

    def landed(self, step: int) -> bool:
        """Whether the step's norms can be read without waiting (a CUDA copy still in flight cannot)."""
        landing = self._landing.get(step)
        if landing is None:
            return True
        try:
            return bool(landing[0].query())
        except Exception as exc:
            self._fail(exc)
            return True

    def sums_of_squares(self, step: int) -> np.ndarray | None:
        """The step's buckets' sums of squares in the order they were reduced, or None if none were seen (a CUDA
        step's: once `landed`, or at the end of the run, when waiting for it is no longer on the training path)."""
        ready = self._ready.pop(step, None)
        if ready is not None:
            return ready
        landing = self._landing.pop(step, None)
        if landing is None:
            return None
        event, pinned, _ = landing
        try:
            event.synchronize()
            return pinned.numpy().astype(np.float64) ** 2
        except Exception as exc:
            self._fail(exc)
            return None

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        self._host, self._device = [], []
        self._on_error(f"gradient-sync norms disabled: {exc!r}")


def _norm(torch, t, dtype):
    """The bucket's L2 norm, estimated from its runs (see SAMPLE_RUN) when it is large: a view, no copy. The last
    partial period (under 1,024 elements) is left out, alike on every replica."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= SAMPLED_ABOVE:
        return torch.linalg.vector_norm(flat, dtype=dtype)
    period = SAMPLE_RUN * SAMPLE_STRIDE
    runs = flat[: n - n % period].view(-1, period)[:, :SAMPLE_RUN]
    return torch.linalg.vector_norm(runs, dtype=dtype) * SAMPLE_STRIDE**0.5
