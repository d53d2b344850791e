"""All-gather receivers (FSDP2 / ZeRO-3 style sharding): every rank that gathers a parameter must hold
the same full tensor.

`fully_shard` is wrapped; each sharded module gets a forward pre-hook that runs after FSDP's own
(hooks run in registration order), when the module's parameters are the gathered full tensors. On a
rotation over modules (the same on every rank), the gathered parameters are fingerprinted and sent
like replicated-state fingerprints, with the ranks of the unit's mesh as the class of receivers: every
rank of the mesh it is sharded over (both dimensions of an HSDP mesh) gathers the same full parameter, and
no other rank need hold it (a pipeline stage's units are sharded over that stage's data-parallel group; a
tensor-parallel job's over one tensor-parallel coordinate's). A receiver whose gathered copy differs from a
strict majority is named. A unit sharded over a sub-mesh of several dimensions (HSDP inside a pipeline
stage), which no one process group spans, is not checked.

Schedule: module i belongs to group i mod G (G = the period made odd); step s checks group s mod G, on
steps that are a multiple of a power-of-two stride. Replicas need not agree on the stride: the group
depends only on the step, and with G odd the multiples of any power-of-two stride visit every group.

CUDA parameters are hashed without a host sync: in the pre-hook, on the training stream (which FSDP has
just made wait for the all-gather), one Triton launch per parameter writes into a device vector that is
copied to pinned memory behind an event (`DeviceResults`); the records are published on a later step,
carrying the step they were taken at. The launches are prepared once per module (`PreparedRanges`) and
rebound each time to the parameters' current storage, which FSDP frees and allocates again around every
gather. The stride keeps the cost (host time of the launches plus the bytes at an assumed 1 TB/s) within
`budget` of the step time, like the replicated-state check. CPU parameters (gloo) are hashed at once,
on every step of their group (stride 1).
"""

from __future__ import annotations

import atexit
import functools
import os
import time
from typing import TYPE_CHECKING, Any

from trainscout.probe.budget import fit_stride
from trainscout.probe.compiled import eager_hook
from trainscout.probe.state_check import STATE_PG_INDEX

if TYPE_CHECKING:  # types only: the CUDA path is imported on first use
    from trainscout.fingerprint.gpu import PreparedRanges
    from trainscout.probe.device_results import DeviceResults

_MAX_STRIDE = 1 << 10
DEVICE_BYTES_PER_S = 1.0e12  # as the state check: H200 reads ~3.5 TB/s, a third of that is safe


