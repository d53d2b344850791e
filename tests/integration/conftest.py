"""Shared helpers for the integration tests: real `trainscout` CLI runs of real multi-process gloo jobs.

Every job runs as a user would start it (`python -m trainscout run|demo ... --console plain`), on
127.0.0.1, with its own run id (so its /dev/shm files are its own) and its own master port. A helper
returns what a user would look at afterwards: the exit code, findings.jsonl, the run folder and the
terminal output. Jobs are generous with time (the machine is small and shared) but never retried.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# A suite started in the background by a non-interactive shell (`make test &`) inherits SIGINT ignored, and so
# would every job it starts: Python then installs no handler of its own, and a Ctrl-C a test sends before
# trainscout's supervisor sets its handler is lost (the job trained on for a minute). The jobs get what a
# terminal gives them: SIGINT at its default (a Python handler here is reset to the default across exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

JOB_TIMEOUT_S = 150.0
PY = sys.executable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique_run_id(name: str) -> str:
    return f"it-{name}-{uuid.uuid4().hex[:8]}"


def trainscout_cmd(*args: str) -> list[str]:
    return [PY, "-m", "trainscout", *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", *args]


def run_torchrun_script(script: Path, nproc: int, *args: str, timeout: float = 120) -> None:
    """`script` as a plain torchrun job of `nproc` ranks on 127.0.0.1 (no trainscout), which must exit 0."""
    cmd = torchrun_cmd(
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_findings(run_path: Path) -> list[dict]:
    """findings.jsonl decoded through the Finding schema, so fields left at their default are present too.

    (The raw lines, as any JSON reader sees them, are JobResult.raw_findings.)
    """
    import msgspec

    from trainscout.findings import from_json

    path = run_path / "findings.jsonl"
    if not path.exists():
        return []
    with open(path, "rb") as fh:
        decoded = [from_json(line) for line in fh if line.strip()]
    return [{name: msgspec.to_builtins(getattr(f, name)) for name in f.__struct_fields__} for f in decoded]


def read_events(run_path: Path) -> list[dict]:
    return read_jsonl(run_path / "events.jsonl")


@dataclass
class JobResult:
    returncode: int
    findings: list[dict]
    run_path: Path
    output: str
    duration_s: float = 0.0
    events: list[dict] = field(default_factory=list)
    raw_findings: list[dict] = field(default_factory=list)

    def describe(self) -> str:
        """Enough context for a failed assertion to be diagnosed from the test report alone."""
        return (
            f"exit code {self.returncode} after {self.duration_s:.1f} s\nfindings: "
            f"{json.dumps(self.findings, indent=1)[:6000]}\nevents: {json.dumps(self.events)[:3000]}\n"
            f"--- output (tail) ---\n{self.output[-6000:]}"
        )


def processes_of_run(run_id: str) -> list[int]:
    """Pids of processes that belong to a run: its ranks and launcher (env) or its agent (command line)."""
    needle_env = f"TRAINSCOUT_RUN_ID={run_id}".encode()
    needle_cmd = run_id.encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read()
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[-1].split()[0]
        except OSError:
            continue
        if state == b"Z":
            continue  # already dead, only waiting to be reaped by its parent
        if needle_env in env or needle_cmd in cmd:
            found.append(int(entry))
    return found


def shm_files_of_run(run_id: str) -> list[str]:
    prefix = f"trainscout-{run_id}-"
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


def kill_run_leftovers(run_id: str) -> list[int]:
    """Last-resort cleanup after a failed test: SIGKILL exactly the processes of this run, by pid."""
    pids = processes_of_run(run_id)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return pids


def _stop(proc: subprocess.Popen) -> None:
    """Stop a trainscout process the way a user would (Ctrl-C, then harder)."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, sig)
        except OSError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


class Job:
    """A started `trainscout` process whose merged stdout+stderr goes to a file (no pipe to fill up)."""

    def __init__(
        self,
        args: list[str],
        run_root: Path,
        run_id: str,
        *,
        env: dict | None = None,
        cwd: Path | None = None,
        node_suffix: str = "",
    ) -> None:
        self.args = args
        self.run_id = run_id
        self.run_path = Path(run_root) / (run_id + node_suffix)
        Path(run_root).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(run_root) / f"{run_id}{node_suffix}.console.txt"
        full_env = dict(os.environ)
        full_env.pop("TRAINSCOUT_RUN_ID", None)
        full_env.pop("TRAINSCOUT_INJECT", None)
        full_env["PYTHONUNBUFFERED"] = "1"
        if env:
            full_env.update(env)
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=str(cwd or run_root),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def launcher_log(self) -> str:
        path = self.run_path / "launcher.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_launcher_text(self, text: str, timeout: float = JOB_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.launcher_log():
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"trainscout exited ({self.proc.returncode}) before the launcher printed "
                    f"{text!r}\n{self.output()[-4000:]}"
                )
            time.sleep(0.1)
        raise AssertionError(f"launcher did not print {text!r} within {timeout} s\n{self.output()[-4000:]}")

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> JobResult:
        try:
            self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            _stop(self.proc)
            kill_run_leftovers(self.run_id)
            self._log.close()
            pytest.fail(f"{' '.join(self.args)} did not finish within {timeout} s\n{self.output()[-6000:]}")
        duration = time.monotonic() - self.started
        self._log.close()
        return JobResult(
            returncode=self.proc.returncode,
            findings=read_findings(self.run_path),
            run_path=self.run_path,
            output=self.output(),
            duration_s=duration,
            events=read_events(self.run_path),
            raw_findings=read_jsonl(self.run_path / "findings.jsonl"),
        )

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            _stop(self.proc)
        if not self._log.closed:
            self._log.close()
        kill_run_leftovers(self.run_id)


