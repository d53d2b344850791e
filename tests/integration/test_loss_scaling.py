"""A dynamic loss scaler's overflow is not a non-finite origin; a rank whose gradients stay non-finite at every
scale is.

Four gloo DDP ranks train with `torch.amp.GradScaler` under `trainscout run`, unmodified but for the fault. A
loss scaler overflows the gradients of the replicas whose batches are large now and then, by design: it skips
that step on every rank and lowers the scale. Blaming the replica that overflowed first would blame a healthy
rank; a rank whose gradients are non-finite pass after pass, whatever the scale, is the fault.
"""

from __future__ import annotations

import textwrap

import pytest

from conftest import free_port, of_kind, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

STEPS = 60
ONSET = 12

SCRIPT = textwrap.dedent("""
    import math, sys
    import torch
    import torch.distributed as dist

    mode, steps, onset = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    state = {"step": 0}

    def fault(grad):
        step = state["step"]
        if mode == "stuck" and step >= onset:  # from the onset on, non-finite at any scale
            return grad * math.inf
        if mode == "overflow" and step in (onset, onset + 1, onset + 20):  # this replica's batch overflows
            return grad * 1e38
        return grad

    if rank == 2:
        model.module[0].weight.register_hook(fault)
    torch.manual_seed(100 + rank)
    for step in range(steps):
        state["step"] = step
        loss = model(torch.randn(8, 16)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    dist.destroy_process_group()
""")


def _run(tmp_path, mode: str):
    script = tmp_path / "scaled.py"
    script.write_text(SCRIPT)
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), str(script), mode, str(STEPS), str(ONSET)
    )
    # every step's gradients checked (the CPU check's budget would skip most of them)
    return run_under_trainscout(tmp_path, f"scaled-{mode}", launch, env={"TRAINSCOUT_NONFINITE_BUDGET": "1"})


def test_a_loss_scalers_overflow_on_one_replica_names_nobody(tmp_path):
    result = _run(tmp_path, "overflow")

    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()


def test_gradients_non_finite_at_every_scale_name_the_rank(tmp_path):
    result = _run(tmp_path, "stuck")

    assert result.returncode == 0, result.describe()
    (f,) = of_kind(result.findings, "nonfinite")
    assert f["culprit_ranks"] == [2] and f["status"] == "attributed", result.describe()
    assert "backward passes in a row" in f["summary"], result.describe()
    assert [g["kind"] for g in result.findings] == ["nonfinite"], result.describe()