class GatherCheck:
    name = "gather_check"  # its figures' key in the rank's cost report

    def __init__(
        self, append, get_step, register_tensor, period: int = 4, budget: float = 0.005, before_check=None
    ) -> None:
        self.append = append
        self.get_step = get_step
        self.register_tensor = register_tensor  # (name, receivers' group name) -> tensor id in the tensor table
        self.period = max(1, period)
        self.groups = self.period | 1  # odd: every power-of-two stride reaches every group
        self.budget = budget
        self.stride = 1
        self.modules = 0
        self.spent_s = 0.0  # host time of steady checks and publishing (the cost report's per-step figure)
        self.setup_s = 0.0  # host time of first checks and checks that compiled a kernel
        self.checked_bytes = 0
        self.before_check = before_check  # fault injection point: (module, step) -> None, between gather and check
        self._results: DeviceResults | None = None  # DeviceResults(int64), made on the first CUDA check
        self._last = (0, 0.0)  # (step, perf_counter) when a pre-hook first saw that step
        self._wall_s = 0.0  # smoothed seconds per step
        self._step_cost = 0.0  # this step's cost so far (host seconds + charged device seconds)
        self._cost_s = 0.0  # smoothed cost per checked step
        self._compiled_now = False
        self.published = 0
        self.error = ""

    def wrap(self, module) -> None:
        real = module.fully_shard
        check = self

        def fully_shard(mod, *args, **kwargs):
            result = real(mod, *args, **kwargs)
            try:
                group = _receivers(kwargs.get("mesh"))
                if group is not None:
                    check.watch(result if result is not None else mod, group)
            except Exception:
                pass  # fail open: sharding itself must not be affected
            return result

        # fully_shard carries attributes its own code uses (fully_shard.state(module)): keep them all
        module.fully_shard = functools.wraps(real)(fully_shard)

    def watch(self, mod, group: str) -> None:
        """Check the unit's gathered parameters; `group`: the process group of the ranks that gather them."""
        index = self.modules
        self.modules += 1
        unit = _Unit(index, f"gathered[{index}]{type(mod).__name__}", group)

        def pre_forward(m, args):
            if not m.training:
                return
            step = self.get_step() + 1  # the step being computed
            if step != self._last[0]:
                self._new_step(step)
            if step % self.stride or step % self.groups != index % self.groups:
                return
            if self.before_check is not None:
                self.before_check(m, step)
            t0 = time.perf_counter()
            try:
                device_bytes = self._check(m, unit, step)
            except Exception as exc:  # fail open: stop checking this unit, say why once
                unit.off = True
                self.error = self.error or f"all-gather check of {unit.label} off: {exc!r}"[:300]
                return
            cost = time.perf_counter() - t0
            # a unit's first check registers its names, and a check that compiled a kernel variant (~0.5 s,
            # once per process) is not a steady cost either: neither may set the stride or count as per-step
            if unit.checks > 1 and not self._compiled_now:
                self.spent_s += cost
                self._step_cost += cost + device_bytes / DEVICE_BYTES_PER_S
            else:
                self.setup_s += cost
            self._compiled_now = False

        mod.register_forward_pre_hook(eager_hook(pre_forward))

    # ---------------------------------------------------------------- schedule and budget

    def _new_step(self, step: int) -> None:
        """The first pre-hook of a step: publish landed CUDA results, smooth the step time and the last
        checked step's cost, adapt the stride."""
        now = time.perf_counter()
        last_step, last_t = self._last
        self._last = (step, now)
        if self._results is not None:
            t0 = time.perf_counter()
            self.publish()
            self.spent_s += time.perf_counter() - t0
        if last_step and step > last_step:
            wall = (now - last_t) / (step - last_step)
            self._wall_s = wall if not self._wall_s else 0.9 * self._wall_s + 0.1 * wall
        if self._step_cost:
            # one slow sample (a GC pause, a page fault) moves the estimate by at most 4x the usual cost
            sample = min(self._step_cost, 4 * self._cost_s) if self._cost_s else self._step_cost
            self._cost_s = sample if not self._cost_s else 0.8 * self._cost_s + 0.2 * sample
            self._step_cost = 0.0
            self._adapt_stride()

    def _adapt_stride(self) -> None:
        """The stride for the smoothed cost per checked step (probe/budget.py)."""
        if self._results is None or self._wall_s <= 0 or self.budget <= 0:
            return  # CPU parameters only: every step of the group
        self.stride = fit_stride(self.stride, self._cost_s, self.budget, self._wall_s, _MAX_STRIDE)

    # ---------------------------------------------------------------- the check

    def _check(self, m, unit: _Unit, step: int) -> int:
        """Fingerprint the unit's gathered parameters; returns the CUDA bytes enqueued."""
        if unit.off:
            return 0
        unit.checks += 1
        if unit.params is None:
            unit.params = [
                (sub, pname, f"{unit.label}.{full}")
                for full, sub, pname in _own_parameters(m)
                if sub._parameters[pname] is not None
            ]
        params, tids = [], []
        for sub, pname, name in unit.params:
            p = sub._parameters.get(pname)
            if p is None or type(p).__name__ == "DTensor":
                continue  # still sharded: not gathered here
            params.append(p)
            tids.append(unit.tid(name, self.register_tensor))
        cuda = [i for i, p in enumerate(params) if p.is_cuda]
        if len(cuda) < len(params):  # CPU parameters (or a mix): hashed now, on the host
            from trainscout.fingerprint import fingerprint

            for i, p in enumerate(params):
                if p.is_cuda:
                    continue
                size = p.numel() * p.element_size()
                self.append(
                    STATE_PG_INDEX, tids[i], fingerprint(p.detach()), 0, time.time_ns(), step, "state", f"0:{size}"
                )
                self.checked_bytes += size
        if not cuda:
            return 0
        return self._launch(unit, [params[i] for i in cuda], [tids[i] for i in cuda], step)

    def _launch(self, unit: _Unit, params: list, tids: list, step: int) -> int:
        import torch

        from trainscout.fingerprint import gpu

        if not gpu.HAVE_TRITON:
            raise RuntimeError("the CUDA all-gather check needs Triton")
        key = tuple(tids)
        if unit.prepared is None or unit.prepared_key != key or unit.prepared.device != params[0].device:
            unit.prepared = gpu.PreparedRanges([(p.detach(), 0, p.numel() * p.element_size()) for p in params])
            # keep no tensor alive (enqueue below is always given the tensors, so items' tensors are never read)
            unit.prepared.items = [(None, s, e) for _, s, e in unit.prepared.items]  # type: ignore[misc]
            unit.prepared_key = key
            unit.meta = [(tid, 0, p.numel() * p.element_size()) for tid, p in zip(tids, params)]
        if self._results is None:
            from trainscout.probe.device_results import DeviceResults

            self._results = DeviceResults(torch.int64, depth=32)
            # publish what is still in flight at exit; registered after the probe's own exit handlers,
            # so (atexit is LIFO) it runs before them and before the exit record
            atexit.register(self._at_exit, os.getpid())
        slot = self._results.take(unit.prepared.device, len(params))
        if slot is None:
            return 0  # the GPU is far behind: skip (counted as dropped), never wait
        variants = gpu.kernels_compiled()
        try:
            unit.prepared.enqueue(slot.device, params)
        except Exception:
            self._results.give_back(slot)
            raise
        self._compiled_now = gpu.kernels_compiled() != variants
        self._results.submit(slot, len(params), (step, unit.meta))
        self.checked_bytes += unit.prepared.nbytes
        return unit.prepared.nbytes

    def publish(self) -> int:
        """Append the records of every landed CUDA result, in order; never waits."""
        return self._emit(self._results.ready()) if self._results is not None else 0

    def costs(self) -> dict | None:
        if not self.modules:
            return None
        return {"seconds": self.spent_s, "setup_seconds": self.setup_s, "stride": self.stride, "units": self.modules}

    def flush(self, timeout_s: float = 1.0) -> int:
        """Exit paths only: wait up to timeout_s for results still in flight."""
        return self._emit(self._results.wait(timeout_s)) if self._results is not None else 0

    def _at_exit(self, pid: int) -> None:
        if os.getpid() == pid:  # not in a forked child
            try:
                self.flush()
            except Exception:
                pass

    def _emit(self, landed) -> int:
        from trainscout.fingerprint.cpu import as_unsigned64

        n = 0
        for (step, meta), values in landed:
            for (tid, start, end), v in zip(meta, values):
                self.append(
                    STATE_PG_INDEX, tid, as_unsigned64(int(v)), start, time.time_ns(), step, "state", f"{start}:{end}"
                )
                n += 1
        self.published += n
        return n

    @property
    def dropped(self) -> int:
        return self._results.inflight.dropped if self._results is not None else 0


