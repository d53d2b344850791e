"""Python-level wrappers around torch.distributed collectives.

The Flight Recorder sees every collective but not its reduce op or root; these wrappers add that
for collectives issued from Python, keyed by (group name, the sequence number the call will get),
and give fault injection its hook. The functional all-reduce (DTensor, TorchTitan) is recorded the
same way. For the common single-tensor collectives they also put the record
in the channel before issuing the call, described exactly as the Flight Recorder would describe it
(the publisher checks that and counts differences): a call that then hangs, or aborts its process,
is already on record. They never change what the call does unless a fault is planned.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from trainscout.markers import P2P_WAIT
from trainscout.probe import protocol

WRAPPED = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)
# torch >= 2.13: the old names only call the new `_single` ones (FSDP2 calls those directly); wrapping
# the new ones alone sees both and counts each call once
_DELEGATES = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}
_ROOT_ARGS = ("src", "dst", "group_src", "group_dst")
_MAX_EXTRAS = 8192
_MAX_DESCRIBED = 4096
_SYNC_RECORDED = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor"}
# Point-to-point calls (pipeline stages): not collectives, and not in the Flight Recorder's collective sequence.
# Gloo counts them in the group's sequence number all the same (a send or recv adds one on its rank only), so
# each call's effect on it is measured and taken off: a stage doing 8 P2P ops a step and one doing 16 would
# otherwise place the same barrier at different sequence numbers (a desync and stragglers of a healthy job).
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


class CollectiveRefused(RuntimeError):
    """A collective of the job's called where the probe forbids one (Tap.refusing)."""


