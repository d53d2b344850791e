"""Per-step timings of a rank: wall time, compute, collective waits, data loading and checkpoint writes.

Ranks of a data-parallel job run the same work per step and wait for each other, so wall time per step
is equal across them; how the step was spent is not. A rank that needs more compute per step is a
compute straggler (its peers wait longer for it, it waits least); one that spends its step waiting for
data is data-loader stalled, one in `torch.save` checkpoint-write stalled. A slow transport makes every
member of a process group wait longer in that group's collectives while compute stays the same.

Measured per optimizer step, all as durations on this rank's own clocks:
- compute: CPU time of the training thread minus its CPU in data loading, checkpoint writes and the
  probe's own checks on that thread (the communication library's and the probe's own threads are not
  compute either, and their share differs by rank role: a collective's root does more); on CUDA also the
  GPU time from the step's start to the end of backward (CUDA events, read back when complete: no sync);
- wait: time blocked in collectives issued from Python (per process group) plus the gradient-sync wait
  from the end of backward's own work to backward's return (DDP / FSDP finish their reductions in the
  engine's final callbacks; when backward is not seen returning, up to the optimizer step);
  on CUDA also that wait on the GPU (end of backward to the optimizer step, events on the same stream);
- starved: time the training thread was runnable but not running (the kernel's run-queue delay,
  /proc/thread-self/schedstat) outside its collective waits: a rank that waits for a core, not for its
  peers or its own work. A thread woken at the end of a wait often queues for a core too (4 ranks on 2
  cores: 10-40 ms a step): that delay belongs to the wait, so it is read at each wait's ends and left out.
- between steps: time from the previous optimizer step to this step's first training forward (a forward of
  the DDP / FSDP model in training mode with autograd on), minus data loading, checkpoint writes, collective
  waits and the probe's own checks: where a script does work of its own between steps (evaluation, logging)
  on some ranks only. Data fetched with autograd off (an evaluation loop's loader) is not data loading.
What is left of the wall time (minus compute, wait, data, checkpoint and starved) is time the thread
was off the CPU of its own accord: sleeping, blocked in I/O or on a lock.
One record per step; the coordinator compares ranks.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

from trainscout.markers import ASYNC_WAIT
from trainscout.wire.messages import GPU_UNMEASURED  # a CUDA step whose GPU span was not read

STEP_PG_INDEX = -4
SLOW_FETCH_S = 0.05  # a data fetch this slow gets its call site recorded (at most once per SITE_EVERY_S)
SITE_EVERY_S = 10.0
# Steps whose GPU events are still in flight; older ones are given up (GPU_UNMEASURED). A GPU-bound job's
# host ran ~100 steps ahead of its GPU (a few kernels a step, nothing synchronising): at 8 every step was
# given up and the job had no GPU timings at all. Three events a step: 256 steps cost nothing to hold.
_GPU_PENDING_MAX = 256
# Completed steps' events are read every DRAIN_EVERY steps, several at a time (each read is mostly fixed host
# cost on the training thread; the step records reach the agent a few steps later).
DRAIN_EVERY = 4
BETWEEN_FIELD = 10  # index of the time between steps in a step's fields (the GPU may raise it later)
FWD_FIELD = 13  # index of the forwards' time: CPU on the host, replaced by the GPU's span on CUDA steps


class RunQueueClock:
    """Seconds the calling thread spent runnable but waiting for a CPU (Linux schedstat), or None.

    Opened on the thread it measures (thread-self resolves at open time); one pread a step (~2 us)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> float | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            self.close()
            return None

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class StepTiming:
    name = "step_timing"  # its figures' key in the rank's cost report

    def __init__(
        self,
        append,
        *,
        on_device: Callable[[str], None] | None = None,
        other_thread_s: Callable[[], float] | None = None,
    ) -> None:
        self.append = append
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()
        self.on_device = on_device  # told the CUDA device's UUID once the loss is seen on one
        self.other_thread_s = other_thread_s  # () -> cumulative seconds the probe's own thread worked (GIL held)
        self._other_last = 0.0
        self._runq: RunQueueClock | None = None  # opened on the training thread, at its first step
        self._runq_last: float | None = None
        self._runq_waiting = 0.0  # run-queue delay inside this step's collective waits (part of the wait)
        self._runq_at_backward: float | None = None
        self.data_s = 0.0
        self._frozen: list[tuple[float, float]] = []  # (from, to) perf_counter spans the process was stopped
        self._frozen_lock = threading.Lock()
        self.data_workers_s = 0.0  # the part of data_s spent waiting for DataLoader worker processes
        self.ckpt_s = 0.0
        self.io_cpu_s = 0.0  # CPU spent inside data loading and checkpoint writes: not "compute"
        self.probe_cpu_s = 0.0  # CPU the probe's own checks took on the training thread: not "compute" either
        self.probe_wall_s = 0.0  # ... and their wall time this step: not the script's time between steps
        self._between_s = -1.0  # previous optimizer step -> first training forward (-1: no forward seen)
        # CPU of the training thread in the step's training forwards (each from the model's call to backward's
        # start, the loss included): the compute's forward share, which a rank's own machine noise leaves alone
        self._fwd_cpu0: float | None = None  # thread CPU at the current forward's start (None: not in one)
        self._fwd_cpu_s = -1.0  # -1: no forward ended by a backward this step
        self._fwd_event = None  # CUDA: an event at the current forward's start, on the training stream
        self._fwd_pairs: list = []  # CUDA: (start, end) events of this step's forwards: the GPU's forward span
        self._grad_enabled: Callable[[], bool] | None = None  # torch.is_grad_enabled, once torch is loaded
        self.wait_s = 0.0
        self.pg_wait: dict[str, float] = {}  # Python-level collective time per process group, this step
        self._backward_end: float | None = None
        self._thread: int | None = None  # the thread that runs the steps (known from the first step's end)
        self._host_to_backward_s = 0.0
        self.last_wall_s = 0.0
        self.total_wall_s = 0.0  # from the first step's end: what per-step costs are compared against
        self.sites: dict[str, str] = {}  # "data" / "ckpt" -> where the training code waits (call site)
        self._site_at: dict[str, float] = {}
        # CUDA: events A (after the previous optimizer step), B (end of backward), C (optimizer pre-step)
        self._cuda = None
        self._stream: Any = None  # a torch.cuda.Stream
        self._ev_start = None
        self._ev_backward = None
        self._ev_pre = None
        self._ev_forward = None  # M: the step's first training forward (between A and B)
        # (record fields, A, B, C, M or None, collective pairs, forward pairs)
        self._gpu_pending: deque = deque()
        self._free_events: list = []
        # Python-level collectives between A and B (e.g. a logged loss all-reduced after the optimizer step):
        # the training stream waits there for the slowest rank, which is not this rank's compute
        self._coll_events: list = []

    # ---- step boundaries -------------------------------------------------------------------
    def backward_started(self) -> None:
        """backward() was called on the training thread: the forward phase (with the loss) ends here."""
        if self._fwd_cpu0 is not None:
            self._fwd_cpu_s = max(0.0, self._fwd_cpu_s) + time.thread_time() - self._fwd_cpu0
            self._fwd_cpu0 = None
        if self._fwd_event is not None:
            try:
                self._fwd_pairs.append((self._fwd_event, self._event()))
            except Exception:
                self._free_events.append(self._fwd_event)
            self._fwd_event = None

    def backward_ended(self) -> None:
        """Autograd engine callback: backward's own work is done; DDP's reduction wait comes after."""
        self._backward_end = time.perf_counter()
        if self._runq is not None:  # the training thread's clock, whichever thread runs this callback
            self._runq_at_backward = self._runq.read()
        self._host_to_backward_s = self._backward_end - self._wall
        if self._cuda is not None:
            self._ev_backward = self._event()

    def backward_returned(self) -> None:
        """backward() returned: DDP / FSDP waited for the gradient reduction in its final callbacks, after
        `backward_ended`; what the script does from here to the optimizer step is its own (a wrapped or slow
        optimizer step, gradient clipping), not a wait."""
        self._end_sync_wait()

    def before_optimizer_step(self) -> None:
        self._end_sync_wait()  # backward was not seen returning (called another way): the wait ends here
        if self._cuda is not None and self._ev_backward is not None:
            self._ev_pre = self._event()

    def _end_sync_wait(self) -> None:
        if self._backward_end is None:
            return
        self.wait_s += time.perf_counter() - self._backward_end
        self._backward_end = None
        if self._runq_at_backward is not None:
            now = self._runq.read() if self._runq is not None else None
            if now is not None:
                self._runq_waiting += now - self._runq_at_backward
            self._runq_at_backward = None

    def exclude_cpu(self, seconds: float) -> None:
        """The probe spent this much CPU on the training thread (its checks, not the user's compute)."""
        self.probe_cpu_s += seconds

    def exclude_wall(self, seconds: float) -> None:
        """... and this much wall time (after the optimizer step: not time the script spent between steps)."""
        self.probe_wall_s += seconds

    def training_forward(self) -> None:
        """A forward of the trained model in training mode with autograd on (the probe's hook): the first one
        of a step ends the time between steps; each one opens a forward phase that backward's start closes."""
        if self._fwd_cpu0 is None:
            self._fwd_cpu0 = time.thread_time()
            if self._cuda is not None and self._ev_start is not None:
                try:
                    self._fwd_event = self._event()
                except Exception:
                    self._fwd_event = None
        if self._between_s < 0:
            spent = time.perf_counter() - self._wall
            self._between_s = max(0.0, spent - self.data_s - self.ckpt_s - self.wait_s - self.probe_wall_s)
            if self._cuda is not None and self._ev_start is not None:
                try:  # the GPU side too: work queued between steps (an evaluation's kernels) runs later there
                    self._ev_forward = self._event()
                except Exception:
                    self._ev_forward = None

    def collective_begin(self):
        """Before a blocking Python-level collective: (the run-queue clock, an event on the training stream on
        CUDA jobs, else None)."""
        # inside the gradient-sync wait (backward's end to its return: FSDP2's last reduce-scatter in its final
        # callback) the whole span is counted as a wait, its run-queue delay with it
        inside = self._backward_end is not None
        runq = self._runq.read() if self._runq is not None and not inside else None
        if self._cuda is None or self._ev_start is None or self._ev_backward is not None:
            return runq, None  # after backward the GPU's wait is already in B..C
        try:
            return runq, self._event()
        except Exception:
            return runq, None

    def collective_end(self, begin) -> None:
        """After it: its run-queue delay belongs to the wait; the training stream's wait for it is begin..end,
        taken out of this rank's compute."""
        runq0, event = begin
        if runq0 is not None:
            assert self._runq is not None  # runq0 was read from it, and it is never unset
            now = self._runq.read()
            if now is not None:
                self._runq_waiting += now - runq0
        if event is None:
            return
        try:
            self._coll_events.append((event, self._event()))
        except Exception:
            self._free_events.append(event)

    def async_wait_begin(self):
        """Before a wait on an asynchronous call's handle: a token, or None where the wait is not to be counted:
        on another thread than the one that runs the steps (a background checkpoint's), or inside the
        gradient-sync wait (backward's end to its return), which is counted whole."""
        if self._backward_end is not None:
            return None
        if self._thread is not None and threading.get_ident() != self._thread:
            return None
        return time.perf_counter(), self.collective_begin()

    def async_wait_end(self, token) -> None:
        t0, begin = token
        self.add_wait(ASYNC_WAIT, time.perf_counter() - t0)
        self.collective_end(begin)

    def add_wait(self, pg_name: str, seconds: float) -> None:
        """A blocking collective issued from Python took this long (the tap measures it). Inside the
        gradient-sync wait it is part of that span, already counted whole."""
        if self._backward_end is None:
            self.wait_s += seconds
        self.pg_wait[pg_name] = self.pg_wait.get(pg_name, 0.0) + seconds

    def note_frozen(self, start: float, end: float) -> None:
        """The probe thread woke at `end`, due at `start` (perf_counter): the process did not run in between."""
        with self._frozen_lock:
            self._frozen.append((start, end))

    def _frozen_us(self, start: float, end: float) -> int:
        """Microseconds of this step (start..end) the process was stopped; later spans stay for the next step."""
        if not self._frozen:  # nearly every step: no lock taken
            return 0
        with self._frozen_lock:
            spans, self._frozen = self._frozen, [s for s in self._frozen if s[1] > end]
        return int(sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans) * 1e6)

    def after_step(self, step: int) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self._thread = threading.get_ident()  # the thread that runs the steps: its waits are the step's
        compute_cpu = max(0.0, cpu - self._cpu - self.io_cpu_s - self.probe_cpu_s)
        runq_us = self._runq_us()
        fields = (
            step,
            int(compute_cpu * 1e9),
            # the step's time less the probe's own checks on this thread (after the last optimizer step): their
            # CPU is not the rank's compute, and their wall time, left in, read as time the rank was blocked,
            # so a replay every N steps that cost one replica 4 ms more than the others named it an
            # intermittent straggler of period N
            int(max(0.0, wall - self._wall - self.probe_wall_s) * 1e9),
            int(self.data_s * 1e6),
            int(self.ckpt_s * 1e6),
            int(self.wait_s * 1e6),
            dict(self.pg_wait),
            int(self._host_to_backward_s * 1e6),
            runq_us,
            self._other_us(),
            int(self._between_s * 1e6) if self._between_s >= 0 else -1,
            int(self.data_workers_s * 1e6),
            self._frozen_us(self._wall, wall),
            int(self._fwd_cpu_s * 1e6) if self._fwd_cpu_s >= 0 else -1,
        )
        pairs, self._coll_events = self._coll_events, []
        fwd_pairs, self._fwd_pairs = self._fwd_pairs, []
        if self._fwd_event is not None:  # a forward not followed by a backward this step (evaluation in train mode)
            self._free_events.append(self._fwd_event)
            self._fwd_event = None
        if (
            self._cuda is not None
            and self._ev_start is not None
            and self._ev_backward is not None
            and self._ev_pre is not None
        ):
            events = (self._ev_start, self._ev_backward, self._ev_pre, self._ev_forward)
            self._gpu_pending.append((fields, *events, pairs, fwd_pairs))
        else:
            for pair in fwd_pairs:
                self._free_events.extend(pair)
            self._emit(fields, -1, -1)
        if self._cuda is not None:
            try:
                self._ev_start = self._event()
                self._ev_backward = self._ev_pre = self._ev_forward = None
                if step % DRAIN_EVERY == 0:
                    self._drain_gpu()
            except Exception:  # fail open: no GPU timings from now on, CPU ones go on
                self._cuda = None
                for fields, *_ in self._gpu_pending:
                    self._emit(fields, GPU_UNMEASURED, GPU_UNMEASURED)
                self._gpu_pending.clear()
        self.last_wall_s = wall - self._wall
        if step > 1:
            self.total_wall_s += self.last_wall_s
        self._wall, self._cpu = wall, cpu
        self.data_s = self.ckpt_s = self.io_cpu_s = self.probe_cpu_s = self.wait_s = self._host_to_backward_s = 0.0
        self.probe_wall_s, self._between_s, self.data_workers_s = 0.0, -1.0, 0.0
        self._fwd_cpu0, self._fwd_cpu_s = None, -1.0
        self.pg_wait = {}
        self._backward_end = None

    def _runq_us(self) -> int:
        """Run-queue delay of the training thread since the last step, in us (-1: not measurable)."""
        if self._runq is None:
            self._runq = RunQueueClock()  # on the training thread: the optimizer hook calls after_step
        now = self._runq.read()
        last, self._runq_last = self._runq_last, now
        waiting, self._runq_waiting = self._runq_waiting, 0.0
        if now is None or last is None:
            return -1
        return max(0, int((now - last - waiting) * 1e6))

    def _other_us(self) -> int:
        """The probe thread's work since the last step, in us: the training thread may have waited for the GIL
        meanwhile, which is not the rank's own blocking."""
        if self.other_thread_s is None:
            return 0
        try:
            now = self.other_thread_s()
        except Exception:
            return 0
        # monotonic: a read between the end of a tick and its addition to the total reads low for an instant
        last, self._other_last = self._other_last, max(now, self._other_last)
        return max(0, int((now - last) * 1e6))

    def _emit(self, fields: tuple, gpu_us: int, gpu_wait_us: int) -> None:
        (
            step,
            cpu_ns,
            wall_ns,
            data_us,
            ckpt_us,
            wait_us,
            pg_wait,
            host_us,
            runq_us,
            other_us,
            between_us,
            workers_us,
            frozen_us,
            fwd_us,
        ) = fields
        if gpu_us >= 0:
            # The GPU span alone misreads a host-bound rank: the last to arrive finds its GPU idle,
            # waiting for its own host, and a host a few % slower reads as a GPU 10x slower. The longer
            # of the two spans is the rank's own time to the end of backward.
            gpu_us = max(gpu_us, host_us)
        desc = (
            f"{data_us}:{ckpt_us}:{wait_us}:{gpu_us}:{gpu_wait_us}:{runq_us}:{other_us}:{between_us}:{workers_us}"
            f":{frozen_us}:{fwd_us}"
        )
        if pg_wait:
            desc += "|" + ",".join(f"{name}={int(s * 1e6)}" for name, s in pg_wait.items())
        self.append(STEP_PG_INDEX, step, cpu_ns, wall_ns, time.time_ns(), step, "step", desc)

    # ---- CUDA: GPU busy and wait time per step, from events read back once complete -----------------
    def use_cuda(self, torch_cuda, device) -> None:
        """The loss lives on a CUDA device: time the GPU side too (called from the first backward)."""
        if self._cuda is None:
            self._cuda = torch_cuda
            self._stream = torch_cuda.current_stream(device)
            self._ev_start = self._event()
            if self.on_device is not None:  # which GPU: ranks sharing one compete for it (coordinator)
                try:
                    self.on_device(f"GPU-{torch_cuda.get_device_properties(device).uuid}")
                except Exception:
                    pass

    def _event(self):
        ev = self._free_events.pop() if self._free_events else self._cuda.Event(enable_timing=True)
        # On the training stream, captured on the training thread when backward was called: the
        # end-of-backward callback may run on an autograd worker thread whose current device or stream is
        # another one (rank 1 of a node got device 0's stream, and negative spans).
        ev.record(self._stream)
        return ev

    def _drain_gpu(self, force: bool = False) -> None:
        while self._gpu_pending:
            fields, a, b, c, m, pairs, fwd_pairs = self._gpu_pending[0]
            if not (c.query() and b.query()):  # non-blocking; later steps complete later
                if force or len(self._gpu_pending) > _GPU_PENDING_MAX:
                    self._gpu_pending.popleft()
                    self._emit(fields, GPU_UNMEASURED, GPU_UNMEASURED)
                    continue
                return
            self._gpu_pending.popleft()
            coll_ms = sum(x.elapsed_time(y) for x, y in pairs)  # recorded before B: complete with it
            span_ms = a.elapsed_time(b)
            if m is not None:  # the GPU's time between steps, less the collectives waited for there
                before_ms = a.elapsed_time(m) - sum(x.elapsed_time(y) for x, y in pairs if m.elapsed_time(y) <= 0)
                between = max(fields[BETWEEN_FIELD], int(max(0.0, before_ms) * 1e3))
                fields = (*fields[:BETWEEN_FIELD], between, *fields[BETWEEN_FIELD + 1 :])
                self._free_events.append(m)
            fields = (*fields[:FWD_FIELD], _forward_us(fwd_pairs, pairs), *fields[FWD_FIELD + 1 :])
            self._emit(fields, int(max(0.0, span_ms - coll_ms) * 1e3), int((b.elapsed_time(c) + coll_ms) * 1e3))
            self._free_events.extend((a, b, c))
            for pair in (*pairs, *fwd_pairs):
                self._free_events.extend(pair)

    def costs(self) -> None:
        return None  # its work is measuring (step timing) or runs on hpZ jobs only: not reported apart

    def flush(self) -> None:
        if self._gpu_pending and self._cuda is not None:
            try:
                self._cuda.synchronize()  # at exit only
                self._drain_gpu(force=True)
            except Exception:
                pass

    # ---- hooks that feed it ------------------------------------------------------------------
    def on_loss(self, loss) -> None:
        """A scalar loss enters backward (the probe's backward wrapper): on CUDA, time the GPU side too, on the
        loss's stream. The end of backward comes through `backward_ended`, from an engine callback queued at
        the start of the pass: it runs before DDP's own finalisation, which is where the gradient all-reduce
        wait happens."""
        if loss.device.type == "cuda":
            import torch

            if self._cuda is None:
                self.use_cuda(torch.cuda, loss.device)
            self._stream = torch.cuda.current_stream(loss.device)

    @property
    def training_stream(self):
        """The CUDA stream the loss was last computed on (None before a CUDA loss)."""
        return self._stream

    def add_checkpoint(self, wall_s: float, cpu_s: float) -> None:
        self.ckpt_s += wall_s
        self.io_cpu_s += cpu_s
        self._note_site("ckpt")

    def wrap_dataloader(self, module) -> None:
        """Time every batch fetched from a torch DataLoader (single- and multi-process iterators)."""
        cls = module._BaseDataLoaderIter
        real = cls.__next__
        timing = self

        def __next__(it):
            if timing._grad_enabled is None:
                timing._grad_enabled = sys.modules["torch"].is_grad_enabled
            if not timing._grad_enabled():
                return real(it)  # an evaluation loop's batch: not the training's data loading
            t0, c0 = time.perf_counter(), time.thread_time()
            q0 = timing._runq.read() if timing._runq is not None else None
            try:
                return real(it)
            finally:
                spent = time.perf_counter() - t0
                q1 = timing._runq.read() if q0 is not None else None
                # time queued for a core while loading is the machine's, not the loader's (starved): on 4 ranks
                # sharing 2 busy cores a 0.6 ms fetch read 4-11 ms for ~10 steps on one healthy rank
                queued = min(spent, q1 - q0) if q1 is not None else 0.0
                timing.data_s += spent - queued
                if getattr(it, "_num_workers", 0) > 0:  # waiting for a worker process's batch
                    timing.data_workers_s += spent - queued
                timing.io_cpu_s += time.thread_time() - c0
                if spent > SLOW_FETCH_S:
                    timing._note_site("data")

        __next__.__wrapped__ = real  # type: ignore[attr-defined]
        cls.__next__ = __next__

    def _note_site(self, kind: str) -> None:
        """Record where the training code waits (its own frames, innermost first); rarely, it costs ~50 us."""
        now = time.monotonic()
        if now - self._site_at.get(kind, -SITE_EVERY_S) < SITE_EVERY_S:
            return
        self._site_at[kind] = now
        try:
            site = call_site(sys._getframe(1))
        except Exception:
            return
        if site and site != self.sites.get(kind):
            self.sites[kind] = site
            self.append(STEP_PG_INDEX, 0, 0, 0, time.time_ns(), 0, "site", f"{kind}|{site}")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../trainscout
