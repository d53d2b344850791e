"""Makes one rank of an unmodified training job misbehave on cue, so detectors can be shown and tested.

The probe (in every rank process) builds a FaultInjector from TRAINSCOUT_INJECT and calls it at three points:
after each optimizer step (on_step_end: hangs, GIL spins, crashes, early exits, slowness, pauses), just before
each Python-level torch.distributed collective (rewrite_collective: desyncs), and right after
init_process_group (on_init_process_group: the side group a "pg" desync issues on). Where and when it is
called is the probe's business. Faults that must act inside forward, backward or data loading (delay,
gradnoise, outflip) or beside the rank (starve) are "drills": armed once from on_step_end with the model at
hand, they install their own hooks, helper threads or child processes and act on their own schedule; the
injector ticks their clock every step and writes their fault log lines.

Apart from the faults that end or stop the rank by design, nothing here raises into the training script:
an injector that breaks a job in an unplanned way would be blamed on the detectors. Every fault that fires
writes one "trainscout-fault:" line to stderr so a demo shows cause next to effect, and, when
TRAINSCOUT_FAULT_LOG names a file, one JSON line to it, so benchmarks can measure detection latency from the
moment the fault took effect rather than from the launch.

torch is imported inside functions only: this module is loaded in every process at interpreter start.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from trainscout.faults.fault_log import FAULT_LOG_ENV, LOG_PREFIX, log_line, record  # noqa: F401 (re-exported)
from trainscout.faults.spec import ENV_VAR, FaultSpec, format_value, parse_faults

# Kept importable from here: callers and tests know these names.
_log = log_line
_record = record

# Faults driven by the optimizer step; the order says what goes first when several are due at one step:
# the ones that return (slow, pause) before the ones that never do.
_STEP_KINDS = (
    "slow",
    "straggle",
    "gpuslow",
    "dataslow",
    "ckptslow",
    "commslow",
    "pause",
    "corrupt",
    "nan",
    "perturb",
    "delay",
    "starve",
    "gradnoise",
    "outflip",
    "hang",
    "gil",
    "crash",
    "exit",
)
_EVERY_STEP = ("slow", "straggle", "gpuslow")  # fire at every step from spec.step on; the others fire once
# Armed once, then they act on their own schedule (faults/schedule.py) from hooks in forward, backward or data
# loading, or from child processes; the injector ticks their clock every step and writes their fault log lines.
_DRILL_KINDS = ("delay", "starve", "gradnoise", "outflip")

# Positional parameter names of the torch.distributed functions the probe may wrap (torch 2.13), so an
# argument can be read or replaced whether the caller passed it by position or by keyword.
_SIGNATURES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op"),
    "broadcast": ("tensor", "src", "group", "async_op", "group_src"),
    "reduce": ("tensor", "dst", "op", "group", "async_op", "group_dst"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_single": ("output_tensor", "input_tensor", "group", "async_op"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "reduce_scatter_tensor": ("output", "input", "op", "group", "async_op"),
    "reduce_scatter_single": ("output", "input", "op", "group", "async_op"),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group", "async_op"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
    "gather": ("tensor", "gather_list", "dst", "group", "async_op", "group_dst"),
    "scatter": ("tensor", "scatter_list", "src", "group", "async_op", "group_src"),
    "barrier": ("group", "async_op", "device_ids", "timeout"),
    "monitored_barrier": ("group", "timeout", "wait_all_ranks"),
    "broadcast_object_list": ("object_list", "src", "group", "device", "group_src"),
    "all_gather_object": ("object_list", "obj", "group"),
    "gather_object": ("obj", "object_gather_list", "dst", "group", "group_dst"),
    "scatter_object_list": ("scatter_object_output_list", "scatter_object_input_list", "src", "group", "group_src"),
}

# The tensor this rank contributes, i.e. the one a shape/dtype desync replaces.
_INPUT_TENSOR: dict[str, str] = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "all_to_all_single": "input",
    "gather": "tensor",
    "scatter": "tensor",
}

_REDUCING = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
)


class _NotApplicable(Exception):
    """This collective cannot carry the pending desync; keep it pending for the next one."""


class _Call:
    """A collective call's arguments, addressable by parameter name however they were passed."""

    def __init__(self, name: str, args: tuple, kwargs: dict) -> None:
        self.name = name
        self.params = _SIGNATURES.get(name, ())
        self.args = list(args)
        self.kwargs = dict(kwargs)  # a copy: the caller's dict is never mutated

    def _index(self, param: str) -> int | None:
        if param in self.params:
            index = self.params.index(param)
            if index < len(self.args):
                return index
        return None

    def has(self, param: str) -> bool:
        return param in self.kwargs or self._index(param) is not None

    def get(self, param: str, default: Any = None) -> Any:
        if param in self.kwargs:
            return self.kwargs[param]
        index = self._index(param)
        return self.args[index] if index is not None else default

    def set(self, param: str, value: Any) -> None:
        index = self._index(param)
        if index is not None and param not in self.kwargs:
            self.args[index] = value
        else:
            self.kwargs[param] = value

    def result(self) -> tuple[str, tuple, dict]:
        return self.name, tuple(self.args), self.kwargs


