"""Command lines of `trainscout coordinator`, `trainscout agent` and `trainscout rank-env`: the monitoring
roles started one by one, for launchers `trainscout run` does not wrap (docs/launchers.md)."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys

from trainscout import config

COMMANDS = ("coordinator", "agent", "rank-env")

_EXAMPLE = """\
example (one coordinator, an agent on every node, ranks started by anything):
  export TRAINSCOUT_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')  # same everywhere
  trainscout coordinator --run-id job1 --bind 0.0.0.0:29600 &                  # one host
  trainscout agent --run-id job1 --coordinator-addr HOST:29600 --node-rank N &  # every node
  eval "$(trainscout rank-env --run-id job1)"; RANK=... WORLD_SIZE=... python train.py
"""


def _run_id_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run-id",
        default=os.environ.get("TRAINSCOUT_RUN_ID") or None,
        help="the run's id, the same for the coordinator, every agent and every rank (default: $TRAINSCOUT_RUN_ID)",
    )
    p.add_argument("--run-dir", default="runs", help="folder for runs/<run-id>/ (default: ./runs)")
    p.add_argument("--config", metavar="FILE", help=f"settings file (default: ./{config.TOML_FILE} if present)")
    p.add_argument("--monitor-nice", type=int, default=None, metavar="N", help="CPU niceness added (0-19)")


def add_parsers(sub) -> None:
    coord = sub.add_parser(
        "coordinator",
        help="run a job's coordinator alone (launchers trainscout does not wrap)",
        description="The coordinator of one job, in the foreground: it judges what the agents of every "
        "node report, prints findings and writes runs/<run-id>/ (findings.jsonl, events.jsonl, summary.md). "
        "It ends once every agent that connected has said goodbye, or on SIGTERM. Needs TRAINSCOUT_SECRET "
        "(hex, the same as the agents').",
        epilog=_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _run_id_option(coord)
    coord.add_argument(
        "--bind", default="0.0.0.0:29600", metavar="HOST:PORT", help="where agents reach it (default 0.0.0.0:29600)"
    )
    coord.add_argument("--hang-timeout", type=float, default=None, metavar="S", help="see `trainscout config`")
    coord.add_argument("--stall-timeout", type=float, default=None, metavar="S", help="see `trainscout config`")
    coord.add_argument("--abort-on", default=None, metavar="KINDS", help="finding kinds that stop the training job")
    coord.add_argument("--console", choices=["auto", "rich", "plain"], default=None)
    agent = sub.add_parser(
        "agent",
        help="run one node's agent alone (launchers trainscout does not wrap)",
        description="The agent of this node, in the foreground: it reads the run's ranks on this host "
        "(their shared memory; stacks from outside them, so it needs their process namespace) and reports "
        "to the coordinator. Needs TRAINSCOUT_SECRET, the coordinator's. It ends a few seconds after the "
        "last rank of this node exited (unless --keep-running), or on SIGTERM.",
        epilog=_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _run_id_option(agent)
    agent.add_argument("--coordinator-addr", required=True, metavar="HOST:PORT", help="the coordinator's --bind")
    agent.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's index, named node<N> in findings (default: $SLURM_NODEID, else the host name)",
    )
    agent.add_argument("--stack-method", choices=["py-spy", "faulthandler"], default=None)
    agent.add_argument(
        "--keep-running", action="store_true", help="stay after this node's ranks exited (until SIGTERM)"
    )
    env = sub.add_parser(
        "rank-env",
        help="print the environment that makes a process a monitored rank",
        description="Shell `export` lines that make processes started by any launcher ranks of a run: the "
        "bootstrap on PYTHONPATH, the run id, where trainscout is. The ranks also need RANK, WORLD_SIZE and "
        "LOCAL_RANK (their launcher's, or, with --slurm, derived from SLURM's variables).",
        epilog='example: eval "$(trainscout rank-env --run-id job1)"',
    )
    env.add_argument("--run-id", default=os.environ.get("TRAINSCOUT_RUN_ID") or None, help="the run's id")
    env.add_argument("--inject", default="", metavar="SPEC", help="a fault to inject (docs/faults.md)")
    env.add_argument(
        "--slurm",
        action="store_true",
        help="srun tasks are the ranks: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from SLURM_*",
    )


def main(args) -> int:
    if not args.run_id or not config_run_id_ok(args.run_id):
        print(f"trainscout {args.cmd}: give --run-id NAME (letters, digits, '.', '_', '-')", file=sys.stderr)
        return 2
    if args.cmd == "rank-env":
        return _rank_env(args)
    flags = {"run.monitor_nice": args.monitor_nice}
    if args.cmd == "coordinator":
        flags.update(
            {
                "run.hang_timeout": args.hang_timeout,
                "run.stall_timeout": args.stall_timeout,
                "run.abort_on": args.abort_on,
                "run.console": args.console,
            }
        )
    else:
        flags["run.stack_method"] = args.stack_method
    try:
        cfg, _ = config.load(flags, toml_path=args.config)
    except config.ConfigError as exc:
        print(f"trainscout: bad setting: {exc}", file=sys.stderr)
        return 2
    address = args.bind if args.cmd == "coordinator" else args.coordinator_addr
    if ":" not in address:
        print(f"trainscout {args.cmd}: the address must be HOST:PORT, not {address!r}", file=sys.stderr)
        return 2
    from trainscout.runner.launchers import node_id_from
    from trainscout.runner.standalone import AgentService, CoordinatorService
    from trainscout.runner.supervisor import RunOptions

    is_coordinator = args.cmd == "coordinator"
    opts = RunOptions(
        command=[],
        run_root=args.run_dir,
        run_id=args.run_id,
        hang_timeout_s=cfg.run.hang_timeout,
        stall_timeout_s=cfg.run.stall_timeout,
        abort_on=[k for k in cfg.run.abort_on.split(",") if k],
        coordinator_addr=address,
        serve_coordinator=is_coordinator,
        node_id=None if is_coordinator else node_id_from(os.environ, socket.gethostname(), args.node_rank),
        stack_method=cfg.run.stack_method,
        console=cfg.run.console,
        monitor_nice=cfg.run.monitor_nice,
        settings=config.to_environ(cfg),
        agent_until_ranks_exit=not is_coordinator and not args.keep_running,
    )
    service = CoordinatorService(opts) if is_coordinator else AgentService(opts)
    return service.run()


def config_run_id_ok(run_id: str) -> bool:
    from trainscout.cli import _RUN_ID

    return bool(_RUN_ID.fullmatch(run_id))


def _rank_env(args) -> int:
    from trainscout.faults.spec import parse_faults
    from trainscout.runner.launchers import RANKS_FROM_ENV, rank_variables

    variables = rank_variables(os.environ, args.run_id)
    if args.inject:
        try:
            parse_faults(args.inject)
        except ValueError as exc:
            print(f"trainscout: bad --inject: {exc}", file=sys.stderr)
            return 2
        variables["TRAINSCOUT_INJECT"] = args.inject
    if args.slurm:
        variables[RANKS_FROM_ENV] = "slurm"
    for name, value in variables.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0
