"""An agent that comes back after a silence (restarted) makes its ranks judged again only with fresh news.

Its Hello arrives before its first digest; until that digest, the ranks' last known state is the one from
before the silence, seconds old: judged then, any rank that happened to be a collective behind would be
named for a hang that is only the monitor's own blindness.
"""

from __future__ import annotations

import io
import signal

from test_detectors import WORLD, obs, pg

from trainscout.coordinator.main import Coordinator
from trainscout.sinks import ConsoleSink
from trainscout.wire.endpoints import CoordinatorEndpoint
from trainscout.wire.messages import Hello, LauncherReport, NodeDigest, RankExit


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


def _exited(exits: dict[int, RankExit]) -> NodeDigest:
    states = [obs(r, [pg(45)], exit=exits.get(r)).state for r in WORLD]
    return NodeDigest(node_id="node0", host="vm", number=2, ranks=states)


def test_the_signal_of_our_own_abort_is_not_a_crash(tmp_path):
    """--abort-on stopped a short job as it ended: rank 2, still running, was gone before its probe could
    record why (the launcher says SIGTERM), and rank 0 lost its peer. Neither is a crash of its own."""
    coord = _coordinator(tmp_path)
    try:
        coord.handle(b"node0", _digest(1, behind=1), 100.0)
        coord.abort("sdc found", 100.2)
        lost_peer = RankExit("exception", 1, None, "RuntimeError: [gloo] Connection closed by peer", 12, 0.05)
        coord.handle(b"node0", _exited({2: RankExit("vanished", None, None, "", 12, 0.1), 0: lost_peer}), 101.0)
        coord.handle(b"node0", LauncherReport(node_id="node0", exit_code=1, worker_exits=[(2, -15, 12)]), 101.1)
        coord.finish()
        assert coord.findings == []
    finally:
        coord.endpoint.close()


def test_a_rank_ending_as_our_abort_lands_is_not_a_crash(tmp_path):
    """The job ended as --abort-on stopped it: rank 2 was already in its interpreter's exit, and our SIGTERM,
    which the launcher reports, ended it there."""
    coord = _coordinator(tmp_path)
    try:
        coord.handle(b"node0", _digest(1, behind=1), 100.0)
        coord.handle(b"node0", _exited({2: RankExit("exit", 0, None, "interpreter exit", 12, 0.0)}), 100.1)
        coord.abort("sdc found", 100.2)
        codes = [(0, -15, 12), (1, -15, 12), (2, -15, 12)]
        coord.handle(b"node0", LauncherReport(node_id="node0", exit_code=1, worker_exits=codes), 101.1)
        coord.handle(b"node0", LauncherReport(node_id="node0", exit_code=1, worker_exits=codes, final=True), 101.2)
        coord.finish()
        assert coord.findings == []
    finally:
        coord.endpoint.close()


def test_a_crash_before_our_abort_is_still_named(tmp_path):
    coord = _coordinator(tmp_path)
    try:
        coord.handle(b"node0", _exited({1: RankExit("signal", None, signal.SIGSEGV, "", 12, 0.5)}), 100.0)
        coord.abort("sdc found", 100.2)
        coord.finish()
        (crash,) = coord.findings
        assert crash.kind == "crash" and crash.culprit_ranks == [1], crash
    finally:
        coord.endpoint.close()


def test_ranks_without_a_record_of_a_launcher_that_succeeded_are_not_crashes(tmp_path):
    """Every rank ended with os._exit(0) after its work (no exit record of its own) and its agent missed the
    exit code; torchrun exited 0, naming no worker: each of that node's ranks exited 0."""
    coord = _coordinator(tmp_path)
    try:
        coord.handle(b"node0", _digest(1, behind=1), 100.0)
        gone = {r: RankExit("vanished", None, None, "", 45, 0.1) for r in WORLD}
        coord.handle(b"node0", _exited(gone), 101.0)
        coord.handle(b"sup", LauncherReport(node_id="node0", exit_code=0, worker_exits=[]), 101.1)
        coord.finish()
        assert coord.findings == []
    finally:
        coord.endpoint.close()


def test_another_nodes_success_does_not_clear_a_vanished_rank(tmp_path):
    coord = _coordinator(tmp_path)
    try:
        coord.handle(b"node0", _digest(1, behind=1), 100.0)
        coord.handle(b"node0", _exited({2: RankExit("vanished", None, None, "", 45, 0.1)}), 101.0)
        coord.handle(b"sup", LauncherReport(node_id="node1", exit_code=0, worker_exits=[]), 101.1)
        coord.finish()
        (crash,) = coord.findings
        assert crash.kind == "crash" and crash.culprit_ranks == [2], crash
    finally:
        coord.endpoint.close()