_DEMO = os.path.join(_PACKAGE, "demo")
_LIBRARIES = (os.sep + "torch" + os.sep, os.sep + "deepspeed" + os.sep)


def _is_library(path: str) -> bool:
    if path.startswith(_PACKAGE) and not path.startswith(_DEMO):
        return True  # our own wrappers (the demo script is user code)
    return any(s in path for s in _LIBRARIES)


def call_site(frame, depth: int = 3) -> str:
    """The innermost `depth` frames outside trainscout/torch/deepspeed: 'train.py:88 in train <- ...'."""
    parts: list[str] = []
    while frame is not None and len(parts) < depth:
        path = frame.f_code.co_filename
        if not _is_library(path):
            parts.append(f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(parts)


def _forward_us(fwd_pairs: list, coll_pairs: list) -> int:
    """The GPU's span of a step's training forwards in us (-1: none seen), less the collectives it waited for
    inside them (FSDP's all-gathers, DDP's buffer broadcast): time in the forward, not waiting for peers."""
    if not fwd_pairs:
        return -1
    ms = 0.0
    try:
        for start, end in fwd_pairs:
            ms += start.elapsed_time(end)
            for x, y in coll_pairs:
                if start.elapsed_time(x) >= 0 and y.elapsed_time(end) >= 0:
                    ms -= x.elapsed_time(y)
    except Exception:  # fail open: the step's other GPU timings stand
        return -1
    return int(max(0.0, ms) * 1e3)
