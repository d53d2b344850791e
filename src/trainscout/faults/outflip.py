"""The outflip fault: from step S on, one layer's output is multiplied by `factor` (-1: a sign flip) on this rank.

Models a device that computes wrong, persistently: every forward of the layer on this rank is affected,
including a later call of the layer by anyone else (an in-situ replay of the layer must reproduce the fault,
that is how it is confirmed). Two mechanisms, so a detector cannot lean on one:
  hook:  a forward hook returns the changed output;
  patch: the module's forward is wrapped (an instance attribute), so the module itself returns it.
Tuple outputs have their first element changed (the hidden states of most blocks), dict and dataclass outputs
their first tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainscout.faults.fault_log import log_line
from trainscout.faults.layers import describe_layer, find_layer
from trainscout.faults.schedule import StepSchedule

_NO_INSTANCE_FORWARD = object()


def scaled_output(output: Any, factor: float) -> Any:
    """`output` with its (first) tensor multiplied by factor; anything else passes unchanged."""
    if isinstance(output, dict):  # a dict, or a library's model-output record (a dict subclass)
        key = next((k for k, v in output.items() if hasattr(v, "mul")), None)
        if key is not None:
            output[key] = output[key] * factor
        return output
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        field = next((f.name for f in dataclasses.fields(output) if hasattr(getattr(output, f.name), "mul")), None)
        return output if field is None else dataclasses.replace(output, **{field: getattr(output, field) * factor})
    if isinstance(output, (tuple, list)) and output and hasattr(output[0], "mul"):
        first = output[0] * factor
        if hasattr(output, "_make"):  # a namedtuple
            return output._make([first, *output[1:]])
        return type(output)([first, *output[1:]])
    if hasattr(output, "mul"):
        return output * factor
    return output


class OutFlipDrill:
    def __init__(self, params: Mapping[str, Any], start: int, model: Any, who: str) -> None:
        self._who = who  # "rank R: outflip", the head of this drill's log lines
        self._broken = False
        self.how = params["how"]
        self.factor = float(params["factor"])
        self.schedule = StepSchedule(start)
        self._layer_name, self._layer = find_layer(model, params["layer"])
        self._handle: Any = None
        self._instance_forward: Any = _NO_INSTANCE_FORWARD  # what the patch replaced, to put back on close
        self._step: int | None = None

    def arm(self) -> str:
        layer = self._layer
        if self.how == "hook":
            self._handle = layer.register_forward_hook(lambda module, args, output: self._changed(output))
        else:
            self._instance_forward = layer.__dict__.get("forward", _NO_INSTANCE_FORWARD)
            real = layer.forward

            def flipped_forward(*args: Any, **kwargs: Any) -> Any:
                return self._changed(real(*args, **kwargs))

            layer.forward = flipped_forward
        what = "a sign flip" if self.factor == -1 else f"x{self.factor:g}"
        return (
            f"how={self.how}: {describe_layer(self._layer_name)} outputs {what} on every forward from step "
            f"{self.schedule.start}"
        )

    def on_step(self, step: int) -> None:
        self._step = step

    def _changed(self, output: Any) -> Any:
        if self._broken or not self.schedule.fires_after(self._step):
            return output
        try:
            return scaled_output(output, self.factor)
        except Exception as exc:  # inside the training's forward: stop the drill, not the training
            self._broken = True
            log_line(f"{self._who}: disabled: {exc!r}")
            return output

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.how == "patch" and "forward" in self._layer.__dict__:
            if self._instance_forward is _NO_INSTANCE_FORWARD:
                del self._layer.forward
            else:
                self._layer.forward = self._instance_forward