@pytest.fixture
def jobs():
    """Start jobs through this fixture: whatever a failed test leaves running is stopped afterwards."""
    started: list[Job] = []

    def start(args: list[str], run_root: Path, run_id: str, **kwargs) -> Job:
        job = Job(args, run_root, run_id, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        job.cleanup()


def run_job(args: list[str], run_root: Path, run_id: str, timeout: float = JOB_TIMEOUT_S, **kwargs) -> JobResult:
    """Run one trainscout command to the end: (returncode, findings, run dir, output) and more."""
    job = Job(args, run_root, run_id, **kwargs)
    try:
        return job.wait(timeout)
    finally:
        job.cleanup()


def run_demo(
    tmp_path: Path,
    name: str,
    *,
    fault: str = "none",
    rank: str | int = 2,
    step: int = 20,
    steps: int = 60,
    params: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    timeout: float = JOB_TIMEOUT_S,
) -> JobResult:
    """`trainscout demo` (4 CPU ranks, tiny GPT under DDP) with one injected fault."""
    run_id = unique_run_id(name)
    args = trainscout_cmd(
        "demo",
        "--fault",
        fault,
        "--rank",
        str(rank),
        "--step",
        str(step),
        "--steps",
        str(steps),
        "--master-port",
        str(free_port()),
        "--run-dir",
        str(tmp_path),
        "--run-id",
        run_id,
        "--console",
        "plain",
    )
    for p in params:
        args += ["--param", p]
    args += list(extra)
    return run_job(args, tmp_path, run_id, timeout=timeout)


@pytest.fixture(scope="session")
def demo_hang(tmp_path_factory) -> JobResult:
    """`trainscout demo --fault hang --rank 2 --step 20`, run once for the session: tests in several files
    read what this one job left (its finding, its terminal, its report) and change none of it."""
    return run_demo(tmp_path_factory.mktemp("demo-hang"), "demo-hang", fault="hang", rank=2, step=20, steps=100)


def run_under_trainscout(
    tmp_path: Path,
    name: str,
    launch: list[str],
    options: tuple[str, ...] = (),
    timeout: float = JOB_TIMEOUT_S,
    env: dict | None = None,
) -> JobResult:
    """`trainscout run [options] -- <launch>`."""
    run_id = unique_run_id(name)
    args = trainscout_cmd(
        "run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain", *options, "--", *launch
    )
    return run_job(args, tmp_path, run_id, timeout=timeout, env=env)


def demo_with_fault(tmp_path: Path, name: str, inject: str, steps: int, *script_args: str) -> JobResult:
    """The unmodified 4-rank demo script under `trainscout run --inject <inject>`."""
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), "-m", "trainscout.demo.train", "--steps", str(steps)
    )
    return run_under_trainscout(tmp_path, name, [*launch, *script_args], options=("--inject", inject))


def start_demo_with_fault(jobs, tmp_path: Path, name: str, inject: str, steps: int, *script_args: str) -> Job:
    """demo_with_fault's job, started through the `jobs` fixture and left running (see stop_once_found)."""
    run_id = unique_run_id(name)
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), "-m", "trainscout.demo.train", "--steps", str(steps)
    )
    args = trainscout_cmd("run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain")
    return jobs([*args, "--inject", inject, "--", *launch, *script_args], tmp_path, run_id)


def start_under_trainscout(jobs, tmp_path: Path, name: str, launch: list[str], *options: str) -> Job:
    """`trainscout run [options] -- <launch>`, started through the `jobs` fixture and left running."""
    run_id = unique_run_id(name)
    args = trainscout_cmd("run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain", *options)
    return jobs([*args, "--", *launch], tmp_path, run_id)


def stop_once_found(job: Job, enough, timeout: float = JOB_TIMEOUT_S) -> JobResult:
    """Once findings.jsonl holds what `enough(findings)` waits for, Ctrl-C the job as a user would; its result.

    For jobs that must be long enough for a slow machine to reach a finding but would then train on for
    nothing: a culprit was named, so `trainscout run` exits 3 (0 if the job ended by itself first)."""
    path = job.run_path / "findings.jsonl"
    while job.proc.poll() is None and time.monotonic() - job.started < timeout:
        try:
            found = read_jsonl(path)
        except ValueError:  # the last line is being written
            found = []
        if enough(found):
            job.proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.2)
    return job.wait(timeout)


def of_kind(findings: list[dict], kind: str) -> list[dict]:
    return [f for f in findings if f["kind"] == kind]
