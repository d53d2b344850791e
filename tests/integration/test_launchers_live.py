"""trainscout under launchers other than torchrun, each with the unmodified demo script and one injected hang
that must be named exactly (kind, rank, step):

- DeepSpeed's launcher (`deepspeed --num_gpus 4`, CPU accelerator) and HF Accelerate's (`accelerate launch`)
  under `trainscout run`;
- Slurm: `trainscout run -- srun python train.py` inside a real allocation of a one-host Slurm
  (.ci/slurm-single-host; skipped where none runs), and srun's tasks as plain processes given the variables
  srun sets (SLURM_PROCID, SLURM_NTASKS, ...), which the bootstrap turns into RANK, WORLD_SIZE, MASTER_ADDR...;
- no launcher: the script spawns its ranks itself (torch.multiprocessing.spawn, as PyTorch's DDP tutorial does),
  and each learns its rank in its own init_process_group call;
- any other launcher (a Kubernetes pod spec): `trainscout coordinator`, a `trainscout agent` per node and ranks
  started as `python -m trainscout.demo.train` with the environment `trainscout rank-env` prints (no torchrun).

Where two nodes are simulated on this host, each gets its own run id (as in test_multinode.py) so they share
nothing through /dev/shm, as two hosts would not.
"""

from __future__ import annotations

import os
import random
import secrets
import shlex
import shutil
import socket
import subprocess

import pytest

from conftest import JOB_TIMEOUT_S, PY, free_port, run_under_trainscout, trainscout_cmd, unique_run_id

pytestmark = pytest.mark.slow

BIN = os.path.dirname(PY)
HANG = "hang:rank=2:step=20"
# these launchers start slowly on a crowded machine (DeepSpeed imports its accelerator in every process)
LAUNCHER_TIMEOUT_S = 2 * JOB_TIMEOUT_S
DEMO = ["-m", "trainscout.demo.train", "--steps", "40"]


def assert_hang_of_rank_2_named(result) -> None:
    assert [f["kind"] for f in result.findings] == ["hang"], result.describe()
    f = result.findings[0]
    assert f["status"] == "attributed", result.describe()
    assert f["culprit_ranks"] == [2], result.describe()
    assert f["step"] == 20, result.describe()
    assert sorted(f["evidence"]["waiting_ranks"]) == [0, 1, 3], result.describe()


def test_deepspeed_launcher_hang_is_named(tmp_path):
    launch = [
        os.path.join(BIN, "deepspeed"),
        "--num_gpus",  # on CPU: the number of ranks (DeepSpeed's CPU accelerator, gloo in the script)
        "4",
        "--master_port",
        str(free_port()),
        "--no_local_rank",  # the demo script takes no --local_rank argument
        "--module",
        *DEMO[1:],
    ]
    result = run_under_trainscout(
        tmp_path, "ds-hang", launch, ("--inject", HANG, "--abort-on", "hang"), timeout=LAUNCHER_TIMEOUT_S
    )
    assert "deepspeed.launcher.launch" in result.output, result.describe()  # DeepSpeed's launcher started them
    assert_hang_of_rank_2_named(result)


SPAWN_JOB = os.path.join(os.path.dirname(__file__), "spawn_job.py")


def test_ranks_spawned_by_the_script_hang_is_named(tmp_path):
    launch = [PY, SPAWN_JOB, "40", str(free_port())]
    result = run_under_trainscout(tmp_path, "spawn-hang", launch, ("--inject", HANG, "--abort-on", "hang"))
    assert_hang_of_rank_2_named(result)


def test_ranks_spawned_by_the_script_crash_is_named_with_its_exception(tmp_path):
    # torch.multiprocessing.spawn's worker catches the exception, saves the traceback for the parent, sys.exit(1)
    launch = [PY, SPAWN_JOB, "40", str(free_port())]
    result = run_under_trainscout(tmp_path, "spawn-crash", launch, ("--inject", "crash:rank=1:step=20:how=exception"))
    crashes = [f for f in result.findings if f["kind"] == "crash"]
    assert [f["culprit_ranks"] for f in crashes] == [[1]], result.describe()
    assert "RuntimeError: trainscout injected crash" in crashes[0]["summary"], result.describe()


def test_ranks_spawned_by_the_script_are_watched_and_a_clean_run_names_nobody(tmp_path):
    result = run_under_trainscout(tmp_path, "spawn-clean", [PY, SPAWN_JOB, "60", str(free_port())])
    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    assert "topology: 4 ranks" in result.output, result.describe()
    # one probe in each rank, none in the script's own process that spawned them
    assert sorted(p.name for p in result.run_path.glob("probe-cost.rank*.json")) == [
        f"probe-cost.rank{r}.json" for r in range(4)
    ], result.describe()


def test_accelerate_launcher_hang_is_named(tmp_path):
    pytest.importorskip("accelerate", reason="the test extra installs accelerate")
    launch = [
        os.path.join(BIN, "accelerate"),
        "launch",
        "--multi_gpu",  # its multi-process path (torchrun in-process); the script's gloo runs on CPU
        "--num_processes",
        "4",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        *DEMO,
    ]
    result = run_under_trainscout(
        tmp_path, "acc-hang", launch, ("--inject", HANG, "--abort-on", "hang"), timeout=LAUNCHER_TIMEOUT_S
    )
    assert_hang_of_rank_2_named(result)


def _slurm_runs() -> bool:
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "idle" in out.stdout


