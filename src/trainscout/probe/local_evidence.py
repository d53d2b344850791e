"""Per-step numerical evidence of a rank: its local loss and the norm of each layer's local gradient.

After DDP averages the gradients every replica holds the same numbers, so a rank whose forward went wrong
or whose gradient was corrupted before the all-reduce leaves no trace any later exact check can see. Its
own loss and its own gradients, read before the reduction, do: the coordinator compares them across the
replicas every step (detectors/numerics.py). This module turns what the non-finite pass measured (the loss,
each gradient's sum of squares) into one record per step: the loss and one L2 norm per layer.

A layer is a parameter's name up to its first numeric component (`blocks.3.attn.qkv.weight` -> `blocks.3`),
else its parent module (`head.weight` -> `head`): the granularity of the replay rotation, coarse enough that a
record stays small. Layer names go to a sidecar table once; records carry the loss as float64 bits and the
norms as packed float32 (NORMS_PER_RECORD per ring record, several records for a large model).

After the norms come two counts per layer: its parameters whose local gradient is exactly 0 this step, and those
whose sum of squares is bit for bit the one of the step before (and not 0). A layer's norm hides one parameter's
gradient dropped or held stale (a hook zeroing it, a stale copy): the counts show it. A sum of squares is read at
float32 precision (one fused norm a step; float64 costs 3.7x), so two different gradients share a norm by chance
now and then: a parameter whose norm barely moves repeats it often, and is not counted (its sum of squares must
usually move by REPEAT_MIN_CHANGE or more a step); one that moves still did once in a 300-step 4-rank run (two
gradients 0.03 apart, both of norm 0.07340596). The coordinator names an odd parameter only where replay
reproduces it (detectors/numerics.py), so a chance repeat costs one confirmation, never a finding.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from typing import TYPE_CHECKING

import numpy as np

from trainscout.channel.layout import DESC_BYTES, evidence_table_path
from trainscout.markers import GRAD_SYNC_LAYER, REPEATED_PARAMS, ZERO_PARAMS

if TYPE_CHECKING:
    from trainscout.probe.grad_sync import GradSyncNorms

EVIDENCE_PG_INDEX = -5
NORMS_PER_RECORD = DESC_BYTES // 4
_LOSS = struct.Struct("<d")
_BITS = struct.Struct("<Q")
_MAX_HELD = 64
REPEAT_MIN_CHANGE = 0.05  # |log| of a sum of squares' step-to-step ratio, averaged over ~10 steps (see above)
_CHANGE_WEIGHT = 0.1
F32_MAX = float(np.finfo(np.float32).max)  # records carry float32: a finite value past it is sent as it


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: up to its first numeric component, else its parent module."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def pack_header(part: int, count: int, version: int) -> int:
    """The record's rolling_hash slot: which slice of the layer list it holds, and of which table."""
    return (version & 0xFFFFFFFF) << 32 | (count & 0xFFFF) << 16 | (part & 0xFFFF)


def unpack_header(value: int) -> tuple[int, int, int]:
    """(part, count, version) of an evidence record."""
    return value & 0xFFFF, (value >> 16) & 0xFFFF, value >> 32


def loss_bits(loss: float) -> int:
    return _BITS.unpack(_LOSS.pack(loss))[0]


def loss_from_bits(bits: int) -> float:
    return _LOSS.unpack(_BITS.pack(bits & 0xFFFFFFFFFFFFFFFF))[0]