def _input_tensor(call: _Call) -> tuple[str, Any]:
    import torch

    param = _INPUT_TENSOR.get(call.name)
    tensor = call.get(param) if param else None
    if not param or not isinstance(tensor, torch.Tensor):
        raise _NotApplicable(f"{call.name} has no input tensor to rewrite")
    return param, tensor


def _scratch_tensor(group: Any) -> Any:
    """A one-element tensor on the device the group's backend needs (for ops that carried no tensor)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    try:
        if dist.is_initialized() and dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
    except Exception:
        pass
    return torch.zeros(1, device=device)


def _first_rank_of(group: Any) -> int:
    """Global rank of the group's rank 0: a broadcast root that is valid on any group (world: 0)."""
    if group is None:
        return 0
    try:
        import torch.distributed as dist

        return dist.get_global_rank(group, 0)
    except Exception:
        return 0


def _desync_shape(call: _Call) -> str:
    param, tensor = _input_tensor(call)
    bigger = tensor.new_zeros(tensor.numel() + 1)
    bigger[: tensor.numel()] = tensor.detach().reshape(-1)
    call.set(param, bigger)
    return f"{param} {tuple(tensor.shape)} -> {tuple(bigger.shape)}"


def _desync_dtype(call: _Call) -> str:
    import torch

    param, tensor = _input_tensor(call)
    # float32 <-> float64; any other dtype also becomes float64, which differs from it just as well.
    dtype = torch.float32 if tensor.dtype == torch.float64 else torch.float64
    call.set(param, tensor.detach().to(dtype))
    return f"{param} {tensor.dtype} -> {dtype}"


def _desync_op(call: _Call) -> str:
    group = call.get("group")
    kwargs: dict[str, Any] = {"group": group}
    if call.has("async_op"):  # keep the caller's expectation of a Work handle (or of None)
        kwargs["async_op"] = call.get("async_op")
    if call.name == "all_reduce":
        tensor = call.get("tensor")
        new = _Call("broadcast", (tensor,), {"src": _first_rank_of(group), **kwargs})
    else:
        try:
            _, tensor = _input_tensor(call)
        except _NotApplicable:
            tensor = _scratch_tensor(group)
        new = _Call("all_reduce", (tensor,), kwargs)
    call.name, call.params, call.args, call.kwargs = new.name, new.params, new.args, new.kwargs
    return f"issued as {call.name}"


def _desync_reduce(call: _Call) -> str:
    import torch.distributed as dist

    if call.name not in _REDUCING:
        raise _NotApplicable(f"{call.name} has no reduce op")
    old = call.get("op", dist.ReduceOp.SUM)
    new = dist.ReduceOp.MAX if old == dist.ReduceOp.SUM else dist.ReduceOp.SUM
    call.set("op", new)
    return f"op {old} -> {new}"


def _build_drill(spec: FaultSpec, start: int, rank: int, model: Any, who: str) -> Any:
    """The drill object for a kind in _DRILL_KINDS, its schedule starting at `start`; ValueError when it cannot
    work here (no model, no CUDA)."""
    if spec.kind == "delay":
        from trainscout.faults.delay import DelayDrill

        return DelayDrill(spec.params, start, model, who)
    if spec.kind == "starve":
        from trainscout.faults.starve import CpuStarver

        return CpuStarver(spec.params, start)
    if spec.kind == "gradnoise":
        from trainscout.faults.gradnoise import GradNoiseDrill

        return GradNoiseDrill(spec.params, start, model, rank, who)
    from trainscout.faults.outflip import OutFlipDrill

    return OutFlipDrill(spec.params, start, model, who)


