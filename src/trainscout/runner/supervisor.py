"""The process behind `trainscout run`: starts coordinator, agent and launcher, and ends them cleanly.

The training launcher gets the probe through PYTHONPATH (a sitecustomize bootstrap); the agent and
the coordinator run in their own sessions so a Ctrl-C reaches only this supervisor, which then stops
the launcher first, lets the agent and coordinator record the end, and removes shared memory. If the
agent or coordinator dies, training goes on; the supervisor starts it again (bounded, with backoff: see
`restarts`), the coordinator on the same address, and summary.md lists every gap. Past the limit the run
ends with a message that monitoring was lost.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from trainscout import config, log
from trainscout.channel.layout import list_channels, remove_run_files
from trainscout.channel.reader import ChannelReader
from trainscout.findings import from_json
from trainscout.runner import launchers
from trainscout.runner.handoff import ABORT_MARK, attempt_lines_of
from trainscout.runner.launcher_log import launcher_interrupted, signalled_pids, worker_exits
from trainscout.runner.launchers import BOOTSTRAP_DIR, PKG_PARENT  # noqa: F401  (re-exported)
from trainscout.runner.live_exits import LiveExitReporter
from trainscout.runner.restarts import RestartPolicy
from trainscout.sinks import ConsoleSink, EventLog, probe_costs, report_html
from trainscout.sinks.held_lines import FullFolderNotice, HeldLines
from trainscout.sinks.jsonl import read_objects
from trainscout.sinks.summary import write_summary_or_say
from trainscout.wire.endpoints import AgentEndpoint
from trainscout.wire.messages import LauncherReport


@dataclass
class RunOptions:
    command: list[str]
    run_root: str = "runs"
    run_id: str | None = None
    inject: str = ""
    hang_timeout_s: float = config.RUN.hang_timeout
    stall_timeout_s: float = config.RUN.stall_timeout
    abort_on: list[str] = field(default_factory=list)
    coordinator_addr: str | None = None  # HOST:PORT; node 0 binds it, other nodes connect
    serve_coordinator: bool = True
    node_id: str | None = None
    stack_method: str = "py-spy"
    monitor_nice: int = 0  # added to the agent's and coordinator's niceness (--monitor-nice)
    console: str = "auto"
    fr_buffer: int = 256
    quiet_launcher: bool = False
    settings: dict[str, str] = field(default_factory=dict)  # the checked settings, as their environment variables
    agent_until_ranks_exit: bool = False  # the agent ends with this node's ranks (`trainscout agent`)
    tool_restarts: int = config.RUN.tool_restarts  # restarts of a dead agent or coordinator, each


def live_ranks(run_id: str) -> dict[int, int]:
    """rank -> pid of this host's running training processes of run `run_id`: the writers of its channels
    that still carry TRAINSCOUT_RUN_ID=run_id (a pid reused by an unrelated process does not)."""
    found: dict[int, int] = {}
    for rank, path in list_channels(run_id).items():
        try:
            reader = ChannelReader(path)
            try:
                pid = int(reader.header()["pid"])
            finally:
                reader.close()
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if f"TRAINSCOUT_RUN_ID={run_id}".encode() in fh.read().split(b"\0"):
                    found[rank] = pid
        except (OSError, ValueError):
            continue
    return found


def processes_with_run_id(run_id: str) -> list[int]:
    """Pids of this host's live processes started with TRAINSCOUT_RUN_ID=run_id (the launcher's descendants)."""
    needle = f"TRAINSCOUT_RUN_ID={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    continue  # dead already, waiting for its parent
        except (OSError, IndexError):
            continue
        found.append(int(entry))
    return found


def run_dir_of(opts: RunOptions, run_id: str) -> str:
    """This node's folder of a run: the run id on the node that serves the coordinator, else suffixed."""
    suffix = "" if opts.serve_coordinator else f"-{opts.node_id or 'node'}"
    return os.path.abspath(os.path.join(opts.run_root, run_id + suffix))


