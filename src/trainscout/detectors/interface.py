"""The one interface every detector implements, and what the coordinator hands it.

A detector is a state machine the coordinator feeds and polls:

- `observe(digest, now)`: each node digest as it arrives (the node's host, its ranks' latest states, its GPU
  readings). A detector keeps what it needs; most read their own records off each rank's state.
- `judge(view)`: once per detection pass (about once a second, and soon after a digest). `view` is the job as
  the coordinator sees it now. It returns a `Judgement`: findings to emit, and `asks` for evidence or
  actions only the coordinator can get (stacks from outside a rank, records from an agent, a replay on every
  replica, a link probe), each of which comes back to the detector through a callback where it needs one.
- `close()`: once, when the job ends: last findings, events and counters for `events.jsonl`.

The coordinator holds detectors in a `Registry` (detectors/registry.py) in judging order; it names none of
them to run them. Detectors are pure: no torch, no wire, no probe, no I/O (tests/unit/test_import_graph.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from trainscout.detectors.observations import RankObs
from trainscout.findings import Finding

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.detectors.desync import FetchRequest
    from trainscout.detectors.numerics import NumericSuspect
    from trainscout.wire.messages import NodeDigest


MAX_BACKLOG_S = 60.0  # beyond this a coordinator that never catches up judges on what it has


@dataclass
class JobView:
    """What one detection pass sees of the job."""

    now: float  # coordinator monotonic seconds
    ranks: Mapping[int, RankObs]  # every rank ever reported, with its latest state
    seen: Mapping[int, RankObs]  # the ranks whose agent still reports (a silent agent's are not judged)
    live: set[int]  # seen and alive
    members: Mapping[str, list[int]]  # process group name -> its members
    classes: Mapping[str, list[int]]  # replica class -> its live members, ascending
    launcher_codes: Mapping[int, int] = field(default_factory=dict)  # rank -> exit code the launcher saw
    launcher_done: bool = False
    launcher_signalled: frozenset[int] = frozenset()  # ranks their launcher sent a closing signal
    job_interrupted: bool = False  # the whole job was told to stop (Ctrl-C, the scheduler, --abort-on)
    root_found: bool = False  # a root cause (hang, desync, crash, ...) was named: later exits follow from it
    caught_up: float | None = None  # every frame sent before this was handled (None: all of them, up to now)
    final: bool = False  # the job ended and its agents' last reports are drained: no evidence is still to come

    @property
    def waited_until(self) -> float:
        """The clock of every wait for evidence ("judged once all members reported, or after N s"): behind a
        backlog of frames not handled yet, the evidence that seems late may be queued, and a vote on part of
        it misses the rank whose report is still in the queue. Never more than MAX_BACKLOG_S behind now."""
        return evidence_clock(self.now, self.caught_up)

    @property
    def replicas(self) -> list[int]:
        """Live ranks that belong to a replica class, ascending."""
        return sorted(r for ranks in self.classes.values() for r in ranks)

    @property
    def work_classes(self) -> dict[str, list[int]]:
        """Live ranks that do the same work each step: the replica classes, and for ranks in none (sharded data
        parallel: FSDP2, ZeRO-3) the group they are sharded over, whose members compute the same layers on
        different data. Ascending members; a shard group's class is named "shard:" + the group's name."""
        out = {name: list(ranks) for name, ranks in self.classes.items()}
        placed = {r for ranks in out.values() for r in ranks}
        for r in sorted(self.live - placed):
            obs = self.ranks.get(r)
            shard = shard_group(obs.state) if obs is not None else None
            if shard is not None:
                out.setdefault("shard:" + shard, []).append(r)
        return out

    @property
    def shared_gpu(self) -> bool:
        """Several live ranks compute on one GPU (their timings then mix)."""
        devices = [self.ranks[r].state.device for r in self.live if self.ranks[r].state.device]
        return len(devices) != len(set(devices))


def shard_group(state) -> str | None:
    """The name of the group a rank's parameters are sharded over (declared "shard" by a framework integration:
    FSDP2, ZeRO-3), or None."""
    return next((pg.name for pg in state.pgs if pg.role == "shard"), None)


def evidence_clock(now: float, caught_up: float | None) -> float:
    """How far evidence waits have run at `now` when every frame sent before `caught_up` was handled."""
    if caught_up is None:
        return now
    return max(min(now, caught_up), now - MAX_BACKLOG_S)


@dataclass
class DumpStacks:
    """Take these ranks' stacks from outside their processes, attach them to the finding, then emit it."""

    finding: Finding
    ranks: list[int]


@dataclass
class FetchRecords:
    """Pull these ranks' collective records of one group from their agents; `resolve` judges them."""

    request: FetchRequest
    resolve: Callable[[FetchRequest, dict], Finding | None]


@dataclass
class Confirm:
    """A statistical suspect: confirm it by replay and a whole-state check on every replica before naming."""

    suspect: NumericSuspect


@dataclass
class LinkProbe:
    """Collectives of `pg` slowed on every member: time exchanges between the members at a step ahead."""

    pg: str
    members: list[int]
    before_s: float
    now_s: float
    scheduled: Callable[[int, int, float], None]  # (request id, step, now) once it is sent


Ask = DumpStacks | FetchRecords | Confirm | LinkProbe


@dataclass
class Judgement:
    findings: list[Finding] = field(default_factory=list)
    asks: list[Ask] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # for events.jsonl
    counters: dict[str, Any] = field(default_factory=dict)  # totals for the coordinator's exit event


@runtime_checkable
class Detector(Protocol):
    name: str

    def observe(self, digest: NodeDigest, now: float) -> None: ...

    def judge(self, view: JobView) -> Judgement: ...

    def close(self) -> Judgement: ...


class DetectorBase:
    """Defaults for the parts of the interface a detector does not need."""

    name = ""

    def observe(self, digest: NodeDigest, now: float) -> None:
        pass

    def close(self) -> Judgement:
        return Judgement()


def findings_only(findings: Sequence[Finding]) -> Judgement:
    return Judgement(findings=list(findings))
