"""Node agent process: `python -m trainscout.agent` (started by `trainscout run`, one per node).

It lives outside the training processes, so it keeps working when ranks hang, hold the GIL or die.
Every tick it reads each local rank's channel; every interval it sends one NodeDigest. It answers the
coordinator's commands: stack dumps (from outside the stuck process), record pulls, abort.
If the coordinator is gone, sends are dropped and training is untouched.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from trainscout import config, log
from trainscout.agent import stacks
from trainscout.agent.rank_view import RankView
from trainscout.process_priority import lower_priority
from trainscout.channel.layout import link_probe_request_path, list_channels, replay_request_path, trust_path
from trainscout.wire.endpoints import AgentEndpoint
from trainscout.wire.membership import pack_members
from trainscout.wire.messages import Command, GroupInfo, Goodbye, Hello, NodeDigest, RecordsReport, StackReport

_log = log.get("agent")

if TYPE_CHECKING:  # types only: NVML is loaded at the first digest with ranks
    from trainscout.agent.device_health import DeviceSampler
    from trainscout.wire.device import DeviceReading


# an agent that ends with its ranks waits this long after the last exit: long enough for the coordinator's
# stack and record requests about the end, and for a rank whose channel appears late
RANKS_DONE_GRACE_S = 3.0


class Agent:
    def __init__(
        self,
        run_id: str,
        coordinator: str,
        secret: bytes,
        node_id: str,
        interval_s: float = 1.0,
        tick_s: float = 1.0,
        stack_method: str = "py-spy",
        until_ranks_exit: bool = False,
    ) -> None:
        self.run_id = run_id
        self.until_ranks_exit = until_ranks_exit
        self.node_id = node_id
        self.host = socket.gethostname()
        self.interval_s = interval_s
        self.tick_s = tick_s
        self.stack_method = stack_method
        self.endpoint = AgentEndpoint(coordinator, secret, node_id)
        self.views: dict[int, RankView] = {}
        self.retired: list = []  # last states of ranks of an ended attempt, sent once in the next digest
        self.number = 0
        self.stop = threading.Event()
        self._send_lock = threading.Lock()
        self.devices: DeviceSampler | None = None  # DeviceSampler (NVML), made at the first digest with ranks
        self._all_exited_since: float | None = None
        self._groups_sent: dict[str, list[int]] = {}  # group -> the members the coordinator has (sent once)

    def send(self, msg) -> bool:
        with self._send_lock:  # zmq sockets are not thread-safe; stack threads send too
            return self.endpoint.send(msg)

    def discover(self) -> None:
        for rank, path in list_channels(self.run_id).items():
            view = self.views.get(rank)
            if view is not None and view.reader.path == path and view.pid and not _restarted(view):
                continue
            try:
                fresh = RankView(self.run_id, rank, path)
            except (OSError, ValueError):
                continue  # the probe is still creating it; next discovery will catch it
            if view is not None:
                self._retire(view)
            self.views[rank] = fresh

    def _retire(self, view: RankView) -> None:
        """A rank restarted (elastic restart): read the old process's channel to the end, so that how it ended
        reaches the coordinator, then let it go."""
        try:
            view.refresh()
            last = view.state()
            if last is not None:
                self.retired.append(last)
        except (OSError, ValueError):
            pass
        view.close()

    def digest(self) -> NodeDigest:
        self.number += 1
        # an ended attempt's ranks first: the coordinator closes that attempt before it sees the new one
        retired, self.retired = self.retired, []
        ranks = retired + [s for s in (v.state() for v in self.views.values()) if s is not None]
        devices: list[DeviceReading] = []
        if self.devices is None and ranks:  # started once ranks exist: NVML costs a job without GPUs nothing
            from trainscout.agent.device_health import DeviceSampler

            self.devices = DeviceSampler()
        if self.devices is not None and self.devices.enabled:
            try:
                devices = self.devices.sample()
            except Exception as exc:
                devices = []  # the sampler fails open; one bad read must not cost the digest
                _log.warning("GPU readings failed this digest: %r", exc)
        return NodeDigest(
            node_id=self.node_id,
            host=self.host,
            number=self.number,
            ranks=ranks,
            devices=devices,
            groups=self._new_groups(),
        )

    def _new_groups(self) -> list[GroupInfo]:
        """Memberships not sent yet (new groups, or changed ones): a group's members travel once, not in every
        digest (the world group alone is O(world) per rank)."""
        out = []
        for view in self.views.values():
            for track in view.pgs.values():
                members, sent = track.members, self._groups_sent.get(track.name)
                if not members or members is sent:
                    continue
                if sent != members:
                    out.append(GroupInfo(track.name, pack_members(members)))
                self._groups_sent[track.name] = members
        return out

    def send_digest(self) -> None:
        digest = self.digest()
        if not self.send(digest):
            for g in digest.groups:  # dropped: send those memberships again with the next digest
                self._groups_sent.pop(g.name, None)

    def handle(self, cmd: Command) -> None:
        if cmd.kind == "dump_stacks":
            for rank in cmd.ranks:
                view = self.views.get(rank)
                if view is not None and view.pid:
                    threading.Thread(target=self._dump_stack, args=(cmd.request_id, view), daemon=True).start()
        elif cmd.kind == "profile":
            seconds = float(cmd.payload or 2.0)
            for rank in cmd.ranks:
                view = self.views.get(rank)
                if view is not None and view.pid:
                    threading.Thread(target=self._profile, args=(cmd.request_id, view, seconds), daemon=True).start()
        elif cmd.kind == "fetch_records":
            for rank in cmd.ranks:
                view = self.views.get(rank)
                if view is not None:
                    self.send(
                        RecordsReport(
                            node_id=self.node_id,
                            request_id=cmd.request_id,
                            rank=rank,
                            pg=cmd.pg,
                            records=view.records(cmd.pg, cmd.seq_from, cmd.seq_to),
                        )
                    )
        elif cmd.kind == "trust":
            _write_atomic(trust_path(self.run_id), cmd.payload)
        elif cmd.kind == "replay":
            _write_atomic(replay_request_path(self.run_id), cmd.payload)
        elif cmd.kind == "linkprobe":
            _write_atomic(link_probe_request_path(self.run_id), cmd.payload)
        elif cmd.kind == "send_groups":  # the coordinator lacks a membership (a lost frame, or it restarted)
            self._groups_sent.clear()
        elif cmd.kind == "abort":
            threading.Thread(target=self._abort, daemon=True).start()

    def _dump_stack(self, request_id: int, view: RankView) -> None:
        method, text = stacks.capture(view.pid, self.run_id, view.rank, prefer=self.stack_method)
        self.send(
            StackReport(
                node_id=self.node_id, request_id=request_id, rank=view.rank, pid=view.pid, method=method, text=text
            )
        )

    def _profile(self, request_id: int, view: RankView, seconds: float) -> None:
        method, text = stacks.profile(view.pid, seconds)
        self.send(
            StackReport(
                node_id=self.node_id,
                request_id=request_id,
                rank=view.rank,
                pid=view.pid,
                method=method,
                text=_main_thread_only(text, view.pid),
            )
        )

    def _abort(self) -> None:
        pids = [v.pid for v in self.views.values() if v.pid and v.exit is None]
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + wait
            while wait and time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.1)

    def run(self) -> None:
        self.send(Hello(node_id=self.node_id, host=self.host, agent_pid=os.getpid()))
        next_discover = 0.0
        next_digest = 0.0
        parent = os.getppid()
        while not self.stop.is_set():
            now = time.monotonic()
            if os.getppid() != parent:
                break  # the supervisor is gone (killed hard): do not linger as an orphan
            if now >= next_discover:
                self.discover()
                next_discover = now + 1.0
            for view in list(self.views.values()):
                try:
                    view.refresh()
                except (OSError, ValueError):
                    pass
            if now >= next_digest:
                self.send_digest()
                next_digest = now + self.interval_s
            cmd = self.endpoint.recv_command(int(self.tick_s * 1000))
            if cmd is not None:
                self.handle(cmd)
            if self.until_ranks_exit and self._ranks_done(now):
                break
        self.finish()

    def _ranks_done(self, now: float) -> bool:
        """Every rank seen has exited, for a few seconds (a late channel of a slow starter still counts)."""
        if not self.views or any(v.exit is None for v in self.views.values()):
            self._all_exited_since = None
            return False
        if self._all_exited_since is None:
            self._all_exited_since = now
        return now - self._all_exited_since >= RANKS_DONE_GRACE_S

    def finish(self) -> None:
        # Last look: exits that happened in the final moments must not be lost.
        deadline = time.monotonic() + 1.0
        self.discover()
        while time.monotonic() < deadline:
            for view in self.views.values():
                try:
                    view.refresh()
                except (OSError, ValueError):
                    pass
            if all(v.exit is not None for v in self.views.values()):
                break
            time.sleep(0.1)
        self.send_digest()
        self.send(Goodbye(node_id=self.node_id, reason="agent stopping"))
        time.sleep(0.2)  # let the last frames leave before the socket closes
        self.endpoint.close()


def _main_thread_only(collapsed: str, pid: int, limit: int = 400) -> str:
    """The rank's main (training) thread's lines of a collapsed profile, most sampled first, at most `limit`."""
    mine = f"thread ({pid})"
    lines = [line for line in collapsed.splitlines() if line.startswith(mine)]
    lines.sort(key=lambda line: -_samples(line))
    return "\n".join(lines[:limit])


def _samples(line: str) -> int:
    count = line.rpartition(" ")[2]
    return int(count) if count.isdigit() else 0


def _write_atomic(path: str, text: str) -> None:
    try:
        with open(path + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _restarted(view: RankView) -> bool:
    try:
        if view.reader.replaced():
            return True
        h = view.reader.header()
        return int(h["pid"]) != view.pid
    except Exception:
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _log_level() -> str:
    settings, _problems = config.from_environ()
    return settings.run.log_level


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainscout.agent", description=__doc__)
    p.add_argument("--run-id", required=True)
    p.add_argument("--coordinator", required=True, help="tcp://HOST:PORT of the coordinator")
    p.add_argument("--node-id", default=socket.gethostname())
    # once a second: the hang timeout (5 s) dominates detection latency, and each digest costs the node CPU
    p.add_argument("--interval", type=float, default=1.0, help="seconds between digests (default 1)")
    p.add_argument("--stack-method", choices=["py-spy", "faulthandler"], default="py-spy")
    p.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by this much")
    p.add_argument("--until-ranks-exit", action="store_true", help="end once every rank seen on this node has exited")
    args = p.parse_args(argv)
    lower_priority(args.nice)
    log.setup(f"agent@{args.node_id}", os.environ.get("TRAINSCOUT_RUN_DIR"), level=_log_level())
    secret = bytes.fromhex(os.environ["TRAINSCOUT_SECRET"])
    agent = Agent(
        args.run_id,
        args.coordinator,
        secret,
        args.node_id,
        interval_s=args.interval,
        stack_method=args.stack_method,
        until_ranks_exit=args.until_ranks_exit,
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
