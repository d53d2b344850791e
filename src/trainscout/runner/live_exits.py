"""The launcher's report of its workers' exits, passed on to the coordinator while the launcher still runs.

A rank killed by a signal (SIGSEGV, SIGKILL) leaves no exit record of its own: only its parent, the
launcher, learns the signal, and prints it. Sent as soon as it is printed (not when the launcher ends),
the crash finding can name the signal instead of "unknown status".
"""

from __future__ import annotations

from trainscout.runner.launcher_log import worker_exits
from trainscout.wire.endpoints import AgentEndpoint
from trainscout.wire.messages import LauncherReport


class LiveExitReporter:
    """Owned by the one thread that reads the launcher's output (a zmq socket belongs to one thread)."""

    def __init__(self, secret: bytes, identity: str, node_id: str) -> None:
        self.secret = secret
        self.identity = identity
        self.node_id = node_id
        self.sent: set[tuple[int, int, int]] = set()
        self._endpoint: AgentEndpoint | None = None
        self._address = ""

    def update(self, address: str, recent_text: str) -> bool:
        """Send the exits in `recent_text` (the launcher's latest lines) not sent yet; True if any were."""
        new = [e for e in worker_exits(recent_text) if e not in self.sent]
        if not new or not address:
            return False
        if self._endpoint is None or address != self._address:
            self.close()
            self._endpoint = AgentEndpoint(address, self.secret, self.identity)
            self._address = address
        if self._endpoint.send(LauncherReport(node_id=self.node_id, exit_code=0, worker_exits=new, final=False)):
            self.sent.update(new)
            return True
        return False

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
