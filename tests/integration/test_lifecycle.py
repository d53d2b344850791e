"""How `trainscout run` starts and ends: the job's exit code, Ctrl-C, and bad input.

`trainscout run` must be transparent to whatever wraps it (a scheduler reads the exit code), must leave
nothing behind when interrupted (no rank, agent or coordinator process, no shared memory), and must
reject bad input before starting anything, naming what was wrong.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import (
    PY,
    free_port,
    processes_of_run,
    run_under_trainscout,
    shm_files_of_run,
    torchrun_cmd,
    trainscout_cmd,
    unique_run_id,
)


@pytest.mark.slow
def test_exit_code_of_the_command_is_passed_through_with_exit_status_launcher(tmp_path):
    result = run_under_trainscout(
        tmp_path, "exit3", [PY, "-c", "import sys; sys.exit(3)"], options=("--exit-status", "launcher")
    )

    assert result.returncode == 3, result.describe()
    summary = result.run_path / "summary.md"
    assert summary.exists(), result.describe()
    assert "Exit code: 3" in summary.read_text(), summary.read_text()
    assert result.findings == [], result.describe()


@pytest.mark.slow
def test_ctrl_c_stops_the_job_and_every_trainscout_process(jobs, tmp_path):
    run_id = unique_run_id("ctrlc")
    launch = torchrun_cmd(
        "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "trainscout.demo.train", "--steps", "100000"
    )
    job = jobs(
        trainscout_cmd("run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain", "--", *launch),
        tmp_path,
        run_id,
    )
    job.wait_for_launcher_text("step 10")
    tools = [c for c in psutil.Process(job.pid).children(recursive=True)]
    assert len(processes_of_run(run_id)) >= 3, "launcher and 2 ranks should be running"
    assert shm_files_of_run(run_id), "the ranks' channels should exist while training"

    job.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
    try:
        code = job.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"trainscout did not exit within 60 s of Ctrl-C\n{job.output()[-4000:]}")

    # torchrun ends with 1 when interrupted; nobody was named, so trainscout says it was interrupted (128 + SIGINT)
    assert code == 130, job.output()[-4000:]
    deadline = time.monotonic() + 5  # reaping of the last children may trail the exit by a moment
    while time.monotonic() < deadline and (processes_of_run(run_id) or any(_alive(p) for p in tools)):
        time.sleep(0.1)
    assert processes_of_run(run_id) == [], "processes of the run outlived Ctrl-C"
    assert [p.pid for p in tools if _alive(p)] == [], "agent/coordinator/launcher outlived Ctrl-C"
    assert shm_files_of_run(run_id) == [], "shared memory of the run was left in /dev/shm"
    assert (tmp_path / run_id / "summary.md").exists()
    assert "step 100000" not in job.output()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainscout", *args], capture_output=True, text=True, timeout=timeout)


def test_run_without_a_command_is_a_usage_error(tmp_path):
    done = _cli("run", "--run-dir", str(tmp_path))
    assert done.returncode == 2, done
    assert "give the launch command after --" in done.stderr, done.stderr
    assert "trainscout run -- torchrun" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == [], "nothing should be started or written"


def test_a_run_id_that_already_has_a_run_is_refused(tmp_path):
    """Run files are appended to: a second run there would report the first run's findings as its own."""
    first = tmp_path / "r1"
    first.mkdir()
    (first / "findings.jsonl").write_text('{"kind": "hang"}\n')
    done = _cli("run", "--run-dir", str(tmp_path), "--run-id", "r1", "--", PY, "-c", "pass")
    assert done.returncode == 2, done
    assert "already holds a run" in done.stderr and "--run-id" in done.stderr, done.stderr
    assert sorted(p.name for p in first.iterdir()) == ["findings.jsonl"], "nothing should be started or written"


@pytest.mark.slow
def test_a_run_id_in_use_by_a_running_job_is_refused_and_that_job_is_left_alone(jobs, tmp_path):
    """Run ids name this host's shared-memory channels. A second run under a live run's id (another run
    folder, or the folder deleted) would overwrite its channels, and at its own exit remove them and
    SIGKILL that run's ranks as its leftovers; it must be refused before anything starts."""
    run_id = unique_run_id("busy")
    launch = torchrun_cmd(
        "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "trainscout.demo.train", "--steps", "100000"
    )
    first = jobs(
        trainscout_cmd(
            "run", "--run-dir", str(tmp_path / "a"), "--run-id", run_id, "--console", "plain", "--", *launch
        ),
        tmp_path / "a",
        run_id,
    )
    first.wait_for_launcher_text("step 10")
    ranks = set(processes_of_run(run_id))
    # the ring channels, by inode: a second run that re-created them would give new inodes. Sidecar JSONs are
    # rewritten through temporary files as the job runs, so only the rings are compared.
    rings = {name: os.stat(f"/dev/shm/{name}").st_ino for name in shm_files_of_run(run_id) if name.endswith(".ch")}
    assert len(rings) == 2, "the first run's two ring channels should exist while it trains"

    done = _cli("run", "--run-dir", str(tmp_path / "b"), "--run-id", run_id, "--", PY, "-c", "pass")
    assert done.returncode == 2, done
    assert f"run id {run_id!r} is in use by a job running on this host" in done.stderr, done.stderr
    assert "rank 0 (pid " in done.stderr and "rank 1 (pid " in done.stderr, done.stderr
    assert not (tmp_path / "b" / run_id).exists(), "nothing of the second run should be started or written"
    assert ranks <= set(processes_of_run(run_id)), "the first run's processes must be untouched"
    assert {name: os.stat(f"/dev/shm/{name}").st_ino for name in rings} == rings, (
        "the first run's channels must be untouched"
    )
    assert first.proc.poll() is None, first.output()[-4000:]


def test_bad_inject_spec_is_a_usage_error_naming_the_token(tmp_path):
    done = _cli("run", "--run-dir", str(tmp_path), "--inject", "bogus", "--", PY, "-c", "pass")
    assert done.returncode == 2, done
    assert "'bogus'" in done.stderr, done.stderr
    assert "valid kinds" in done.stderr and "hang" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == [], "nothing should be started or written"


def test_monitors_run_at_a_lower_priority_than_the_job(tmp_path):
    """The agent and coordinator take --monitor-nice on top of the job's niceness."""
    bad = _cli("run", "--run-dir", str(tmp_path / "bad"), "--monitor-nice", "20", "--", PY, "-c", "pass")
    assert (
        bad.returncode == 2 and "run.monitor_nice (--monitor-nice) = 20: expected an integer >= 0, <= 19" in bad.stderr
    ), bad
    run_dir = tmp_path / "runs"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainscout",
            "run",
            "--console",
            "plain",
            "--monitor-nice",
            "10",
            "--run-dir",
            str(run_dir),
            "--",
            PY,
            "-c",
            "import time; time.sleep(6)",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    want = min(19, psutil.Process().nice() + 10)
    try:
        seen: dict[str, int] = {}  # the latest niceness read (a monitor lowers its own once it has started)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (len(seen) < 2 or set(seen.values()) != {want}):
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    cmd = " ".join(child.cmdline())
                    for role in ("trainscout.agent", "trainscout.coordinator"):
                        if f"-m {role} " in cmd:
                            seen[role] = child.nice()
                except psutil.Error:
                    pass
            time.sleep(0.2)
    finally:
        out, _ = proc.communicate(timeout=60)
    assert seen == {"trainscout.agent": want, "trainscout.coordinator": want}, (seen, out)
    assert proc.returncode == 0, out
