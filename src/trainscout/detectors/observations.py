"""What detectors see of the job: each rank's latest reported state and when the coordinator got it.

Ages in a RankState were measured by the sending agent on its own clock; adding the time since the
coordinator received the state gives an age "now" without comparing clocks across hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import PgState, RankState


@dataclass
class RankObs:
    state: RankState
    host: str
    seen_at: float  # coordinator monotonic seconds when the state arrived
    _pgs: dict[str, PgState] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # by name: detectors look a rank's groups up once per group per pass (a list scan was the hot spot)
        self._pgs = {pg.name: pg for pg in reversed(self.state.pgs)}  # the first of a repeated name, as before

    @property
    def rank(self) -> int:
        return self.state.rank

    def age(self, reported_age: float, now: float) -> float:
        return reported_age + max(0.0, now - self.seen_at)

    def progress_age(self, now: float) -> float:
        return self.age(self.state.progress_age_s, now)

    def busy_age(self, now: float) -> float:
        return self.age(self.state.busy_age_s, now)

    def moving_age(self, now: float) -> float:
        return self.age(self.state.moving_age_s, now)

    def ended_cleanly(self) -> bool:
        """It exited of its own accord with code 0 (its script ended, sys.exit(0))."""
        e = self.state.exit
        return e is not None and e.how == "exit" and e.code in (0, None)

    def gpu_pending(self, now: float) -> float:
        """Seconds its training GPU has not completed the work queued when the probe looked (0: nothing pending)."""
        return self.age(self.state.gpu_pending_s, now) if self.state.gpu_pending_s > 0 else 0.0

    def heartbeat_age(self, now: float) -> float:
        return self.age(self.state.heartbeat_age_s, now)

    def exited_at(self) -> float | None:
        """Coordinator-clock estimate of when the rank's exit was observed."""
        if self.state.exit is None:
            return None
        return self.seen_at - self.state.exit.age_s

    def pg(self, name: str) -> PgState | None:
        return self._pgs.get(name)


def who(obs: RankObs) -> str:
    """'rank 2 (host h, pid 41)' as findings print it."""
    return f"rank {obs.rank} (host {obs.host}, pid {obs.state.pid})"


def rank_list(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def group_label(name: str, desc: str) -> str:
    return f"pg {name}" + (f" ({desc})" if desc else "")
