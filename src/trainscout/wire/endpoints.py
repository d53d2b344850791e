"""ZeroMQ endpoints of the agent <-> coordinator link.

The coordinator binds one ROUTER socket; each node agent (and the run supervisor) connects a DEALER
with a stable identity, so the coordinator can address commands back to a node. Both ends sit beside
a training job they must never disturb: every send is non-blocking, lingering is off, and network
conditions (peer gone, queue full, socket closed) become a False/None result instead of an exception.
Connections are authenticated by CurveZMQ (`security`): a peer without the job secret is refused at the
handshake, before it can claim an identity or send a byte of a message. Frames are also signed and
checked by `framing.Codec`; rejected input and refused connections are counted in `rejected`.
Like any zmq socket, each endpoint belongs to one thread.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import msgspec
import zmq

from trainscout.wire.framing import DEFAULT_MAX_PAYLOAD, Codec
from trainscout.wire.messages import Command
from trainscout.wire.security import ServerGuard, secure_client

# zmq refuses (and disconnects) single frames far beyond the codec's limit before buffering them whole;
# moderately oversized frames still reach the codec so they are counted as "oversize".
_ZMQ_FRAME_LIMIT = 2 * DEFAULT_MAX_PAYLOAD + 1024
AGENT_SEND_HWM = 1000
# Messages zmq queues per connected peer before it stops reading that peer's socket (TCP pushes back on
# the sender alone, whose own queue then fills: AGENT_SEND_HWM): with the frame limit, what one peer can make
# the coordinator hold, and the reason one flooding peer cannot crowd the others out (the ROUTER reads its
# peers in turn). It bounds the whole job's backlog in the coordinator too: 12,544 agents (100k ranks) of
# ~11 KB digests a second held it at 37 GiB behind a backlog with 256, 10 GiB with 32; 8 is at most ~1.1 GB
# there (8 s of digests). A backlog beyond it waits in the agents' own send queues, not lost.
COORDINATOR_RECV_HWM_PER_PEER = 8
# Reason counted in `rejected` for a connection refused at the CURVE handshake.
REJECT_HANDSHAKE = "handshake"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _deadline(timeout_ms: int) -> float | None:
    return None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000.0


def _remaining_ms(deadline: float | None) -> int:
    if deadline is None:
        return -1  # zmq: wait indefinitely
    # rounded up: a wait truncated to 0 ms returns at once, and a caller that loops until its deadline spins
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


class CoordinatorEndpoint:
    """The coordinator's ROUTER socket: receives from every agent, sends commands to one of them."""

    def __init__(self, bind: str, secret: bytes) -> None:
        self._codec = Codec(secret)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Mandatory routing off: a command for an agent that went away is dropped by zmq, never queued
        # or blocking; send() still reports False if zmq refuses it outright.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A restarted agent reuses its identity; let the new connection take it over.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _ZMQ_FRAME_LIMIT)
        self._sock.setsockopt(zmq.RCVHWM, COORDINATOR_RECV_HWM_PER_PEER)
        self._guard = ServerGuard(self._ctx, self._sock, secret)
        # refused handshakes are reported on an in-process monitor socket; counted when `rejected` is read
        self._monitor = self._sock.get_monitor_socket(_HANDSHAKE_FAILED)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError:
            self._teardown()
            raise  # a bad bind address is a configuration error the caller must see
        self._address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False

    @property
    def address(self) -> str:
        """The bound endpoint with its actual port, e.g. "tcp://127.0.0.1:41235"."""
        return self._address

    @property
    def rejected(self) -> Counter[str]:
        """Rejected frames by reason, and connections refused at the handshake ("handshake")."""
        self._count_refused_handshakes()
        return self._codec.rejected

    def _count_refused_handshakes(self) -> None:
        if self._closed:
            return
        try:
            while self._monitor.poll(0, zmq.POLLIN):
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
                if len(frames) == 2:  # an event frame and the peer's address
                    self._codec.rejected[REJECT_HANDSHAKE] += 1
        except zmq.ZMQError:
            pass

    def recv(self, timeout_ms: int) -> tuple[bytes, Any] | None:
        """(agent identity, message) or None when nothing valid arrived within timeout_ms.

        Rejected frames are dropped and counted; waiting continues until the timeout expires.
        A negative timeout waits indefinitely.
        """
        deadline = _deadline(timeout_ms)
        while not self._closed:
            try:
                if not self._sock.poll(_remaining_ms(deadline), zmq.POLLIN):
                    return None
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # spurious wake-up: nothing to read after all
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            except zmq.ZMQError:  # socket or context went away under us
                return None
            msg = self._codec.decode_to_coordinator(parts[1:])
            if msg is not None:
                return parts[0], msg
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return None

    def backlog(self) -> bool:
        """Whether frames are waiting to be received now (the coordinator is behind its agents)."""
        if self._closed:
            return False
        try:
            return bool(self._sock.poll(0, zmq.POLLIN))
        except zmq.ZMQError:
            return False

    def send(self, identity: bytes, cmd: Command) -> bool:
        """Queue a command for one agent without blocking; False if zmq would not take it."""
        if self._closed:
            return False
        try:
            self._sock.send_multipart([identity, *self._codec.encode(cmd)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._count_refused_handshakes()
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._sock.close(0)
        self._guard.stop()
        self._ctx.term()


class AgentEndpoint:
    """An agent's DEALER socket: sends digests and reports, receives commands.

    A dead or slow coordinator must never stall the agent: messages queue up to AGENT_SEND_HWM while
    disconnected, beyond that send() drops them and returns False.
    """

    def __init__(self, connect: str, secret: bytes, identity: str) -> None:
        self._codec = Codec(secret)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity.encode("utf-8"))
        self._sock.setsockopt(zmq.SNDHWM, AGENT_SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE off: queue while the coordinator is not (yet) reachable, so a late-starting
        # coordinator still gets the Hello and the first digests.
        self._sock.setsockopt(zmq.IMMEDIATE, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _ZMQ_FRAME_LIMIT)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)  # back off against a coordinator that is gone
        secure_client(self._sock, secret)
        try:
            self._sock.connect(connect)
        except zmq.ZMQError:
            self._sock.close(0)
            self._ctx.term()
            raise  # a malformed address is a configuration error; an absent peer is not (connect is lazy)
        self._closed = False

    @property
    def rejected(self) -> Counter[str]:
        return self._codec.rejected

    def send(self, msg: msgspec.Struct) -> bool:
        """Send without blocking; False when the message was dropped (queue full, socket closed)."""
        if self._closed:
            return False
        try:
            self._sock.send_multipart(self._codec.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def recv_command(self, timeout_ms: int) -> Command | None:
        """The next valid command within timeout_ms, or None. Rejected frames are counted and skipped."""
        deadline = _deadline(timeout_ms)
        while not self._closed:
            try:
                if not self._sock.poll(_remaining_ms(deadline), zmq.POLLIN):
                    return None
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            except zmq.ZMQError:
                return None
            cmd = self._codec.decode_to_agent(parts)
            if cmd is not None:
                return cmd
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(0)
        self._ctx.term()
