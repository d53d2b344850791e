"""Healthy jobs produce no findings: no false alarms from normal training, uniform slowness or a long pause.

A tool that blames a rank in a healthy job is worse than none (the demo would also abort the job), so
these runs must end with the training's own exit code 0 and an empty findings.jsonl.
"""

from __future__ import annotations

import pytest

from conftest import free_port, run_demo, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow


def _assert_clean(result) -> None:
    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    assert (result.run_path / "findings.jsonl").exists(), result.describe()
    assert "0 findings" in result.output, result.describe()
    assert (result.run_path / "summary.md").exists(), result.describe()
    assert not any(e["kind"] in ("abort", "suspect", "finding") for e in result.events), result.describe()


def test_healthy_demo_job_has_no_findings(tmp_path):
    result = run_demo(tmp_path, "clean", fault="none", steps=100)

    _assert_clean(result)
    assert "trainscout: demo PASS: a clean run, no finding" in result.output, result.describe()
    assert "done: 100 steps" in result.output, result.describe()


def test_uniformly_slow_job_has_no_findings(tmp_path):
    # every rank sleeps 30 ms after every step: slow, but nobody is slower than the others
    result = run_demo(tmp_path, "slow-all", fault="slow", rank="all", step=0, steps=60, params=("ms=30",))

    _assert_clean(result)
    assert "trainscout: demo PASS: a clean run, no finding" in result.output, result.describe()
    assert "done: 60 steps" in result.output, result.describe()
    assert "slow: sleeping 30 ms per step" in result.output, result.describe()


def test_job_wide_pause_longer_than_hang_timeout_is_not_a_hang(tmp_path):
    # every rank saves a checkpoint and sleeps 8 s after step 20, with a 3 s hang timeout
    launch = torchrun_cmd(
        "--nproc-per-node",
        "4",
        "--master-port",
        str(free_port()),
        "-m",
        "trainscout.demo.train",
        "--steps",
        "40",
        "--pause-at",
        "20",
        "--pause-seconds",
        "8",
    )
    result = run_under_trainscout(tmp_path, "pause", launch, options=("--hang-timeout", "3"))

    _assert_clean(result)
    assert "done: 40 steps" in result.output, result.describe()
    assert result.duration_s > 8, result.describe()
