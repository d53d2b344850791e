"""What each numerical-integrity check costs on the demo workload, side by side with the checks off.

One invocation runs, interleaved round by round, the demo job (4 ranks, gloo DDP) without trainscout and
under `trainscout run` with: every check off (the foundation alone), one check on at a time (replicated
state, non-finite origin, replay), and the defaults (all on). Step times come from rank 0 (first --warmup
steps dropped). A/B step times on a shared 2-core machine move by several percent from run to run, more
than one check costs, so the table also gives each rank's own accounting of the time its checks took on
the training thread (`probe-cost.rank*.json`, written at exit): that is the number to hold against the
0.5 % budgets; the A/B ratios bound what the accounting might miss (background threads, cache effects).

    .venv/bin/python -m benchmarks overhead checks --rounds 3 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainscout.sinks import probe_costs

from benchmarks._common import (
    begin,
    CpuSampler,
    append_results,
    command_line,
    fmt,
    launch,
    markdown_table,
    median,
    read_jsonl,
    text_table,
    uptime,
)
from benchmarks._demo_job import step_seconds, train_cmd, under_trainscout

OFF = {"TRAINSCOUT_STATE_CHECK": "0", "TRAINSCOUT_NONFINITE_CHECK": "0", "TRAINSCOUT_REPLAY_EVERY": "0"}
CONFIGS = {
    "baseline": None,
    "checks off": OFF,
    "state only": {**OFF, "TRAINSCOUT_STATE_CHECK": "1"},
    "non-finite only": {**OFF, "TRAINSCOUT_NONFINITE_CHECK": "1"},
    "replay only": {k: v for k, v in OFF.items() if k != "TRAINSCOUT_REPLAY_EVERY"},
    "defaults (all on)": {},
}


def one_run(name: str, env: dict | None, index: int, args, out: Path) -> dict:
    run_id = f"chk-{name.split()[0].replace('-', '')}-{index:02d}"
    timing = out / f"{run_id}.steps.txt"
    timing.unlink(missing_ok=True)
    job = train_cmd(args.nproc, args.steps, "--timing-file", str(timing))
    cmd = job if env is None else under_trainscout(job, out, run_id)
    sampler = CpuSampler(out / f"{run_id}.out", args.warmup)
    res = launch(cmd, out / f"{run_id}.out", env=env or {}, timeout_s=args.timeout, sampler=sampler)
    steps = step_seconds(timing)
    kept = steps[args.warmup :]
    costs = probe_costs.read_reports(str(out / run_id)) if env is not None else []
    findings = read_jsonl(out / run_id / "findings.jsonl") if env is not None else []
    return {
        "config": name,
        "run_id": run_id,
        "code": res.code,
        "load": round(res.load_before, 2),
        "median_ms": 1000 * median(kept) if kept else None,
        "cpu_ms": sampler.cpu_ms_per_step(),
        "costs": costs,
        "findings": [(f.get("kind"), f.get("culprit_ranks")) for f in findings],
    }


def accounting(rows: list[dict], check: str) -> tuple[float | None, float | None, str]:
    """Median over runs and ranks of ms/step and % of step time the rank spent in `check`; plus detail."""
    reports = [c for r in rows for c in r["costs"]]
    per_step, share = probe_costs.per_step(reports, check)
    detail = set()
    for c in reports:
        if check == "state_check" and check in c:
            detail.add(
                f"stride {c[check]['stride']}, {c[check]['slots']} slots, period {c[check]['period_steps']} steps"
            )
        elif check == "replay" and check in c:
            detail.add(f"every {c[check]['every']} steps, {c[check]['count']} replays")
    if not per_step:
        return None, None, ""
    return median(per_step), median(share), "; ".join(sorted(detail)[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated configurations to run (default: all of "
        + ", ".join(CONFIGS)
        + "); baseline and checks off are always run",
    )
    args = parser.parse_args()
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    unknown = wanted - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configuration(s) {sorted(unknown)}; choose from {list(CONFIGS)}")
    configs = {k: v for k, v in CONFIGS.items() if not wanted or k in wanted or k in ("baseline", "checks off")}
    out, info, up_before = begin("check-overhead", args.out_dir)
    rows: list[dict] = []
    for i in range(args.rounds):
        for name, env in configs.items():
            row = one_run(name, env, i, args, out)
            rows.append(row)
            with (out / "check_overhead.jsonl").open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(
                f"{row['run_id']}: {name}: median {fmt(row['median_ms'], 3)} ms, exit {row['code']}, load "
                f"{row['load']:.2f}" + (f", findings {row['findings']}" if row["findings"] else ""),
                flush=True,
            )
    up_after = uptime()

    def med(name: str, key: str = "median_ms") -> float | None:
        vals = [r[key] for r in rows if r["config"] == name and r[key] is not None]
        return median(vals) if vals else None

    base, off = med("baseline"), med("checks off")
    cbase, coff = med("baseline", "cpu_ms"), med("checks off", "cpu_ms")
    header = [
        "configuration",
        "median of run medians ms",
        "vs baseline",
        "vs checks off",
        "CPU ms/step (all processes)",
        "CPU vs baseline",
        "CPU vs checks off",
        "in-rank accounting ms/step",
        "% of step time",
        "schedule",
    ]
    table = []
    for name in configs:
        m = med(name)
        check = {"state only": "state_check", "replay only": "replay", "non-finite only": "nonfinite"}.get(name)
        acc = accounting([r for r in rows if r["config"] == name], check) if check else (None, None, "")
        c = med(name, "cpu_ms")
        table.append(
            [
                name,
                fmt(m, 3),
                fmt(m / base, 4) if m and base else "-",
                fmt(m / off, 4) if m and off and name != "baseline" else "-",
                fmt(c, 2),
                fmt(c / cbase, 4) if c and cbase else "-",
                fmt(c / coff, 4) if c and coff and name != "baseline" else "-",
                fmt(acc[0], 3) if acc[0] is not None else "-",
                fmt(acc[1], 3) if acc[1] is not None else "-",
                acc[2],
            ]
        )
    per_round = markdown_table(
        ["round"] + list(configs),
        [
            [str(i)] + [fmt(r["median_ms"], 3) for r in rows[i * len(configs) : (i + 1) * len(configs)]]
            for i in range(args.rounds)
        ],
    )
    print()
    print(text_table(header, table))
    print(f"uptime after: {up_after}")
    findings = [(r["run_id"], r["findings"]) for r in rows if r["findings"]]
    failed = [r["run_id"] for r in rows if r["code"] != 0 or r["median_ms"] is None]
    body = [
        f"- uptime before `{up_before}`; after `{up_after}`; 1-min load at run starts "
        f"{min(r['load'] for r in rows):.2f}-{max(r['load'] for r in rows):.2f}",
        f"- {args.rounds} rounds x {len(configs)} configurations, interleaved; {args.nproc} ranks, {args.steps} "
        f"steps, first {args.warmup} ignored; step time from rank 0; run dirs under `<out-dir>`",
        "- in-rank accounting: seconds each rank's probe spent in the check on the training thread "
        "(`probe-cost.rank*.json`), median over ranks and runs",
        "",
        markdown_table(header, table),
        "",
        "Median step ms per run:",
        "",
        per_round,
        "",
    ]
    if findings:
        body.append(f"**Findings on healthy runs:** {findings}")
    if failed:
        body.append(f"**Runs that failed or wrote no timings:** {failed}")
    if not args.no_record:
        append_results(
            "Per-check overhead (python -m benchmarks overhead checks)", info, command_line(), "\n".join(body)
        )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