class Supervisor:
    def __init__(self, opts: RunOptions, console: ConsoleSink | None = None) -> None:
        self.opts = opts
        self.launch = launchers.identify(opts.command)
        self.console = console or ConsoleSink(sys.stderr, rich=False)
        self.run_id = opts.run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
        self.run_dir = run_dir_of(opts, self.run_id)
        os.makedirs(self.run_dir, exist_ok=True)
        log.setup("supervisor", self.run_dir, level=self.opts.settings.get("TRAINSCOUT_LOG_LEVEL", "INFO"))
        self.folder = FullFolderNotice(self.console.warn, self.console.info)
        self.events = EventLog(os.path.join(self.run_dir, "events.supervisor.jsonl"), self.folder)
        secret_hex = os.environ.get("TRAINSCOUT_SECRET")
        if not secret_hex:
            if not opts.serve_coordinator or opts.coordinator_addr:
                raise SystemExit(
                    "trainscout: multi-node runs need the same secret on every node: "
                    "export TRAINSCOUT_SECRET=$(python -c 'import secrets;print(secrets.token_hex(32))')"
                )
            secret_hex = secrets.token_hex(32)
        try:
            self.secret = bytes.fromhex(secret_hex)
        except ValueError:
            raise SystemExit("trainscout: TRAINSCOUT_SECRET must be hex (e.g. 64 hex digits)") from None
        if len(self.secret) < 16:
            raise SystemExit("trainscout: TRAINSCOUT_SECRET must be at least 16 bytes (32 hex digits)")
        self.secret_hex = secret_hex
        self.coordinator: subprocess.Popen | None = None
        self.agent: subprocess.Popen | None = None
        self.launcher: subprocess.Popen | None = None
        self.findings: list = []  # the run's findings, read back from findings.jsonl for the summary (node 0)
        self.notes: list[str] = []
        self._launcher_text: list[str] = []
        self._interrupted = 0
        self.interrupted_by = 0  # the first signal that asked this supervisor to stop the job
        self._muted = False  # the launcher's output no longer goes to the terminal (the job is stopped on purpose)
        self._forwarded_at = 0.0  # monotonic time the first interrupt reached the launcher
        self._interrupt_seen = False  # the launcher printed that it took it
        self._interrupt_repeated = False
        self._lost: set[str] = set()
        self.started = time.time()
        self.address = ""  # the coordinator's, as the agent connects to it
        self.restarts = RestartPolicy(limit=opts.tool_restarts)
        self._restart_due: dict[str, float] = {}  # component -> monotonic time to start it again
        self._tool_started: dict[str, float] = {}  # component -> monotonic time it was last started

    # ---- start ----------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.opts.settings)  # checked once here; the ranks, agent and coordinator read them back
        env["TRAINSCOUT_SECRET"] = self.secret_hex
        return env

    def _start_coordinator(self, bind: str = "") -> str:
        """Start the coordinator and return its address ("" if a restart on `bind` did not come up)."""
        restart = bool(bind)
        bind = bind or (
            "tcp://0.0.0.0:0" if self.launch.kind == launchers.SRUN else "tcp://127.0.0.1:0"
        )  # srun: agents on all nodes
        if self.opts.coordinator_addr:
            host, _, port = self.opts.coordinator_addr.rpartition(":")
            bind = f"tcp://{host or '0.0.0.0'}:{port}"
        cmd = [
            sys.executable,
            "-m",
            "trainscout.coordinator",
            "--bind",
            bind,
            "--run-dir",
            self.run_dir,
            "--hang-timeout",
            str(self.opts.hang_timeout_s),
            "--stall-timeout",
            str(self.opts.stall_timeout_s),
            "--abort-on",
            ",".join(self.opts.abort_on),
            "--console",
            self.opts.console,
            "--nice",
            str(self.opts.monitor_nice),
        ]
        addr_file = os.path.join(self.run_dir, "coordinator.addr")
        if os.path.exists(addr_file):
            os.unlink(addr_file)
        self.coordinator = subprocess.Popen(cmd, env=self._env(), start_new_session=True)
        self._tool_started["coordinator"] = time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (self._interrupted and not restart):
            if os.path.exists(addr_file):
                with open(addr_file) as fh:
                    return fh.read().strip()
            if self.coordinator.poll() is not None:
                if restart:
                    return ""
                raise SystemExit(f"trainscout: the coordinator failed to start (exit {self.coordinator.returncode})")
            time.sleep(0.05)
        if self._interrupted and not restart:
            return ""  # Ctrl-C during start-up: run() stops what was started
        if restart:
            self._stop(self.coordinator, 5)
            return ""
        raise SystemExit("trainscout: the coordinator did not start within 30 s")

    def _start_agent(self, address: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "trainscout.agent",
            "--run-id",
            self.run_id,
            "--coordinator",
            address,
            "--node-id",
            self._node_id(),
            "--stack-method",
            self.opts.stack_method,
            "--nice",
            str(self.opts.monitor_nice),
        ]
        if self.opts.agent_until_ranks_exit:
            cmd.append("--until-ranks-exit")
        if self.launch.kind == launchers.SRUN:  # one agent on every node of the job, as a job step
            reach = launchers.reachable_address(address, os.environ, os.uname().nodename)
            agent = launchers.agent_cli_command(
                sys.executable, self.run_id, reach, self.opts.stack_method, self.opts.monitor_nice
            )
            try:
                cmd = launchers.slurm_agent_step(agent, os.environ)
            except ValueError as exc:
                raise SystemExit(f"trainscout: {exc}") from None
        self.agent = subprocess.Popen(cmd, env=self._env(), start_new_session=True)
        self._tool_started["agent"] = time.monotonic()

    def _launcher_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("TRAINSCOUT_SECRET", None)  # training code has no business holding the job secret
        env.update(launchers.rank_variables(env, self.run_id, self.run_dir))
        if self.launch.ranks_from_slurm:
            env[launchers.RANKS_FROM_ENV] = "slurm"
        env.setdefault("TORCH_FR_BUFFER_SIZE", str(self.opts.fr_buffer))
        if self.opts.inject:
            env["TRAINSCOUT_INJECT"] = self.opts.inject
        else:
            env.pop("TRAINSCOUT_INJECT", None)
        return env

    def _pump(self, stream, out) -> None:
        exits = LiveExitReporter(self.secret, f"supervisor-{os.getpid()}-exits", self._node_id())
        # held while the disk is full: this thread must keep draining the launcher's pipe, or training blocks
        log = HeldLines(os.path.join(self.run_dir, "launcher.log"), self.folder.full, self.folder.space)
        for line in iter(stream.readline, ""):
            self._launcher_text.append(line)
            if len(self._launcher_text) > 20000:
                del self._launcher_text[:10000]
            log.append(line.encode(errors="replace"))
            if not self.opts.quiet_launcher and not self._stopping_on_purpose():
                out.write(line)
                out.flush()
            if self._forwarded_at and "signal" in line.lower():
                self._interrupt_seen = True  # torchrun: "Received 2 death signal", DeepSpeed: "... SIGINT"
            if "exitcode" in line or "signal" in line:  # a worker's exit status; a closing signal sent or received
                exits.update(self.address, "".join(self._launcher_text[-50:]), bool(self.interrupted_by))
        if exits.sent:
            time.sleep(0.3)  # let the last report leave before the socket closes
        exits.close()
        log.close()

    def _stopping_on_purpose(self) -> bool:
        """Once the coordinator stops the job (--abort-on), the ranks' and launcher's teardown tracebacks are
        expected noise: from then on the launcher's output goes to launcher.log only."""
        if not self._muted and os.path.exists(os.path.join(self.run_dir, ABORT_MARK)):
            self._muted = True
            self.console.info(
                "stopping the job: waiting for the launcher to end its ranks (its output: "
                f"{os.path.join(self.run_dir, 'launcher.log')})..."
            )
        return self._muted

    # ---- run ------------------------------------------------------------------------------
    def run(self) -> int:
        # The handlers come first: a Ctrl-C at any moment of start-up stops what was started so far.
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _stopped_in_start_up(self) -> int:
        self.events.write("interrupted_in_start_up")
        self.console.warn("interrupted while starting: stopping what was started")
        self._shutdown_tools(None)
        return 128 + signal.SIGINT

    def _run(self) -> int:
        if self.opts.serve_coordinator:
            self.address = self._start_coordinator()
        else:
            host, _, port = (self.opts.coordinator_addr or "").rpartition(":")
            self.address = f"tcp://{host}:{port}"
        if self._interrupted:
            return self._stopped_in_start_up()
        address = self.address
        self.events.write("start", run_id=self.run_id, command=self.opts.command, coordinator=address)
        self._start_agent(address)
        self.console.info(f"run {self.run_id}: monitoring {' '.join(self.opts.command)}")
        self.console.info(f"findings and report: {self.run_dir}")
        if self._interrupted:
            return self._stopped_in_start_up()
        try:
            self.launcher = subprocess.Popen(
                self.opts.command,
                env=self._launcher_env(),
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            self._shutdown_tools(None)
            raise SystemExit(f"trainscout: cannot start {self.opts.command[0]!r}: {exc}") from None
        if self._interrupted:  # the Ctrl-C came while it was being started: it gets it now
            self._interrupted -= 1
            self._on_signal(signal.SIGINT, None)
        pump = threading.Thread(target=self._pump, args=(self.launcher.stdout, sys.stdout), daemon=True)
        pump.start()
        code = self._wait_launcher()
        pump.join(timeout=5)
        self._report_launcher(self.address, code)
        self._shutdown_tools(code)
        return code

    def _on_signal(self, signum, frame) -> None:
        self._interrupted += 1
        self.interrupted_by = self.interrupted_by or signum
        if self.launcher is None or self.launcher.poll() is not None:
            return
        sig = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        if self._interrupted >= 3:
            sig = signal.SIGKILL
        self.events.write("signal", signal=signum, forwarded=int(sig))
        self._forwarded_at = self._forwarded_at or time.monotonic()
        try:
            os.killpg(self.launcher.pid, sig)
        except OSError:
            pass

    def _repeat_lost_interrupt(self, after_s: float = 5.0) -> None:
        """A launcher interrupted while still starting can lose the signal (Python start-up swallows a
        KeyboardInterrupt here and there) and go on to start the ranks: unless it said it took the signal,
        it gets it once more."""
        if not self._forwarded_at or self._interrupt_seen or self._interrupt_repeated:
            return
        if time.monotonic() - self._forwarded_at < after_s or self.launcher is None or self.launcher.poll() is not None:
            return
        self._interrupt_repeated = True
        self.events.write("signal_repeated", signal=int(signal.SIGINT))
        try:
            os.killpg(self.launcher.pid, signal.SIGINT)
        except OSError:
            pass

    def _wait_launcher(self) -> int:
        # Popen.wait(timeout) polls every few ms; a waiter thread blocks in waitpid instead, so the
        # supervisor wakes once a second to watch the tools and costs the training job nothing.
        launcher = self.launcher
        assert launcher is not None  # run() starts it before waiting
        done = threading.Event()

        def wait() -> None:
            launcher.wait()
            done.set()

        waiter = threading.Thread(target=wait, daemon=True, name="launcher-wait")
        waiter.start()
        while not done.wait(self._watch_period()):
            self._watch_tools(restart=not self._interrupted)
            self._repeat_lost_interrupt()
        code = launcher.wait()
        # the launcher is gone; anything it left behind in its process group goes too
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except OSError:
            pass
        return code

    def _watch_period(self) -> float:
        """Once a second; sooner when a restart falls due before that."""
        if not self._restart_due:
            return 1.0
        return max(0.05, min(1.0, min(self._restart_due.values()) - time.monotonic()))

    def _watch_tools(self, restart: bool = False) -> None:
        for name, proc in (("coordinator", self.coordinator), ("agent", self.agent)):
            if proc is None or proc.poll() is None or name in self._lost or name in self._restart_due:
                continue
            ran_s = time.monotonic() - self._tool_started.get(name, time.monotonic())
            delay = self.restarts.died(name, proc.returncode, ran_s, time.time()) if restart else None
            if delay is not None:
                self._restart_due[name] = time.monotonic() + delay
                n = self.restarts.restarts.get(name, 0) + 1
                self.console.warn(
                    f"the {name} exited (code {proc.returncode}) at {time.strftime('%H:%M:%S')}: "
                    f"restarting it in {delay:.1f} s (restart {n} of {self.restarts.limit})"
                )
                self.events.write("tool_died", component=name, code=proc.returncode, restart_in_s=delay)
            else:
                self._lost.add(name)
                note = (
                    f"monitoring was lost: the {name} exited (code {proc.returncode}) at "
                    f"{time.strftime('%H:%M:%S')}; training continued unmonitored"
                )
                self.notes.append(note)
                self.console.warn(note)
                self.events.write("monitoring_lost", component=name, code=proc.returncode)
        if restart:
            for name, due in list(self._restart_due.items()):
                if time.monotonic() >= due:
                    del self._restart_due[name]
                    self._restart(name)

    def _restart(self, name: str) -> None:
        """Start a dead tool again. The coordinator rebinds its address, so the agent's connection comes back
        by itself; if that address is taken meanwhile, it takes a new one and the agent is restarted on it."""
        if name == "coordinator":
            moved = False
            address = self._start_coordinator(bind=self.address)
            if not address:
                address = self._start_coordinator(bind="tcp://127.0.0.1:0")
                if address:
                    self.console.warn(f"the coordinator's address {self.address} was taken: it moved to {address}")
                    self.events.write("coordinator_moved", old=self.address, new=address)
                if address and self.agent is not None:
                    self._stop(self.agent, 5)  # connects to the old address: it must be told the new one
                    moved = True
            if not address:
                self.restarts.failed_restart(name)
                self._watch_tools(restart=True)  # counts as another death: the next try waits longer
                return
            self.address = address
            if moved:
                self._start_agent(self.address)  # the one stopped above, on the new address
                self._restart_due.pop("agent", None)
        else:
            self._start_agent(self.address)
        n = self.restarts.restarted(name, time.time())
        self.console.info(f"the {name} is running again (restart {n} of {self.restarts.limit})")
        self.events.write("tool_restarted", component=name, restart=n, pid=getattr(self, name).pid)

    def _node_id(self) -> str:
        """This node's name, the same in the agent's digests and the launcher's report (which tells the
        coordinator whose ranks a launcher that succeeded ran)."""
        return self.opts.node_id or os.uname().nodename

    def _report_launcher(self, address: str, code: int) -> None:
        text = "".join(self._launcher_text)
        exits = worker_exits(text)
        ep = AgentEndpoint(address, self.secret, f"supervisor-{os.getpid()}")
        report = LauncherReport(
            node_id=self._node_id(),
            exit_code=code,
            worker_exits=exits,
            signalled_pids=sorted(signalled_pids(text)),
            interrupted=bool(self.interrupted_by) or launcher_interrupted(text),
        )
        ep.send(report)
        time.sleep(0.3)
        ep.close()
        self.events.write("launcher_exit", code=code, workers=exits)

    def _stop(self, proc: subprocess.Popen | None, timeout: float) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _shutdown_tools(self, code: int | None) -> None:
        self._restart_due.clear()  # the end is no time to bring a tool back
        self._watch_tools()
        self.console.info("job ended: collecting the last reports of the agent and coordinator...")
        self._stop(self.agent, 5)
        self._stop(self.coordinator, 8)
        self._kill_leftover_ranks()
        removed = remove_run_files(self.run_id)
        self.events.write("cleanup", shm_files_removed=removed)
        if self.opts.serve_coordinator:
            self._write_summary(code)
        for note in self.notes:
            self.console.warn(note)

    def _kill_leftover_ranks(self) -> None:
        """Ranks that outlived their launcher (own session, ignored signals) must not run on unseen."""
        for rank, pid in live_ranks(self.run_id).items():
            try:
                os.kill(pid, signal.SIGKILL)
                self.events.write("killed_leftover_rank", rank=rank, pid=pid)
            except OSError:
                continue
        # and those that had no channel yet (the launcher started them in sessions of their own just before
        # it was stopped): the launcher's environment marks them as this run's
        for pid in processes_with_run_id(self.run_id):
            try:
                os.kill(pid, signal.SIGKILL)
                self.events.write("killed_leftover_process", pid=pid)
            except OSError:
                continue

    def _write_summary(self, code: int | None) -> None:
        path = os.path.join(self.run_dir, "findings.jsonl")
        findings = []
        if os.path.exists(path):
            with open(path, "rb") as fh:
                findings = [from_json(line) for line in fh if line.strip()]
        self.findings = findings
        notes = list(self.notes)
        cost = probe_costs.summary_line(self.run_dir)
        if cost:
            notes.append(cost)
        topology = _topology_line(self.run_dir)
        if topology:
            notes.insert(0, topology)
        notes.extend(self.restarts.gap_lines())
        notes.extend(monitoring_gap_lines(os.path.join(self.run_dir, "events.jsonl")))
        notes.extend(attempt_lines_of(os.path.join(self.run_dir, "events.jsonl")))
        notes.extend(observation_lines(os.path.join(self.run_dir, "events.jsonl")))
        write_summary_or_say(
            self.console,
            os.path.join(self.run_dir, "summary.md"),
            run_id=self.run_id,
            command=self.opts.command,
            exit_code=code,
            findings=findings,
            notes=notes,
            started=self.started,
            ended=time.time(),
        )
        report_html.write_report_at_exit(self.run_dir)
        n = len(findings)
        self.console.info(f"{n} finding{'s' if n != 1 else ''}; report: {os.path.join(self.run_dir, 'summary.md')}")


def observation_lines(events_path: str) -> list[str]:
    """What the detectors saw and chose not to name (rank 0's own work between steps), so a report with no
    finding still says what slowed the job."""
    lines = []
    for e in read_objects(events_path):
        if e.get("kind") == "main_rank_side_work" and isinstance(e.get("summary"), str):
            lines.append(f"observation, not a fault: {e['summary']}")
    return lines


def monitoring_gap_lines(events_path: str) -> list[str]:
    """What the run's monitoring missed, from the coordinator's events: agents silent and for how long,
    stretches in which the coordinator itself did not run, frames it refused. A report that says "no
    findings" must also say when nobody was looking."""
    lines: list[str] = []
    lost_at: dict[str, float] = {}

    def clock(t: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(t))

    for e in read_objects(events_path):  # a torn or foreign line is skipped, not the whole log
        try:
            kind, t = e.get("kind"), float(e.get("t", 0.0))
            clock(t)  # a time that cannot be printed (NaN, beyond the calendar): the event is unusable
            if kind == "agent_lost":
                lost_at[str(e.get("node"))] = t
            elif kind == "agent_back":
                node = str(e.get("node"))
                since = lost_at.pop(node, t - float(e.get("silent_s", 0.0)))
                lines.append(
                    f"monitoring gap: the agent of {node} was silent from {clock(since)} to {clock(t)} "
                    f"({e.get('silent_s')} s without news); its ranks were not judged meanwhile"
                )
            elif kind == "coordinator_stalled":
                lines.append(
                    f"monitoring gap: the coordinator did not run for {e.get('seconds')} s up to {clock(t)} "
                    "(stopped or starved of CPU); nothing was judged meanwhile"
                )
            elif kind == "coordinator_exit" and e.get("rejected"):
                rejected = ", ".join(f"{n} {why}" for why, n in sorted(e["rejected"].items()))
                lines.append(
                    f"input refused by the coordinator (connections without this job's key, bad frames): {rejected}"
                )
        except (TypeError, ValueError, AttributeError, OverflowError, OSError):  # an event of another shape
            continue
    for node, since in lost_at.items():
        lines.append(f"monitoring gap: the agent of {node} went silent at {clock(since)} and never reported again")
    return lines


def _topology_line(run_dir: str) -> str:
    """The coordinator's last view of the groups and replicas (topology.json), as one line."""
    try:
        with open(os.path.join(run_dir, "topology.json")) as fh:
            return str(json.load(fh)["line"])
    except (OSError, ValueError, KeyError, TypeError):  # TypeError: JSON of another shape
        return ""
