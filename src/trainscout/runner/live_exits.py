"""The launcher's report of its workers' exits, passed on to the coordinator while the launcher still runs.

A rank killed by a signal (SIGSEGV, SIGKILL) leaves no exit record of its own: only its parent, the
launcher, learns the signal, and prints it. Sent as soon as it is printed (not when the launcher ends),
the crash finding can name the signal instead of "unknown status". The workers the launcher sent a closing
signal, and whether the job was told to stop, go with it: they tell a teardown SIGTERM from one sent to a
single rank from outside the job.
"""

from __future__ import annotations

from trainscout.runner.launcher_log import launcher_interrupted, signalled_pids, worker_exits
from trainscout.wire.endpoints import AgentEndpoint
from trainscout.wire.messages import LauncherReport


class LiveExitReporter:
    """Owned by the one thread that reads the launcher's output (a zmq socket belongs to one thread)."""

    def __init__(self, secret: bytes, identity: str, node_id: str) -> None:
        self.secret = secret
        self.identity = identity
        self.node_id = node_id
        self.sent: set[tuple[int, int, int]] = set()
        self.sent_pids: set[int] = set()
        self.sent_interrupted = False
        self._endpoint: AgentEndpoint | None = None
        self._address = ""

    def update(self, address: str, recent_text: str, interrupted: bool = False) -> bool:
        """Send what `recent_text` (the launcher's latest lines) and `interrupted` (the supervisor was told to
        stop the job) add to what was sent; True if anything was."""
        new = [e for e in worker_exits(recent_text) if e not in self.sent]
        pids = signalled_pids(recent_text) - self.sent_pids
        stop = (interrupted or launcher_interrupted(recent_text)) and not self.sent_interrupted
        if not (new or pids or stop) or not address:
            return False
        if self._endpoint is None or address != self._address:
            self.close()
            self._endpoint = AgentEndpoint(address, self.secret, self.identity)
            self._address = address
        report = LauncherReport(
            node_id=self.node_id,
            exit_code=0,
            worker_exits=new,
            final=False,
            signalled_pids=sorted(pids),
            interrupted=stop or self.sent_interrupted,
        )
        if self._endpoint.send(report):
            self.sent.update(new)
            self.sent_pids.update(pids)
            self.sent_interrupted = self.sent_interrupted or stop
            return True
        return False

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
