"""When the supervisor restarts a monitoring process (agent, coordinator) that died, and what was missed.

Pure bookkeeping, no processes: the supervisor tells a `RestartPolicy` when a tool died and when it is
back; the policy answers whether and when to start it again (bounded count, exponential backoff that
resets after a healthy stretch), and keeps the monitoring gaps (from, to, what was blind) for summary.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# What each tool's absence leaves unseen: the report says it next to every gap.
BLIND = {
    "coordinator": "no rank was judged (the agents kept sampling; findings were re-derived after)",
    "agent": "this node's ranks were not read (their channels kept filling; read again after)",
}


@dataclass
class Gap:
    component: str
    since: float  # wall-clock seconds: when the death was noticed
    until: float | None = None  # when the restarted process was up again; None: never
    code: int | None = None  # the dead process's exit status (negative: signal)

    def line(self) -> str:
        def clock(t: float) -> str:
            return time.strftime("%H:%M:%S", time.localtime(t))

        blind = BLIND.get(self.component, "")
        if self.until is None:
            return (
                f"monitoring gap: the {self.component} died at {clock(self.since)} (code {self.code}) "
                f"and was not restarted; {blind}"
            )
        return (
            f"monitoring gap: the {self.component} was down from {clock(self.since)} to {clock(self.until)} "
            f"({self.until - self.since:.1f} s, code {self.code}, restarted); {blind}"
        )


@dataclass
class RestartPolicy:
    """At most `limit` restarts per component; the k-th quick failure in a row waits base_s * 2**(k-1),
    at most cap_s; a process that ran `healthy_s` before dying starts the backoff over."""

    limit: int
    base_s: float = 0.5
    cap_s: float = 8.0
    healthy_s: float = 60.0
    restarts: dict[str, int] = field(default_factory=dict)
    _streak: dict[str, int] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)
    _open: dict[str, Gap] = field(default_factory=dict)

    def died(self, component: str, code: int | None, ran_s: float, now: float) -> float | None:
        """Record a death; the delay before the restart, or None when the limit is spent."""
        gap = self._open.get(component)  # a restart that did not come up extends the gap it was to close
        if gap is None:
            gap = Gap(component, now, code=code)
            self.gaps.append(gap)
        if self.restarts.get(component, 0) >= self.limit:
            return None
        self._open[component] = gap
        streak = 0 if ran_s >= self.healthy_s else self._streak.get(component, 0)
        self._streak[component] = streak + 1
        return min(self.cap_s, self.base_s * 2**streak)

    def restarted(self, component: str, now: float) -> int:
        """Record that the component runs again; returns how many restarts it has had."""
        self.restarts[component] = self.restarts.get(component, 0) + 1
        gap = self._open.pop(component, None)
        if gap is not None:
            gap.until = now
        return self.restarts[component]

    def failed_restart(self, component: str) -> None:
        """A restart that did not come up: the gap stays open (never back, unless a later try succeeds)."""
        self.restarts[component] = self.restarts.get(component, 0) + 1

    def gap_lines(self) -> list[str]:
        return [g.line() for g in self.gaps]
