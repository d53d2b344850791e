"""DDP with uneven inputs (the Join context manager) under `trainscout run`: a healthy job, no finding.

The last rank runs out of batches 60 steps early; from there it does no optimizer step and shadows its peers'
collectives until they finish. Two things named or broke that healthy job: replay at a step number that the
rank out of data never reached (its peers waited for it in the side group until its 60 s timeout), and its
clean exit at the end, a moment before its peers, read as leaving early because they were steps ahead.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import free_port, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parent / "uneven_job.py"
STEPS, SHORT = 200, 60


def test_a_rank_out_of_data_under_join_is_neither_waited_for_nor_blamed(tmp_path):
    launch = torchrun_cmd("--nproc-per-node", "3", "--master-port", str(free_port()), str(JOB), str(STEPS), str(SHORT))
    env = {"TRAINSCOUT_REPLAY_EVERY": "10", "TRAINSCOUT_REPLAY_BUDGET": "0"}
    began = time.monotonic()
    result = run_under_trainscout(tmp_path, "uneven", launch, env=env)
    took = time.monotonic() - began
    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    assert took < 55, f"{took:.0f} s: the side group waited for the rank out of data\n{result.describe()}"
    errors = [e for e in result.events if e.get("kind") == "probe_error"]
    assert errors == [], result.describe()
    for rank in range(3):
        costs = json.loads((result.run_path / f"probe-cost.rank{rank}.json").read_text())
        assert costs["replay"]["count"] >= 10, costs  # every 10 steps until the last rank is out of data (140)
