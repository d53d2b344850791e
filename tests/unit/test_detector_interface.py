"""detectors/interface.py and detectors/registry.py: every detector speaks one interface, and the coordinator
runs whatever is registered (a new detector needs no coordinator change)."""

from __future__ import annotations

import io
import json
import os

import pytest

from trainscout.coordinator.main import Coordinator
from trainscout.detectors.interface import Detector, DetectorBase, DumpStacks, JobView, Judgement
from trainscout.detectors.registry import Registry, default_detectors
from trainscout.findings import STRAGGLER, Finding
from trainscout.sinks import ConsoleSink
from trainscout.wire.endpoints import CoordinatorEndpoint
from trainscout.wire.messages import NodeDigest, PgState, RankState

SECRET = b"k" * 32


def test_every_default_detector_implements_the_interface_under_its_own_name():
    registry = default_detectors(hang_timeout_s=5.0, stall_timeout_s=300.0)
    names = registry.names()
    assert len(names) == len(set(names)) == len(registry) >= 10
    for d in registry:
        assert isinstance(d, Detector), d
        assert registry.get(d.name) is d
    # protocol first (a desync explains the hang it causes), exits last (they may follow from a root cause)
    assert names[0] == "desync" and names[-1] == "exits"


def test_the_registry_refuses_what_is_not_a_detector_and_duplicate_names():
    class NoJudge:
        name = "nojudge"

        def observe(self, digest, now): ...

        def close(self): ...

    with pytest.raises(TypeError, match="detector interface"):
        Registry([NoJudge()])  # type: ignore[list-item]

    class Named(DetectorBase):
        name = "same"

        def judge(self, view: JobView) -> Judgement:
            return Judgement()

    with pytest.raises(ValueError, match="two detectors named 'same'"):
        Registry([Named(), Named()])


class SlowestStep(DetectorBase):
    """A new detector, written against the interface alone: names the rank with the longest last step once
    every rank's step is at least `min_step` and that rank's wall time is >= 3x the others'."""

    name = "slowest"

    def __init__(self, min_step: int = 5) -> None:
        self.min_step = min_step
        self.walls: dict[int, float] = {}
        self.observed = 0
        self.closed = False

    def observe(self, digest, now: float) -> None:
        self.observed += 1
        for st in digest.ranks:
            self.walls[st.rank] = float(st.cpu_percent)  # the test's digests carry the step wall time here

    def judge(self, view: JobView) -> Judgement:
        if not view.live or min(view.ranks[r].state.step for r in view.live) < self.min_step:
            return Judgement()
        worst = max(view.live, key=lambda r: self.walls.get(r, 0.0))
        others = [self.walls[r] for r in view.live if r != worst]
        if others and self.walls[worst] >= 3 * max(others):
            f = Finding(kind=STRAGGLER, summary=f"rank {worst} slowest", culprit_ranks=[worst], step=5)
            f.evidence = {"type": "slowest"}
            return Judgement(findings=[f], events=[("slowest_seen", {"rank": worst})])
        return Judgement()

    def close(self) -> Judgement:
        self.closed = True
        return Judgement(counters={"slowest_observed": self.observed})


class AskForStacks(DetectorBase):
    """Asks the coordinator for a culprit's stacks: the finding goes out once they are in (or time out)."""

    name = "asks"

    def __init__(self) -> None:
        self.asked = False

    def judge(self, view: JobView) -> Judgement:
        if self.asked or not view.live:
            return Judgement()
        self.asked = True
        f = Finding(kind="hang", summary="rank 1 stuck", culprit_ranks=[1], step=5)
        return Judgement(asks=[DumpStacks(f, [1])])


def _digest(walls: dict[int, float], step: int) -> NodeDigest:
    ranks = []
    for r, wall in walls.items():
        pg = PgState(
            name="0", desc="", members=list(walls), seq=step, rolling_hash=0, anchors=[], recent=[], seq_age_s=0
        )
        ranks.append(
            RankState(
                rank=r,
                local_rank=r,
                world_size=len(walls),
                pid=1000 + r,
                alive=True,
                step=step,
                heartbeat_age_s=0.1,
                progress_age_s=0.1,
                collectives=step,
                pgs=[pg],
                cpu_percent=wall,
            )
        )
    return NodeDigest(node_id="n0", host="h0", number=step, ranks=ranks)


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_the_coordinator_runs_a_registered_detector_it_does_not_know(tmp_path):
    slowest, asks = SlowestStep(), AskForStacks()
    endpoint = CoordinatorEndpoint("tcp://127.0.0.1:0", SECRET)
    out = io.StringIO()
    coord = Coordinator(
        endpoint, str(tmp_path), ConsoleSink(out, rich=False), stack_timeout_s=0.5, detectors=Registry([slowest, asks])
    )
    try:
        coord.handle(b"n0", _digest({0: 0.1, 1: 0.1, 2: 0.1}, step=3), now=10.0)
        coord.detect(10.0)
        assert _read(tmp_path / "findings.jsonl") == []  # before min_step: nothing; the stack ask is pending
        coord.handle(b"n0", _digest({0: 0.1, 1: 0.1, 2: 0.5}, step=6), now=11.0)
        coord.detect(11.0)  # the straggler finding waits for no profile (its type is not sampled)
        coord.detect(12.0)  # the stack ask timed out (no agent answered): the hang finding goes out without them
        coord.finish()
    finally:
        endpoint.close()
    findings = _read(tmp_path / "findings.jsonl")
    assert [(f["kind"], f["culprit_ranks"]) for f in findings] == [("straggler", [2]), ("hang", [1])]
    assert findings[0]["hosts"] == ["h0"] and findings[0]["pids"] == [1002]  # identity filled by the coordinator
    assert slowest.observed == 2 and slowest.closed
    events = _read(tmp_path / "events.jsonl")
    assert {"rank": 2} == {
        k: v for k, v in next(e for e in events if e["kind"] == "slowest_seen").items() if k == "rank"
    }
    exit_event = next(e for e in events if e["kind"] == "coordinator_exit")
    assert exit_event["slowest_observed"] == 2 and exit_event["findings"] == 2
