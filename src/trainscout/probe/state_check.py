"""Replicated-state fingerprints: after the optimizer step, hash parameters and optimizer state in chunks.

Data-parallel replicas (DDP, ZeRO-1/2, HSDP replicas) must hold bit-identical parameters and optimizer
state after every step. Hashing everything every step would cost a full pass over memory, so the state
is cut into byte ranges and `period` steps cover it once; every replica follows the same schedule (it
depends only on the step number and the state's structure, which replicas share), so the coordinator
compares the same range at the same step across replicas and names the odd one out.
"""

from __future__ import annotations

import json
import os
import time

from trainscout.channel.layout import tensor_table_path

STATE_PG_INDEX = -1  # ring records with this pg index are state fingerprints, not collectives
_ALIGN = 4


class StateCheck:
    def __init__(self, run_id: str, rank: int, append, period: int = 16, min_chunk: int = 64 * 1024) -> None:
        self.run_id = run_id
        self.rank = rank
        self.append = append  # (pg_index, seq, entry_hash, rolling, wall_ns, step, op, desc)
        self.period = max(1, period)
        self.min_chunk = min_chunk
        self.names: dict[int, str] = {}  # id(param) -> name, from the model when the probe saw it
        self.replica_group: str | None = None
        self._structure: tuple | None = None
        self._quick: tuple | None = None
        self._chunks: list[tuple[int, object, int, int]] = []  # (tensor id, tensor, start, end)
        self._next = 0
        self.spent_s = 0.0
        self.checked_bytes = 0
        self.replay_layers: list[str] = []
        self.table: list[tuple[str, str | None]] = []  # tensor id -> (name, comparison group)
        self._ids: dict[str, int] = {}
        self._meta: dict = {}

    def register(self, name: str, group: str | None = None) -> int:
        """Id of a named tensor in the sidecar table the agent reads (append-only, so ids stay valid)."""
        tid = self._ids.get(name)
        if tid is None:
            tid = self._ids[name] = len(self.table)
            self.table.append((name, group))
            self._write_table()
        return tid

    def _write_table(self) -> None:
        doc = {"replica_group": self.replica_group, "tensors": [n for n, _ in self.table],
               "groups": [g for _, g in self.table], "replay_layers": self.replay_layers, **self._meta}
        path = tensor_table_path(self.run_id, self.rank)
        with open(path + ".tmp", "w") as fh:
            json.dump(doc, fh)
        os.replace(path + ".tmp", path)

    def learn_model(self, module, process_group_name: str | None) -> None:
        for name, p in module.named_parameters():
            self.names[id(p)] = name
        if process_group_name is not None:
            self.replica_group = process_group_name
        self._structure = None

    def after_step(self, optimizer, step: int) -> None:
        if self.replica_group is None:
            return  # no known replicas (e.g. sharded parameters): nothing to compare against
        t0 = time.perf_counter()
        # Rebuilding the tensor list walks every parameter: do it only when the cheap signature moved
        # (optimizer state appears after the first step) or every 64 steps as a safety net.
        quick = (len(optimizer.param_groups), sum(len(g["params"]) for g in optimizer.param_groups),
                 len(optimizer.state), id(self._structure))
        if quick != self._quick or step % 64 == 0:
            tensors = self._tensors(optimizer)
            structure = tuple((name, t.dtype, tuple(t.shape), t.data_ptr()) for name, t in tensors)
            if structure != self._structure:
                self._structure = structure
                self._plan(tensors)
            self._quick = (quick[0], quick[1], quick[2], id(self._structure))
        if not self._chunks:
            return
        budget = self._per_step_bytes
        spent = 0
        from trainscout.fingerprint import fingerprint_range

        while spent < budget:
            tid, t, start, end = self._chunks[self._next]
            self._next = (self._next + 1) % len(self._chunks)
            h = fingerprint_range(t, start, end)
            self.append(STATE_PG_INDEX, tid, h, start, time.time_ns(), step, "state", f"{start}:{end}")
            spent += end - start
            if self._next == 0:
                break  # a step never wraps: each covers a slice of one rotation, rotations start aligned
        self.checked_bytes += spent
        self.spent_s += time.perf_counter() - t0

    def _rotation_steps(self) -> int:
        """How many steps after_step takes to cover every chunk once (same loop, no hashing)."""
        steps, i = 0, 0
        while True:
            steps += 1
            spent = 0
            while spent < self._per_step_bytes:
                _, _, start, end = self._chunks[i]
                i = (i + 1) % len(self._chunks)
                spent += end - start
                if i == 0:
                    return steps

    def _tensors(self, optimizer) -> list[tuple[str, object]]:
        out = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                pname = self.names.get(id(p), f"param_group{g}.{i}")
                out.append((pname, p.detach()))
                state = optimizer.state.get(p, {})
                for key in sorted(state):
                    v = state[key]
                    if hasattr(v, "detach") and hasattr(v, "element_size"):
                        out.append((f"{pname}:{key}", v.detach()))
        return out

    def _plan(self, tensors) -> None:
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        chunk = max(self.min_chunk, -(-total // self.period))
        chunk = -(-chunk // _ALIGN) * _ALIGN
        self._per_step_bytes = chunk
        self._chunks = []
        for name, t in tensors:
            tid = self.register(name, self.replica_group)
            size = t.numel() * t.element_size()
            for start in range(0, size, chunk):
                self._chunks.append((tid, t, start, min(size, start + chunk)))
        self._next = 0
        self._meta = {"bytes": total, "period_steps": self._rotation_steps() if self._chunks else 0}
        self._write_table()
