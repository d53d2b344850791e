"""Replicated-state fingerprints: after the optimizer step, hash parameters and optimizer state in slots.

Data-parallel replicas (DDP, ZeRO-1/2, HSDP replicas) must hold bit-identical parameters and optimizer
state after every step. Hashing everything every step would cost a full pass over memory, so the state
is cut into `n` slots of byte ranges and step `s` hashes slot `s mod n`, only on steps that are a multiple
of a power-of-two stride. The stride is chosen so the hashing costs at most `budget` (default 0.5 %) of
the measured step time.

Replicas need not agree on the stride: slot `s mod n` depends only on the step and the state's structure
(which replicas share), so every step two replicas both hash is comparable, and with `n` odd the steps of
any power-of-two stride still visit every slot. The coordinator compares per (step, tensor, range) and names
the odd one out. A fixed `period` (slots = period, every step) replaces the budget when set, for tests.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from trainscout.channel.layout import tensor_table_path
from trainscout.probe import device_state
from trainscout.probe.budget import fit_stride

STATE_PG_INDEX = -1  # ring records with this pg index are state fingerprints, not collectives
_ALIGN = 4
_TARGET_SLOTS = 63  # odd; fewer when the state is small (slots never go below min_chunk bytes)
_MAX_STRIDE = 1 << 12


class StateCheck:
    name = "state_check"  # its figures' key in the rank's cost report

    def __init__(
        self,
        run_id: str,
        rank: int,
        append,
        *,
        budget: float = 0.005,
        period: int = 0,
        min_chunk: int = 256 * 1024,
        initial_stride: int = 16,
    ) -> None:
        self.run_id = run_id
        self.rank = rank
        self.append = append  # (pg_index, seq, entry_hash, rolling, wall_ns, step, op, desc)
        self.budget = budget
        self.fixed_period = max(0, period)
        self.min_chunk = min_chunk
        self.stride = 1 if self.fixed_period else max(1, initial_stride)
        self.names: dict[int, str] = {}  # id(param) -> name, from the model when the probe saw it
        self.replica_group: str | None = None
        self._structure: tuple | None = None
        self._quick: tuple | None = None
        self._slots: list[list[tuple[int, Any, int, int]]] = []  # slot -> [(tensor id, tensor, start, end)]
        self._cost_s = 0.0  # smoothed seconds per hashed step
        self._wall_s = 0.0  # smoothed seconds per training step
        self.spent_s = 0.0
        self.checked_bytes = 0
        self.replay_layers: list[str] = []
        self.table: list[tuple[str, str | None]] = []  # tensor id -> (name, comparison group)
        self._ids: dict[str, int] = {}
        self._bytes = 0  # total bytes of the planned state
        self._device: device_state.DeviceStateHashes | None = None  # the CUDA path, made when CUDA state shows up
        self._params_of = None  # a module whose parameters alone are the replicated state (ZeRO-1/2)
        self.full_checks = 0  # whole-state checks asked for by the coordinator (confirmations)
        self._hashers: dict[tuple[int, int], Any] = {}  # (id(tensor), start) -> prepared CPU range hasher

    def register(self, name: str, group: str | None = None) -> int:
        """Id of a named tensor in the sidecar table the agent reads (append-only, so ids stay valid)."""
        tid = self._ids.get(name)
        if tid is None:
            tid = self._ids[name] = len(self.table)
            self.table.append((name, group))
            self._write_table()
        return tid

    def costs(self) -> dict:
        return {
            "seconds": self.spent_s,
            "bytes": self.checked_bytes,
            "stride": self.stride,
            "slots": len(self._slots),
            "period_steps": self.period_steps,
        }

    def _write_table(self) -> None:
        doc = {
            "replica_group": self.replica_group,
            "tensors": [n for n, _ in self.table],
            "groups": [g for _, g in self.table],
            "replay_layers": self.replay_layers,
            "bytes": self._bytes,
            "slots": len(self._slots),
            "stride": self.stride,
            "period_steps": self.period_steps,
            "budget": self.budget,
        }
        path = tensor_table_path(self.run_id, self.rank)
        with open(path + ".tmp", "w") as fh:
            json.dump(doc, fh)
        os.replace(path + ".tmp", path)

    def learn_model(self, module, process_group_name: str | None, params_only: bool = False) -> None:
        """params_only: the optimizer's tensors are not replicated (ZeRO-1/2 shards them); the module's are."""
        for name, p in module.named_parameters():
            self.names[id(p)] = name
        if process_group_name is not None:
            self.replica_group = process_group_name
        self._params_of = module if params_only else None
        self._structure = None

    def after_step(self, optimizer, step: int, step_wall_s: float = 0.0) -> None:
        if self.replica_group is None:
            return  # no known replicas (e.g. sharded parameters): nothing to compare against
        if self._device is not None:
            self._device.publish(self._emit)  # results of earlier check steps whose copy has landed
        if step_wall_s > 0:
            self._wall_s = step_wall_s if not self._wall_s else 0.9 * self._wall_s + 0.1 * step_wall_s
        if step % self.stride and self._slots:
            return
        cpu0 = time.thread_time()  # the check's own CPU time, rebuilds included (the cost report)
        # Rebuilding the tensor list walks every parameter: do it only when the cheap signature moved
        # (optimizer state appears after the first step) or every 64 steps as a safety net.
        quick = (
            len(optimizer.param_groups),
            sum(len(g["params"]) for g in optimizer.param_groups),
            len(optimizer.state),
            id(self._structure),
        )
        if quick != self._quick or step % 64 == 0:
            tensors = self._tensors(optimizer)
            structure = tuple((name, t.dtype, tuple(t.shape), t.data_ptr()) for name, t in tensors)
            if structure != self._structure:
                self._structure = structure
                self._plan(tensors)
            self._quick = (quick[0], quick[1], quick[2], id(self._structure))
        if not self._slots or step % self.stride:
            return
        c0 = time.thread_time()
        spent = 0
        index = step % len(self._slots)
        items, device_bytes = self._slots[index], 0
        if self._device is not None:  # CUDA ranges: enqueued, published on a later step; no host sync
            items, device_bytes = self._device.launch(self._slots, index, step)
            spent += device_bytes
        for tid, t, start, end in items:
            h = self._hash(t, start, end)
            self.append(STATE_PG_INDEX, tid, h, start, time.time_ns(), step, "state", f"{start}:{end}")
            spent += end - start
        self.checked_bytes += spent
        # CPU time, not wall time: on a machine with more ranks than cores a check is often descheduled, and
        # charging that wait to the check would stretch the coverage period for nothing.
        now = time.thread_time()
        cost = now - c0 + device_bytes / device_state.DEVICE_BYTES_PER_S
        self.spent_s += now - cpu0 + device_bytes / device_state.DEVICE_BYTES_PER_S
        self._cost_s = cost if not self._cost_s else 0.8 * self._cost_s + 0.2 * cost
        self._adapt_stride()

    def _hash(self, t, start: int, end: int) -> int:
        """fingerprint_range(t, start, end), through the range's prepared hasher when it has one."""
        hasher = self._hashers.get((id(t), start))
        digest = hasher() if hasher is not None else None
        if digest is None:
            if hasher is not None:
                self._quick = None  # the tensor's memory moved: plan again on the next step
            from trainscout.fingerprint import fingerprint_range

            digest = fingerprint_range(t, start, end)
        return digest

    def full_check(self, step: int) -> int:
        """Hash every slot now, whatever the stride: a confirmation the coordinator asked for at this step on
        every replica (a numerical outlier on one of them: is its state still equal to theirs?). Returns the
        bytes hashed (CUDA ones are published on later steps, like the rotation's)."""
        if self.replica_group is None or not self._slots:
            return 0
        cpu0 = time.thread_time()
        spent = 0
        for index in range(len(self._slots)):
            items = self._slots[index]
            if self._device is not None:
                items, device_bytes = self._device.launch(self._slots, index, step)
                spent += device_bytes
            for tid, t, start, end in items:
                self.append(
                    STATE_PG_INDEX,
                    tid,
                    self._hash(t, start, end),
                    start,
                    time.time_ns(),
                    step,
                    "state",
                    f"{start}:{end}",
                )
                spent += end - start
        self.checked_bytes += spent
        self.spent_s += time.thread_time() - cpu0
        self.full_checks += 1
        return spent

    def _adapt_stride(self) -> None:
        """The stride for the smoothed cost per hashed step (probe/budget.py); the table says it to the agent."""
        if self.fixed_period or self._wall_s <= 0 or self.budget <= 0:
            return
        stride = fit_stride(self.stride, self._cost_s, self.budget, self._wall_s, _MAX_STRIDE)
        if stride != self.stride:
            self.stride = stride
            self._write_table()

    def _emit(self, step: int, tid: int, start: int, end: int, digest: int) -> None:
        self.append(STATE_PG_INDEX, tid, digest, start, time.time_ns(), step, "state", f"{start}:{end}")

    def flush(self, timeout_s: float = 1.0) -> None:
        """At exit: publish CUDA results still in flight (waits up to timeout_s; never in steady state)."""
        if self._device is not None:
            self._device.flush(self._emit, timeout_s)

    @property
    def period_steps(self) -> int:
        """Steps one full pass over the state takes at the current stride."""
        return self.stride * len(self._slots)

    def _tensors(self, optimizer) -> list[tuple[str, Any]]:
        if self._params_of is not None:
            return [(name, _local(p.detach())) for name, p in self._params_of.named_parameters()]
        out = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                pname = self.names.get(id(p), f"param_group{g}.{i}")
                out.append((pname, _local(p.detach())))
                state = optimizer.state.get(p, {})
                for key in sorted(state):
                    v = state[key]
                    if hasattr(v, "detach") and hasattr(v, "element_size"):
                        out.append((f"{pname}:{key}", _local(v.detach())))
        return out

    def _plan(self, tensors) -> None:
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        target = self.fixed_period or _TARGET_SLOTS
        chunk = max(self.fixed_period and 1 or self.min_chunk, -(-total // target))
        chunk = -(-chunk // _ALIGN) * _ALIGN
        # Pack byte ranges into slots of about `chunk` bytes; small tensors share a slot.
        slots: list[list[tuple[int, Any, int, int]]] = [[]]
        filled = 0
        for name, t in tensors:
            tid = self.register(name, self.replica_group)
            size = t.numel() * t.element_size()
            for start in range(0, size, chunk):
                end = min(size, start + chunk)
                if filled and filled + (end - start) > chunk:
                    slots.append([])
                    filled = 0
                slots[-1].append((tid, t, start, end))
                filled += end - start
        slots = [s for s in slots if s]
        if self.fixed_period:
            size = lambda slot: sum(e - s for _, _, s, e in slot)  # noqa: E731
            while len(slots) > self.fixed_period:  # packing left remainders: merge the lightest neighbours
                i = min(range(len(slots) - 1), key=lambda j: size(slots[j]) + size(slots[j + 1]))
                slots[i : i + 2] = [slots[i] + slots[i + 1]]
            while len(slots) < self.fixed_period and any(len(s) > 1 for s in slots):
                big = max(range(len(slots)), key=lambda i: len(slots[i]))  # spread to use the whole period
                half = len(slots[big]) // 2
                slots[big : big + 1] = [slots[big][:half], slots[big][half:]]
        elif len(slots) % 2 == 0 and slots:
            slots.append(slots[0])  # an odd count lets every power-of-two stride reach every slot
        self._slots = slots
        from trainscout.fingerprint.cpu import RangeHasher

        self._hashers = {
            (id(t), start): RangeHasher(t, start, end)
            for slot in slots
            for _, t, start, end in slot
            if t.device.type == "cpu" and t.is_contiguous()
        }
        if self._device is None and device_state.usable(tensors):
            # deep enough for a whole-state confirmation (every slot at once) on top of the rotation's in flight
            self._device = device_state.DeviceStateHashes(depth=_TARGET_SLOTS + 9)
        if self._device is not None:
            self._device.prepare(slots)  # compiles the kernel now, not on a later check step
        self._bytes = total
        self._write_table()


def _local(t):
    """This rank's part of a DTensor (FSDP2/HSDP shards: replicas hold equal shards), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