class CollectiveTap:
    def __init__(
        self,
        get_step: Callable[[], int],
        injector=None,
        on_error: Callable[[str], None] = print,
        record_sync: Callable | None = None,
    ) -> None:
        self.record_sync = record_sync
        self.on_wait: Callable[[str, float], None] | None = None  # (group name, seconds) of a blocking call
        # CUDA jobs: an event before a blocking call (or None) and the call's end given that event (StepTiming)
        self.on_begin: Callable[[], object] | None = None
        self.on_end: Callable[[object], None] | None = None
        # (collective, group name, bound arguments) before a call is issued (probe/grad_sync.py)
        self.on_issue: Callable[[str, str, Any], None] | None = None
        # a wait on an asynchronous call's handle (Work.wait, a functional collective's wait_tensor): a token to
        # time it with, or None where it is not the training thread's wait (StepTiming), and its end
        self.on_async_begin: Callable[[], object] | None = None
        self.on_async_end: Callable[[object], None] | None = None
        self._inside = threading.local()  # in a wrapped call, whose own inner Work.wait is part of its time
        self.extras: "OrderedDict[tuple[str, int], str]" = OrderedDict()
        # (group, seq) of Python calls not put on record before issue: the publisher takes their record from
        # the Flight Recorder. A collective it counts that is neither there nor recorded was issued outside
        # Python (DDP's reducer, functional collectives, compiled code).
        self.noted: dict[tuple[str, int], None] = {}
        self.p2p_taken: dict[str, int] = {}  # group name -> sequence numbers its P2P calls took (gloo: 1 each)
        self._p2p_per_op: dict[str, int] = {}  # group name -> what one P2P call adds to its sequence number
        self._in_p2p = False  # inside a wrapped P2P call (the training thread's)
        self._get_step = get_step
        self._injector = injector
        self._on_error = on_error
        self._broken = False
        self._functional_broken = False
        self.functional_recorded = 0  # functional all-reduces put on record before issue
        self._c10d: Any = None  # torch.distributed.distributed_c10d, from patch()
        self.originals: dict[str, Callable] = {}
        self._sigs: dict[Callable, inspect.Signature | None] = {}
        self._binders: dict[Callable, Callable] = {}
        self._described: dict[tuple, tuple[tuple, str]] = {}  # (op, shape, dtype, extra) -> (signature, text)

    def patch(self, c10d_module) -> None:
        """Replace the module's collective functions; called before torch.distributed re-exports them."""
        self._c10d = c10d_module
        for name in WRAPPED:
            fn = getattr(c10d_module, name, None)
            if fn is None or getattr(fn, "__trainscout_wrapped__", False):
                continue
            if name in _DELEGATES and getattr(c10d_module, _DELEGATES[name], None) is not None:
                continue
            self.originals[name] = fn
            setattr(c10d_module, name, self._wrap(name, fn))
        for name in P2P:
            fn = getattr(c10d_module, name, None)
            if fn is not None and not getattr(fn, "__trainscout_wrapped__", False):
                self.originals[name] = fn
                setattr(c10d_module, name, self._wrap_p2p(fn))
        self.patch_work_wait(getattr(c10d_module, "Work", None))

    def patch_work_wait(self, work_cls) -> None:
        """Time `Work.wait()` where the training code waits on an asynchronous call's handle: FSDP2's all-gathers
        and reduce-scatters, a pipeline schedule's sends and receives (`isend`, `batch_isend_irecv`). Left out,
        that wait read as time the rank was blocked of its own accord: every pipeline stage blocked for its
        bubbles, every FSDP2 rank 0-30 ms a step on a busy machine. Patched on the class, so a handle the
        training code gets by any route is covered; the calls the wrappers time whole are not counted twice."""
        wait = getattr(work_cls, "wait", None)
        if wait is None or getattr(wait, "__trainscout_wrapped__", False):
            return
        self.originals["Work.wait"] = wait
        inside = self._inside

        @functools.wraps(wait)
        def timed_wait(work, *args, **kwargs):
            if self.on_async_begin is None or getattr(inside, "depth", 0):
                return wait(work, *args, **kwargs)
            token = self._async_begin()
            try:
                return wait(work, *args, **kwargs)
            finally:
                if token is not None:
                    self._async_end(token)

        timed_wait.__trainscout_wrapped__ = True  # type: ignore[attr-defined]
        try:
            work_cls.wait = timed_wait
        except (AttributeError, TypeError) as exc:  # a build whose Work type is closed: waits stay unmeasured
            self.originals.pop("Work.wait", None)
            self._on_error(f"asynchronous waits not timed: {exc!r}")

    def _async_begin(self):
        if _compiling():
            return None
        try:
            return self.on_async_begin() if self.on_async_begin is not None else None
        except Exception as exc:  # fail open: the wait goes on untimed
            self.on_async_begin = None
            self._on_error(f"asynchronous wait timing disabled: {exc!r}")
            return None

    def _async_end(self, token) -> None:
        try:
            if self.on_async_end is not None:
                self.on_async_end(token)
        except Exception as exc:
            self.on_async_begin = self.on_async_end = None
            self._on_error(f"asynchronous wait timing disabled: {exc!r}")

    def _wrap_p2p(self, fn: Callable) -> Callable:
        blocking = fn.__name__ in ("send", "recv")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # inner: torch's send is its isend's wait, and that isend is wrapped too (counted once, outside)
            if _compiling() or self._broken or self._in_p2p:
                return fn(*args, **kwargs)
            self._refuse_if_asked(fn.__name__)
            self._in_p2p = True
            timed = not self._enter()  # the probe's own (a link probe's): no wait, and no pipeline stage
            try:
                return counted(timed, *args, **kwargs)
            finally:
                self._in_p2p = False
                self._inside.depth -= 1

        def counted(timed, *args, **kwargs):
            batch = args[0] if args and isinstance(args[0], list) else None  # batch_isend_irecv's P2POps
            groups = self._p2p_groups(batch, args, kwargs)
            ops = len(batch) if batch is not None else 1
            tensor = getattr(batch[0], "tensor", None) if batch else (args[0] if args else kwargs.get("tensor"))
            # until a group's first call tells: gloo (CPU tensors) counts each call in the group's sequence
            guess = 1 if getattr(getattr(tensor, "device", None), "type", "") == "cpu" else 0
            # taken off before the call: the publisher reads the group's sequence number while a recv waits
            before = []
            for g in groups:
                name = g.group_name
                expected = self._p2p_per_op.get(name, guess) * ops
                self.p2p_taken[name] = self.p2p_taken.get(name, 0) + expected
                before.append((g, name, g._get_sequence_number_for_group(), expected))
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if timed and self.on_wait is not None:  # blocking calls wait for the peer; async ones mark the step
                    self.on_wait(P2P_WAIT, time.perf_counter() - t0 if blocking else 0.0)
                for g, name, seq, expected in before:
                    taken = g._get_sequence_number_for_group() - seq
                    self._p2p_per_op.setdefault(name, taken // ops)  # the backend's way, learnt at its first call
                    self.p2p_taken[name] += taken - expected

        wrapper.__trainscout_wrapped__ = True  # type: ignore[attr-defined]
        return wrapper

    @contextlib.contextmanager
    def refusing(self):
        """No collective of the job's may start here (this thread): a replay over a subset of the job's ranks
        recomputes a layer that must not talk to ranks that are not replaying (see Replay.guard)."""
        self._inside.refuse = True
        try:
            yield
        finally:
            self._inside.refuse = False

    def _refuse_if_asked(self, name: str) -> None:
        if getattr(self._inside, "refuse", False):
            raise CollectiveRefused(f"{name} called while recomputing a layer for replay")

    @contextlib.contextmanager
    def untimed(self):
        """The probe's own calls (replay's broadcasts, link probes): their waits are not the training's."""
        self._enter()
        try:
            yield
        finally:
            self._inside.depth -= 1

    def _enter(self) -> int:
        """In a wrapped call from here on (this thread): its inner Work.wait is in its own time. Returns the
        depth before: above 0, the call is inside another timed one or the probe's own (`untimed`)."""
        depth = getattr(self._inside, "depth", 0)
        self._inside.depth = depth + 1
        return depth

    def _p2p_groups(self, batch, args, kwargs) -> list:
        """The process groups a P2P call uses (batch_isend_irecv: each op's), default group for None."""
        try:
            c10d = self._c10d
            if batch is not None:
                found = [getattr(op, "group", None) for op in batch]
            else:
                found = [kwargs["group"] if "group" in kwargs else (args[2] if len(args) > 2 else None)]
            groups = {id(g): g for g in (g if g is not None else c10d._get_default_group() for g in found)}
            return [g for g in groups.values() if not c10d._rank_not_in_group(g)]
        except Exception as exc:  # fail open: the tap's sequence numbers would be off, so it stops
            self._broken = True
            self._on_error(f"collective tap disabled: P2P call not understood: {exc!r}")
            return []

    def collective_seq(self, group) -> int:
        """The group's collectives issued so far, as the Flight Recorder numbers its entries (P2P calls left
        out; its status counts them on gloo: the publisher takes them off with `p2p_taken`)."""
        return int(group._get_sequence_number_for_group()) - self.p2p_taken.get(group.group_name, 0)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        sig = self._signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if _compiling():  # traced into a compiled graph: dynamo handles the real call, we record nothing
                return fn(*args, **kwargs)
            self._refuse_if_asked(name)
            t0 = time.perf_counter()
            call_name, call_fn = name, fn
            if self._injector is not None:
                call_name, args, kwargs = self._injector.rewrite_collective(name, args, kwargs, self._get_step())
                call_fn = self.originals.get(call_name, fn)
            pg_name = None
            if not self._broken and sig is not None:
                pg_name = self._note(call_name, call_fn, args, kwargs)
            if getattr(self._inside, "depth", 0):
                pg_name = None  # inside a timed call or the probe's own: not a wait of the training's own
            begin = self.on_begin() if pg_name is not None and self.on_begin is not None else None
            self._enter()
            try:
                return call_fn(*args, **kwargs)
            finally:
                self._inside.depth -= 1
                if pg_name is not None and self.on_wait is not None:
                    self.on_wait(pg_name, time.perf_counter() - t0)
                if begin is not None:
                    self.on_end(begin)

        wrapper.__trainscout_wrapped__ = True  # type: ignore[attr-defined]
        return wrapper

    def _note(self, name: str, fn: Callable, args, kwargs) -> str | None:
        """Record the call's extras; return its group's name if the call blocks (not async_op)."""
        try:
            bound = self._binder(fn)(args, kwargs)
            group = bound.get("group")
            c10d = self._c10d
            if group is None:
                group = c10d._get_default_group()
            if c10d._rank_not_in_group(group):
                return None  # non-members issue nothing, so no sequence number to key on
            seq = self.collective_seq(group) + 1
            parts = []
            op = bound.get("op")
            if op is not None or name in (
                "all_reduce",
                "reduce",
                "reduce_scatter",
                "reduce_scatter_tensor",
                "reduce_scatter_single",
            ):
                parts.append(f"op={_op_name(op)}")
            for key in _ROOT_ARGS:
                if bound.get(key) is not None:
                    parts.append(f"{key}={bound[key]}")
            extra = " ".join(parts)
            if extra:
                self._remember_extra(group.group_name, seq, extra)
            if self.on_issue is not None:
                try:
                    self.on_issue(name, group.group_name, bound)
                except Exception as exc:  # fail open: the listener goes, the record keeping stays
                    self.on_issue = None
                    self._on_error(f"collective listener disabled: {exc!r}")
            tensor_arg = _SYNC_RECORDED.get(name)
            if not (
                tensor_arg
                and self.record_sync is not None
                and bound.get(tensor_arg) is not None
                and self._record_now(name, group.group_name, seq, bound[tensor_arg], extra)
            ):
                self._note_python(group.group_name, seq)
            return None if bound.get("async_op") else group.group_name
        except Exception as exc:  # fail open: lose the extra detail, keep training untouched
            self._broken = True
            self._on_error(f"collective tap disabled: {exc!r}")
            return None

    def patch_coalesced(self, dist_module) -> None:
        """Time `torch.distributed._broadcast_coalesced` as a collective wait. DDP calls it before each forward to
        re-broadcast the model's buffers from rank 0 (`broadcast_buffers`, its default, for any model with
        buffers: BatchNorm statistics, rotary tables), a C++ call the wrappers above never see. Its wait was
        counted as time blocked outside collectives, and rank 0, the root, which waits there for its slowest
        receiver, was named a straggler on a busy machine."""
        fn = getattr(dist_module, "_broadcast_coalesced", None)
        if fn is None or getattr(fn, "__trainscout_wrapped__", False):
            return
        self.originals["_broadcast_coalesced"] = fn

        @functools.wraps(fn)
        def _broadcast_coalesced(process_group, *args, **kwargs):
            self._refuse_if_asked("_broadcast_coalesced")
            if _compiling() or self.on_wait is None:
                return fn(process_group, *args, **kwargs)
            t0 = time.perf_counter()
            begin = self.on_begin() if self.on_begin is not None else None
            try:
                return fn(process_group, *args, **kwargs)
            finally:
                self.on_wait(getattr(process_group, "group_name", "0"), time.perf_counter() - t0)
                if begin is not None and self.on_end is not None:
                    self.on_end(begin)

        _broadcast_coalesced.__trainscout_wrapped__ = True  # type: ignore[attr-defined]
        dist_module._broadcast_coalesced = _broadcast_coalesced

    # ---- functional collectives (DTensor, TorchTitan): recorded before issue as well ----------------
    def patch_functional(self, funcol_module) -> None:
        """Wrap `torch.distributed._functional_collectives.all_reduce`. Its call returns at once and the
        wait comes later (`.item()`, `wait_tensor`), where the Flight Recorder's entry may not reach the
        probe's thread before the rank blocks: a rank stuck there would look as far behind as a rank
        that never issued the call. Recording it first, as the c10d wrappers do, puts it on record."""
        fn = getattr(funcol_module, "all_reduce", None)
        if fn is None or getattr(fn, "__trainscout_wrapped__", False):
            return
        sig = self._signature(fn)
        resolve = getattr(funcol_module, "_resolve_group_name", None)
        if sig is None or resolve is None:
            return
        self.originals["functional.all_reduce"] = fn

        @functools.wraps(fn)
        def all_reduce(*args, **kwargs):
            self._refuse_if_asked("functional all_reduce")
            if not self._functional_broken and not _compiling():
                self._note_functional(sig, resolve, args, kwargs)
            return fn(*args, **kwargs)

        all_reduce.__trainscout_wrapped__ = True  # type: ignore[attr-defined]
        funcol_module.all_reduce = all_reduce
        self._patch_wait_tensor(funcol_module)

    def _patch_wait_tensor(self, funcol_module) -> None:
        """Time the functional collectives' wait (`wait_tensor`: where an AsyncCollectiveTensor is first used).
        DTensor's tensor-parallel collectives are issued and waited for this way: left out, a tensor-parallel
        rank's wait for its slow peer read as its own blocked time, so both were equally "slow"."""
        fn = getattr(funcol_module, "wait_tensor", None)
        if fn is None or getattr(fn, "__trainscout_wrapped__", False):
            return
        self.originals["functional.wait_tensor"] = fn

        @functools.wraps(fn)
        def wait_tensor(tensor):
            token = self._async_begin() if self.on_async_begin is not None else None
            try:
                return fn(tensor)
            finally:
                if token is not None:
                    self._async_end(token)

        wait_tensor.__trainscout_wrapped__ = True  # type: ignore[attr-defined]
        funcol_module.wait_tensor = wait_tensor

    def _note_functional(self, sig, resolve, args, kwargs) -> None:
        try:
            bound = sig.bind(*args, **kwargs).arguments
            c10d = self._c10d or sys.modules["torch.distributed.distributed_c10d"]
            group = c10d._resolve_process_group(resolve(bound["group"], bound.get("tag", "")))
            if c10d._rank_not_in_group(group):
                return
            seq = self.collective_seq(group) + 1
            extra = f"op={str(bound['reduceOp']).upper()}"
            self._remember_extra(group.group_name, seq, extra)
            if self.record_sync is not None and self._record_now(
                "all_reduce", group.group_name, seq, bound["self"], extra
            ):
                self.functional_recorded += 1
            else:
                self._note_python(group.group_name, seq)
        except Exception as exc:  # fail open: the Flight Recorder still reports the call, later
            self._functional_broken = True
            self._on_error(f"functional collective tap disabled: {exc!r}")

    def _remember_extra(self, pg_name: str, seq: int, extra: str) -> None:
        """What the Flight Recorder does not record (reduce op, root): the publisher adds it to the entry."""
        self.extras[(pg_name, seq)] = extra
        if len(self.extras) > _MAX_EXTRAS:
            self.extras.popitem(last=False)

    def _note_python(self, pg_name: str, seq: int) -> None:
        noted = self.noted
        noted[(pg_name, seq)] = None
        if len(noted) > _MAX_EXTRAS:  # the publisher takes them within a tick; this bounds a stopped one
            try:
                del noted[next(iter(noted))]
            except (RuntimeError, KeyError, StopIteration):  # the publisher took some meanwhile
                pass

    def _record_now(self, op: str, pg_name: str, seq: int, tensor, extra: str) -> bool:
        # a training loop issues the same few collectives every step: describe each kind once
        key = (op, tuple(tensor.shape), tensor.dtype, extra)
        known = self._described.get(key)
        if known is None:
            dtype = _recorder_dtype(tensor)
            if dtype is None:
                return False  # the publisher will record it from the Flight Recorder
            sizes = [list(tensor.shape)]
            known = (
                protocol.signature(op, sizes, [dtype], sizes, [dtype], extra),
                protocol.describe(op, sizes, [dtype], extra),
            )
            if len(self._described) < _MAX_DESCRIBED:
                self._described[key] = known
        assert self.record_sync is not None  # both callers check
        self.record_sync(pg_name, seq, op, known[0], known[1])
        return True

    def _binder(self, fn: Callable) -> Callable:
        """fn's arguments by name, as a dict (what Signature.bind_partial gives, without defaults), at a
        fraction of its cost: positional names zipped with the call's arguments, keywords added."""
        try:
            return self._binders[fn]
        except KeyError:
            pass
        sig = self._signature(fn)
        params = list(sig.parameters.values()) if sig is not None else []
        plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = tuple(p.name for p in params if p.kind in plain)
        if sig is None or any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):

            def bind(args, kwargs):
                return sig.bind_partial(*args, **kwargs).arguments
        else:

            def bind(args, kwargs):
                if len(args) > len(names):
                    raise TypeError(f"too many positional arguments ({len(args)})")
                out = dict(zip(names, args))
                if kwargs:
                    out.update(kwargs)
                return out

        self._binders[fn] = bind
        return bind

    def _signature(self, fn: Callable):
        try:
            return self._sigs[fn]
        except KeyError:
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                sig = None
            self._sigs[fn] = sig
            return sig

    def pop_extra(self, pg_name: str, seq: int) -> str:
        return self.extras.pop((pg_name, seq), "")


def _compiling() -> bool:
    """Inside torch.compile tracing a call is not issued now: nothing to record."""
    try:
        import torch

        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def _recorder_dtype(tensor) -> str | None:
    """The scalar type name the Flight Recorder prints ('Float', 'BFloat16', ...)."""
    try:
        name = tensor.type()  # 'torch.FloatTensor', 'torch.cuda.BFloat16Tensor'
    except Exception:
        return None
    name = name.rsplit(".", 1)[-1]
    return name[: -len("Tensor")] if name.endswith("Tensor") else None


def _op_name(op) -> str:
    if op is None:
        return "SUM"
    # A ReduceOp object (ReduceOp(ReduceOp.SUM), a premul-sum with its factor) wraps its kind in .op; its own
    # text is its address, different on every rank, which would read as a desync.
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", None)
    return name if isinstance(name, str) else str(kind).rsplit(".", 1)[-1]
