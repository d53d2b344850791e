"""Non-finite origin: notice, before any reduction, the first local loss or gradient that is NaN/Inf.

After the gradient all-reduce every rank holds NaN, so the origin can only be seen locally and early:
the loss when `backward()` is called on it, and each gradient right after it is accumulated (tensor
post-accumulate-grad hooks run before DDP launches the bucket's all-reduce). The coordinator then names
the rank(s) that turned non-finite at the earliest step.

CPU tensors are checked at once; CUDA tensors are not checked here yet (a check would force a host
sync on the training stream).
"""

from __future__ import annotations

import time

NONFINITE_PG_INDEX = -2
_MAX_REPORTS = 8


class NonFiniteCheck:
    def __init__(self, append, get_step) -> None:
        self.append = append
        self.get_step = get_step
        self.reports = 0
        self._reported_steps: set[tuple[int, str]] = set()
        self._hooked: set[int] = set()
        self._sums: list = []
        self.names: dict[int, str] = {}

    def _report(self, what: str, name: str, step_offset: int = 1) -> None:
        # the step being computed: `step` optimizer steps are done (after the step hook: offset 0)
        step = self.get_step() + step_offset
        if self.reports >= _MAX_REPORTS or (step, what) in self._reported_steps:
            return
        self._reported_steps.add((step, what))
        self.reports += 1
        self.append(NONFINITE_PG_INDEX, step, 0, 0, time.time_ns(), step, "nonfinite", f"{what} {name}".strip())

    def patch_autograd(self, autograd_module) -> None:
        real_backward = autograd_module.backward
        check = self

        def backward(tensors, *args, **kwargs):
            try:
                t = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
                if getattr(t, "device", None) is not None and t.device.type == "cpu" and t.numel() == 1:
                    import torch

                    if not bool(torch.isfinite(t.detach()).all()):
                        check._report("loss", "")
            except Exception:
                pass  # fail open: the check must never break backward
            return real_backward(tensors, *args, **kwargs)

        backward.__wrapped__ = real_backward  # type: ignore[attr-defined]
        backward.__doc__ = real_backward.__doc__
        autograd_module.backward = backward

    def hook_params(self, params, names: dict[int, str]) -> None:
        for p in params:
            if id(p) in self._hooked or not getattr(p, "requires_grad", False) or p.device.type != "cpu":
                continue
            self._hooked.add(id(p))
            name = names.get(id(p), "")

            def hook(param, name=name):
                # One cheap op per gradient, before DDP reduces it: NaN/Inf anywhere makes the sum
                # non-finite. The sums are judged together once per step (check_step).
                try:
                    if param.grad is not None:
                        self._sums.append((name, param.grad.detach().sum()))
                except Exception:
                    pass

            p.register_post_accumulate_grad_hook(hook)

    def check_step(self) -> None:
        """Called after the optimizer step: report the first gradient whose local sum was not finite."""
        sums, self._sums = self._sums, []
        if not sums:
            return
        try:
            import torch

            finite = torch.isfinite(torch.stack([s.float() for _, s in sums]))
            if not bool(finite.all()):
                self._report("grad", sums[int((~finite).nonzero()[0])][0], step_offset=0)
        except Exception:
            pass
