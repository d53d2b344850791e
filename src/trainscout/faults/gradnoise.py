"""The gradnoise fault: large noise in this rank's local gradient of one layer, before the all-reduce.

Models a device that computes a wrong backward for a few steps. After DDP averages, every replica holds the same
poisoned gradient, so only per-rank evidence taken before the reduction (local gradient norms, replay) can name
the rank. Two mechanisms, so a detector cannot lean on one:
  tensor:     a tensor hook on each parameter of the layer; tensor hooks run before gradient accumulation, so
              DDP's reducer (which copies the accumulated gradient into its bucket) reduces the noisy one. A
              post-accumulate-grad hook would run after that copy and must not be used.
  activation: a forward hook puts a tensor hook on the layer's output, so the gradient flowing back into the
              layer is noisy: its parameter gradients and everything upstream of it are corrupted.
The noise is Gaussian with std = scale x the RMS of the gradient it is added to, generated on the gradient's
device and dtype from a generator seeded by rank and step, so a rerun injects the same noise.

Other operations on the same path (`op`): `zero` drops the gradient (all zeros), `stale` hands on the gradient of
the rank's previous backward pass instead of this one's (a stale copy; the first pass after arming has none and
passes), `expflip` flips the top exponent bit of the gradient's largest element (one element ~1e35 in float32:
finite, but past what a float32 sum of squares holds). `param=N` limits a tensor-hook fault to the layer's N-th
trainable parameter: one weight's gradient dropped or held stale barely moves its layer's norm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainscout.faults.fault_log import log_line
from trainscout.faults.layers import describe_layer, find_layer
from trainscout.faults.numeric import exponent_flipped
from trainscout.faults.schedule import StepSchedule


def noisy(grad: Any, scale: float, seed: int) -> Any:
    import torch

    generator = torch.Generator(device=grad.device)
    generator.manual_seed(seed)
    noise = torch.randn(grad.shape, generator=generator, device=grad.device, dtype=grad.dtype)
    rms = grad.detach().float().pow(2).mean().sqrt()
    return grad + noise * (rms * scale).to(grad.dtype)


class GradNoiseDrill:
    def __init__(self, params: Mapping[str, Any], start: int, model: Any, rank: int, who: str) -> None:
        self._who = who  # "rank R: gradnoise", the head of this drill's log lines
        self._broken = False
        self.how = params["how"]
        self.scale = float(params["scale"])
        self.rank = rank
        self.schedule = StepSchedule(start, count=int(params["count"]))
        self._layer_name, self._layer = find_layer(model, params["layer"])
        self.op = params.get("op", "noise")
        self.param = int(params.get("param", -1))
        self._previous: dict[int, Any] = {}  # op=stale: tensor index -> its gradient of the last backward pass
        self._handles: list[Any] = []
        self._step: int | None = None  # last completed optimizer step (the clock the hooks read)

    def arm(self) -> str:
        if self.how == "tensor":
            named = [(n, p) for n, p in self._layer.named_parameters() if p.requires_grad]
            if not named:
                raise ValueError(f"{describe_layer(self._layer_name)} has no trainable parameter")
            if self.param >= len(named):
                raise ValueError(
                    f"{describe_layer(self._layer_name)} has {len(named)} trainable parameter(s), no param={self.param}"
                )
            if self.param >= 0:
                named = [named[self.param]]
            for index, (_, p) in enumerate(named):
                self._handles.append(p.register_hook(lambda grad, index=index: self._on_grad(grad, index)))
            which = f"parameter {named[0][0]}" if self.param >= 0 else f"{len(named)} parameter(s)"
            where = f"the local gradients of {describe_layer(self._layer_name)}'s {which}"
        else:  # op=stale and param= need how=tensor: refused where the spec is parsed (spec.py)
            self._handles.append(self._layer.register_forward_hook(self._on_output))
            where = f"the gradient flowing back into {describe_layer(self._layer_name)}'s output"
        count = self.schedule.count
        what = {
            "noise": f"noise of {self.scale:g}x the RMS added to",
            "zero": "zeros in place of",
            "stale": "the previous backward pass's gradient in place of",
            "expflip": "the top exponent bit of the largest element flipped in",
        }[self.op]
        return f"how={self.how}: {what} {where} in {count} backward pass(es) from step {self.schedule.start}"

    def on_step(self, step: int) -> None:
        self._step = step

    def _active(self) -> bool:
        return not self._broken and self.schedule.fires_after(self._step)

    def _fail_open(self, exc: Exception) -> None:
        # Hooks run inside the training's backward: an error here must stop the drill, not the training.
        self._broken = True
        log_line(f"{self._who}: disabled: {exc!r}")

    def _seed(self, index: int) -> int:
        # Distinct per rank, step and tensor, so two same-shaped parameters do not get the same noise.
        return ((self.rank * 1_000_003 + (self._step or 0)) * 1_009 + index) % (1 << 63)

    def _on_grad(self, grad: Any, index: int) -> Any:
        if grad is None or grad.is_sparse or self._broken:
            return None  # None: the gradient passes unchanged
        try:
            previous = self._previous.get(index)
            if self.op == "stale":
                self._previous[index] = grad.detach().clone()
            if not self._active():
                return None
            if self.op == "zero":
                return grad.detach().new_zeros(grad.shape)
            if self.op == "stale":
                return previous if previous is not None and previous.shape == grad.shape else None
            if self.op == "expflip":
                return exponent_flipped(grad)
            return noisy(grad, self.scale, self._seed(index))
        except Exception as exc:
            self._fail_open(exc)
            return None

    def _on_output(self, module: Any, args: Any, output: Any) -> None:
        tensor = output[0] if isinstance(output, (tuple, list)) and output else output
        if self._active() and getattr(tensor, "requires_grad", False):
            try:
                tensor.register_hook(lambda grad: self._on_grad(grad, 1_000))
            except Exception as exc:
                self._fail_open(exc)

    def close(self) -> None:
        self._previous.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
