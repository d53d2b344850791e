"""A job stopped whole now and then (SIGSTOP of its process tree: a suspended job, gang scheduling, a paused VM)
names no rank.

Stopped one after the other, some ranks halt inside their compute while the others have already entered the
gradient sync: to the timings those look like the ranks their peers wait for, once a second. Each rank's probe
thread sees it woke late (the whole process did not run), the steps a majority of ranks spent stopped are left
unjudged (`job_frozen` events), and the run ends with no finding. Stopped for longer than the hang timeout,
the job has made no progress, with ranks caught at different collectives; as most ranks' probe threads were
stopped too, no rank is voted a hang.
"""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from conftest import free_port, start_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

FREEZES, FROZEN_S, RUNNING_S = 10, 1.0, 1.0


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def test_a_job_stopped_whole_again_and_again_names_no_rank(jobs, tmp_path):
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), "-m", "trainscout.demo.train", "--steps", "700"
    )
    job = start_under_trainscout(jobs, tmp_path, "frozen", launch)
    job.wait_for_launcher_text("step 50")  # past the warm-up of every rule
    for _ in range(FREEZES):
        procs = _tree(job.pid)
        _signal_all(procs, signal.SIGSTOP)
        time.sleep(FROZEN_S)
        _signal_all(procs, signal.SIGCONT)
        time.sleep(RUNNING_S)
    result = job.wait()
    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    frozen = [s for e in result.events if e["kind"] == "job_frozen" for s in e["steps"]]
    assert len(frozen) >= FREEZES // 2, result.describe()  # the probes saw the stops, the steps went unjudged


def test_a_job_stopped_whole_for_longer_than_the_hang_timeout_is_not_a_hang(jobs, tmp_path):
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), "-m", "trainscout.demo.train", "--steps", "300"
    )
    job = start_under_trainscout(jobs, tmp_path, "frozen-long", launch, "--hang-timeout", "3")
    job.wait_for_launcher_text("step 50")
    for _ in range(2):
        procs = _tree(job.pid)
        _signal_all(procs, signal.SIGSTOP)
        time.sleep(7.0)
        _signal_all(procs, signal.SIGCONT)
        time.sleep(2.0)
    result = job.wait()
    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
