"""`trainscout coordinator` and `trainscout agent`: the two monitoring roles alone, for launchers trainscout
does not wrap (Kubernetes operators, site scripts, anything that starts the ranks itself).

They are the pieces `trainscout run` starts, run in the foreground: a pod spec runs the coordinator in one
container and an agent beside the ranks of every node (a sidecar); the ranks only need the bootstrap on
PYTHONPATH and the run id (`trainscout rank-env`). The agent ends with its node's ranks and the coordinator
with its agents, then writes the run's summary, so a job's pods finish on their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

from trainscout.channel.layout import remove_run_files
from trainscout.runner.supervisor import Supervisor, live_ranks


class AgentPresence:
    """Which agents are connected, read from the coordinator's events.jsonl as it grows (agent_hello,
    agent_goodbye): the job is over for its coordinator once every agent that came has left."""

    def __init__(self, events_path: str) -> None:
        self.path = events_path
        self.offset = 0
        self.present: dict[str, bool] = {}

    def all_gone(self) -> bool:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return False
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("kind") in ("agent_hello", "agent_goodbye"):
                self.present[str(event.get("node"))] = event["kind"] == "agent_hello"
        return bool(self.present) and not any(self.present.values())


class _Service(Supervisor):
    """One monitoring process in the foreground: a stop signal reaches it as SIGTERM (it ignores SIGINT)."""

    def _serve(self, proc: subprocess.Popen, done=lambda: False) -> int:
        """Wait for `proc`; stop it (SIGTERM) on a signal or once done() holds."""

        def forward(signum, frame) -> None:
            self.events.write("signal", signal=signum, forwarded=int(signal.SIGTERM))
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                try:
                    return proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    if done():
                        proc.send_signal(signal.SIGTERM)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


class CoordinatorService(_Service):
    """The job's coordinator, bound to opts.coordinator_addr; ends once every agent that said hello has
    said goodbye (or on SIGTERM), then writes summary.md."""

    def run(self) -> int:
        address = self._start_coordinator()
        assert self.coordinator is not None
        self.events.write("start", run_id=self.run_id, command=[], coordinator=address)
        self.console.info(f"run {self.run_id}: coordinator listening at {address}")
        self.console.info(f"findings and report: {self.run_dir}")
        presence = AgentPresence(os.path.join(self.run_dir, "events.jsonl"))
        code = self._serve(self.coordinator, presence.all_gone)
        self.events.write("coordinator_service_exit", code=code)
        self._write_summary(None)
        return code


class AgentService(_Service):
    """This node's agent of run `run_id`, reporting to opts.coordinator_addr; with agent_until_ranks_exit
    it ends a few seconds after the node's last rank exited. It then removes the node's shared memory."""

    def run(self) -> int:
        host, _, port = (self.opts.coordinator_addr or "").rpartition(":")
        self._start_agent(f"tcp://{host}:{port}")
        assert self.agent is not None
        self.console.info(f"run {self.run_id}: agent {self.opts.node_id} reporting to {host}:{port}")
        code = self._serve(self.agent)
        if not live_ranks(self.run_id):  # ranks that outlive their agent keep their channels (a new agent reads them)
            self.events.write("cleanup", shm_files_removed=remove_run_files(self.run_id))
        return code
