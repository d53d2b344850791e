"""Replay of a model shaped like the common library models (tests/integration/wrapped_lm_job.py).

A Hugging Face causal LM under trainscout had replay disabled on every rank at its first replay: its
transformer answered with a model-output record, not a tensor. Its blocks, one level down and called with
keyword arguments, were never replayed at all. Replay now takes the inner model's blocks one by one, sends
a block's whole call (positional and keyword arguments), and fingerprints every tensor of what it answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import free_port, run_under_trainscout, start_under_trainscout, stop_once_found, torchrun_cmd

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parent / "wrapped_lm_job.py"
STOPPED = 3  # `trainscout run` interrupted after naming a culprit (0: the job ended by itself first)
LAYERS = ["model.embed", "model.blocks.0", "model.blocks.1", "model.norm", "lm_head"]


def _launch(nproc: int, steps: int, *options: str) -> list[str]:
    return torchrun_cmd(
        "--nproc-per-node", str(nproc), "--master-port", str(free_port()), str(JOB), "--steps", str(steps), *options
    )


def test_blocks_called_with_keywords_and_answering_records_are_replayed(tmp_path):
    env = {"TRAINSCOUT_REPLAY_EVERY": "2", "TRAINSCOUT_REPLAY_BUDGET": "0"}
    result = run_under_trainscout(tmp_path, "replay-lib", _launch(3, 60), env=env)
    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    assert "replay disabled" not in result.output and "leaves layer" not in result.output, result.describe()
    for rank in range(3):
        costs = json.loads((result.run_path / f"probe-cost.rank{rank}.json").read_text())["replay"]
        assert costs["layer_names"] == LAYERS and costs["left_out"] == [], costs
        assert costs["count"] >= 25, costs  # every 2 steps from step 2: 29 replays


def test_a_sharded_optimizer_step_ends_after_the_wrapper_broadcasts_the_shards(tmp_path):
    """ZeroRedundancyOptimizer steps a local optimizer on this rank's shard, then broadcasts every shard from its
    owner. The local optimizer's step ended first and was taken for the step's end: replay compared the
    replicas' parameters while only the owner of each shard had updated it, and named rank 0 (owner of the
    embedding) a corrupted replica at the first replay."""
    env = {"TRAINSCOUT_REPLAY_EVERY": "2", "TRAINSCOUT_REPLAY_BUDGET": "0"}
    result = run_under_trainscout(tmp_path, "replay-zero", _launch(3, 40, "--zero"), env=env)
    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    for rank in range(3):
        costs = json.loads((result.run_path / f"probe-cost.rank{rank}.json").read_text())["replay"]
        assert costs["layer_names"] == LAYERS and costs["count"] >= 15, costs  # every 2 steps from step 2: 19


def test_a_rank_computing_wrong_in_a_sharded_job_is_named_by_its_loss(jobs, tmp_path):
    """FSDP2 has no replicas to replay or hash against, but its ranks compute the whole model on their own
    batches: a block's output negated on rank 2 (by the job itself) went unnamed for the whole run. Its loss
    leaves its data-parallel peers' and it is named, unconfirmed; a clean sharded run names nobody."""
    clean = run_under_trainscout(tmp_path, "fsdp-clean", _launch(4, 80, "--fsdp"))
    assert clean.returncode == 0 and clean.findings == [], clean.describe()
    job = start_under_trainscout(jobs, tmp_path, "fsdp-flip", _launch(4, 400, "--fsdp", "--flip", "2:60"))
    result = stop_once_found(job, lambda found: any(f["kind"] == "sdc" for f in found))
    assert result.returncode in (0, STOPPED), result.describe()
    assert [(f["kind"], f["culprit_ranks"], f["evidence"]["check"]) for f in result.findings] == [
        ("sdc", [2], "numeric_loss")
    ], result.describe()
    assert 60 < result.findings[0]["step"] <= 100, result.describe()  # +13 here
    assert result.findings[0]["evidence"]["confirmation"]["outcome"] == "unconfirmed", result.describe()


def test_a_block_computing_wrong_is_confirmed_by_replaying_its_call(jobs, tmp_path):
    job = start_under_trainscout(
        jobs, tmp_path, "replay-lib-flip", _launch(4, 400), "--inject", "outflip:rank=1:step=30:layer=model.blocks.1"
    )
    result = stop_once_found(
        job, lambda found: any(f.get("evidence", {}).get("confirmation", {}).get("outcome") for f in found)
    )
    assert result.returncode in (0, STOPPED), result.describe()
    assert {r for f in result.findings for r in f["culprit_ranks"]} == {1}, result.describe()
    numeric = [f for f in result.findings if f["evidence"].get("check", "").startswith("numeric")]
    assert numeric and numeric[0]["kind"] == "sdc", result.describe()
    confirmation = numeric[0]["evidence"]["confirmation"]
    assert confirmation["outcome"] == "reproduced", result.describe()
    assert "model.blocks.1" in confirmation["layers_deviating"], result.describe()


def test_a_rank_slow_between_steps_is_named_alone_where_ddp_broadcasts_buffers(jobs, tmp_path):
    """The job has buffers, so DDP broadcasts them from rank 0 before each forward: the peers of a rank that is
    late wait for it there, in a call issued from C++. Counted as blocked time, that wait made every rank look
    as blocked as the slow one (no outlier), and made rank 0, the root, a straggler on a busy machine."""
    job = start_under_trainscout(
        jobs, tmp_path, "buffers-slow", _launch(4, 400), "--inject", "slow:rank=2:step=30:ms=30"
    )
    result = stop_once_found(job, lambda found: any(f["kind"] == "straggler" for f in found))
    assert result.returncode in (0, STOPPED), result.describe()
    stragglers = [f for f in result.findings if f["kind"] == "straggler"]
    assert stragglers and stragglers[0]["culprit_ranks"] == [2], result.describe()
    assert stragglers[0]["step"] - 30 <= 10, result.describe()
    assert {r for f in result.findings for r in f["culprit_ranks"]} == {2}, result.describe()
