"""A TCP proxy on 127.0.0.1 that the chaos test puts between an agent and the coordinator.

It forwards bytes, whatever the protocol above them, and can make the link misbehave the ways a real network
does: `delay` holds every chunk for a while (latency), `throttle` caps the bytes per second (a thin link),
`blackhole` holds all traffic for some seconds and then lets it through (a partition that heals: TCP would
retransmit, so nothing is lost, only late), and `drop` resets every open connection and refuses new ones for
some seconds (a partition that the endpoints notice; what was in flight is lost).

Each connection has one reader and one writer thread per direction: readers keep draining their socket into a
queue of (due time, bytes), so a held link buffers here, not in the sender's kernel.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ProxyStats:
    accepted: int = 0
    refused: int = 0  # connections closed at once while the proxy dropped traffic
    reset: int = 0  # open connections reset by drop()
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    events: list[tuple[float, str]] = field(default_factory=list)


class _Direction:
    """One way of one connection: a reader fills the queue, a writer empties it when the link allows."""

    def __init__(self, proxy: TcpProxy, src: socket.socket, dst: socket.socket, up: bool) -> None:
        self.proxy, self.src, self.dst, self.up = proxy, src, dst, up
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.closed = False

    def read(self) -> None:
        try:
            while True:
                data = self.src.recv(65536)
                if not data:
                    break
                with self.cond:
                    self.queue.append((time.monotonic() + self.proxy.delay_s, data))
                    self.cond.notify()
        except OSError:
            pass
        with self.cond:
            self.closed = True
            self.cond.notify()

    def write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait(0.05)
                    if not self.queue:
                        break  # the source closed and everything it sent went out
                    due, data = self.queue[0]
                wait = max(due - time.monotonic(), self.proxy.held_for())
                if wait > 0:
                    time.sleep(min(wait, 0.05))
                    continue
                data = data[: self.proxy.allowance(len(data))]
                if not data:
                    time.sleep(0.01)
                    continue
                self.dst.sendall(data)
                with self.cond:
                    head_due, head = self.queue.popleft()
                    if len(data) < len(head):  # throttled: the rest waits for the next allowance
                        self.queue.appendleft((head_due, head[len(data) :]))
                self.proxy.count(self.up, len(data))
        except OSError:
            pass
        _close(self.dst)
        _close(self.src)
        self.proxy.forget(self.src, self.dst)


def _close(sock: socket.socket, reset: bool = False) -> None:
    try:
        if reset:  # RST instead of FIN: the peer sees the connection broken, as on a failed link
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class TcpProxy:
    """Listens on 127.0.0.1:<port> and forwards each connection to `target` (host, port)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.delay_s = 0.0
        self._held_until = 0.0
        self._refuse_until = 0.0
        self._rate = 0.0  # bytes per second; 0: unlimited
        self._budget = 0.0
        self._budget_at = time.monotonic()
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self.stats = ProxyStats()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(16)
        self.port = self._server.getsockname()[1]
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ---- what the test does to the link ----------------------------------------------------
    def delay(self, seconds: float) -> None:
        """From now on every chunk is forwarded `seconds` after it arrived (0: no delay)."""
        self.delay_s = seconds
        self._note(f"delay {seconds} s")

    def throttle(self, bytes_per_s: float) -> None:
        """At most this many bytes per second in each direction of all connections together (0: unlimited)."""
        with self._lock:
            self._rate, self._budget, self._budget_at = bytes_per_s, 0.0, time.monotonic()
        self._note(f"throttle {bytes_per_s} B/s")

    def blackhole(self, seconds: float) -> None:
        """Nothing gets through for `seconds`; then what was held goes on, in order."""
        self._held_until = time.monotonic() + seconds
        self._note(f"blackhole {seconds} s")

    def drop(self, seconds: float) -> None:
        """Reset every open connection, and close new ones at once for `seconds`."""
        self._refuse_until = time.monotonic() + seconds
        with self._lock:
            conns, self._conns = self._conns, []
        for client, upstream in conns:
            _close(client, reset=True)
            _close(upstream, reset=True)
            self.stats.reset += 1
        self._note(f"drop {seconds} s ({len(conns)} connections reset)")

    def close(self) -> None:
        self._stopped = True
        _close(self._server)
        with self._lock:
            conns, self._conns = self._conns, []
        for client, upstream in conns:
            _close(client)
            _close(upstream)

    # ---- used by the forwarding threads ------------------------------------------------------
    def held_for(self) -> float:
        return self._held_until - time.monotonic()

    def allowance(self, wanted: int) -> int:
        with self._lock:
            if not self._rate:
                return wanted
            now = time.monotonic()
            self._budget = min(self._rate, self._budget + (now - self._budget_at) * self._rate)
            self._budget_at = now
            granted = min(wanted, int(self._budget))
            self._budget -= granted
            return granted

    def count(self, up: bool, n: int) -> None:
        with self._lock:
            if up:
                self.stats.bytes_up += n
            else:
                self.stats.bytes_down += n

    def forget(self, a: socket.socket, b: socket.socket) -> None:
        """A connection that ended by itself: nothing left to reset."""
        with self._lock:
            self._conns = [c for c in self._conns if a not in c and b not in c]

    def _note(self, what: str) -> None:
        self.stats.events.append((time.time(), what))

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if time.monotonic() < self._refuse_until:
                _close(client, reset=True)
                self.stats.refused += 1
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:  # the target is down (a coordinator being restarted): the client retries
                _close(client, reset=True)
                self.stats.refused += 1
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.append((client, upstream))
            self.stats.accepted += 1
            for d in (_Direction(self, client, upstream, True), _Direction(self, upstream, client, False)):
                threading.Thread(target=d.read, daemon=True, name="proxy-read").start()
                threading.Thread(target=d.write, daemon=True, name="proxy-write").start()