class _ArmedDrill:
    """An armed drill and its fault-log bookkeeping: the onset once, and every occurrence of an intermittent one."""

    def __init__(self, spec: FaultSpec, drill: Any, who: str) -> None:
        self.spec, self.drill, self.who = spec, drill, who
        self.recorded_onset = False
        self.finished = False

    def tick(self, rank: int, step: int) -> None:
        schedule = self.drill.schedule
        if schedule.fires_after(step):  # recorded now, before the iteration in which it acts
            if schedule.intermittent:
                _record(rank, self.spec.kind, step, {**self.spec.params, "occurrence": schedule.occurrence(step)})
            elif not self.recorded_onset:
                _record(rank, self.spec.kind, step, self.spec.params)
            self.recorded_onset = True
        self.drill.on_step(step)
        if schedule.is_over(step):  # e.g. gradnoise after its count: take the hooks off
            self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            try:
                self.drill.close()
            except Exception as exc:
                _log(f"{self.who}: cleanup failed: {exc!r}")


class FaultInjector:
    """The faults one rank must fire, and the once-only bookkeeping that goes with them."""

    def __init__(self, specs: Iterable[FaultSpec], rank: int, attempt: int = 0) -> None:
        specs = list(specs)
        self.rank = rank
        self.specs: tuple[FaultSpec, ...] = tuple(s for s in specs if s.applies_to(rank, attempt))
        # Creating a process group is itself collective: every rank must join the side group if any rank
        # will later desync onto it, even ranks with no fault of their own.
        self.needs_side_group = any(s.kind == "desync" and s.params.get("what") == "pg" for s in specs)
        self._side_group: Any = None
        self._fired: set[int] = set()  # indexes into self.specs of one-shot faults already fired
        self._lock = threading.Lock()  # collectives may be issued from several threads
        self._drills: list[_ArmedDrill] = []

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] = os.environ, attempt: int = 0) -> FaultInjector | None:
        """The injector for this rank, or None when it has nothing to do (no faults, no side group)."""
        text = environ.get(ENV_VAR, "")
        if not text.strip():
            return None
        try:
            specs = parse_faults(text)
        except ValueError as exc:  # the CLI validates first; here a bad value must not kill training
            _log(f"rank {rank}: ignoring {ENV_VAR}: {exc}")
            return None
        injector = cls(specs, rank, attempt)
        return injector if injector.specs or injector.needs_side_group else None

    def describe(self) -> str:
        """One line for logs: what this rank will do and when."""
        parts = []
        for spec in self.specs:
            params = ",".join(f"{k}={format_value(v)}" for k, v in spec.params.items())
            parts.append(f"{spec.kind}({params})@step{spec.step}" if params else f"{spec.kind}@step{spec.step}")
        text = f"rank {self.rank}: " + (", ".join(parts) if parts else "no faults")
        if self.needs_side_group:
            text += "; joins the side group for a pg desync"
        return text

    # ---- optimizer step ----------------------------------------------------------------------------

    def on_step_end(
        self, step: int, optimizer: Any = None, names: Mapping[int, str] | None = None, model: Any = None
    ) -> None:
        """Fire the step-driven faults due after `step` optimizer steps. Raises only by design.

        optimizer/names/model: the optimizer that just stepped, parameter names and the replicated model,
        for numerical faults.
        """
        self._optimizer, self._names, self._model = optimizer, dict(names or {}), model
        self._measure_cpu()
        try:
            due = self._due_at(step)
        except Exception as exc:
            _log(f"rank {self.rank}: step fault check failed, disabled: {exc!r}")
            self.specs = ()
            return
        for spec in due:
            self._fire(spec, step)
        self._tick_drills(step)

    def close(self) -> None:
        """Undo what the armed drills installed: hooks, patches, helper threads, hog processes, CPU pinning.

        For tests and tools that run several injectors in one process; a training job never needs it (the hog
        processes also die with the rank on their own)."""
        for armed in self._drills:
            armed.close()
        self._drills = []

    def _arm_drill(self, spec: FaultSpec, step: int) -> None:
        who = f"rank {self.rank}: {spec.kind}"
        try:
            # Scheduled from the step it is armed at: spec.step, or later when the probe attached late (a
            # step=0 fault is armed at step 1), so a late drill still fires in full rather than not at all.
            drill = _build_drill(spec, step, self.rank, getattr(self, "_model", None), who)
            what = drill.arm()
        except Exception as exc:
            _log(f"{who}: not fired: {exc}")
            return
        self._drills.append(_ArmedDrill(spec, drill, who))
        _log(f"{who}: {what}")

    def _tick_drills(self, step: int) -> None:
        """Advance every armed drill's clock to `step`; write the fault log for the iteration about to run."""
        for armed in list(self._drills):
            try:
                armed.tick(self.rank, step)
            except Exception as exc:  # fail open: this drill stops, training goes on
                _log(f"{armed.who}: disabled: {exc!r}")
                armed.close()
            if armed.finished:
                self._drills.remove(armed)

    def _due_at(self, step: int) -> list[FaultSpec]:
        due: list[tuple[int, FaultSpec]] = []
        with self._lock:
            for index, spec in enumerate(self.specs):
                if spec.kind not in _STEP_KINDS or step < spec.step:
                    continue
                if spec.kind in _EVERY_STEP:
                    due.append((index, spec))
                    if index not in self._fired:
                        self._fired.add(index)  # marks "announced": logs once, acts every step
                        _record(self.rank, spec.kind, step, spec.params)
                        if spec.kind == "slow":
                            _log(f"rank {self.rank}: slow: sleeping {spec.params['ms']:g} ms per step from step {step}")
                        elif spec.kind == "gpuslow":
                            _log(
                                f"rank {self.rank}: gpuslow: a {spec.params['ms']:g} ms spin kernel on the "
                                f"current CUDA stream every step from step {step}"
                            )
                        else:
                            _log(
                                f"rank {self.rank}: straggle: {spec.params['factor']:g}x extra CPU work every "
                                f"{spec.params['every']} step(s) from step {step}"
                            )
                elif index not in self._fired:
                    # >= rather than ==: a probe attached a few steps late still fires the fault once.
                    self._fired.add(index)
                    due.append((index, spec))
        due.sort(key=lambda item: (_STEP_KINDS.index(item[1].kind), item[0]))
        return [spec for _, spec in due]

    def _fire(self, spec: FaultSpec, step: int) -> None:
        kind, params, rank = spec.kind, spec.params, self.rank
        if kind in _DRILL_KINDS:  # recorded by _tick_drills, once armed, before each iteration it acts in
            self._arm_drill(spec, step)
            return
        if kind not in _EVERY_STEP:  # those act every step; they were recorded once, when announced
            _record(rank, kind, step, params)
        if kind == "straggle":
            self._straggle(step, params)
            return
        if kind in ("dataslow", "ckptslow"):
            self._arm_slow_io(kind, params)
            return
        if kind == "commslow":
            self._arm_slow_transport(params)
            return
        if kind == "gpuslow":
            self._spin_gpu(params)
            return
        if kind == "corrupt" and params.get("target") == "gathered":
            # fired by on_gathered, inside the next checked forward
            self._corrupt_gathered: dict[str, Any] | None = dict(params)
            _log(f"rank {rank}: corrupt: the next checked all-gathered parameter will be corrupted")
            return
        if kind in ("corrupt", "nan", "perturb"):
            from trainscout.faults import numeric

            if getattr(self, "_optimizer", None) is None:
                _log(f"rank {rank}: {kind}: no optimizer at hand, not fired")
                return
            try:
                if kind == "perturb":
                    done = numeric.perturb(self._model, params)
                else:
                    fn = numeric.corrupt if kind == "corrupt" else numeric.make_nonfinite
                    done = fn(self._optimizer, self._names, params)
                _log(f"rank {rank}: {kind}: {done} after step {step}")
            except Exception as exc:
                _log(f"rank {rank}: {kind}: not fired: {exc}")
            return
        if kind == "slow":
            time.sleep(params["ms"] / 1000.0)
        elif kind == "pause":
            _log(f"rank {rank}: pause: sleeping {params['seconds']:g} s at step {step}")
            time.sleep(params["seconds"])
        elif kind == "hang":
            _log(f"rank {rank}: hang: stopping before the next collective at step {step} (sleeping forever)")
            while True:  # like a rank blocked in data loading: alive, GIL free, never progressing
                time.sleep(3600)
        elif kind == "gil":
            _log(f"rank {rank}: gil: spinning in Python with the GIL held at step {step}")
            sys.setswitchinterval(1e6)  # other Python threads of this process wait ~forever for the GIL
            while True:
                pass
        elif kind == "crash":
            how = params["how"]
            _log(f"rank {rank}: crash: how={how} at step {step}")
            if how == "exception":
                raise RuntimeError("trainscout injected crash")
            signals = {"segv": signal.SIGSEGV, "term": signal.SIGTERM, "int": signal.SIGINT}
            os.kill(os.getpid(), signals.get(how, signal.SIGKILL))  # term, int: as if sent from outside the job
            time.sleep(10)  # signal delivery is asynchronous; do not run on into the next step meanwhile
        elif kind == "exit":
            _log(f"rank {rank}: exit: code={params['code']} at step {step}")
            sys.exit(params["code"])

    # ---- collectives -------------------------------------------------------------------------------

    def _straggle(self, step: int, params: Mapping[str, Any]) -> None:
        """Extra CPU work: `factor` times this rank's own CPU time per step (measured before the fault), done
        at the start of the next training forward (inside the step, as a slower CPU would), or at once when
        the model is unknown."""
        if step % int(params.get("every", 1)):
            return
        self._straggle_due = float(params["factor"]) * getattr(self, "_cpu_per_step", 0.0)
        model = getattr(self, "_model", None)
        if model is None or not hasattr(model, "register_forward_pre_hook"):
            self._burn_due()
        elif getattr(self, "_straggle_hooked", None) is not model:
            self._straggle_hooked = model
            model.register_forward_pre_hook(lambda module, args: self._burn_due() if module.training else None)

    def _burn_due(self) -> None:
        target, self._straggle_due = getattr(self, "_straggle_due", 0.0), 0.0
        if target <= 0:
            return
        t0 = time.process_time()
        while time.process_time() - t0 < target:
            sum(i * i for i in range(2000))
        self._burnt = time.process_time() - t0

    def _measure_cpu(self) -> None:
        now = time.process_time()
        last = getattr(self, "_cpu_last", None)
        if last is not None and not any(s.kind == "straggle" and i in self._fired for i, s in enumerate(self.specs)):
            spent = now - last
            ema = getattr(self, "_cpu_per_step", None)
            self._cpu_per_step = spent if ema is None else 0.8 * ema + 0.2 * spent
        self._cpu_last = now

    def _arm_slow_io(self, kind: str, params: Mapping[str, Any]) -> None:
        """dataslow: every DataLoader batch from now on takes `ms` longer; ckptslow: every torch.save."""
        delay = float(params["ms"]) / 1000.0
        # Slow the work itself (fetching a batch, serialising a checkpoint), below the entry points the
        # probe times, as a slow disk or loader would.
        targets: list[tuple[Any, str]]  # (class or module, attribute)
        if kind == "dataslow":
            from torch.utils.data import dataloader

            targets = [
                (dataloader._SingleProcessDataLoaderIter, "_next_data"),
                (dataloader._MultiProcessingDataLoaderIter, "_next_data"),
            ]
        else:
            import torch.serialization as serialization

            targets = [(serialization, "_save"), (serialization, "_legacy_save")]
        for owner, attr in targets:
            real = getattr(owner, attr, None)
            if real is None:
                continue

            def slowed(*args, _real=real, **kwargs):
                time.sleep(delay)
                return _real(*args, **kwargs)

            setattr(owner, attr, slowed)
        _log(f"rank {self.rank}: {kind}: +{params['ms']:g} ms per {'batch' if kind == 'dataslow' else 'save'}")

    def _arm_slow_transport(self, params: Mapping[str, Any]) -> None:
        """commslow: from now on every collective and point-to-point call this rank issues from Python
        waits `ms` first, as over a slow link or a congested host network stack. Its compute is untouched."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        delay = float(params["ms"]) / 1000.0
        self._transport_delay = delay
        for name in ("send", "recv", "isend", "irecv"):
            for owner in (dist, c10d):
                real = getattr(owner, name, None)
                if real is None or getattr(real, "__trainscout_slowed__", False):
                    continue

                def slowed(*args, _real=real, **kwargs):
                    time.sleep(delay)
                    return _real(*args, **kwargs)

                slowed.__trainscout_slowed__ = True  # type: ignore[attr-defined]
                setattr(owner, name, slowed)
        _log(f"rank {self.rank}: commslow: +{params['ms']:g} ms per collective and send/recv")

    def _spin_gpu(self, params: Mapping[str, Any]) -> None:
        """gpuslow: a spin kernel of `ms` on the current CUDA stream (the GPU is slow, the host is not)."""
        import torch

        from trainscout.faults.blockers import spin_gpu

        if torch.cuda.is_available():
            spin_gpu(float(params["ms"]))

    def on_gathered(self, module: Any, step: int) -> None:
        """Called by the probe between an all-gather and its check: corrupt this receiver's copy once."""
        params = getattr(self, "_corrupt_gathered", None)
        if not params:
            return
        try:
            import torch

            for name, p in module.named_parameters():
                if type(p).__name__ != "DTensor" and p.numel() > 0:
                    with torch.no_grad():
                        p.view(-1)[0] = p.view(-1)[0] * 1e3 + 1.0
                    self._corrupt_gathered = None
                    _log(f"rank {self.rank}: corrupt: gathered {type(module).__name__}.{name} at step {step}")
                    return
        except Exception as exc:
            _log(f"rank {self.rank}: corrupt gathered: not fired: {exc!r}")

    def on_init_process_group(self) -> None:
        """Create the side group on every rank (group creation is collective); keep it for a pg desync."""
        if not self.needs_side_group or self._side_group is not None:
            return
        try:
            import torch.distributed as dist

            self._side_group = dist.new_group(ranks=list(range(dist.get_world_size())))
        except Exception as exc:
            _log(f"rank {self.rank}: could not create the side group, pg desync disabled: {exc!r}")

    def rewrite_collective(self, name: str, args: tuple, kwargs: dict, step: int) -> tuple[str, tuple, dict]:
        """Return the collective to issue instead of (name, args, kwargs): changed once, for a due desync."""
        unchanged = (name, args, kwargs)
        delay = getattr(self, "_transport_delay", 0.0)
        if delay:
            time.sleep(delay)  # commslow: inside the collective as the caller sees it
        with self._lock:
            index = self._pending_desync(step)
            if index is None:
                return unchanged
            what = self.specs[index].params["what"]
            try:
                call = _Call(name.rsplit(".", 1)[-1], args, kwargs)
                if what == "pg":
                    detail = self._desync_pg(call)
                else:
                    detail = {
                        "shape": _desync_shape,
                        "dtype": _desync_dtype,
                        "op": _desync_op,
                        "reduce": _desync_reduce,
                    }[what](call)
            except _NotApplicable:
                return unchanged  # stays pending: the next collective that can carry it gets it
            except Exception as exc:
                self._fired.add(index)  # fail open, once
                _log(f"rank {self.rank}: desync {what} on {name} failed, disabled: {exc!r}")
                return unchanged
            self._fired.add(index)
            # Recorded before returning: the rewritten collective is issued by the caller right after.
            _record(self.rank, "desync", step, {**self.specs[index].params, "collective": call.name})
        _log(f"rank {self.rank}: desync: what={what} on {name} at step {step}: {detail}")
        return call.result()

    def _pending_desync(self, step: int) -> int | None:
        for index, spec in enumerate(self.specs):
            if spec.kind == "desync" and index not in self._fired and step >= spec.step:
                return index
        return None

    def _desync_pg(self, call: _Call) -> str:
        if call.name not in _SIGNATURES or "group" not in call.params:
            raise _NotApplicable(f"{call.name}: unknown group parameter")
        if self._side_group is None:
            raise RuntimeError("no side group: on_init_process_group was not called")
        call.set("group", self._side_group)
        return "issued on the side group"
