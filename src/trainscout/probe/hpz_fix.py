"""ZeRO++ hpZ: order the secondary all-gather after the secondary copy with a CUDA event, not a host stall.

With hierarchical partitioning (`zero_hpz_partition_size > 1`), DeepSpeed ZeRO-3 fills a parameter's
secondary partition when it releases the gathered parameter: a device-to-device copy enqueued on the
compute stream. With `overlap_comm`, the all-gathers that later read that secondary partition (the
backward prefetch) run on a separate all-gather stream, and nothing orders them after the copy: the
gather can read memory the copy has not filled yet, and training diverges. DeepSpeed's guard is a host
stall: after the copy the host waits until the compute stream has drained, so the host cannot run ahead
of the GPU there.

The event-ordered secondary partition keeps DeepSpeed's own function for the copy and replaces only the
stall: the host skips it, records one CUDA event behind the copy on the stream that enqueued it, and makes
every all-gather stream wait on that event. The ordering then lives on the GPU (`cudaStreamWaitEvent`),
the host keeps running ahead, and every later all-gather of that secondary is enqueued behind the wait.

The probe installs this through its import hooks (it runs before the training script imports DeepSpeed).
It is applied only where all of these hold, and otherwise leaves DeepSpeed untouched with one message
saying why: a DeepSpeed version whose layout was read (see `TESTED`), the secondary-partition function
and its stall where they are expected, an accelerator whose streams need the stall (CUDA), and an
all-gather stream separate from the stream that copies (`overlap_comm`). A release whose stream knows no
separate all-gather stream keeps DeepSpeed's stall.

`TRAINSCOUT_HPZ_FIX` picks the mode: `event` (default), `off` (DeepSpeed as shipped, with its stall),
`unsafe` (the stall removed and nothing in its place: this reproduces the race; never use it for
training).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

MODES = ("event", "off", "unsafe")
# DeepSpeed versions whose secondary-partition layout was read: the stall (added in 0.14) sits in
# Init._partition_param_sec behind the accelerator's resolves_data_dependency(), and the parameter
# coordinator is given its all-gather stream as `allgather_stream`. Newer versions are left alone
# until someone reads them and widens this range.
TESTED = ((0, 14, 0), (0, 20, 0))  # [first, past-the-last)

_PARTITION_MODULE = "deepspeed.runtime.zero.partition_parameters"
_COORDINATOR_MODULE = "deepspeed.runtime.zero.partitioned_param_coordinator"


def parse_version(text: str) -> tuple[int, int, int] | None:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:  # leading digits only: "0rc1" is 0
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            return None
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def version_supported(text: str) -> bool:
    v = parse_version(text)
    return v is not None and TESTED[0] <= v < TESTED[1]


def _copies(param, args, kwargs) -> bool:
    """Whether DeepSpeed's secondary-partition function will copy (and so stall) for this call: the
    parameter is gathered, and its secondary partition is missing or stale (`has_been_updated`)."""
    if getattr(getattr(param, "ds_status", None), "name", "") != "AVAILABLE":
        return False
    updated = kwargs.get("has_been_updated", args[1] if len(args) > 1 else False)
    return getattr(param, "ds_secondary_tensor", None) is None or bool(updated)


def _source_through_decorators(fn, depth: int = 3) -> str:
    """Source text of fn and of the functions its decorators close over (DeepSpeed's NVTX decorator keeps
    the real function in a closure cell, without functools.wraps): for layout checks, never executed."""
    try:
        texts = [inspect.getsource(fn)]
    except (OSError, TypeError):
        texts = []
    inner = [getattr(fn, "__wrapped__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:
            continue
    for f in inner:
        if depth > 0 and inspect.isfunction(f):
            texts.append(_source_through_decorators(f, depth - 1))
    return "\n".join(texts)


class HpzFix:
    """Wraps DeepSpeed's secondary-partition function; `state` says what it did (for messages and tests)."""

    def __init__(self, mode: str = "event", on_message: Callable[[str], None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"TRAINSCOUT_HPZ_FIX must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.on_message = on_message or (lambda text: None)
        self.state = "waiting"  # waiting | installed | left-alone: <why>
        self.streams: list = []  # all-gather streams of the parameter coordinators built so far
        self.applied = 0  # secondary copies ordered by an event (or, in unsafe mode, left unordered)
        self.kept_stall = 0  # copies for which no separate all-gather stream was known: DeepSpeed's stall ran
        self._tls = threading.local()
        self._event = None
        self._pending: dict[int, object] = {}  # id(param) -> event recorded behind its latest secondary copy
        self._events: dict[int, object] = {}  # id(param) -> its reusable event
        self._announced = False
        self._resolves: bool | None = None  # the accelerator's own resolves_data_dependency(), read once
        self._waiters: dict[int, list] = {}  # copying stream's handle -> the all-gather streams that must wait

    # ---- installation -----------------------------------------------------------------------
    def install(self, hooks) -> None:
        """Register the patches with the probe's import hooks (before the training script imports DeepSpeed)."""
        if self.mode == "off":
            self.state = "left-alone: TRAINSCOUT_HPZ_FIX=off"
            return
        hooks.on_import(_COORDINATOR_MODULE, self.patch_coordinator)
        hooks.on_import(_PARTITION_MODULE, self.patch_partition)

    def _leave_alone(self, why: str) -> None:
        self.state = f"left-alone: {why}"
        self.on_message(f"hpZ fix not applied ({why}); DeepSpeed's own host stall stays")

    def patch_coordinator(self, module) -> None:
        """Learn the all-gather stream of every parameter coordinator DeepSpeed builds."""
        cls = getattr(module, "PartitionedParameterCoordinator", None)
        if cls is None or "allgather_stream" not in inspect.signature(cls.__init__).parameters:
            self._leave_alone("unknown DeepSpeed layout: the parameter coordinator takes no allgather_stream")
            return
        real_init = cls.__init__
        fix = self

        def __init__(coordinator, *args, **kwargs):
            real_init(coordinator, *args, **kwargs)
            try:
                bound = inspect.signature(real_init).bind(coordinator, *args, **kwargs)
                stream = bound.arguments.get("allgather_stream")
                if stream is not None and all(stream is not s for s in fix.streams):
                    fix.streams.append(stream)
                    fix._waiters.clear()  # recomputed per copying stream at its next copy
            except Exception:
                pass  # no stream learnt: releases keep DeepSpeed's stall

        __init__.__wrapped__ = real_init  # type: ignore[attr-defined]
        cls.__init__ = __init__

    def patch_partition(self, module) -> None:
        """Wrap Init._partition_param_sec. Where this DeepSpeed is not laid out as expected the wrapper only
        calls through, and says why once, at the first secondary copy that would need the fix."""
        from importlib import metadata

        init_cls = getattr(module, "Init", None)
        real = getattr(init_cls, "_partition_param_sec", None)
        if real is None:
            self._leave_alone("unknown DeepSpeed layout: no Init._partition_param_sec")
            return
        assert init_cls is not None  # real was found on it
        try:
            version = metadata.version("deepspeed")
        except metadata.PackageNotFoundError:
            version = "?"
        self.version = version
        source = _source_through_decorators(real)
        why = None
        if not version_supported(version):
            why = (
                f"DeepSpeed {version} is outside the versions whose layout was read "
                f"({'.'.join(map(str, TESTED[0]))} to before {'.'.join(map(str, TESTED[1]))})"
            )
        elif "resolves_data_dependency" not in source or "synchronize" not in source:
            why = (
                f"unknown DeepSpeed {version} layout: the secondary partition has no host stall behind "
                "resolves_data_dependency()"
            )
        fix = self

        def _partition_param_sec(init, param, *args, **kwargs):
            return fix.partition_secondary(real, why, init, param, *args, **kwargs)

        _partition_param_sec.__wrapped__ = real  # type: ignore[attr-defined]
        _partition_param_sec.__doc__ = real.__doc__
        init_cls._partition_param_sec = _partition_param_sec
        self.state = "installed" if why is None else f"left-alone: {why}"
        real_convert = getattr(init_cls, "_convert_to_deepspeed_param", None)
        if why is None and real_convert is not None:

            def _convert_to_deepspeed_param(init, param, *args, **kwargs):
                result = real_convert(init, param, *args, **kwargs)
                gather = getattr(param, "all_gather_coalesced", None)
                if callable(gather):
                    param.all_gather_coalesced = fix.ordered_gather(gather)
                    param._trainscout_ordered = True
                return result

            _convert_to_deepspeed_param.__wrapped__ = real_convert  # type: ignore[attr-defined]
            init_cls._convert_to_deepspeed_param = _convert_to_deepspeed_param

    def ordered_gather(self, gather):
        """The parameter coordinator's all-gather of a parameter list (enqueued with the all-gather stream
        current): first make that stream wait on the copies into these parameters' secondary partitions
        still pending, so only gathers that read a secondary partition wait, and only for their own copy."""
        pending = self._pending

        def all_gather_coalesced(params, *args, **kwargs):
            if pending:
                for p in params:
                    event = pending.pop(id(p), None)
                    if event is not None:
                        event.wait()  # the current stream (the all-gather stream here) waits on the copy
            return gather(params, *args, **kwargs)

        all_gather_coalesced.__wrapped__ = gather
        return all_gather_coalesced

    # ---- the replacement for the stall ------------------------------------------------------
    def _accelerator(self):
        """DeepSpeed's accelerator, with resolves_data_dependency() answering True for this thread while
        the secondary copy runs under this fix (so DeepSpeed's stall is skipped there and nowhere else)."""
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        if not getattr(acc, "_trainscout_hpz", False):
            real = acc.resolves_data_dependency
            tls = self._tls

            def resolves_data_dependency():
                return True if getattr(tls, "skip_stall", False) else real()

            acc.resolves_data_dependency = resolves_data_dependency
            acc._trainscout_hpz = True
            acc._trainscout_real_resolves = real
        return acc

    def partition_secondary(self, real, why, init, param, *args, **kwargs):
        if self.mode == "off":  # switched off after installation (benchmarks switch modes at run time)
            return real(init, param, *args, **kwargs)
        if self._resolves is None:
            self._resolves = bool(self._accelerator()._trainscout_real_resolves())
        if self._resolves:
            return real(init, param, *args, **kwargs)  # streams resolve dependencies here: no stall, no race
        if why is not None:
            if not self._announced:
                self._announced = True
                self.on_message(f"hpZ fix not applied ({why}); DeepSpeed's own host stall stays")
            return real(init, param, *args, **kwargs)
        if not _copies(param, args, kwargs):
            return real(init, param, *args, **kwargs)  # no copy, so DeepSpeed does not stall either
        import torch

        current = torch.cuda.current_stream()
        waiters = self._waiters.get(current.cuda_stream)
        if waiters is None:
            waiters = self._waiters[current.cuda_stream] = [s for s in self.streams if s != current]
        if not waiters:
            self.kept_stall += 1  # overlap_comm off (the all-gather stream is this one) or none known yet
            return real(init, param, *args, **kwargs)
        self._tls.skip_stall = True
        try:
            result = real(init, param, *args, **kwargs)
        finally:
            self._tls.skip_stall = False
        if self.mode == "event":
            if getattr(param, "_trainscout_ordered", False):
                # ordered where it is read: the gather of this parameter waits on this event
                event = self._events.get(id(param))
                if event is None:
                    event = self._events[id(param)] = torch.cuda.Event()
                event.record(current)
                self._pending[id(param)] = event
            else:
                # a parameter whose gather is not wrapped: every all-gather stream waits here. A stream
                # waits on the event's latest record as of the wait call, so one event serves all copies.
                if self._event is None:
                    self._event = torch.cuda.Event()
                self._event.record(current)
                for stream in waiters:
                    stream.wait_event(self._event)
        self.applied += 1
        if not self._announced:
            self._announced = True
            what = (
                "event-ordered secondary partition applied"
                if self.mode == "event"
                else "secondary-partition host stall REMOVED without ordering (TRAINSCOUT_HPZ_FIX=unsafe)"
            )
            self.on_message(f"hpZ: {what} (DeepSpeed {getattr(self, 'version', '?')}, overlap_comm)")
        return result

    def describe(self) -> str:
        return f"mode={self.mode} state={self.state} applied={self.applied} kept_stall={self.kept_stall}"


_fix: HpzFix | None = None


def install(hooks, mode: str = "event", on_message: Callable[[str], None] | None = None) -> HpzFix:
    """Install once per process (the probe calls this; so can a benchmark that runs without the probe)."""
    global _fix
    if _fix is None:
        _fix = HpzFix(mode, on_message)
        _fix.install(hooks)
    return _fix


def current() -> HpzFix | None:
    return _fix