class _Unit:
    """One FSDP unit's cached check state: where its parameters live, their tensor ids, prepared launches."""

    __slots__ = ("index", "label", "group", "params", "tids", "prepared", "prepared_key", "meta", "checks", "off")

    def __init__(self, index: int, label: str, group: str) -> None:
        self.index = index
        self.label = label
        self.group = group  # the receivers' process group: the class their fingerprints are compared in
        self.params: list[tuple[Any, str, str]] | None = None  # [(submodule, parameter name, full name)]
        self.tids: dict[str, int] = {}
        self.prepared: PreparedRanges | None = None
        self.prepared_key: tuple | None = None
        self.meta: list[tuple[int, int, int]] | None = None
        self.checks = 0
        self.off = False

    def tid(self, name: str, register) -> int:
        tid = self.tids.get(name)
        if tid is None:
            tid = self.tids[name] = register(name, self.group)
        return tid


def _receivers(mesh) -> str | None:
    """The process group of the ranks that gather a unit sharded over `mesh` (None: fully_shard's default, the
    world), or None where no one group spans them (a sub-mesh of several dimensions)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if world is None:
        return None
    if mesh is None or mesh.size() == dist.get_world_size():
        return world.group_name
    if mesh.ndim == 1:
        return mesh.get_group().group_name
    return None


def _own_parameters(module, prefix: str = ""):
    """(full name, owning submodule, name there) of the parameters this FSDP unit gathers: its own and
    those of descendants that are not FSDP units themselves (nor inside one)."""
    for pname in list(module._parameters):
        yield prefix + pname, module, pname
    for name, child in module.named_children():
        if not type(child).__name__.startswith("FSDP"):
            yield from _own_parameters(child, f"{prefix}{name}.")
