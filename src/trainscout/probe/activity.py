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

Work of its own needs no forward, save or compilation: rank 0 tokenizing the dataset while the others wait in a
barrier (`main_process_first` in Hugging Face scripts), computing metrics in Python, downloading weights. The
publisher thread therefore looks at the training thread each tick while the rank issues no collective, and writes
`moving_ns` when, since the last look, it read or wrote 64 KiB (its own I/O counters), or its stack (the code
objects of its frames) changed while it computed (its own CPU time grew by a tenth of the time between looks). A
rank asleep, blocked on a lock or a dead socket, spinning in one function (CPU, one stack), or polling for
something that never comes (a changing stack, no CPU, a log line at most) is named as before. (A look lands where
the training thread lets go of the GIL, in a tight loop always at the same place: a loop over a few lines of one
function reads as a spin; while the thread computes, a look therefore takes three more stacks 2 ms apart, each
after letting it run.) A look costs ~20 us a tick (the one after progress takes the baseline), plus three GIL
hand-overs while the rank computes a whole tick without a collective.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from trainscout.markers import BUSY_ACTIVE, BUSY_COMPILE, BUSY_IDLE


# I/O since the last look that counts as moving: a download or a cache written, not a warning printed by a loop
# waiting for something that never comes
MOVING_IO_BYTES = 64 * 1024
# stacks taken after the first, while the thread computes: a tokenizing loop read as moving in 65 % of single looks
# (so 4 looks in a row, 2 s, missed it 1-2 % of the time: rank 0 preparing data alone was named a hang)
MORE_LOOKS, MORE_LOOKS_GAP_S = 3, 0.002


class Activity:
    def __init__(self, set_field) -> None:
        self._set = set_field  # the channel writer's header store
        self._inside = BUSY_IDLE  # the outermost save or compilation in progress
        self._pid = os.getpid()  # a forked DataLoader worker shares the header: it marks nothing
        main = threading.main_thread()
        self.thread: int = main.ident or 0  # the training thread: the one that runs forwards (ident, native id)
        self._native: int = main.native_id or 0
        self._progress_seen = -1  # progress_ns at the last look; the stack and I/O then (None: not looked yet)
        self._seen: tuple | None = None  # (code stack, I/O bytes, CPU ns, monotonic ns)
        self.blocked = False  # since the last look the training thread neither computed nor moved: it waits

    def forward(self, *_args) -> None:
        """A forward pre-hook: the rank ran a forward pass now (unless a save or compilation is in progress)."""
        if self.thread != threading.get_ident():
            self.thread, self._native = threading.get_ident(), threading.get_native_id()
        if self._inside == BUSY_IDLE:
            self._set("busy_ns", time.monotonic_ns())
            self._set("busy", BUSY_ACTIVE)

    def look(self, progress_ns: int) -> None:
        """Publisher thread, each tick: while progress_ns stays put, note when the training thread moves on its own."""
        now = time.monotonic_ns()
        stacks = [self._stack()]
        io, cpu = _io_bytes(self._native), _cpu_ns(self.thread)
        last, self._seen = self._seen, (stacks[0], io, cpu, now)
        self.blocked = False
        if progress_ns != self._progress_seen:  # it issued a collective since: this look is the new baseline (taken
            self._progress_seen = progress_ns  # now, not a tick later: work begun alone shows at the next tick)
            return
        if last is None:
            return
        computed = cpu - last[2] >= (now - last[3]) // 10
        if computed:  # a look lands where the thread lets go of the GIL, in a working loop often the same place
            stacks += self._more_stacks()  # a few more, each after letting it run, before reading a spin
            self._seen = (stacks[-1], io, cpu, now)
        changed = any(stack != last[0] for stack in stacks)
        self.blocked = not computed and not changed and io - last[1] < MOVING_IO_BYTES
        if io - last[1] >= MOVING_IO_BYTES or computed and changed:
            self._set("moving_ns", now)

    def _stack(self) -> tuple[int, ...]:
        return _code_stack(sys._current_frames().get(self.thread))

    def _more_stacks(self) -> list[tuple[int, ...]]:
        """MORE_LOOKS stacks of the training thread, each taken after sleeping (the GIL released) for it to run on."""
        more = []
        for _ in range(MORE_LOOKS):
            time.sleep(MORE_LOOKS_GAP_S)
            more.append(self._stack())
        return more

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


def _code_stack(frame, depth: int = 64) -> tuple[int, ...]:
    """The code objects of a thread's innermost frames: the same while it sleeps, blocks or loops on one line; a
    loop over work of its own calls other functions between looks (a line number would move in any loop)."""
    codes: list[int] = []
    while frame is not None and len(codes) < depth:
        codes.append(id(frame.f_code))
        frame = frame.f_back
    return tuple(codes)


def _io_bytes(native_id: int) -> int:
    """Bytes a thread has read and written (files, pipes, sockets), from its own /proc counters (0: unreadable)."""
    try:
        with open(f"/proc/self/task/{native_id}/io", "rb") as fh:
            fields = fh.read().split()
        return int(fields[1]) + int(fields[3])  # rchar, wchar
    except (OSError, ValueError, IndexError):
        return 0


def _cpu_ns(ident: int) -> int:
    """A thread's CPU time so far (0: unreadable)."""
    try:
        return time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
    except (OSError, TypeError, ValueError, OverflowError):
        return 0
