"""Chaos: trainscout's own processes and links fail while a job with injected faults trains.

One two-node job on this machine (two `trainscout run` invocations, 2 gloo ranks each, as in test_multinode),
node 1's agent and supervisor reaching the coordinator through a TCP proxy (`tcp_proxy.py`). While it trains:
the proxy delays, holds (blackhole), resets (drop) and throttles the link; node 1's agent and the coordinator
are SIGKILLed (their supervisors restart them) and SIGSTOPped for a few seconds; node 0's run folder, a small
tmpfs, is filled to the last byte while a NaN is injected into rank 1's gradient; then the space comes back and
rank 3 (node 1, behind the proxy) hangs.

The job runs once (module fixture); each test asserts one promise on it: both faults named with their exact rank
and kind and no other finding, the training never held up (every rank's step, read from its own channel, kept
advancing), every blind stretch in summary.md, and a full disk costs no trainscout process and no finding.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from conftest import Job, free_port, read_jsonl, torchrun_cmd, trainscout_cmd, unique_run_id
from tcp_proxy import TcpProxy

pytestmark = pytest.mark.slow

NAN_RANK, NAN_STEP = 1, 330  # node 0; fires while the run folder is full (when it can be mounted)
HANG_RANK, HANG_STEP = 3, 360  # node 1, behind the proxy; fires after the space came back
# every rank sleeps this long a step, so at most ~16 steps a second: the chaos (~15 s with the restarts) ended by
# step 217 on a quiet machine, and the faults come over 100 steps later
SLOW_MS = 60
TMPFS_SIZE = "4m"
CHAOS_MARGIN_STEPS = 15  # the chaos must be over this many steps before the first fault


@dataclass
class ChaosRun:
    node0: object  # JobResult
    node1: object
    proxy: TcpProxy
    chaos: list[tuple[float, str]]  # (wall time, what the test did)
    steps: dict[int, list[tuple[float, int]]]  # rank -> (monotonic time, step) samples from its channel
    fired: list[dict]  # the fault log
    disk: str  # "" if the run folder was a full-able tmpfs, else why not
    disk_full: tuple[float, float] = (0.0, 0.0)  # wall time filled, freed
    tools: dict[str, list[int]] = field(default_factory=dict)  # component -> exit codes seen by the supervisors


def _tool(job: Job, module: str) -> psutil.Process | None:
    """The supervisor's live child running `python -m <module>`."""
    for child in psutil.Process(job.pid).children():
        try:
            if module in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except psutil.Error:
            continue
    return None


def _restarts(job: Job, component: str) -> int:
    return sum(
        1
        for e in read_jsonl(job.run_path / "events.supervisor.jsonl")
        if e["kind"] == "tool_restarted" and e["component"] == component
    )


class _StepWatch(threading.Thread):
    """Reads every rank's step from its own shared-memory channel ten times a second: the training's progress as
    the ranks themselves record it, whatever trainscout's processes are doing."""

    def __init__(self, run_ids: list[str]) -> None:
        super().__init__(daemon=True, name="step-watch")
        self.run_ids = run_ids
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        from trainscout.channel.layout import list_channels
        from trainscout.channel.reader import ChannelReader

        readers: dict[int, ChannelReader] = {}
        while not self.halt.wait(0.1):
            for run_id in self.run_ids:
                for rank, path in list_channels(run_id).items():
                    if rank not in readers:
                        try:
                            readers[rank] = ChannelReader(path)
                        except (OSError, ValueError):
                            continue
            now = time.monotonic()
            for rank, reader in readers.items():
                try:
                    step = int(reader.header()["step"])
                except (OSError, ValueError):
                    continue
                self.samples.setdefault(rank, []).append((now, step))
        for reader in readers.values():
            reader.close()

    def step(self, rank: int) -> int:
        got = self.samples.get(rank)
        return got[-1][1] if got else 0


