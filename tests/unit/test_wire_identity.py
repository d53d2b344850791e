"""Who may talk to the coordinator: peers without the job secret are refused at the CURVE handshake.

Real sockets on 127.0.0.1: an unauthenticated peer cannot take an agent's identity, cannot make the
coordinator buffer a huge message, bytes replayed into a live connection are not delivered twice (a
real TCP proxy replays them), and one flooding peer does not crowd out another.
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
import time

import psutil
import zmq

from trainscout.wire.endpoints import AgentEndpoint, CoordinatorEndpoint
from trainscout.wire.framing import Codec
from trainscout.wire.messages import Command, Hello, NodeDigest
from trainscout.wire.security import secure_client, server_keys

SECRET = b"s" * 32
OTHER_SECRET = b"o" * 32


def _digest(number: int) -> NodeDigest:
    return NodeDigest(node_id="node-a", host="h", number=number, ranks=[])


def _wait_rejected(coordinator: CoordinatorEndpoint, reason: str, at_least: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while coordinator.rejected[reason] < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return coordinator.rejected[reason]


def _raw_dealer(ctx: zmq.Context, address: str, identity: bytes, keys: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    if keys == "other-secret":
        secure_client(sock, OTHER_SECRET)
    elif keys == "right-server-wrong-client":  # knows the server key (say it leaked) but not the client key
        public, private = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_keys(SECRET)[0])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, private)
    sock.connect(address)
    return sock


def test_peers_without_the_secret_are_refused_before_any_message() -> None:
    coordinator = CoordinatorEndpoint("tcp://127.0.0.1:0", SECRET)
    ctx = zmq.Context()
    # each sends correctly signed frames (as if captured from the wire): the handshake refuses them anyway
    signed = Codec(SECRET).encode(Hello(node_id="node-a", host="h", agent_pid=1))
    peers = [
        _raw_dealer(ctx, coordinator.address, b"node-a", k)
        for k in ("plain", "other-secret", "right-server-wrong-client")
    ]
    try:
        for peer in peers:
            peer.send_multipart(signed)
        assert coordinator.recv(timeout_ms=1500) is None
        assert _wait_rejected(coordinator, "handshake", 3) >= 3
        assert set(coordinator.rejected) == {"handshake"}  # not one frame reached the codec
    finally:
        for peer in peers:
            peer.close(0)
        ctx.term()
        coordinator.close()


def test_an_unauthenticated_peer_cannot_take_an_agents_identity() -> None:
    coordinator = CoordinatorEndpoint("tcp://127.0.0.1:0", SECRET)
    agent = AgentEndpoint(coordinator.address, SECRET, identity="node-a")
    ctx = zmq.Context()
    thieves: list[zmq.Socket] = []
    try:
        assert agent.send(_digest(1))
        got = coordinator.recv(timeout_ms=5000)
        assert got is not None and got[0] == b"node-a"
        # peers claim the same identity for a while, the way the real agent would after a restart
        for _ in range(3):
            for keys in ("plain", "other-secret", "right-server-wrong-client"):
                thieves.append(_raw_dealer(ctx, coordinator.address, b"node-a", keys))
                thieves[-1].send_multipart([b"x"])
            time.sleep(0.2)
        # the route still leads to the real agent, both ways
        assert coordinator.send(b"node-a", Command(kind="flush", request_id=5))
        assert agent.recv_command(timeout_ms=5000) == Command(kind="flush", request_id=5)
        assert agent.send(_digest(2))
        got = coordinator.recv(timeout_ms=5000)
        assert got is not None and got[0] == b"node-a" and got[1].number == 2
        assert _wait_rejected(coordinator, "handshake", 9) >= 9
    finally:
        for t in thieves:
            t.close(0)
        ctx.term()
        agent.close()
        coordinator.close()


_FLOOD = """
import sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.SNDHWM, 0)
big = b"\\0" * (30 * 1024 * 1024)
# A DEALER's pipe exists from connect() until the refused handshake tears it down (and this peer does not come
# back): the message is queued at once, without copying 1.8 GB first, which on a loaded machine took longer
# than the handshake's refusal. A send that still finds no pipe waits, not forever.
s.setsockopt(zmq.SNDTIMEO, 20000)
s.connect(sys.argv[1])
try:
    s.send_multipart([big] * 60, copy=False)  # 1.8 GB in one multipart message
    print("sent", flush=True)
