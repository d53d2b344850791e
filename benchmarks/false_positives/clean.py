"""False positives: healthy demo jobs that trainscout must leave alone (zero findings, the job's own exit code).

Kinds of healthy run, 4 CPU ranks (gloo DDP, tiny GPT) unless said otherwise, 300 steps by default, each run
with its own data seed:
  plain  the demo job under `trainscout run`: nothing wrong at all;
  six    the same with 6 ranks on the machine's cores (2 here: heavily oversubscribed);
  slow   `trainscout demo --fault slow --rank all --step 0 --param ms=30`: every rank uniformly slow, so no
         rank is a straggler and nobody is to blame;
  pause  `trainscout run -- torchrun ... trainscout.demo.train --pause-at 50 --pause-seconds 12`: every rank
         checkpoints and sleeps longer than the 5 s hang timeout, a job-wide pause that is not a hang;
  hog    the plain job while --hog-procs busy-looping processes (one per core by default) compete for the
         machine's CPUs, slowing every rank: not a straggler either;
  real   examples/lm_train.py, a job written the way real ones are (DataLoader worker processes, 1 or 2 per
         rank in turn, padded variable-length batches, bf16 autocast, gradient accumulation, clipping, an
         evaluation every 50 steps and a rank-0 checkpoint every 100 between barriers): its steps are uneven
         on every rank, and none of that is a fault.
The kinds are interleaved so a burst of load on the shared machine does not fall on one kind only. A run
passes when it has zero findings and exits 0.

    .venv/bin/python -m benchmarks false-positives clean
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks._common import (
    PYTHON,
    begin,
    append_results,
    command_line,
    fmt,
    free_port,
    launch,
    markdown_table,
    median,
    read_jsonl,
    text_table,
    uptime,
)
from benchmarks._demo_job import train_cmd, under_trainscout


def demo_cmd(kind: str, args: argparse.Namespace, out: Path, run_id: str, seed: int = 0) -> list[str]:
    common = ["--console", "plain", "--run-dir", str(out), "--run-id", run_id]
    port = str(free_port())
    if kind in ("plain", "hog", "six"):
        job = train_cmd("6" if kind == "six" else "4", args.steps, "--seed", str(seed), port=port)
        return under_trainscout(job, out, run_id)
    if kind == "real":
        script = str(Path(__file__).resolve().parents[2] / "examples" / "lm_train.py")
        job = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", port, script]
        job += ["--steps", str(args.steps), "--seed", str(seed), "--workers", str(1 + seed % 2)]
        return under_trainscout(job, out, run_id)
    if kind == "slow":
        return [
            PYTHON,
            "-m",
            "trainscout",
            "demo",
            "--fault",
            "slow",
            "--rank",
            "all",
            "--step",
            "0",
            "--param",
            f"ms={args.slow_ms:g}",
            "--steps",
            str(args.steps),
            "--master-port",
            port,
            *common,
        ]
    if kind == "pause":
        pause = ["--pause-at", str(args.pause_at), "--pause-seconds", f"{args.pause_seconds:g}"]
        return under_trainscout(train_cmd(4, args.steps, *pause, port=port), out, run_id)
    raise ValueError(kind)


def schedule(plain: int, slow: int, pause: int, hog: int = 0, six: int = 0, real: int = 0) -> list[str]:
    """Spread the slow, pause, hog, six-rank and realistic runs evenly among the plain ones."""
    order: list[tuple[float, str]] = [((i + 0.5) / plain, "plain") for i in range(plain)]
    order += [((i + 0.9) / max(six, 1), "six") for i in range(six)]
    order += [((i + 0.33) / max(slow, 1), "slow") for i in range(slow)]
    order += [((i + 0.66) / max(pause, 1), "pause") for i in range(pause)]
    order += [((i + 0.8) / max(hog, 1), "hog") for i in range(hog)]
    order += [((i + 0.15) / max(real, 1), "real") for i in range(real)]
    return [kind for _, kind in sorted(order)]


def start_hog(procs: int) -> list[subprocess.Popen]:
    """Busy-looping processes: a machine-wide CPU hog, outside the job."""
    return [subprocess.Popen([PYTHON, "-c", "while True: pass"]) for _ in range(procs)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", type=int, default=14)
    parser.add_argument("--slow", type=int, default=2)
    parser.add_argument("--pause", type=int, default=2)
    parser.add_argument("--hog", type=int, default=4, help="runs beside a background CPU hog")
    parser.add_argument("--hog-procs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--six", type=int, default=0, help="runs with 6 ranks on the machine's cores")
    parser.add_argument("--real", type=int, default=2, help="runs of examples/lm_train.py (a realistic job)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--slow-ms", type=float, default=30.0)
    parser.add_argument("--pause-at", type=int, default=50)
    parser.add_argument("--pause-seconds", type=float, default=12.0)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a run is stopped")
    parser.add_argument("--out-dir", type=Path, default=None, help="run dirs and logs (default /tmp/...)")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md (smoke tests)")
    args = parser.parse_args()
    # stopped from outside (kill, pkill): exit through the finally below, which stops the hog processes
    # (left running, two of them once slowed every later benchmark on the machine)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out, info, up_before = begin("clean", args.out_dir)

    rows: list[dict] = []
    counts: dict[str, int] = {}
    for kind in schedule(args.plain, args.slow, args.pause, args.hog, args.six, args.real):
        counts[kind] = counts.get(kind, 0) + 1
        run_id = f"clean-{kind}-{counts[kind]:02d}"
        cmd = demo_cmd(kind, args, out, run_id, seed=counts[kind])
        hog = start_hog(args.hog_procs) if kind == "hog" else []
        try:
            res = launch(cmd, out / f"{run_id}.out", timeout_s=args.timeout)
        finally:
            for p in hog:
                p.kill()
                p.wait()
        findings = read_jsonl(out / run_id / "findings.jsonl")
        launcher_log = out / run_id / "launcher.log"
        done = launcher_log.exists() and "done:" in launcher_log.read_text(errors="replace")
        row = {
            "kind": kind,
            "run_id": run_id,
            "run_dir": str(out / run_id),
            "code": res.code,
            "timed_out": res.timed_out,
            "wall_s": round(res.wall_s, 2),
            "load": round(res.load_before, 2),
            "trained_to_end": done,
            "command": " ".join(cmd),
            "findings": [
                {
                    "kind": f.get("kind"),
                    "culprits": f.get("culprit_ranks"),
                    "status": f.get("status", "attributed"),  # omitted from JSON when default
                    "summary": f.get("summary"),
                }
                for f in findings
            ],
        }
        row["passed"] = not findings and res.code == 0 and not res.timed_out
        rows.append(row)
        with (out / "clean.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(
            f"{run_id}: findings={len(findings)} {[(f['kind'], f['culprits']) for f in row['findings']]} "
            f"exit={res.code} trained_to_end={done} wall {res.wall_s:.1f} s load {res.load_before:.2f}",
            flush=True,
        )
    up_after = uptime()

    header = ["run", "kind", "findings", "exit", "trained to end", "wall s", "load"]
    table = [
        [
            r["run_id"],
            r["kind"],
            "; ".join(f"{f['kind']} {f['culprits']} {f['status']}" for f in r["findings"]) or "0",
            str(r["code"]) + (" (timed out)" if r["timed_out"] else ""),
            "yes" if r["trained_to_end"] else "no",
            fmt(r["wall_s"], 1),
            fmt(r["load"]),
        ]
        for r in rows
    ]
    totals_header = ["kind", "runs", "runs with findings", "findings", "exit != 0"]
    totals = []
    for kind in ("plain", "six", "slow", "pause", "hog", "real"):
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            totals.append(
                [
                    kind,
                    str(len(mine)),
                    str(sum(1 for r in mine if r["findings"])),
                    str(sum(len(r["findings"]) for r in mine)),
                    str(sum(1 for r in mine if r["code"] != 0)),
                ]
            )
    totals.append(
        [
            "all",
            str(len(rows)),
            str(sum(1 for r in rows if r["findings"])),
            str(sum(len(r["findings"]) for r in rows)),
            str(sum(1 for r in rows if r["code"] != 0)),
        ]
    )
    print()
    print(text_table(totals_header, totals))
    print()
    print(text_table(header, table))
    print(f"uptime after: {up_after}")

    failed = [r for r in rows if not r["passed"]]
    loads = [r["load"] for r in rows]
    body = [
        f"- load: before `{up_before}`; after `{up_after}`; 1-min load at run starts median "
        f"{fmt(median(loads))}, max {fmt(max(loads))}",
        f"- {args.steps} steps per run; slow = {args.slow_ms:g} ms on every rank from step 0; pause = every rank "
        f"checkpoints and sleeps {args.pause_seconds:g} s after step {args.pause_at} (hang timeout 5 s); "
        f"hog = {args.hog_procs} busy-looping processes beside the job; six = 6 ranks; plain, hog and six runs "
        "each use their own data seed; run dirs under `<out-dir>`",
        "- pass = zero findings and exit code 0",
        "",
        markdown_table(totals_header, totals),
        "",
        markdown_table(header, table),
        "",
    ]
    body.append(
        f"Passed {len(rows) - len(failed)}/{len(rows)}."
        if not failed
        else f"**Failed {len(failed)}/{len(rows)}:** "
        + "; ".join(
            f"`{r['run_id']}`: exit {r['code']}, findings "
            f"{[(f['kind'], f['culprits'], f['summary']) for f in r['findings']]}"
            for r in failed
        )
    )
    if not args.no_record:
        append_results(
            "False positives on clean runs (python -m benchmarks false-positives clean)",
            info,
            command_line().replace(str(out), "<out-dir>"),
            "\n".join(body),
        )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