def _mount_tmpfs(path: Path) -> str:
    """Mount a small tmpfs at path; "" on success, else the reason it could not be."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount -t tmpfs failed: {exc}"
    if done.returncode != 0:
        return f"mount -t tmpfs failed (needs root): {done.stderr.strip() or done.returncode}"
    return ""


def _fill(path: Path) -> Path:
    """Write a file at path until the filesystem refuses another byte."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as fh:
        block = b"\0" * 65536
        while True:
            try:
                fh.write(block)
            except OSError:
                if len(block) == 1:
                    break
                block = block[: len(block) // 2]
    return filler


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chaos")
    disk = _mount_tmpfs(tmp / "node0")
    try:
        yield _run_chaos(tmp, disk)
    finally:
        if not disk:
            subprocess.run(["umount", "-l", str(tmp / "node0")], check=False, timeout=20)


def _run_chaos(tmp: Path, disk: str) -> ChaosRun:
    """The job and everything done to it (see the module's docstring); disk: "" if node 0's run root is a tmpfs."""
    root0, root1 = tmp / "node0", tmp / "node1"
    fault_log = tmp / "faults.jsonl"
    coordinator_port = free_port()
    proxy = TcpProxy(("127.0.0.1", coordinator_port))
    env = {
        "TRAINSCOUT_SECRET": secrets.token_hex(32),
        "TRAINSCOUT_FAULT_LOG": str(fault_log),
        "TRAINSCOUT_NONFINITE_BUDGET": "1",
    }
    run_id = unique_run_id("chaos")
    master_port = str(free_port())
    inject = f"nan:rank={NAN_RANK}:step={NAN_STEP}:where=grad;hang:rank={HANG_RANK}:step={HANG_STEP}"
    inject += f";slow:rank=all:step=0:ms={SLOW_MS}"
    jobs: list[Job] = []
    for node in (0, 1):
        node_run_id = run_id if node == 0 else f"{run_id}-n1"
        launch = torchrun_cmd(
            *("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node)),
            *("--master-addr", "127.0.0.1", "--master-port", master_port),
            *("-m", "trainscout.demo.train", "--steps", "2000", "--log-every", "10"),
        )
        address = f"127.0.0.1:{coordinator_port}" if node == 0 else proxy.address
        args = trainscout_cmd(
            *("run", "--run-dir", str(root0 if node == 0 else root1), "--run-id", node_run_id),
            *("--console", "plain", "--coordinator-addr", address, "--inject", inject, "--abort-on", "hang"),
        )
        if node == 1:
            args += ["--node-rank", "1"]
        root = root0 if node == 0 else root1
        # node 0's console log lives outside its run folder: the test fills that folder, not its own files
        if node == 0:
            jobs.append(Job([*args, "--", *launch], tmp, node_run_id, env=env))
            jobs[0].run_path = root / node_run_id
        else:
            jobs.append(Job([*args, "--", *launch], root, node_run_id, env=env, node_suffix="-node1"))
    node0, node1 = jobs
    watch = _StepWatch([run_id, f"{run_id}-n1"])
    watch.start()
    chaos: list[tuple[float, str]] = []

    def did(what: str) -> None:
        chaos.append((time.time(), what))

    def await_restart(job: Job, component: str, before: int) -> None:
        deadline = time.monotonic() + 30
        while _restarts(job, component) <= before:
            assert job.proc.poll() is None, f"the run ended while the {component} was down\n{job.output()[-4000:]}"
            assert time.monotonic() < deadline, f"the {component} was not restarted\n{job.output()[-4000:]}"
            time.sleep(0.1)
        did(f"{component} restarted")

    def kill(job: Job, component: str) -> None:
        before = _restarts(job, component)
        victim = _tool(job, f"trainscout.{component}")
        assert victim is not None, f"no {component} running\n{job.output()[-3000:]}"
        victim.send_signal(signal.SIGKILL)
        did(f"SIGKILL {component} of {job.run_id}")
        victim.wait(timeout=10)
        await_restart(job, component, before)

    def stop_for(job: Job, component: str, seconds: float) -> None:
        victim = _tool(job, f"trainscout.{component}")
        assert victim is not None, f"no {component} running\n{job.output()[-3000:]}"
        victim.send_signal(signal.SIGSTOP)
        did(f"SIGSTOP {component} of {job.run_id}")
        time.sleep(seconds)
        victim.send_signal(signal.SIGCONT)
        did(f"SIGCONT {component} of {job.run_id}")

    disk_full = (0.0, 0.0)
    try:
        deadline = time.monotonic() + 60
        while min((watch.step(r) for r in range(4)), default=0) < 5:
            assert time.monotonic() < deadline, f"the job did not reach step 5\n{node0.output()[-4000:]}"
            assert node0.proc.poll() is None and node1.proc.poll() is None, node0.output()[-4000:]
            time.sleep(0.2)
        # the link: latency, a partition that heals, resets, a thin link
        proxy.delay(0.3)
        did("proxy delay 0.3 s")
        time.sleep(2)
        proxy.delay(0.0)
        kill(node1, "agent")
        proxy.blackhole(4)  # longer than an agent may be silent (3 s): a gap the summary must list
        did("proxy blackhole 4 s")
        time.sleep(4.2)
        kill(node0, "coordinator")
        stop_for(node1, "agent", 3.5)
        proxy.drop(1.5)
        did("proxy drop 1.5 s")
        time.sleep(1.7)
        proxy.throttle(2000)
        did("proxy throttle 2000 B/s")
        time.sleep(2)
        proxy.throttle(0)
        stop_for(node0, "coordinator", 2)
        chaos_done_step = max(watch.step(r) for r in range(4))
        did(f"link and tool chaos over at step {chaos_done_step}")
        assert chaos_done_step + CHAOS_MARGIN_STEPS < NAN_STEP, (
            f"the chaos ran until step {chaos_done_step}: raise NAN_STEP/HANG_STEP or SLOW_MS"
        )
        if not disk:
            # the run folder full while a finding is made; then the space comes back
            filler = _fill(node0.run_path.parent)
            disk_full = (time.time(), 0.0)
            did("run folder full")
            deadline = time.monotonic() + 60
            while not any(e["kind"] == "nan" for e in read_jsonl(fault_log)):
                assert time.monotonic() < deadline, f"the NaN did not fire\n{node0.output()[-4000:]}"
                time.sleep(0.2)
            while "NONFINITE at step" not in node0.output():  # made, and shown, while the folder is full
                assert time.monotonic() < deadline, f"the NaN was not named\n{node0.output()[-4000:]}"
                time.sleep(0.2)
            filler.unlink()
            disk_full = (disk_full[0], time.time())
            did("run folder has space again")
        r0 = node0.wait(timeout=150)
        r1 = node1.wait(timeout=30)
    finally:
        watch.halt.set()
        for job in jobs:
            job.cleanup()
        proxy.close()
    watch.join(timeout=5)
    tools: dict[str, list[int]] = {}
    for job in jobs:
        for e in read_jsonl(job.run_path / "events.supervisor.jsonl"):
            if e["kind"] in ("tool_died", "monitoring_lost"):
                tools.setdefault(e["component"], []).append(e["code"])
    return ChaosRun(
        node0=r0,
        node1=r1,
        proxy=proxy,
        chaos=chaos,
        steps=watch.samples,
        fired=read_jsonl(fault_log),
        disk=disk,
        disk_full=disk_full,
        tools=tools,
    )


def _story(run: ChaosRun) -> str:
    chaos = "\n".join(f"{time.strftime('%H:%M:%S', time.localtime(t))} {what}" for t, what in run.chaos)
    return f"--- chaos ---\n{chaos}\n--- node 0 ---\n{run.node0.describe()}\n--- node 1 ---\n{run.node1.output[-3000:]}"


def test_every_injected_fault_is_named_with_its_rank_and_no_healthy_rank_is(chaos_run):
    run = chaos_run
    fired = {f["kind"]: f for f in run.fired}
    assert set(fired) >= {"nan", "hang"}, _story(run)
    named = sorted((f["kind"], f["culprit_ranks"]) for f in run.node0.findings)
    assert named == [("hang", [HANG_RANK]), ("nonfinite", [NAN_RANK])], _story(run)
    by_kind = {f["kind"]: f for f in run.node0.findings}
    assert by_kind["nonfinite"]["step"] == NAN_STEP + 1, _story(run)
    assert by_kind["hang"]["step"] == HANG_STEP, _story(run)
    assert all(f["status"] == "attributed" for f in run.node0.findings), _story(run)
    # the hang is named within the bar of the self-healing work, chaos or not
    latency = by_kind["hang"]["confirmed"] - fired["hang"]["t"]
    assert latency <= 15.0, f"hang named {latency:.1f} s after it began\n{_story(run)}"
    assert run.node0.returncode == 3, _story(run)  # a fault found and the job stopped (--abort-on hang)


def test_the_training_is_never_held_up(chaos_run):
    run = chaos_run
    assert sorted(run.steps) == [0, 1, 2, 3], run.steps.keys()
    for rank, samples in run.steps.items():
        reached = max(s for _, s in samples)
        assert reached >= HANG_STEP, f"rank {rank} stopped at step {reached}\n{_story(run)}"
        # the longest stretch in which the rank's step did not move, before the hang: never more than a few steps'
        # time, whatever the monitoring went through
        training = [(t, s) for t, s in samples if s >= 1]  # from its first step (start-up is not training)
        longest, since, last = 0.0, training[0][0], training[0][1]
        for t, step in training:
            if step >= HANG_STEP:
                break
            if step != last:
                longest, since, last = max(longest, t - since), t, step
        assert longest < 3.0, f"rank {rank} made no step for {longest:.1f} s\n{_story(run)}"
    losses = [
        float(line.split()[3])
        for line in (run.node0.run_path / "launcher.log").read_text().splitlines()
        if line.startswith("step ") and int(line.split()[1]) <= NAN_STEP
    ]
    assert len(losses) == NAN_STEP // 10, losses
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses  # finite, and learning


def test_every_blind_stretch_is_in_the_summary(chaos_run):
    run = chaos_run
    summary = (run.node0.run_path / "summary.md").read_text()
    assert "monitoring gap: the coordinator was down from" in summary, summary
    assert "monitoring gap: the agent of node1 was silent" in summary, summary
    assert "monitoring was lost" not in run.node0.output + run.node1.output, _story(run)
    # each restarted tool died by the test's hand only
    assert set(run.tools) <= {"agent", "coordinator"}, run.tools
    assert all(code == -signal.SIGKILL for codes in run.tools.values() for code in codes), run.tools
    # the drop cut the link: it reset the connection it found, or (a loaded machine: the agent was between
    # connections then) refused the new ones
    stats = run.proxy.stats
    assert (stats.reset >= 1 or stats.refused >= 1) and stats.accepted >= 2, stats


def test_a_full_run_folder_costs_no_process_and_no_finding(chaos_run):
    run = chaos_run
    if run.disk:
        pytest.skip(run.disk)
    assert run.disk_full[1] > run.disk_full[0] > 0
    nan_t = next(f["t"] for f in run.fired if f["kind"] == "nan")
    assert run.disk_full[0] < nan_t < run.disk_full[1], _story(run)
    # said once, in one clear line, when the space ran out
    assert "run folder is full" in run.node0.output, _story(run)
    # the finding made meanwhile reached the terminal at once and findings.jsonl once there was space
    assert "NONFINITE" in run.node0.output.upper(), _story(run)
    lines = [json.loads(line) for line in (run.node0.run_path / "findings.jsonl").read_text().splitlines()]
    assert sorted(f["kind"] for f in lines) == ["hang", "nonfinite"], lines
    # no trainscout process died of it: the only death of the coordinator was the test's kill, and no traceback
    assert run.tools.get("coordinator") == [-signal.SIGKILL], run.tools
    assert "Traceback" not in run.node0.output, _story(run)
    assert (run.node0.run_path / "summary.md").exists(), _story(run)


def test_the_proxy_delays_holds_drops_and_throttles(tmp_path):
    """The test's own link: what each condition does to bytes sent through it, against a real echo server."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def echo() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo_one, args=(conn,), daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    proxy = TcpProxy(server.getsockname())
    try:

        def round_trip(payload: bytes) -> float:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
                t = time.monotonic()
                c.sendall(payload)
                got = b""
                while len(got) < len(payload):
                    chunk = c.recv(65536)
                    assert chunk, "connection closed"
                    got += chunk
                assert got == payload
                return time.monotonic() - t

        assert round_trip(b"x" * 1000) < 0.5
        proxy.delay(0.3)
        assert 0.55 <= round_trip(b"hello") < 2.0  # held both ways
        proxy.delay(0.0)
        proxy.blackhole(1.0)
        assert 0.9 <= round_trip(b"hello") < 2.5
        proxy.throttle(20000)
        assert 0.9 <= round_trip(b"y" * 10000) < 4.0  # 10 kB each way at 20 kB/s
        proxy.throttle(0)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
            c.sendall(b"a")
            assert c.recv(1) == b"a"
            proxy.drop(1.0)
            with pytest.raises((ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
                c.sendall(b"b")
                if not c.recv(1):
                    raise ConnectionResetError
        try:  # refused while dropping: reset at once, or closed before a byte comes back
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
                c.sendall(b"c")
                assert c.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            pass
        time.sleep(1.1)
        assert round_trip(b"back") < 0.5
        assert proxy.stats.reset == 1 and proxy.stats.refused >= 1
    finally:
        proxy.close()
        server.close()


def _echo_one(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass
