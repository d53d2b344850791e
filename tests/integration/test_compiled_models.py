"""A compiled model under `trainscout run`: the probe's hooks must not recompile it, nor break its graph.

The probe hooks the trained model's forward (step timing, what a rank is busy with) and arms a hook on one
layer for each replay. Under torch.compile dynamo compiled those hooks as frames of their own and recompiled
them as their state changed: a `model.compile(fullgraph=True)` job died at step 8 at the recompile limit, and a
`torch.compile(model)` job recompiled the replay hook 2-3 times a rank. The job here fails on any
recompilation; replay runs every 10 steps on the compiled model. With the DDP wrapper compiled, the blocks'
hooks run inside the inner model's graph and never see an input: after two such replays the whole model is
replayed (its own hooks run in eager code).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import free_port, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parent / "compiled_job.py"
STEPS = 65


@pytest.mark.parametrize("mode", ["whole", "blocks", "wrap", "ddp"])
def test_a_compiled_model_trains_unchanged_and_is_replayed(tmp_path, mode):
    launch = torchrun_cmd("--nproc-per-node", "3", "--master-port", str(free_port()), str(JOB), mode, str(STEPS))
    env = {"TRAINSCOUT_REPLAY_EVERY": "10", "TRAINSCOUT_REPLAY_BUDGET": "0"}
    result = run_under_trainscout(tmp_path, f"compiled-{mode}", launch, env=env)

    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    for rank in range(3):
        costs = json.loads((result.run_path / f"probe-cost.rank{rank}.json").read_text())
        assert costs["steps"] == STEPS, costs
        assert costs["replay"]["count"] >= 4, costs  # steps 10-60; a compiled DDP wrapper: 30-60 (below)
