"""A rank whose optimizer step is slow is a straggler, wherever the time goes before the step.

Four gloo DDP ranks train under `trainscout run`, unmodified; rank 2's optimizer step is wrapped by a function
that sleeps 30 ms before calling the real step (a slow custom step, a lock, an injector that patches the
optimizer). DDP's gradient-sync wait ends when backward returns, so that time is rank 2's own, not a wait: it
was read as one, and nothing was named.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import free_port, of_kind, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parent / "slow_rank_job.py"


def test_a_rank_sleeping_in_a_wrapped_optimizer_step_is_named(tmp_path):
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), str(JOB), "optimizer", "100", str(tmp_path / "log")
    )
    result = run_under_trainscout(tmp_path, "slow-optimizer-step", launch)

    assert result.returncode == 0, result.describe()
    stragglers = of_kind(result.findings, "straggler")
    assert stragglers and all(f["culprit_ranks"] == [2] for f in stragglers), result.describe()
    assert len(stragglers) == len(result.findings), result.describe()
    assert min(f["step"] for f in stragglers) <= 30 + 10, result.describe()
