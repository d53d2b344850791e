"""When a drill acts: the step arithmetic shared by the hook-driven faults (delay, gradnoise, outflip, starve).

A fault given step=S acts in the iteration that follows optimizer step S, i.e. in the forward/backward computed
after the probe's on_step_end(S) returns; a repeating one also after S+every, S+2*every, ... and, when it has a
count, only `count` times. The hooks only know the last completed step (the drill's clock), so this is the one
place that turns it into "act now or not". Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepSchedule:
    start: int
    every: int = 1
    count: int | None = None  # None: from `start` on, forever

    def fires_after(self, step: int | None) -> bool:
        """Whether the iteration following optimizer step `step` is one the fault acts in."""
        if step is None or step < self.start:
            return False
        index, rest = divmod(step - self.start, self.every)
        return rest == 0 and (self.count is None or index < self.count)

    def occurrence(self, step: int) -> int:
        """0 for the onset, 1 for the next firing, ... (meaningful where fires_after(step))."""
        return (step - self.start) // self.every

    def is_over(self, step: int) -> bool:
        """True once no iteration after `step` will fire again: the drill can take its hooks off."""
        return self.count is not None and step > self.start + (self.count - 1) * self.every

    @property
    def intermittent(self) -> bool:
        """Faults that come and go: the fault log gets one line per occurrence, not only the onset."""
        return self.every > 1
