"""What a rank is doing of its own between collectives, for the hang vote: work of its own is not a hang.

Scripts save checkpoints, evaluate and sample on rank 0 alone while the other ranks wait in a barrier, and
`torch.compile` compiles (tens of seconds on a first step, again on a new shape) on whichever rank meets a new
graph first: for that long the rank is behind its peers in collectives, exactly as a hung rank is. A rank-0 save
taking 8 s was named a hang on every checkpoint, and a rank compiling 6 s longer than its peers made a hang
finding of the first step. The probe therefore writes what the rank is busy with into two header fields
(`busy`, `busy_ns`), from the training thread:

- CHECKPOINT / COMPILE since `busy_ns`: inside a wrapped save (torch.save, torch.distributed.checkpoint.save,
  DeepSpeed's save_checkpoint) or a dynamo compilation (torch._dynamo's compile callbacks);
- ACTIVE at `busy_ns`: the start of the last forward of the trained model (its inner module: evaluation often
  calls it directly) or the end of the last save or compilation.

A rank stuck inside a forward, in a loop of its own or asleep is ACTIVE since the moment it stopped, which ages
like its peers' wait: it is named as before. Two 8-byte stores a forward (~0.4 us).
"""

from __future__ import annotations

import os
import time

from trainscout.markers import BUSY_ACTIVE, BUSY_COMPILE, BUSY_IDLE


class Activity:
    def __init__(self, set_field) -> None:
        self._set = set_field  # the channel writer's header store
        self._inside = BUSY_IDLE  # the outermost save or compilation in progress
        self._pid = os.getpid()  # a forked DataLoader worker shares the header: it marks nothing

    def forward(self, *_args) -> None:
        """A forward pre-hook: the rank ran a forward pass now (unless a save or compilation is in progress)."""
        if self._inside == BUSY_IDLE:
            self._set("busy_ns", time.monotonic_ns())
            self._set("busy", BUSY_ACTIVE)

    def enter(self, what: int) -> bool:
        """Begin a save or compilation; False when one is already in progress (only the outermost counts)."""
        if self._inside != BUSY_IDLE or os.getpid() != self._pid:
            return False
        self._inside = what
        self._set("busy_ns", time.monotonic_ns())
        self._set("busy", what)
        return True

    def leave(self) -> None:
        self._inside = BUSY_IDLE
        self._set("busy_ns", time.monotonic_ns())
        self._set("busy", BUSY_ACTIVE)

    def watch_compiles(self, dynamo) -> None:
        """torch._dynamo was imported (a compile is coming): mark every compilation, first and recompiles."""
        from torch._dynamo.callback import callback_handler

        del dynamo
        owned: list[bool] = []

        def started(_args) -> None:
            owned.append(self.enter(BUSY_COMPILE))

        def ended(_args) -> None:
            if owned and owned.pop():
                self.leave()

        callback_handler.register_start_callback(started)
        callback_handler.register_end_callback(ended)