class LocalEvidence:
    """Collects one step's loss and per-parameter sums of squares; emits the step's record(s)."""

    def __init__(self, append, run_id: str, rank: int) -> None:
        self.append = append
        self.run_id, self.rank = run_id, rank
        self.layers: list[str] = []
        self._layer_index = np.zeros(0, dtype=np.int64)  # parameter -> layer
        self.version = 0
        self._loss_sum, self._losses = 0.0, 0
        self._sumsq: np.ndarray | None = None
        self.records = 0
        self.grad_sync: GradSyncNorms | None = None  # each gradient bucket's norm as it entered its reduction
        self._syncs = 0  # gradient reductions a step, listed after the layers as `grad-sync.K`
        # CUDA steps' values whose reductions' norms are still in flight
        self._held: list[tuple[int, float, np.ndarray | None]] = []
        self._previous: tuple[int, np.ndarray] | None = None  # the last measured step and its sums of squares
        self._change = np.zeros(0)  # per parameter: how much its sum of squares moves a step (a running mean)

    def set_params(self, names: list[str]) -> None:
        """The parameters whose sums of squares `add_sumsq` will receive, in that order."""
        layers = list(dict.fromkeys(layer_of(n) for n in names))
        index = {name: i for i, name in enumerate(layers)}
        self._layer_index = np.asarray([index[layer_of(n)] for n in names], dtype=np.int64)
        self._previous, self._change = None, np.zeros(len(names))  # another parameter list: no step before to repeat
        if layers != self.layers:
            self.layers = layers
            self.version += 1
            self._write_table()

    def _write_table(self) -> None:
        path = evidence_table_path(self.run_id, self.rank)
        try:
            with open(path + ".tmp", "w") as fh:
                json.dump({"version": self.version, "layers": self._names()}, fh)
            os.replace(path + ".tmp", path)
        except OSError:
            pass  # the records still carry the loss; norms without names are dropped by the agent

    def _names(self) -> list[str]:
        counts = [f"{kind}{layer}" for kind in (ZERO_PARAMS, REPEATED_PARAMS) for layer in self.layers]
        return self.layers + counts + [f"{GRAD_SYNC_LAYER}{k}" for k in range(self._syncs)]

    def add_loss(self, value: float) -> None:
        """A scalar loss entered backward (several per step with gradient accumulation: their mean is kept)."""
        self._loss_sum += value
        self._losses += 1

    def add_sumsq(self, sumsq: np.ndarray) -> None:
        """Each parameter's local gradient sum of squares at the end of a backward pass; the last pass of
        the step wins (accumulated gradients include the earlier micro-batches)."""
        if sumsq.shape == self._layer_index.shape:
            self._sumsq = sumsq

    def emit(self, step: int) -> None:
        """After the optimizer step: the step's loss and layer norms (what was measured of them on the host;
        a CUDA job's values land later, through `emit_values`)."""
        if not self._losses and self._sumsq is None:
            return
        loss = self._loss_sum / self._losses if self._losses else math.nan
        sumsq, self._sumsq = self._sumsq, None
        self._loss_sum, self._losses = 0.0, 0
        self.emit_values(step, loss, sumsq)

    def step_ended(self, step: int) -> None:
        """The optimizer step `step` ended: what its backward passes reduced is its own (before any of its
        evidence is emitted); records held for their reductions' norms go out once those landed."""
        if self.grad_sync is None:
            return
        self.grad_sync.end_step(step)
        self._release_held(wait=False)

    def flush(self) -> None:
        """At exit, after the CUDA results still in flight were judged: the records held for their reductions."""
        self._release_held(wait=True)

    def _release_held(self, wait: bool) -> None:
        held, self._held = self._held, []
        for step, loss, sumsq in held:
            self.emit_values(step, loss, sumsq, wait=wait)

    def emit_values(self, step: int, loss: float, sumsq: np.ndarray | None, wait: bool = False) -> None:
        """One step's values, also for results that land later (CUDA); wait: at the end of the run, for the
        reductions' norms still in flight."""
        if self.grad_sync is not None and not wait and not self.grad_sync.landed(step):
            if len(self._held) < _MAX_HELD:
                self._held.append((step, loss, sumsq))
            return
        if sumsq is not None and self.layers and sumsq.shape == self._layer_index.shape:
            measured = True
            with np.errstate(invalid="ignore", over="ignore"):
                per_layer = np.bincount(self._layer_index, weights=sumsq.astype(np.float64), minlength=len(self.layers))
                layer_norms = np.sqrt(per_layer)
                # a finite norm past the float32 limit (a huge gradient) is sent as the limit, not as Inf
                layer_norms = np.where(np.isfinite(layer_norms), np.minimum(layer_norms, F32_MAX), layer_norms)
                norms = np.concatenate([layer_norms, self._param_counts(step, sumsq)]).astype(np.float32)
        else:  # the layers not measured (FSDP2's gradients are shards anyway): only the reductions' inputs, if any
            measured = False
            norms = np.full(3 * len(self.layers), np.nan, dtype=np.float32)
        unsynced = len(norms)
        norms = self._with_syncs(step, norms)
        if not measured and len(norms) == unsynced:
            norms = np.zeros(0, dtype=np.float32)  # nothing measured: the loss alone
        bits, now = loss_bits(loss), time.time_ns()
        if not len(norms):
            self.append(EVIDENCE_PG_INDEX, step, bits, pack_header(0, 0, self.version), now, step, "evidence", b"")
        for part, start in enumerate(range(0, len(norms), NORMS_PER_RECORD)):
            chunk = norms[start : start + NORMS_PER_RECORD]
            self.append(
                EVIDENCE_PG_INDEX,
                step,
                bits,
                pack_header(part, len(chunk), self.version),
                now,
                step,
                "evidence",
                chunk.tobytes(),
            )
        self.records += 1

    def _param_counts(self, step: int, sumsq: np.ndarray) -> np.ndarray:
        """Per layer: how many of its parameters' gradients are exactly 0, then how many repeat the step before's
        sum of squares bit for bit (only against the step just before, measured in the same parameter order)."""
        n = len(self.layers)
        zero = sumsq == 0
        previous, self._previous = self._previous, (step, sumsq)
        repeated = np.zeros(sumsq.shape, dtype=bool)
        # sums of squares reach here only in the order set_params gave (emit_values), which resets both
        if previous is not None and previous[0] == step - 1:
            moving = self._change >= REPEAT_MIN_CHANGE
            repeated = (sumsq == previous[1]) & ~zero & np.isfinite(sumsq) & moving
            with np.errstate(divide="ignore", invalid="ignore"):
                change = np.abs(np.log(sumsq / previous[1]))
            change = np.where(np.isfinite(change), change, 0.0)
            self._change += _CHANGE_WEIGHT * (change - self._change)
        return np.concatenate(
            [
                np.bincount(self._layer_index, weights=zero, minlength=n),
                np.bincount(self._layer_index, weights=repeated, minlength=n),
            ]
        )

    def _with_syncs(self, step: int, norms: np.ndarray) -> np.ndarray:
        """The layers' norms followed by the step's gradient reductions' (a new count of reductions is a new
        table: DDP rebuilds its buckets after the first step)."""
        synced = self.grad_sync.sums_of_squares(step) if self.grad_sync is not None else None
        if synced is None:
            if not self._syncs:
                return norms
            synced = np.full(self._syncs, np.nan)  # none seen this step: unknown, not zero
        if len(synced) != self._syncs:
            self._syncs = len(synced)
            self.version += 1
            self._write_table()
        with np.errstate(invalid="ignore"):
            return np.concatenate([norms, np.sqrt(synced).astype(np.float32)])
