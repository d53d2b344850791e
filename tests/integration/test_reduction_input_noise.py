"""A gradient changed on its way into its reduction (tests/integration/wrapped_lm_job.py --sync-noise: 100x its
norm): in a DDP communication hook, where `.grad` never holds it, and in a wrapper of FSDP2's reduce-scatter,
whose `.grad` after backward is a reduced shard. Neither showed in the per-layer norms; both went unnamed. The
bucket's norm as it enters the collective is now part of the step's evidence (probe/grad_sync.py)."""

from __future__ import annotations

import pytest

from conftest import free_port, run_under_trainscout, start_under_trainscout, stop_once_found, torchrun_cmd
from test_replay_library_models import JOB, STOPPED

pytestmark = pytest.mark.slow


def _launch(steps: int, *options: str) -> list[str]:
    return torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), str(JOB), "--steps", str(steps), *options
    )


def _bucket_finding(result, outcome: str) -> None:
    assert [(f["kind"], f["culprit_ranks"], f["evidence"]["check"]) for f in result.findings] == [
        ("sdc", [2], "numeric_grad_norm")
    ], result.describe()
    found = result.findings[0]
    assert found["step"] == 80 and found["evidence"]["pattern"] == "spike", result.describe()
    assert found["evidence"]["layer"].startswith("grad-sync."), result.describe()
    assert found["evidence"]["confirmation"]["outcome"] == outcome, result.describe()


def test_noise_added_in_a_ddp_communication_hook_is_named_as_a_transient(jobs, tmp_path):
    clean = run_under_trainscout(tmp_path, "hook-clean", _launch(80, "--hook"))
    assert clean.returncode == 0 and clean.findings == [], clean.describe()
    job = start_under_trainscout(jobs, tmp_path, "hook-noise", _launch(300, "--sync-noise", "2:80"))
    result = stop_once_found(job, lambda found: any(f["kind"] == "sdc" for f in found))
    assert result.returncode in (0, STOPPED), result.describe()
    _bucket_finding(result, "transient")  # replay recomputes the layers, which were right


def test_noise_added_to_fsdp2s_reduce_scatter_input_is_named_unconfirmed(jobs, tmp_path):
    job = start_under_trainscout(jobs, tmp_path, "rs-noise", _launch(300, "--fsdp", "--sync-noise", "2:80"))
    result = stop_once_found(job, lambda found: any(f["kind"] == "sdc" for f in found))
    assert result.returncode in (0, STOPPED), result.describe()
    _bucket_finding(result, "unconfirmed")


def test_a_layer_gradient_zeroed_on_one_rank_before_the_all_reduce_is_named(jobs, tmp_path):
    """Exactly 0 has no log-norm: the zero was left out of every comparison, and the layer's average, 3/4 of what
    it should be, went unnamed."""
    job = start_under_trainscout(jobs, tmp_path, "zero-grad", _launch(300, "--zero-grad", "1:60"))
    result = stop_once_found(job, lambda found: any(f["kind"] == "sdc" for f in found))
    assert result.returncode in (0, STOPPED), result.describe()
    (found,) = [f for f in result.findings if f["evidence"].get("check") == "numeric_grad_norm"]
    assert found["culprit_ranks"] == [1] and found["evidence"]["pattern"] == "zero", result.describe()
    assert found["evidence"]["layer"] == "model.blocks.1" and found["step"] - 60 <= 10, result.describe()
    assert {r for f in result.findings for r in f["culprit_ranks"]} == {1}, result.describe()