@pytest.mark.skipif(not _slurm_runs(), reason="no Slurm cluster answers here (.ci/slurm-single-host sets one up)")
def test_srun_inside_a_real_allocation_hang_is_named(jobs, tmp_path):
    run_id = unique_run_id("srun-hang")
    args = [
        "salloc",
        "--ntasks=4",
        "--job-name=trainscout-test",
        *trainscout_cmd("run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain"),
        "--inject",
        HANG,
        "--abort-on",
        "hang",
        "--",
        "srun",
        "--kill-on-bad-exit=0",
        PY,
        *DEMO,
    ]
    result = jobs(args, tmp_path, run_id).wait(LAUNCHER_TIMEOUT_S)
    assert_hang_of_rank_2_named(result)
    # the agent ran as a job step of its own, named by Slurm's node index
    assert any(e["kind"] == "agent_hello" and e["node"] == "node0" for e in result.events), result.describe()


def _slurm_job_id_with_free_port() -> int:
    """A job id whose derived rendezvous port (20000 + id % 10000) is free here."""
    for _ in range(100):
        job_id = random.randrange(10_000, 10_000_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job_id % 10000))
            except OSError:
                continue
        return job_id
    raise RuntimeError("no free port in 20000-29999")


def _coordinator_and_agents(jobs, tmp_path, name: str, agent_env: list[dict], agent_args: list[list[str]]):
    """`trainscout coordinator` and one `trainscout agent` per simulated node (run id <run>-n<i>)."""
    env = {"TRAINSCOUT_SECRET": secrets.token_hex(32)}
    address = f"127.0.0.1:{free_port()}"
    run_id = unique_run_id(name)
    coordinator = jobs(
        trainscout_cmd(
            "coordinator", "--run-id", run_id, "--run-dir", str(tmp_path), "--bind", address, "--console", "plain"
        )
        + ["--abort-on", "hang"],
        tmp_path,
        run_id,
        env=env,
    )
    agents = []
    for node, (extra, more_args) in enumerate(zip(agent_env, agent_args)):
        node_run = f"{run_id}-n{node}"
        args = trainscout_cmd("agent", "--run-id", node_run, "--run-dir", str(tmp_path), "--coordinator-addr", address)
        args += more_args
        agents.append(jobs(args, tmp_path, node_run, env={**env, **extra}))
    return run_id, coordinator, agents


def _rank_environment(run_id: str, *flags: str) -> dict[str, str]:
    """What `trainscout rank-env` prints, as a dict (the documented way to make a process a rank)."""
    out = subprocess.run(
        trainscout_cmd("rank-env", "--run-id", run_id, "--inject", HANG, *flags),
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    found = {}
    for line in out.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        found[name] = shlex.split(value)[0] if value else ""
    return found


def _start_ranks(jobs, tmp_path, run_id: str, per_rank_env) -> list:
    ranks = []
    for rank in range(4):
        node_run = f"{run_id}-n{rank // 2}"
        env = {**_rank_environment(node_run, *per_rank_env(rank)[0]), **per_rank_env(rank)[1]}
        env.pop("TRAINSCOUT_SECRET", None)
        ranks.append(jobs([PY, *DEMO], tmp_path, f"{node_run}-rank{rank}", env=env))
    return ranks


def _finish(coordinator, agents, ranks):
    result = coordinator.wait(LAUNCHER_TIMEOUT_S)  # it ends once both agents left, after their ranks
    for job in (*agents, *ranks):
        job.wait(30)
    return result


def test_srun_tasks_take_their_rank_from_slurm_variables(jobs, tmp_path):
    """srun's tasks as it starts them: SLURM_* variables only (no RANK, no MASTER_ADDR); agents per node."""
    run_id, coordinator, agents = _coordinator_and_agents(
        jobs, tmp_path, "slurmvars", [{"SLURM_NODEID": "0"}, {"SLURM_NODEID": "1"}], [[], []]
    )
    job_id = _slurm_job_id_with_free_port()

    def slurm_task(rank: int):
        return ("--slurm",), {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": str(rank % 2),
            "SLURM_NODEID": str(rank // 2),
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost",
        }

    ranks = _start_ranks(jobs, tmp_path, run_id, slurm_task)
    result = _finish(coordinator, agents, ranks)
    assert_hang_of_rank_2_named(result)
    nodes = {e["node"] for e in result.events if e["kind"] == "agent_hello"}
    assert nodes == {"node0", "node1"}, result.describe()  # named from SLURM_NODEID
    assert result.findings[0]["pids"] == [ranks[2].pid], result.describe()


def test_ranks_started_by_hand_beside_coordinator_and_agents(jobs, tmp_path):
    """The Kubernetes shape (docs/launchers.md): no torchrun; each rank gets RANK/WORLD_SIZE/LOCAL_RANK and
    MASTER_ADDR/MASTER_PORT from its pod spec, the rest from `trainscout rank-env`."""
    run_id, coordinator, agents = _coordinator_and_agents(
        jobs, tmp_path, "by-hand", [{}, {}], [["--node-rank", "0"], ["--node-rank", "1"]]
    )
    master_port = str(free_port())

    def pod_env(rank: int):
        return (), {
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank % 2),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": master_port,
        }

    ranks = _start_ranks(jobs, tmp_path, run_id, pod_env)
    result = _finish(coordinator, agents, ranks)
    assert_hang_of_rank_2_named(result)
    assert result.findings[0]["pids"] == [ranks[2].pid], result.describe()
    assert {e["node"] for e in result.events if e["kind"] == "agent_hello"} == {"node0", "node1"}, result.describe()
    assert (result.run_path / "summary.md").exists(), result.describe()
    # every rank was stopped by the agents (--abort-on hang), and each agent then left on its own
    assert all(job.proc.returncode is not None for job in (*agents, *ranks))
    assert agents[0].proc.returncode == 0 and agents[1].proc.returncode == 0
