"""The delay fault: this rank is held up for `ms` in chosen iterations, inside its forward or its data loading.

Where the time goes is the point: a forward pre-hook on one layer puts the delay inside the compute the probe
measures, the DataLoader patch puts it inside the batch fetch, and the blocker (blockers.py) decides whether the
rank sleeps, burns CPU, waits in the kernel, waits on a lock or leaves the GPU busy. The hook acts once per
firing iteration (the first forward of the layer, or the first batch fetched, after a firing step), so gradient
accumulation or a replay of the layer does not multiply the delay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainscout.faults.blockers import make_blocker
from trainscout.faults.fault_log import log_line
from trainscout.faults.layers import describe_layer, find_layer
from trainscout.faults.schedule import StepSchedule

# The single- and multi-process DataLoader iterators fetch every batch through `_next_data` (torch 2.x).
_FETCH_OWNERS = ("_SingleProcessDataLoaderIter", "_MultiProcessingDataLoaderIter")


class DelayDrill:
    def __init__(self, params: Mapping[str, Any], start: int, model: Any, who: str) -> None:
        self._who = who  # "rank R: delay", the head of this drill's log lines
        self.how = params["how"]
        self.seconds = float(params["ms"]) / 1000.0
        self.schedule = StepSchedule(start, every=int(params["every"]))
        self._layer_name: str
        self._layer: Any  # the torch module whose forward is delayed; None for data delays
        self._layer_name, self._layer = ("", None) if self.how == "data" else find_layer(model, params["layer"])
        self._blocker: Any = None
        self._handle: Any = None
        self._patched: list[tuple[Any, str, Any, Any]] = []  # (owner, attr, original, our wrapper)
        self._step: int | None = None  # last completed optimizer step (the clock the hooks read)
        self._acted_after: int | None = None  # the step whose following iteration was already delayed
        self._closed = False

    def arm(self) -> str:
        self._blocker = make_blocker(self.how)  # ValueError("no CUDA") for gpu on a CPU-only host
        if self.how == "data":
            self._patch_fetch()
            where = "each DataLoader batch fetch"
        else:
            self._handle = self._layer.register_forward_pre_hook(lambda module, args: self._maybe_block())
            where = f"the forward of {describe_layer(self._layer_name)}"
        every = self.schedule.every
        when = "every iteration" if every == 1 else f"every {every} iterations"
        return f"how={self.how}: {self.seconds * 1000:g} ms in {where}, {when} from step {self.schedule.start}"

    def on_step(self, step: int) -> None:
        self._step = step

    def _maybe_block(self) -> None:
        step = self._step
        if self._closed or step == self._acted_after or not self.schedule.fires_after(step):
            return
        self._acted_after = step
        try:
            self._blocker.block(self.seconds)
        except Exception as exc:  # fail open: a broken blocker must not break the training step
            self._closed = True
            log_line(f"{self._who}: disabled: {exc!r}")

    def _patch_fetch(self) -> None:
        from torch.utils.data import dataloader

        for owner_name in _FETCH_OWNERS:
            owner = getattr(dataloader, owner_name, None)
            real = getattr(owner, "_next_data", None)
            if real is None:
                continue
            assert owner is not None  # real was found on it

            def delayed_fetch(iterator, *args, _real=real, **kwargs):
                self._maybe_block()
                return _real(iterator, *args, **kwargs)

            owner._next_data = delayed_fetch
            self._patched.append((owner, "_next_data", real, delayed_fetch))
        if not self._patched:
            raise ValueError("this torch has no DataLoader _next_data to delay")

    def close(self) -> None:
        self._closed = True
        if self._handle is not None:
            self._handle.remove()
        for owner, attr, real, ours in self._patched:
            if getattr(owner, attr, None) is ours:  # someone patched on top of us: stay in the chain, inert
                setattr(owner, attr, real)
        self._patched.clear()
        if self._blocker is not None:
            self._blocker.close()
