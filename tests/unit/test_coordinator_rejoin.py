"""An agent that comes back after a silence (restarted) makes its ranks judged again only with fresh news.

Its Hello arrives before its first digest; until that digest, the ranks' last known state is the one from
before the silence, seconds old: judged then, any rank that happened to be a collective behind would be
named for a hang that is only the monitor's own blindness.
"""

from __future__ import annotations

import io

from test_detectors import WORLD, obs, pg

from trainscout.coordinator.main import Coordinator
from trainscout.sinks import ConsoleSink
from trainscout.wire.endpoints import CoordinatorEndpoint
from trainscout.wire.messages import Hello, LauncherReport, NodeDigest


def _coordinator(tmp_path) -> Coordinator:
    endpoint = CoordinatorEndpoint("tcp://127.0.0.1:0", b"k" * 32)
    return Coordinator(endpoint, str(tmp_path), ConsoleSink(io.StringIO(), rich=False), hang_timeout_s=5.0)


def _digest(number: int, behind: int) -> NodeDigest:
    """The node's ranks in training, rank `behind` one all-reduce behind its peers (any moment shows one)."""
    states = [obs(r, [pg(44 if r == behind else 45)]).state for r in WORLD]
    return NodeDigest(node_id="node0", host="vm", number=number, ranks=states)


def test_a_hello_after_a_silence_does_not_revive_stale_ranks(tmp_path):
    coord = _coordinator(tmp_path)
    try:
        coord.handle(b"node0", _digest(1, behind=3), 100.0)
        coord.detect(100.0)
        coord.detect(104.0)
        assert coord.nodes[b"node0"]["lost"]  # silent for over 3 s
        coord.handle(b"node0", Hello(node_id="node0", host="vm", agent_pid=2), 110.0)  # the restarted agent
        coord.detect(110.0)
        assert coord.pending_stacks == {} and coord.findings == []
        coord.handle(b"node0", _digest(1, behind=1), 110.5)  # its first digest: training went on
        assert not coord.nodes[b"node0"]["lost"]
        coord.detect(110.5)
        assert coord.pending_stacks == {} and coord.findings == []
    finally:
        coord.endpoint.close()


def test_a_crash_the_agent_never_saw_is_named_from_the_launchers_report(tmp_path):
    """A job torn down within a digest of a crash: the agent stops before it sees any rank exit, and only the
    launcher reports who died how (rank 1 by SIGSEGV, its peers by the launcher's SIGTERM)."""
    coord = _coordinator(tmp_path)
    try:
        coord.handle(b"node0", _digest(1, behind=1), 100.0)
        # rank 2 raised on the lost connection (exit 1) before the teardown: that exit is not read as its own
        exits = [(0, -15, 11), (2, 1, 13), (3, -9, 14), (1, -11, 12)]
        coord.handle(b"node0", LauncherReport(node_id="node0", exit_code=1, worker_exits=exits), 100.4)
        coord.handle(b"node0", LauncherReport(node_id="node0", exit_code=1, worker_exits=exits, final=True), 100.5)
        coord.finish()
        (crash,) = [f for f in coord.findings if f.kind == "crash"]
        assert crash.culprit_ranks == [1] and crash.status == "attributed", crash
        assert crash.evidence["signal"] == "SIGSEGV" and "SIGSEGV" in crash.summary, crash
        assert [f.kind for f in coord.findings] == ["crash"]
    finally:
        coord.endpoint.close()
