"""Command line: `trainscout run | demo | report`."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

from trainscout import __version__, config
from trainscout.faults.spec import KINDS as FAULT_KINDS
from trainscout.runner import standalone_cli
from trainscout.runner.handoff import EXIT_HELP

FINDING_HELP = """\
findings (printed live, saved to runs/<run-id>/findings.jsonl and summary.md):
  hang        some ranks wait in a collective that the named rank(s) never entered
  desync      the named rank issued a different collective (op, shape, dtype, reduce op or
              process group) than its peers at the same sequence number
  crash       the named rank died first (exception, signal); later failures are listed as collateral
  early_exit  the named rank exited cleanly while its peers still had work
  stall       the whole job stopped at the same point for a long time; nobody to blame
  straggler   its peers wait for the named rank: blocked off the CPU (sleep, I/O, a lock), compute, data
              loading, checkpoint writes, starved of a core, or its link; with the function its time goes to
  sdc         silent data corruption: a replica's weights, optimizer state, gathered parameters or a
              recomputed layer differ from the other replicas', or its local loss or gradient norms leave
              its replicas' (confirmed by replay: reproduced, or a transient)
  nonfinite   the first loss or local gradient that turned NaN/Inf, before a reduction spread it
  health      the same replica computed a layer wrong twice: its device is faulty
  hpz_race    ZeRO++ hpZ: a module ran backward with weights other than those of its forward
status: attributed (a strict majority names the culprit) or inconclusive (no majority: nobody blamed)
"""

RUN_EXAMPLE = """\
examples:
  trainscout run -- torchrun --nproc-per-node 8 train.py --lr 3e-4
  trainscout run --inject hang:rank=2:step=20 -- torchrun --nproc-per-node 4 train.py
  # two nodes: the same secret everywhere, node 0 serves the coordinator
  export TRAINSCOUT_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
  trainscout run --coordinator-addr 10.0.0.1:29600 -- torchrun --nnodes 2 --node-rank 0 ...
  trainscout run --coordinator-addr 10.0.0.1:29600 --node-rank 1 -- torchrun --nnodes 2 --node-rank 1 ...
"""


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default="runs", help="folder for runs/<run-id>/ (default: ./runs)")
    p.add_argument("--run-id", help="name of this run: letters, digits, '.', '_', '-' (default: date-time + random)")
    p.add_argument(
        "--inject",
        default="",
        metavar="SPEC",
        help="inject a fault, e.g. hang:rank=2:step=20 (see `trainscout demo --help`)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"settings file (default: ./{config.TOML_FILE} if present; see `trainscout config`)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds without progress on any rank before a hang is judged (default {config.RUN.hang_timeout:g})",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds a job-wide pause may last before a stall is reported (default {config.RUN.stall_timeout:g})",
    )
    p.add_argument(
        "--abort-on",
        default=None,
        metavar="KINDS",
        help="comma-separated finding kinds that stop the training job (e.g. hang,desync)",
    )
    p.add_argument(
        "--coordinator-addr",
        metavar="HOST:PORT",
        help="multi-node: address of the coordinator; node 0 serves it, other nodes connect",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="multi-node: this node's rank (default: read from the launcher's --node-rank, else 0)",
    )
    p.add_argument(
        "--stack-method",
        choices=["py-spy", "faulthandler"],
        default=None,
        help="how stacks are taken from outside a stuck rank (falls back to faulthandler)",
    )
    p.add_argument(
        "--console",
        choices=["auto", "rich", "plain"],
        default=None,
        help="finding output style (auto: rich on a terminal, plain lines otherwise)",
    )
    p.add_argument(
        "--monitor-nice",
        type=int,
        default=None,
        metavar="N",
        help="CPU niceness added to the agent and coordinator, 0-19 (default 0): they then use a busy "
        "machine's idle moments, but react later under load",
    )
    p.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default=None,
        help="least severe line written to runs/<id>/trainscout.log (default INFO)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help="serve Prometheus metrics at http://ADDR:N/metrics while the job runs (default 0: off; "
        "needs trainscout[metrics]; docs/metrics.md)",
    )
    p.add_argument("--metrics-addr", default=None, metavar="ADDR", help="address the metrics bind (default 127.0.0.1)")
    p.add_argument(
        "--notify",
        action="append",
        default=None,
        metavar="URL",
        help="POST each finding as JSON (with a chat `text` line) to this webhook; repeat or comma-separate",
    )
    p.add_argument(
        "--on-finding",
        default=None,
        metavar="CMD",
        help="shell command run once per finding that names a culprit, in the background and one at a time; "
        "$TRAINSCOUT_VERDICT is the path of runs/<run-id>/verdict.json (output: on_finding.log)",
    )
    p.add_argument(
        "--exit-status",
        choices=["verdict", "launcher"],
        default=None,
        help="verdict (default): 0 ok, 3 fault localized, 4 failed and nobody named (below); "
        "launcher: the launcher's own exit code",
    )


def _flag_settings(args) -> dict:
    """The settings given as flags of `trainscout run` (None: not given)."""
    return {
        "run.hang_timeout": args.hang_timeout,
        "run.stall_timeout": args.stall_timeout,
        "run.abort_on": args.abort_on,
        "run.monitor_nice": args.monitor_nice,
        "run.stack_method": args.stack_method,
        "run.console": args.console,
        "run.log_level": args.log_level,
        "run.metrics_port": args.metrics_port,
        "run.metrics_addr": args.metrics_addr,
        "run.notify": ",".join(args.notify) if args.notify else None,
        "run.on_finding": args.on_finding,
        "run.exit_status": args.exit_status,
    }


def _outputs_problem(cfg: config.Config) -> str | None:
    """Why the metrics or alert settings cannot work (None: they can), told before the job starts."""
    from trainscout.sinks import metrics, notify

    if cfg.run.metrics_port and not metrics.available():
        return f"--metrics-port needs prometheus-client: {metrics.INSTALL_HINT}"
    try:
        notify.parse_urls(cfg.run.notify)
    except ValueError as exc:
        return f"bad --notify: {exc}"
    return None


def _launcher_node_rank(command: list[str]) -> int | None:
    from trainscout.runner.launchers import identify

    return identify(command).node_rank


def _run(args, command: list[str], on_done=None) -> int:
    """`trainscout run`; on_done(exit status, findings) may replace the job's exit status (the demo's verdict)."""
    from trainscout.faults.spec import parse_faults
    from trainscout.runner.handoff import exit_meaning, exit_status
    from trainscout.channel.layout import claim_run_id, release_run_id
    from trainscout.runner.supervisor import RunOptions, Supervisor, live_ranks, run_dir_of

    if not command:
        print(
            "trainscout run: give the launch command after --, e.g. "
            "trainscout run -- torchrun --nproc-per-node 4 train.py",
            file=sys.stderr,
        )
        return 2
    if args.inject:
        try:
            parse_faults(args.inject)
        except ValueError as exc:
            print(f"trainscout: bad --inject: {exc}", file=sys.stderr)
            return 2
    try:
        cfg, _ = config.load(_flag_settings(args), toml_path=args.config)
    except config.ConfigError as exc:
        print(f"trainscout: bad setting: {exc}", file=sys.stderr)
        return 2
    args.effective = cfg
    problem = _outputs_problem(cfg)
    if problem:
        print(f"trainscout: {problem}", file=sys.stderr)
        return 2
    from trainscout.findings import KINDS

    abort_on = [k for k in cfg.run.abort_on.split(",") if k]
    bad = [k for k in abort_on if k not in KINDS]
    if bad:
        print(
            f"trainscout: unknown kind(s) in --abort-on: {','.join(bad)} (kinds: {', '.join(KINDS)})", file=sys.stderr
        )
        return 2
    node_rank = args.node_rank if args.node_rank is not None else (_launcher_node_rank(command) or 0)
    if args.coordinator_addr and ":" not in args.coordinator_addr:
        print("trainscout: --coordinator-addr must be HOST:PORT", file=sys.stderr)
        return 2
    if node_rank > 0 and not args.coordinator_addr:
        print("trainscout: nodes other than 0 need --coordinator-addr HOST:PORT of node 0", file=sys.stderr)
        return 2
    opts = RunOptions(
        command=command,
        run_root=args.run_dir,
        run_id=args.run_id,
        inject=args.inject,
        hang_timeout_s=cfg.run.hang_timeout,
        stall_timeout_s=cfg.run.stall_timeout,
        abort_on=abort_on,
        coordinator_addr=args.coordinator_addr,
        serve_coordinator=node_rank == 0,
        node_id=f"node{node_rank}",
        stack_method=cfg.run.stack_method,
        console=cfg.run.console,
        monitor_nice=cfg.run.monitor_nice,
        tool_restarts=cfg.run.tool_restarts,
        settings=config.to_environ(cfg),
    )
    problem = _run_place_problem(args.run_dir, args.run_id)
    if problem:
        print(f"trainscout: {problem}", file=sys.stderr)
        return 2
    if args.run_id:
        # a run's files are appended to: a second run in the same folder would report the first one's findings
        run_path = run_dir_of(opts, args.run_id)
        if any(
            os.path.exists(os.path.join(run_path, name))
            for name in ("events.jsonl", "events.supervisor.jsonl", "findings.jsonl")
        ):
            print(
                f"trainscout: {run_path} already holds a run (its findings would mix with this one's): "
                "choose another --run-id, or remove that folder",
                file=sys.stderr,
            )
            return 2
        # run ids name this host's shared-memory channels: a second run with a live run's id would overwrite
        # its channels, and at its own exit remove them and kill that run's ranks as its leftovers
        busy = live_ranks(args.run_id)
        if busy:
            ranks = ", ".join(f"rank {r} (pid {p})" for r, p in sorted(busy.items()))
            print(
                f"trainscout: run id {args.run_id!r} is in use by a job running on this host ({ranks}): "
                "choose another --run-id",
                file=sys.stderr,
            )
            return 2
    try:  # claimed inside the try: an interrupt at any moment from here leaves no claim behind
        if args.run_id:
            holder = claim_run_id(args.run_id)
            if holder is not None:
                print(
                    f"trainscout: run id {args.run_id!r} is in use by a job starting on this host (trainscout pid "
                    f"{holder}): choose another --run-id",
                    file=sys.stderr,
                )
                return 2
        supervisor = Supervisor(opts)
        status = supervisor.run()
    finally:
        if args.run_id:  # (the supervisor's clean-up removed it already, unless it never got that far)
            release_run_id(args.run_id)
    if on_done is not None:
        return on_done(status, supervisor.findings)
    final = exit_status(status, supervisor.findings, supervisor.interrupted_by, cfg.run.exit_status)
    if final != status:
        print(f"trainscout: the launcher exited {status}; trainscout exits {final} ({exit_meaning(final)})", flush=True)
    return final


DEMO_STEPS = 100
DEMO_STEPS_CORRUPT = 400


def _demo_command(args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.nproc),
        "--master-port",
        str(args.master_port),
        "-m",
        "trainscout.demo.train",
        "--steps",
        str(args.steps),
    ]


def _demo_faults(args) -> list:
    """The demo's injected faults, checked against its size and length (a fault that cannot fire would read as
    a detector failure)."""
    from trainscout.faults.spec import parse_faults

    specs = parse_faults(args.inject) if args.inject else []
    if args.steps is None:
        args.steps = DEMO_STEPS_CORRUPT if any(s.kind == "corrupt" for s in specs) else DEMO_STEPS
    for spec in specs:
        bad = [r for r in spec.ranks or () if r >= args.nproc]
        if bad:
            raise ValueError(f"rank {bad[0]} is not in a {args.nproc}-rank demo (ranks 0-{args.nproc - 1})")
        if spec.step > args.steps:
            raise ValueError(
                f"{spec.kind} at step {spec.step} would never fire: the demo trains {args.steps} steps (--steps)"
            )
    return specs


def _demo_verdict(specs: list, status: int, findings: list, hang_timeout_s: float) -> int:
    """Print whether the injected fault was named; the demo's exit status is that verdict."""
    from trainscout.demo.verdict import judge

    verdict = judge(specs, findings, status, hang_timeout_s=hang_timeout_s)
    for line in verdict.lines:
        print(f"trainscout: {line}", flush=True)
    if verdict.ok is None:
        return status
    return 0 if verdict.ok else 1


_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _run_place_problem(run_dir: str, run_id: str | None) -> str | None:
    """Why the run's folder cannot be used (None: it can). A run id names a folder under --run-dir and this
    host's shared-memory channels: a path in it would write outside --run-dir and leave every probe without
    its channel."""
    if run_id is not None and not _RUN_ID.fullmatch(run_id):  # also refuses "." and "..": first character
        return (
            f"--run-id {run_id!r} is not a plain name: use letters, digits, '.', '_' and '-' "
            "(up to 128, not starting with '.', '_' or '-')"
        )
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as exc:
        return f"--run-dir {run_dir!r} cannot hold the run's files: {exc.strerror or exc}"
    return None


def _request_replay(run_dir: str, layer: str) -> int:
    from trainscout.coordinator.main import REPLAY_REQUEST

    if not os.path.exists(os.path.join(run_dir, "coordinator.addr")):
        print(
            f"trainscout: {run_dir} is not the folder of a running trainscout job (no coordinator.addr)",
            file=sys.stderr,
        )
        return 2
    path = os.path.join(run_dir, REPLAY_REQUEST)
    with open(path + ".tmp", "w") as fh:
        json.dump({"layer": layer}, fh)
    os.replace(path + ".tmp", path)  # the coordinator reads it whole or not at all
    print(
        f"trainscout: replay of {layer or 'the next layer'} requested; the coordinator schedules it a few seconds "
        f"of training ahead (events.jsonl: replay_requested; findings as usual)"
    )
    return 0


