"""Replay of layers with BatchNorm in a data-parallel job (DDP without SyncBatchNorm).

Running statistics are each rank's own: DDP copies rank 0's into the others at each forward, then every
rank updates them from its own batch. A layer recomputed in eval mode with its own statistics came out
different on every healthy replica, and trainscout reported "corruption detected, culprit unknown" on a
clean CUDA vision job. Every replica now recomputes with the source's statistics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import free_port, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parents[2] / "examples" / "vision_train.py"
STEPS = 60


def test_batchnorm_layers_replay_alike_on_every_replica(tmp_path):
    launch = torchrun_cmd(
        "--nproc-per-node", "3", "--master-port", str(free_port()), str(JOB), "--steps", str(STEPS), "--workers", "0"
    )
    env = {"TRAINSCOUT_REPLAY_EVERY": "2", "TRAINSCOUT_REPLAY_BUDGET": "0"}
    result = run_under_trainscout(tmp_path, "replay-bn", launch, env=env)
    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    # every 2 steps from step 2: 29 replays a rank over the 13 layers with weights (4 BatchNorms among them)
    for rank in range(3):
        costs = json.loads((result.run_path / f"probe-cost.rank{rank}.json").read_text())
        assert costs["replay"]["count"] >= 20, costs
