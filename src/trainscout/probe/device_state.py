"""The replicated-state check's CUDA path: fingerprint a slot's byte ranges without a host sync.

`StateCheck` hashes one slot of byte ranges on its check steps. For ranges of CUDA tensors it hands the
slot here: the Triton kernel writes one fingerprint per range into a device int64 buffer on the training
stream (after the optimizer's kernels, so it reads the state of this step), the buffer is copied to
pinned host memory behind an event, and `publish` turns landed copies into the same records the CPU
path appends at once, carrying the step they were taken at. Ranges of CPU tensors go back to the caller,
except tiny ones (AdamW keeps its `step` counters as 4-byte CPU tensors beside CUDA state): those are
hashed here with plain integers and published with the next landed results, because the numpy path's
fixed cost per call (~0.2-0.5 ms) made them most of the state check's host time on a small model.
"""

from __future__ import annotations

from collections.abc import Callable

# Device bytes per second charged to the state check's time budget for the kernel's own time (it runs
# on the GPU, unseen by the host clock). H200 reads ~3.5 TB/s; a third of that is a safe estimate.
DEVICE_BYTES_PER_S = 1.0e12
SMALL_HOST_BYTES = 64  # CPU ranges up to this size are hashed with plain integers (see the docstring)


def usable(tensors) -> bool:
    """True when some tensor is on CUDA and the Triton kernel can run."""
    if not any(getattr(t, "is_cuda", False) for _, t in tensors):
        return False
    from trainscout.fingerprint import gpu

    return gpu.HAVE_TRITON


class DeviceStateHashes:
    def __init__(self, depth: int = 8) -> None:
        import torch

        from trainscout.probe.device_results import DeviceResults

        self.results = DeviceResults(torch.int64, depth)
        self._layout: list | None = None  # the StateCheck slot list the prepared launches belong to
        self._prepared: dict[int, tuple[list, list, list]] = {}
        self.launched_bytes = 0
        self.published = 0
        self._host_done: list[tuple[int, int, int, int, int]] = []  # tiny CPU ranges hashed at launch

    def prepare(self, layout: list) -> None:
        """Prepare every slot of a new layout and compile the kernel now (the state check's first step,
        in the job's warm-up) instead of on a later check step."""
        self._layout, self._prepared = layout, {}
        for index, slot in enumerate(layout):
            plan = self._prepared[index] = _prepare(slot)
            for prepared, _ in plan[2]:
                prepared.compile()

    def launch(self, layout: list, index: int, step: int) -> tuple[list, int]:
        """Enqueue the CUDA ranges of slot `index` of `layout`; returns (the CPU ranges left to the caller,
        device bytes enqueued). A slot whose ring entry is busy is skipped this time (counted in results)."""
        if layout is not self._layout:
            self._layout, self._prepared = layout, {}
        plan = self._prepared.get(index)
        if plan is None:
            plan = self._prepared[index] = _prepare(layout[index])
        host_items, small, groups = plan
        for tid, t, start, end in small:
            self._host_done.append((step, tid, start, end, small_range_fingerprint(t, start, end)))
        launched = 0
        for prepared, meta in groups:
            slot = self.results.take(prepared.device, len(meta))
            if slot is None:
                continue
            prepared.enqueue(slot.device)
            self.results.submit(slot, len(meta), (step, meta))
            launched += prepared.nbytes
        self.launched_bytes += launched
        return host_items, launched

    def publish(self, emit: Callable[[int, int, int, int, int], None]) -> int:
        """emit(step, tensor id, start, end, digest) for every landed result, in order; never waits."""
        return self._emit_all(self.results.ready(), emit)

    def flush(self, emit, timeout_s: float = 1.0) -> int:
        """Exit paths only: wait up to timeout_s for results still in flight."""
        return self._emit_all(self.results.wait(timeout_s), emit)

    def _emit_all(self, landed, emit) -> int:
        from trainscout.fingerprint.cpu import as_unsigned64

        n = 0
        if self._host_done:
            done, self._host_done = self._host_done, []
            for record in done:
                emit(*record)
            n += len(done)
        for (step, meta), values in landed:
            for (tid, start, end), v in zip(meta, values):
                emit(step, tid, start, end, as_unsigned64(int(v)))
                n += 1
        self.published += n
        return n


def _prepare(slot) -> tuple[list, list, list]:
    """(CPU entries, tiny CPU entries, [(PreparedRanges, [(tid, start, end)])] per CUDA device) of one slot."""
    from trainscout.fingerprint import gpu

    host_items, small = [], []
    by_device: dict = {}
    for tid, t, start, end in slot:
        if getattr(t, "is_cuda", False):
            by_device.setdefault(t.device, []).append((tid, t, start, end))
        elif end - start <= SMALL_HOST_BYTES and getattr(t, "device", None) is not None and t.device.type == "cpu":
            small.append((tid, t, start, end))
        else:
            host_items.append((tid, t, start, end))
    groups = []
    for entries in by_device.values():
        prepared = gpu.PreparedRanges([(t, s, e) for _, t, s, e in entries])
        groups.append((prepared, [(tid, s, e) for tid, _, s, e in entries]))
    return host_items, small, groups


def small_range_fingerprint(t, start: int, end: int) -> int:
    """`cpu.fingerprint_range(t, start, end)` of a few bytes of a CPU tensor, in plain integers: the same
    definition (word indices from start/4, zero-padded tail word, the length term), without numpy's
    per-call set-up."""
    from trainscout.fingerprint import cpu

    try:
        data = t.detach().numpy().tobytes()[start:end]  # C order whatever the strides
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, ...)
        data = bytes(cpu.tensor_bytes(t)[start:end].numpy())
    base = start // 4
    n_full = len(data) // 4
    sum_a = sum_b = 0
    for k in range(n_full):
        w = int.from_bytes(data[4 * k : 4 * k + 4], "little")
        sum_a += cpu.lane_a(w, base + k)
        sum_b += cpu.lane_b(w, base + k)
    if len(data) % 4:
        w = cpu.tail_word(data[4 * n_full :])
        sum_a += cpu.lane_a(w, base + n_full)
        sum_b += cpu.lane_b(w, base + n_full)
    return cpu.finalize(sum_a, sum_b, len(data))
