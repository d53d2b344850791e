"""Wire format and ZeroMQ endpoints, with real sockets on 127.0.0.1 and hostile raw senders."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq

from trainscout.wire.endpoints import AgentEndpoint, CoordinatorEndpoint
from trainscout.wire.framing import VERSION, Codec
from trainscout.wire.security import secure_client, server_keys
from trainscout.wire.messages import (
    CollectiveRecord,
    Command,
    Goodbye,
    Hello,
    LauncherReport,
    NodeDigest,
    PgState,
    RankExit,
    RankState,
    RecordsReport,
    StackReport,
)

SECRET = b"s" * 32
OTHER_SECRET = b"o" * 32


def _record(seq: int) -> CollectiveRecord:
    return CollectiveRecord(
        seq=seq,
        op="all_reduce",
        desc="all_reduce f32[1024] sum",
        entry_hash=(1 << 63) + seq,  # full 64-bit range must survive msgpack
        rolling_hash=(1 << 64) - 1 - seq,
        wall_ns=1_700_000_000_000_000_000 + seq,
        step=7,
    )


def _digest(number: int = 1) -> NodeDigest:
    pg = PgState(
        name="0",
        desc="default_pg",
        members=[0, 1, 2, 3],
        seq=9921,
        rolling_hash=12345,
        anchors=[(9904, 1), (9920, 2)],
        recent=[_record(9920), _record(9921)],
        seq_age_s=0.25,
    )
    healthy = RankState(
        rank=0,
        local_rank=0,
        world_size=4,
        pid=4410,
        alive=True,
        step=812,
        heartbeat_age_s=0.1,
        progress_age_s=0.2,
        collectives=9921,
        pgs=[pg],
    )
    dead = RankState(
        rank=1,
        local_rank=1,
        world_size=4,
        pid=4411,
        alive=False,
        step=811,
        heartbeat_age_s=3.0,
        progress_age_s=3.0,
        collectives=9900,
        pgs=[],
        exit=RankExit(how="signal", code=None, signal=9, message="killed", step=811, age_s=1.5),
        probe_errors=["fr unavailable"],
        fr_available=False,
    )
    return NodeDigest(node_id="node-a", host="b-07", number=number, ranks=[healthy, dead])


TO_COORDINATOR = [
    Hello(node_id="node-a", host="b-07", agent_pid=99),
    _digest(),
    StackReport(node_id="node-a", request_id=3, rank=13, pid=4411, method="py-spy", text="data.py:88 in __next__"),
    RecordsReport(node_id="node-a", request_id=4, rank=13, pg="dp", records=[_record(1), _record(2)]),
    LauncherReport(node_id="node-a", exit_code=1, worker_exits=[(13, -9, 4411)]),
    Goodbye(node_id="node-a", reason="job finished"),
]


# ---- Codec -------------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", TO_COORDINATOR, ids=lambda m: type(m).__name__)
def test_codec_roundtrip_to_coordinator(msg: msgspec.Struct) -> None:
    codec = Codec(SECRET)
    frames = codec.encode(msg)
    assert frames[0] == VERSION and len(frames[1]) == 32
    assert codec.decode_to_coordinator(frames) == msg
    assert not codec.rejected


def test_codec_roundtrip_command() -> None:
    codec = Codec(SECRET)
    cmd = Command(kind="fetch_records", request_id=5, ranks=[13], pg="dp", seq_from=9900, seq_to=9921)
    assert codec.decode_to_agent(codec.encode(cmd)) == cmd


def test_codec_rejects_short_secret() -> None:
    with pytest.raises(ValueError):
        Codec(b"too-short")


def test_codec_counts_each_rejection_reason() -> None:
    codec = Codec(SECRET, max_payload=128)
    good = codec.encode(Hello(node_id="n", host="h", agent_pid=1))
    assert codec.decode_to_coordinator(good[:2]) is None  # frames
    assert codec.decode_to_coordinator([b"TS0", good[1], good[2]]) is None  # version
    assert codec.decode_to_coordinator([VERSION, good[1][:16], good[2]]) is None  # short mac
    assert codec.decode_to_coordinator([VERSION, b"", good[2]]) is None  # missing mac
    # A command is signed correctly but is not a message for the coordinator (and vice versa).
    assert codec.decode_to_coordinator(codec.encode(Command(kind="flush", request_id=1))) is None
    assert codec.decode_to_agent(good) is None
    big = codec.encode(Goodbye(node_id="n", reason="x" * 200))
    assert codec.decode_to_coordinator(big) is None  # oversize
    assert codec.rejected == {"frames": 1, "version": 1, "mac": 2, "malformed": 2, "oversize": 1}


# ---- Endpoints ---------------------------------------------------------------------------------


@pytest.fixture
def coordinator():
    endpoint = CoordinatorEndpoint("tcp://127.0.0.1:0", SECRET)
    yield endpoint
    endpoint.close()


def test_coordinator_address_has_real_port(coordinator: CoordinatorEndpoint) -> None:
    assert coordinator.address.startswith("tcp://127.0.0.1:")
    assert int(coordinator.address.rsplit(":", 1)[1]) > 0


def test_router_dealer_exchange(coordinator: CoordinatorEndpoint) -> None:
    agent = AgentEndpoint(coordinator.address, SECRET, identity="node-a")
    try:
        digest = _digest(number=42)
        assert agent.send(digest)
        got = coordinator.recv(timeout_ms=5000)
        assert got is not None
        identity, msg = got
        assert identity == b"node-a"
        assert msg == digest

        cmd = Command(kind="dump_stacks", request_id=7, ranks=[13])
        assert coordinator.send(identity, cmd)
        assert agent.recv_command(timeout_ms=5000) == cmd
        assert not coordinator.rejected and not agent.rejected
    finally:
        agent.close()


def test_coordinator_drops_and_counts_hostile_frames(coordinator: CoordinatorEndpoint) -> None:
    codec = Codec(SECRET)
    valid = codec.encode(Hello(node_id="node-b", host="b-08", agent_pid=7))
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    secure_client(raw, SECRET)  # a peer that holds the secret, sending bad frames
    raw.connect(coordinator.address)
    try:
        raw.send_multipart([b"garbage"])  # frames
        raw.send_multipart([os.urandom(8), os.urandom(32), os.urandom(100)])  # version
        raw.send_multipart([VERSION, valid[1], valid[2][: len(valid[2]) // 2]])  # mac (truncated payload)
        raw.send_multipart(Codec(OTHER_SECRET).encode(Hello(node_id="x", host="x", agent_pid=1)))  # mac
        int_payload = msgspec.msgpack.encode(12345)
        raw.send_multipart([VERSION, codec._mac(int_payload), int_payload])  # malformed
        raw.send_multipart(valid)

        got = coordinator.recv(timeout_ms=5000)
        assert got is not None
        assert got[1] == Hello(node_id="node-b", host="b-08", agent_pid=7)
        assert coordinator.recv(timeout_ms=100) is None
        assert coordinator.rejected == {"frames": 1, "version": 1, "mac": 2, "malformed": 1}
    finally:
        raw.close(0)
        ctx.term()


def test_rejected_frame_does_not_end_recv_early(coordinator: CoordinatorEndpoint) -> None:
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    secure_client(raw, SECRET)
    raw.connect(coordinator.address)
    try:
        raw.send_multipart([b"garbage"])
        start = time.monotonic()
        assert coordinator.recv(timeout_ms=300) is None
        assert time.monotonic() - start >= 0.25
        assert coordinator.rejected["frames"] == 1
    finally:
        raw.close(0)
        ctx.term()


def test_agent_drops_and_counts_hostile_commands() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.CURVE_SERVER, 1)  # a coordinator's keys without its client check
    router.setsockopt(zmq.CURVE_SECRETKEY, server_keys(SECRET)[1])
    port = router.bind_to_random_port("tcp://127.0.0.1")
    agent = AgentEndpoint(f"tcp://127.0.0.1:{port}", SECRET, identity="node-c")
    try:
        assert agent.send(Hello(node_id="node-c", host="h", agent_pid=1))
        assert router.poll(5000)
        identity = router.recv_multipart()[0]
        cmd = Command(kind="flush", request_id=1)
        router.send_multipart([identity, b"junk"])
        router.send_multipart([identity, *Codec(OTHER_SECRET).encode(cmd)])
        router.send_multipart([identity, *Codec(SECRET).encode(cmd)])
        assert agent.recv_command(timeout_ms=5000) == cmd
        assert agent.rejected == {"frames": 1, "mac": 1}
    finally:
        agent.close()
        router.close(0)
        ctx.term()


def test_agent_never_blocks_without_coordinator() -> None:
    # Nothing listens on this port (bound then released), so the agent can never connect.
    ctx = zmq.Context()
    probe = ctx.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)
    ctx.term()

    agent = AgentEndpoint(f"tcp://127.0.0.1:{port}", SECRET, identity="lonely")
    try:
        digest = _digest()
        start = time.monotonic()
        results = [agent.send(digest) for _ in range(2000)]
        assert time.monotonic() - start < 1.0
        assert any(results)  # queued while the coordinator might still come up
        assert not all(results)  # beyond the high-water mark messages are dropped, not blocked on
        assert agent.recv_command(timeout_ms=50) is None
    finally:
        start = time.monotonic()
        agent.close()
        assert time.monotonic() - start < 1.0  # LINGER 0: queued messages do not hold up shutdown
    assert agent.send(digest) is False  # closed: still no exception


def test_coordinator_send_to_unknown_peer_does_not_raise(coordinator: CoordinatorEndpoint) -> None:
    result = coordinator.send(b"nobody", Command(kind="flush", request_id=1))
    assert isinstance(result, bool)
    coordinator.close()
    assert coordinator.send(b"nobody", Command(kind="flush", request_id=1)) is False
    assert coordinator.recv(timeout_ms=10) is None
