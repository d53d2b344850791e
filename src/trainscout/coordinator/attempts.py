"""Elastic restarts (torchrun --max-restarts): one run, several attempts, each judged on its own.

Each rank's probe reads the launcher's attempt number (TORCHELASTIC_RESTART_COUNT) and the agent reports it
with the rank's state. When a rank of a newer attempt appears, the coordinator closes the old attempt (what
it still had pending is decided with what it knows), forgets every rank's state (a restarted rank is not
a hung or crashed rank of the new attempt) and starts afresh. A culprit already named for a kind of fault in
an earlier attempt is not named again for the same kind in a later one: the restart did not cure it, but it
is the same fault, recorded once (events.jsonl: `repeat`).

Pure logic, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainscout.findings import Finding


@dataclass
class AttemptTracker:
    current: int = 0
    started: dict[int, float] = field(default_factory=dict)  # attempt -> wall time its first rank was seen
    _blamed: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)  # (kind, culprits) -> attempt

    def is_stale(self, attempt: int) -> bool:
        """A rank state from an attempt that has ended (the agent's last look at a rank that restarted)."""
        return attempt < self.current

    def is_newer(self, attempt: int) -> bool:
        return attempt > self.current

    def begin(self, attempt: int, wall: float) -> None:
        self.current = attempt
        self.started.setdefault(attempt, wall)

    def earlier_blame(self, f: Finding) -> int | None:
        """The earlier attempt that already named the same culprits for the same kind, else None."""
        if not f.culprit_ranks:
            return None
        first = self._blamed.get((f.kind, tuple(sorted(f.culprit_ranks))))
        return first if first is not None and first < f.attempt else None

    def record(self, f: Finding) -> None:
        if f.culprit_ranks:
            self._blamed.setdefault((f.kind, tuple(sorted(f.culprit_ranks))), f.attempt)