except zmq.Again:
    print("not queued", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_an_unauthenticated_multipart_flood_is_not_buffered() -> None:
    coordinator = CoordinatorEndpoint("tcp://127.0.0.1:0", SECRET)
    me = psutil.Process()
    before = me.memory_info().rss
    flood = subprocess.Popen(
        [sys.executable, "-c", _FLOOD, coordinator.address, "3"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert flood.stdout is not None
        assert select.select([flood.stdout], [], [], 30)[0], "the flooding peer said nothing in 30 s"
        assert flood.stdout.readline().strip() == "sent"
        peak = before
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert coordinator.recv(timeout_ms=100) is None
            peak = max(peak, me.memory_info().rss)
        assert peak - before < 64 * 1024 * 1024, f"coordinator grew by {(peak - before) / 2**20:.0f} MiB"
        assert coordinator.rejected["handshake"] >= 1
    finally:
        flood.kill()
        flood.wait()
        coordinator.close()


class _ReplayingProxy:
    """A TCP proxy that forwards both ways and can send one client->server chunk a second time."""

    def __init__(self, target_port: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target_port = target_port
        self._to_server: socket.socket | None = None
        self.last_chunk = b""
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection(("127.0.0.1", self._target_port))
        self._to_server = server
        threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    if upstream:
                        self.last_chunk = data
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def replay_last(self) -> None:
        with self._lock:
            assert self._to_server is not None
            self._to_server.sendall(self.last_chunk)

    def close(self) -> None:
        self._listener.close()


def _received_numbers(recv, wait_s: float) -> list[int]:
    numbers = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        got = recv()
        if got is not None:
            numbers.append(got.number)
    return numbers


def _send_replay_and_count(send, recv, proxy: _ReplayingProxy) -> list[int]:
    assert send(_digest(1))
    assert _received_numbers(recv, 1.0) == [1]  # handshake done, connection quiet
    assert send(_digest(2))
    assert _received_numbers(recv, 0.5) == [2]
    proxy.replay_last()  # the bytes that carried digest 2, once more
    return _received_numbers(recv, 1.5)


def test_bytes_replayed_into_a_connection_are_not_delivered_again() -> None:
    # Control: the same replay over plain ZeroMQ with signed frames delivers the message twice, so the
    # proxy's replay is a real one and the signed frames alone would not stop it.
    codec = Codec(SECRET)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    proxy = _ReplayingProxy(port)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{proxy.port}")

    def plain_recv():
        if not router.poll(50):
            return None
        return codec.decode_to_coordinator(router.recv_multipart()[1:])

    try:
        again = _send_replay_and_count(lambda m: dealer.send_multipart(codec.encode(m)) or True, plain_recv, proxy)
        assert again == [2], again
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()
        proxy.close()

    coordinator = CoordinatorEndpoint("tcp://127.0.0.1:0", SECRET)
    proxy = _ReplayingProxy(int(coordinator.address.rsplit(":", 1)[1]))
    agent = AgentEndpoint(f"tcp://127.0.0.1:{proxy.port}", SECRET, identity="node-a")
    try:
        again = _send_replay_and_count(agent.send, lambda: (coordinator.recv(timeout_ms=50) or (None, None))[1], proxy)
        assert again == [], again  # CURVE's nonce check breaks the connection instead
    finally:
        agent.close()
        coordinator.close()
        proxy.close()


def test_one_flooding_peer_does_not_crowd_out_an_agent() -> None:
    coordinator = CoordinatorEndpoint("tcp://127.0.0.1:0", SECRET)
    stop = threading.Event()
    flooded = [0]

    def flood() -> None:  # a peer that holds the secret and sends as fast as zmq takes it
        noisy = AgentEndpoint(coordinator.address, SECRET, identity="noisy")
        hello = Hello(node_id="noisy", host="h", agent_pid=2)
        try:
            while not stop.is_set():
                if noisy.send(hello):
                    flooded[0] += 1
        finally:
            noisy.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    agent = AgentEndpoint(coordinator.address, SECRET, identity="node-a")
    sent_at: dict[int, float] = {}
    latency: dict[int, float] = {}
    try:
        time.sleep(0.3)  # the flood is under way before the agent speaks
        next_send = time.monotonic()
        number = 0
        deadline = time.monotonic() + 8.0
        while len(latency) < 20 and time.monotonic() < deadline:
            if number < 20 and time.monotonic() >= next_send:
                number += 1
                sent_at[number] = time.monotonic()
                assert agent.send(_digest(number))
                next_send += 0.05
            got = coordinator.recv(timeout_ms=5)
            if got is not None and got[0] == b"node-a":
                latency[got[1].number] = time.monotonic() - sent_at[got[1].number]
    finally:
        stop.set()
        flooder.join(5)
        agent.close()
        coordinator.close()
    assert flooded[0] > 1000, flooded  # it really flooded
    assert sorted(latency) == list(range(1, 21)), sorted(latency)
    assert max(latency.values()) < 2.0, latency