def _print_config(args) -> int:
    if args.markdown:
        sys.stdout.write(config.markdown())
        return 0
    try:
        cfg, sources = config.load(toml_path=args.config)
    except config.ConfigError as exc:
        print(f"trainscout: bad setting: {exc}", file=sys.stderr)
        return 2
    rows = config.describe(cfg, sources)
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    for path, value, source, env, doc in rows:
        print(f"{path:<{width}}  {value:<{vwidth}}  {source:<7}  {env}  {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(
        prog="trainscout",
        description="Names the rank, host or process that broke a distributed PyTorch job, while it runs. "
        "Attach it to an unmodified launch command with `trainscout run -- torchrun ...`.",
        epilog=FINDING_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"trainscout {__version__}")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="monitor a training launch command given after --",
        description="Run a launcher (torchrun, python -m torch.distributed.run, deepspeed, accelerate launch, "
        "srun inside an allocation) under trainscout. The training script needs no change. Other launchers: "
        "`trainscout coordinator`, `trainscout agent` (docs/launchers.md).",
        epilog=RUN_EXAMPLE + "\n" + EXIT_HELP + "\n" + FINDING_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_options(run)
    demo = sub.add_parser(
        "demo",
        help="4 CPU ranks, a tiny GPT, one injected fault, localized live",
        description="A 4-rank CPU (gloo) DDP job training a tiny GPT under trainscout, with one "
        "injected fault. Faults: " + ", ".join(FAULT_KINDS) + ", none. "
        "Exits 0 when trainscout named the injected fault (its kind and exactly its "
        "rank) or, with --fault none, when the job ran clean with no finding; 1 when "
        "it did not; the training job's own exit status is printed.",
        epilog="fault parameters: crash how=kill|segv|term|int|exception; exit code=N; "
        "desync what=shape|dtype|op|reduce|pg; slow ms=N; pause seconds=N; "
        "corrupt how=bitflip|sign|scale|pct1|pct100|expflip|signflip "
        "target=param|state key=NAME frac=F factor=F; nan where=param|grad; "
        "straggle factor=F every=N; delay how=sleep|busy|read|lock|gpu|data ms=N every=N "
        "layer=NAME; starve hogs=N; gradnoise how=tensor|activation scale=F count=N "
        "layer=NAME; outflip how=hook|patch factor=F layer=NAME "
        "(docs/faults.md)\n\n" + FINDING_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--fault", default="hang", help="fault kind to inject, or none (default hang)")
    demo.add_argument("--rank", default="2", help="rank to fault, or all (default 2)")
    demo.add_argument("--step", type=int, default=20, help="optimizer step at which it fires (default 20)")
    demo.add_argument("--param", action="append", default=[], metavar="K=V", help="fault parameter, e.g. what=reduce")
    demo.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps (default {DEMO_STEPS}; {DEMO_STEPS_CORRUPT} with --fault corrupt: at "
        "default settings the replicated-state check and replay cover the model in a few hundred "
        "steps)",
    )
    demo.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    demo.add_argument("--master-port", type=int, default=29512)
    demo.add_argument("--keep-running", action="store_true", help="do not stop the job after the finding")
    _add_run_options(demo)
    ckpt = sub.add_parser(
        "checkpoints",
        help="list checkpoint certificates and which checkpoint to trust",
        description="List the trainscout certificates under DIR (written next to checkpoints "
        "saved with torch.save, torch.distributed.checkpoint or DeepSpeed), judge "
        "them against the run's findings, and name the checkpoint to recover from.",
    )
    ckpt.add_argument("dir", help="folder to search (recursively)")
    replay = sub.add_parser(
        "replay",
        help="ask a running job's replicas to replay a layer now (SDC check)",
        description="Ask the coordinator of a running `trainscout run` to schedule an in-situ "
        "replay: every replica recomputes one layer on the same input with its live "
        "parameters a few seconds of training from now, and the outputs are compared "
        "(findings as for scheduled replays). Needs replay enabled "
        "(TRAINSCOUT_REPLAY_EVERY > 0, DDP over 3 or more replicas to attribute).",
    )
    replay.add_argument("run_dir", help="runs/<run-id> of the running job")
    replay.add_argument(
        "--layer", default="", help="layer to replay (e.g. blocks.1); default: the next one of the rotation"
    )
    cfg_cmd = sub.add_parser(
        "config",
        help="print every setting's effective value and where it came from",
        description="Every setting of trainscout with its effective value here (flags aside: "
        "environment, then ./trainscout.toml or --config FILE, then the default), "
        "the environment variable that sets it, and what it does.",
    )
    cfg_cmd.add_argument("--config", metavar="FILE", help=f"settings file (default: ./{config.TOML_FILE} if present)")
    cfg_cmd.add_argument("--markdown", action="store_true", help="print the settings reference (docs/configuration.md)")
    standalone_cli.add_parsers(sub)
    report = sub.add_parser("report", help="print the summary of a finished run")
    report.add_argument("run_dir", help="runs/<run-id>")
    report.add_argument(
        "--html", action="store_true", help="write report.html (charts) in the run folder, print its path"
    )
    args = parser.parse_args(argv)

    if args.cmd == "run":
        return _run(args, command)
    if args.cmd == "demo":
        if command:
            parser.error("demo takes no command after --")
        if args.fault != "none":
            spec = f"{args.fault}:rank={args.rank}:step={args.step}" + "".join(f":{p}" for p in args.param)
            args.inject = args.inject or spec
        if not args.abort_on and not args.keep_running:
            args.abort_on = "hang,desync,early_exit,stall"
        try:
            specs = _demo_faults(args)
        except ValueError as exc:
            print(f"trainscout demo: {exc}", file=sys.stderr)
            return 2

        def judged(status: int, findings: list) -> int:
            return _demo_verdict(specs, status, findings, args.effective.run.hang_timeout)

        return _run(args, _demo_command(args), on_done=judged)
    if args.cmd in standalone_cli.COMMANDS:
        return standalone_cli.main(args)
    if args.cmd == "config":
        return _print_config(args)
    if args.cmd == "checkpoints":
        from trainscout.checkpoint_list import main as list_main

        return list_main(args.dir, sys.stdout)
    if args.cmd == "replay":
        return _request_replay(args.run_dir, args.layer)
    if args.cmd == "report" and args.html:
        from trainscout.sinks.report_html import write_report

        if not os.path.isdir(args.run_dir):
            print(f"trainscout: no run folder {args.run_dir}", file=sys.stderr)
            return 2
        print(write_report(args.run_dir))
        return 0
    if args.cmd == "report":
        path = os.path.join(args.run_dir, "summary.md")
        if not os.path.exists(path):
            print(f"trainscout: no summary.md in {args.run_dir}", file=sys.stderr)
            return 2
        with open(path) as fh:
            sys.stdout.write(fh.read())
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
