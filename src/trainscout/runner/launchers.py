"""What `trainscout run` needs to know about the launcher it starts, read from the command line alone.

Every launcher gets the probe the same way: the processes it starts inherit PYTHONPATH with the bootstrap
and the run's variables, and each rank finds its identity in RANK/WORLD_SIZE/LOCAL_RANK. Launchers differ in
three things answered here, as pure functions of the command and the environment (no torch, no I/O):
which launcher it is; which node of a multi-node job this invocation is (torchrun --node-rank, deepspeed
--node_rank, accelerate --machine_rank); and, for Slurm's srun, whether its tasks are the ranks themselves
(then the bootstrap takes each rank's identity from SLURM's variables) and how one agent per node is started
(a job step of its own). The bootstrap imports this module, so it stays free of heavy imports.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "probe", "bootstrap")
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TORCHRUN = "torchrun"
DEEPSPEED = "deepspeed"
ACCELERATE = "accelerate"
SRUN = "srun"
OTHER = "other"

# Set in the ranks' environment when their identity comes from a scheduler's variables (srun tasks that are
# the ranks themselves); read by the bootstrap. Value: "slurm".
RANKS_FROM_ENV = "TRAINSCOUT_RANKS_FROM"

_MODULES = {
    "torch.distributed.run": TORCHRUN,
    "torch.distributed.launch": TORCHRUN,
    "deepspeed.launcher.runner": DEEPSPEED,
    "accelerate.commands.launch": ACCELERATE,
    "accelerate.commands.accelerate_cli": ACCELERATE,
}
_PROGRAMS = {"torchrun": TORCHRUN, "deepspeed": DEEPSPEED, "ds": DEEPSPEED, "accelerate": ACCELERATE, "srun": SRUN}
# each launcher's flag for "this is node N of the job"
_NODE_RANK_FLAGS = {
    TORCHRUN: ("--node-rank", "--node_rank"),
    DEEPSPEED: ("--node_rank", "--node-rank"),
    ACCELERATE: ("--machine_rank", "--machine-rank"),
}


@dataclass(frozen=True)
class Launch:
    """A launch command as trainscout sees it."""

    kind: str  # TORCHRUN, DEEPSPEED, ACCELERATE, SRUN or OTHER
    node_rank: int | None  # from the launcher's own flag; None when it has none
    ranks_from_slurm: bool = False  # srun tasks are the ranks (no per-node launcher under srun)


def _kind_at(command: list[str], i: int) -> tuple[str, int]:
    """(launcher kind, index of its first argument) of the program at command[i]."""
    name = os.path.basename(command[i])
    if name in _PROGRAMS:
        return _PROGRAMS[name], i + 1
    if re.fullmatch(r"python[0-9.]*", name):
        for j in range(i + 1, len(command) - 1):
            if command[j] == "-m":
                return _MODULES.get(command[j + 1], OTHER), j + 2
            if not command[j].startswith("-"):
                break  # a script: not a launcher module
    return OTHER, i + 1


def identify(command: list[str]) -> Launch:
    """Which launcher `command` starts, and what its arguments say about this node."""
    if not command:
        return Launch(OTHER, None)
    kind, first = _kind_at(command, 0)
    if kind == ACCELERATE and command[first : first + 1] == ["launch"]:
        first += 1
    if kind == SRUN:
        inner = {_kind_at(command, j)[0] for j in range(first, len(command))}
        return Launch(SRUN, None, ranks_from_slurm=not inner & {TORCHRUN, DEEPSPEED, ACCELERATE})
    return Launch(kind, _flag_int(command[first:], _NODE_RANK_FLAGS.get(kind, ())))


def _flag_int(args: list[str], flags: tuple[str, ...]) -> int | None:
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                return int(args[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return None


def rank_variables(environ: Mapping[str, str], run_id: str, run_dir: str | None = None) -> dict[str, str]:
    """What a process needs in its environment to become a monitored rank of run `run_id` (besides the
    RANK/WORLD_SIZE/LOCAL_RANK its launcher gives it): the bootstrap first on PYTHONPATH, the run's id, and
    where the bootstrap finds trainscout."""
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    found = {
        "PYTHONPATH": os.pathsep.join([BOOTSTRAP_DIR, *paths]),
        "TRAINSCOUT_RUN_ID": run_id,
        "TRAINSCOUT_PKG_PATH": PKG_PARENT,
    }
    if run_dir:
        found["TRAINSCOUT_RUN_DIR"] = run_dir
    return found


# ---- Slurm ------------------------------------------------------------------------------------------------


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: "gpu[07-09,12],cpu1" -> "gpu07" (zero padding kept)."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if m is None or not m.group(0):
        raise ValueError(f"not a Slurm host list: {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges, maxsplit=1)[0]


def slurm_master_port(job_id: str) -> int:
    """A rendezvous port per job (two jobs sharing a node must not pick the same one): 20000-29999."""
    return 20000 + int(job_id) % 10000


def slurm_rank_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables an srun task lacks, from SLURM's: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR (the step's first node), MASTER_PORT (from the job id). Variables already
    set are kept: a script or site that sets its own wins. Empty when this is no Slurm task."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    derived = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
    }
    per_node = env.get("SLURM_TASKS_PER_NODE", "")  # "4(x2)" or "3,2": this node's count is not in it simply
    if re.fullmatch(r"\d+(\(x\d+\))?", per_node):
        derived["LOCAL_WORLD_SIZE"] = per_node.split("(")[0]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        derived["MASTER_ADDR"] = first_host(nodelist)
    if env.get("SLURM_JOB_ID", "").isdigit():
        derived["MASTER_PORT"] = str(slurm_master_port(env["SLURM_JOB_ID"]))
    return {k: v for k, v in derived.items() if k not in env}


def slurm_agent_step(agent_command: list[str], env: Mapping[str, str]) -> list[str]:
    """`srun` of one agent per node of the job, beside the training step (--overlap: it takes no CPUs from it).

    Needs an allocation (sbatch or salloc): the agents must run on the job's nodes before the ranks start."""
    nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not env.get("SLURM_JOB_ID") or not nodes:
        raise ValueError(
            "`trainscout run -- srun ...` runs inside a Slurm allocation (an sbatch script or salloc), "
            "so that one agent per node can start before the ranks"
        )
    return [
        "srun",
        "--overlap",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--ntasks={nodes}",
        "--kill-on-bad-exit=0",
        "--job-name=trainscout-agent",
        *agent_command,
    ]


def node_id_from(env: Mapping[str, str], hostname: str, node_rank: int | None = None) -> str:
    """An agent's node name: node<N> from --node-rank, else from Slurm's node index, else the host name."""
    if node_rank is not None:
        return f"node{node_rank}"
    if env.get("SLURM_NODEID", "").isdigit():
        return f"node{env['SLURM_NODEID']}"
    return hostname


def agent_cli_command(python: str, run_id: str, coordinator_addr: str, stack_method: str, nice: int) -> list[str]:
    """`trainscout agent` for this run, as a job step runs it on every node (node name from SLURM_NODEID)."""
    return [
        python,
        "-m",
        "trainscout",
        "agent",
        "--run-id",
        run_id,
        "--coordinator-addr",
        coordinator_addr,
        "--stack-method",
        stack_method,
        "--monitor-nice",
        str(nice),
    ]


def reachable_address(bound: str, env: Mapping[str, str], hostname: str) -> str:
    """HOST:PORT other nodes reach a coordinator bound to `bound` (tcp://0.0.0.0:PORT) at: the host is the
    job's first node (where an sbatch script runs), else this host's name."""
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    if host in ("0.0.0.0", "*", ""):
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        host = first_host(nodelist) if nodelist else hostname
    return f"{host}:{port}"
