"""ZeRO++ hpZ race check in the rank: fingerprint a module's gathered weights in forward and in backward.

DeepSpeed ZeRO-3 gathers a module's parameters before its forward and releases them after; with
hierarchical partitioning the release fills the secondary partition, and the backward gathers the
parameters again from it. `DeepSpeedZeRoOffload` is wrapped (a post-import hook) at two points: just
before the forward release (the parameters still hold what forward used) and just after the backward
fetch (they hold what backward will use). Checked are, every step, the last two modules the previous
forward released (their backward gather follows their release most closely, where an unordered copy is
most likely still pending: on 2 H200s the deterministic race hit exactly one parameter per step, the
output head) and, on a rotation, one module in `TRAINSCOUT_HPZ_PERIOD` (module `ds_id` modulo the period,
the same on every rank). Each checked parameter is fingerprinted at both points
in byte ranges, one per member of the secondary group (the range a member's secondary partition holds),
and the records go to the coordinator (`detectors/hpz.py`), which names the member whose range differs.

Only parameters that are really released and re-gathered through hpZ are checked: not the persistent
ones (never released), not those of jobs without a secondary group. On CUDA the fingerprints are
enqueued on the current stream and read from pinned memory a step or so later (`DeviceResults`): a host
sync here would itself order the gather after the copy and hide the race. The check never raises into
training: on any internal error it turns itself off and says why.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from trainscout.detectors.hpz import record_name
from trainscout.probe.state_check import STATE_PG_INDEX

if TYPE_CHECKING:  # types only: the CUDA path is imported on first use
    from trainscout.probe.device_results import DeviceResults


def chunk_ranges(numel: int, elem_size: int, partition_world: int, group_size: int) -> list[tuple[int, int, int]]:
    """(member index, start byte, end byte) of the gathered parameter's bytes that came from each member's
    secondary partition. DeepSpeed pads the parameter to a multiple of the primary partition count and
    cuts that into `group_size` equal secondary partitions; starts are rounded down to a 4-byte word (the
    fingerprint's unit), so a 2-byte element on a boundary counts towards the earlier member."""
    if numel <= 0 or group_size <= 0 or partition_world <= 0:
        return []
    aligned = -(-numel // partition_world) * partition_world
    per = max(1, aligned // group_size)
    total = numel * elem_size

    def boundary(k: int) -> int:
        b = min(k * per, numel) * elem_size
        return b if b == total else b // 4 * 4

    out = []
    for member in range(group_size):
        start, end = boundary(member), boundary(member + 1)
        if end > start:
            out.append((member, start, end))
    return out


class HpzCheck:
    name = "hpz_check"  # its figures' key in the rank's cost report

    def __init__(
        self, append, get_step, register_tensor, period: int = 4, mode_of=lambda: "stall", on_error=None, tail: int = 2
    ) -> None:
        self.append = append
        self.get_step = get_step
        self.register_tensor = register_tensor  # name -> tensor id in the shared tensor table
        self.period = max(1, period)
        self.tail = max(0, tail)
        self.mode_of = mode_of  # the fix mode this rank runs with (recorded with every fingerprint)
        self.on_error = on_error or (lambda text: None)
        self.enabled = True
        self.spent_s = 0.0
        self.checked = 0  # parameter fingerprints taken (forward + backward)
        self._names: dict[int, str] = {}
        self._named_models: set[int] = set()
        self._owners: dict[int, list[int]] = {}  # id(group) -> global ranks in group order
        self._due_backward: set[tuple[int, int]] = set()  # (step, id(module)) checked in forward
        self._results: DeviceResults | None = None  # made when a CUDA parameter shows up
        self._published_step = -1
        self._released: dict[int, bool] = {}  # id(module) -> it has own parameters that hpZ releases
        self._order: list[int] = []  # ds_ids of such modules in this step's forward, in release order
        self._order_step = -1
        self._tail: set[int] = set()  # the last `tail` of them in the previous step's forward

    # ---- installation -----------------------------------------------------------------------
    def wrap(self, module) -> None:
        """Wrap DeepSpeedZeRoOffload (deepspeed.runtime.zero.parameter_offload) where it releases after
        forward and fetches before backward."""
        cls = module.DeepSpeedZeRoOffload
        real_fwd = cls.post_sub_module_forward_function
        real_bwd = cls.pre_sub_module_backward_function
        check = self

        def post_sub_module_forward_function(offload, sub_module):
            check._guard(check.before_release, offload, sub_module)
            return real_fwd(offload, sub_module)

        def pre_sub_module_backward_function(offload, sub_module):
            result = real_bwd(offload, sub_module)
            check._guard(check.after_fetch, offload, sub_module)
            return result

        post_sub_module_forward_function.__wrapped__ = real_fwd  # type: ignore[attr-defined]
        pre_sub_module_backward_function.__wrapped__ = real_bwd  # type: ignore[attr-defined]
        cls.post_sub_module_forward_function = post_sub_module_forward_function
        cls.pre_sub_module_backward_function = pre_sub_module_backward_function

    def _guard(self, fn, offload, sub_module) -> None:
        if not self.enabled:
            return
        try:
            fn(offload, sub_module)
        except Exception as exc:  # fail open
            self.enabled = False
            self.on_error(f"hpZ check disabled: {exc!r}")

    # ---- the two points ---------------------------------------------------------------------
    def before_release(self, offload, sub_module) -> None:
        step = self.get_step() + 1  # the step being computed
        self._publish(step)
        ds_id = getattr(sub_module, "ds_id", None)
        if ds_id is None or not sub_module.training:
            return
        if step != self._order_step:  # first release of a new step
            self._tail = set(self._order[-self.tail :]) if self.tail else set()
            self._order, self._order_step = [], step
        released = self._released.get(id(sub_module))
        if released is None:
            released = self._released[id(sub_module)] = any(
                not getattr(p, "ds_persist", True) for p in sub_module.parameters(recurse=False)
            )
        if released:
            self._order.append(ds_id)
        if ds_id % self.period != step % self.period and ds_id not in self._tail:
            return
        params = self._params(offload, sub_module, backward=False)
        if params:
            self._fingerprint(step, "fwd", params)
            self._due_backward.add((step, id(sub_module)))
            if len(self._due_backward) > 4096:  # modules whose backward never came (no grad): forget them
                self._due_backward = {k for k in self._due_backward if k[0] >= step - 1}

    def after_fetch(self, offload, sub_module) -> None:
        step = self.get_step() + 1
        key = (step, id(sub_module))
        if key not in self._due_backward:
            return
        self._due_backward.discard(key)
        params = self._params(offload, sub_module, backward=True)
        if params:
            self._fingerprint(step, "bwd", params)

    def _params(self, offload, sub_module, backward: bool) -> list[tuple[str, object]]:
        """(name, parameter) of the module's own parameters that hpZ releases and that are gathered now;
        in backward only those whose gather could read a secondary partition."""
        model = getattr(offload, "module", None)
        if model is not None and id(model) not in self._named_models:
            self._named_models.add(id(model))
            for name, p in model.named_parameters():
                self._names[id(p)] = name
        recurse = bool(getattr(sub_module, "_z3_leaf", False))
        out = []
        for p in sub_module.parameters(recurse=recurse):
            if getattr(p, "ds_persist", True) or getattr(p, "ds_zero_param_process_group", None) is None:
                continue
            if p.numel() != getattr(p, "ds_numel", -1):
                continue  # not gathered (still a partition)
            if backward and getattr(p, "ds_secondary_tensor", None) is None:
                continue  # gathered from the primary partitions: not the hpZ path
            out.append((self._names.get(id(p), f"ds_id{getattr(p, 'ds_id', '?')}"), p))
        return out

    def _owners_of(self, group) -> list[int]:
        owners = self._owners.get(id(group))
        if owners is None:
            import torch.distributed as dist

            owners = self._owners[id(group)] = list(dist.get_process_group_ranks(group))
        return owners

    def _fingerprint(self, step: int, phase: str, params) -> None:
        t0 = time.perf_counter()
        cuda = bool(getattr(params[0][1].data, "is_cuda", False))
        mode = self.mode_of() if cuda else "none"  # without streams there is no copy/gather race to fix
        items = []  # (tensor, start, end, tid)
        for name, p in params:
            owners = self._owners_of(p.ds_zero_param_process_group)
            t = p.data
            if not t.is_contiguous():
                continue
            ranges = chunk_ranges(t.numel(), t.element_size(), int(p.ds_zero_partition_world_size), len(owners))
            for member, start, end in ranges:
                tid = self.register_tensor(record_name(phase, name, owners[member], mode))
                items.append((t, start, end, tid))
        if not items:
            return
        if cuda:
            self._enqueue(step, items)
        else:
            from trainscout.fingerprint import fingerprint_range

            wall = time.time_ns()
            for t, start, end, tid in items:
                self.append(
                    STATE_PG_INDEX, tid, fingerprint_range(t, start, end), start, wall, step, "state", f"{start}:{end}"
                )
        self.checked += len(params)
        self.spent_s += time.perf_counter() - t0

    def _enqueue(self, step: int, items) -> None:
        import torch

        from trainscout.fingerprint import gpu

        if self._results is None:
            from trainscout.probe.device_results import DeviceResults

            self._results = DeviceResults(torch.int64, depth=256)  # ~2 per checked module a step
        slot = self._results.take(items[0][0].device, len(items))
        if slot is None:
            return  # results still in flight fill the ring: skip this check rather than wait
        for i, (t, start, end, _) in enumerate(items):
            gpu.fingerprint_range_cuda_async(t, start, end, slot.device, i)
        self._results.submit(slot, len(items), (step, [(tid, start, end) for _, start, end, tid in items]))

    def _publish(self, step: int | None = None) -> None:
        """Append the CUDA results that have landed (once per step from the forward hook; at exit)."""
        if self._results is None or step == self._published_step:
            return
        self._published_step = step if step is not None else self._published_step
        self._emit(self._results.ready())

    def _emit(self, landed) -> None:
        from trainscout.fingerprint.cpu import as_unsigned64

        wall = time.time_ns()
        for (step, meta), values in landed:
            for (tid, start, end), v in zip(meta, values):
                self.append(STATE_PG_INDEX, tid, as_unsigned64(int(v)), start, wall, step, "state", f"{start}:{end}")

    def costs(self) -> None:
        return None  # its work is measuring (step timing) or runs on hpZ jobs only: not reported apart

    def flush(self, timeout_s: float = 1.0) -> None:
        """At exit: publish CUDA results still in flight."""
        if self._results is not None:
            self._emit(self._results.wait(timeout_s))
