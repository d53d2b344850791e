"""Launchers as trainscout reads them from a command line, and ranks' identities from SLURM's variables."""

from __future__ import annotations

import pytest

from trainscout.runner import launchers
from trainscout.runner.launchers import (
    Launch,
    first_host,
    identify,
    node_id_from,
    reachable_address,
    slurm_agent_step,
    slurm_rank_environment,
)


@pytest.mark.parametrize(
    "command, expected",
    [
        (["torchrun", "--nnodes", "2", "--node-rank", "1", "t.py"], Launch(launchers.TORCHRUN, 1)),
        (["python3", "-m", "torch.distributed.run", "--node_rank=3", "t.py"], Launch(launchers.TORCHRUN, 3)),
        (["/venv/bin/deepspeed", "--num_gpus", "4", "t.py"], Launch(launchers.DEEPSPEED, None)),
        (["deepspeed", "--no_ssh", "--node_rank", "2", "t.py"], Launch(launchers.DEEPSPEED, 2)),
        (["python", "-m", "deepspeed.launcher.runner", "--node_rank=1", "t.py"], Launch(launchers.DEEPSPEED, 1)),
        (["accelerate", "launch", "--machine_rank", "1", "t.py"], Launch(launchers.ACCELERATE, 1)),
        (["accelerate", "launch", "--machine-rank=2", "t.py"], Launch(launchers.ACCELERATE, 2)),
        (["srun", "-n", "8", "python", "t.py"], Launch(launchers.SRUN, None, ranks_from_slurm=True)),
        (["srun", "--ntasks-per-node=1", "torchrun", "--nproc-per-node", "4", "t.py"], Launch(launchers.SRUN, None)),
        (["srun", "python", "-m", "torch.distributed.run", "t.py"], Launch(launchers.SRUN, None)),
        (["python", "t.py", "--node-rank", "5"], Launch(launchers.OTHER, None)),  # a script's own flag
        ([], Launch(launchers.OTHER, None)),
    ],
)
def test_identify(command, expected):
    assert identify(command) == expected


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu[07-09,12],cpu1", "gpu07"), ("node3", "node3"), ("a-1,b-2", "a-1"), ("rack[001,005]", "rack001")],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


SLURM_TASK = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "123456",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
}


def test_slurm_rank_environment_derives_what_torch_needs():
    assert slurm_rank_environment(SLURM_TASK) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 123456 % 10000),
    }


def test_slurm_rank_environment_keeps_what_is_set_and_ignores_non_slurm_processes():
    mine = {**SLURM_TASK, "MASTER_PORT": "29500", "MASTER_ADDR": "10.0.0.1", "SLURM_TASKS_PER_NODE": "3,2"}
    derived = slurm_rank_environment(mine)
    assert "MASTER_PORT" not in derived and "MASTER_ADDR" not in derived
    assert "LOCAL_WORLD_SIZE" not in derived  # uneven tasks per node: this node's count is not known here
    assert derived["RANK"] == "5"
    assert slurm_rank_environment({"SLURM_JOB_ID": "1"}) == {}  # a batch script, not a task


def test_slurm_agent_step_needs_an_allocation():
    step = slurm_agent_step(["python", "-m", "trainscout", "agent"], {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3"})
    assert step[0] == "srun" and "--overlap" in step and "--nodes=3" in step and "--ntasks-per-node=1" in step
    assert step[-4:] == ["python", "-m", "trainscout", "agent"]
    with pytest.raises(ValueError, match="allocation"):
        slurm_agent_step(["agent"], {})


def test_node_names_and_reachable_address():
    assert node_id_from({"SLURM_NODEID": "3"}, "host-a") == "node3"
    assert node_id_from({"SLURM_NODEID": "3"}, "host-a", node_rank=1) == "node1"
    assert node_id_from({}, "host-a") == "host-a"
    assert reachable_address("tcp://0.0.0.0:4321", {"SLURM_JOB_NODELIST": "n[4-5]"}, "n5") == "n4:4321"
    assert reachable_address("tcp://0.0.0.0:4321", {}, "here") == "here:4321"
    assert reachable_address("tcp://10.1.1.1:4321", {"SLURM_JOB_NODELIST": "n4"}, "n5") == "10.1.1.1:4321"
