"""Healthy-path overhead: the demo job's step time with and without trainscout attached, side by side.

Both sides run the same 4-rank gloo DDP job (`python -m torch.distributed.run ... trainscout.demo.train
--timing-file F`); the trainscout side wraps it in `python -m trainscout run --console plain --`. Runs are
interleaved in pairs, the order alternating (baseline/trainscout, trainscout/baseline, ...), so slow drifts
of a shared machine's load hit both sides alike. The headline is the median of the per-pair ratios with a
95 % bootstrap interval over pairs: the bar is met only when the whole interval is under it. Step times come from rank 0 (whole iteration: data, forward, backward, optimizer, loss
all-reduce), the first --warmup steps dropped. The bar: <= 1 % on CPU.

The script first waits (up to --max-wait s, polling every 15 s) for the 1-minute load average to drop below
--load-below, because on a 2-core machine another job's burst is larger than the effect measured; if it never
drops the benchmark runs anyway and says so. --trainscout-env / --baseline-env (K=V, repeatable) run the same
comparison with changed settings, e.g. TRAINSCOUT_PROBE_TICK_S=1.0 to see what the probe's poll interval costs,
or TORCH_FR_BUFFER_SIZE=2000 on the baseline to isolate the Flight Recorder.

    .venv/bin/python -m benchmarks overhead pairs --pairs 5 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks._common import (
    CpuSampler,
    append_results,
    bootstrap_median_ci,
    command_line,
    date_utc,
    default_out_dir,
    fmt,
    launch,
    load1,
    machine,
    markdown_table,
    median,
    parse_env,
    percentile,
    read_jsonl,
    text_table,
    uptime,
)
from benchmarks._demo_job import step_seconds, train_cmd, under_trainscout

BAR = 1.01


def wait_for_quiet(threshold: float, max_wait_s: float, poll_s: float = 15.0) -> tuple[float, float, bool]:
    """Returns (load at start, seconds waited, whether the load was below threshold)."""
    started = time.monotonic()
    while True:
        load = load1()
        if load < threshold:
            return load, time.monotonic() - started, True
        waited = time.monotonic() - started
        if waited >= max_wait_s:
            return load, waited, False
        print(f"waiting for 1-min load < {threshold:g}: now {load:.2f} ({waited:.0f} s waited)", flush=True)
        time.sleep(poll_s)


def one_run(side: str, index: int, args: argparse.Namespace, out: Path, env: dict[str, str]) -> dict:
    run_id = f"oh-{side}-{index:02d}"
    timing = out / f"{run_id}.steps.txt"
    timing.unlink(missing_ok=True)
    job = train_cmd(args.nproc, args.steps, "--timing-file", str(timing))
    cmd = job if side == "base" else under_trainscout(job, out, run_id)
    sampler = CpuSampler(out / f"{run_id}.out", args.warmup)
    res = launch(cmd, out / f"{run_id}.out", env=env, timeout_s=args.timeout, sampler=sampler)
    steps = step_seconds(timing)
    kept = steps[args.warmup :]
    findings = read_jsonl(out / run_id / "findings.jsonl") if side == "trainscout" else []
    return {
        "side": side,
        "run_id": run_id,
        "code": res.code,
        "wall_s": round(res.wall_s, 2),
        "load": round(res.load_before, 2),
        "n_steps": len(steps),
        "steps": kept,
        "median_ms": 1000 * median(kept) if kept else None,
        "cpu_ms": sampler.cpu_ms_per_step(),
        "p95_ms": 1000 * percentile(kept, 95) if kept else None,
        "findings": [(f.get("kind"), f.get("culprit_ranks")) for f in findings],
    }


def per_pair_ratios(pairs: list[tuple[dict, dict]]) -> tuple[list[float], list[float]]:
    """Step-time and CPU ratios (trainscout / baseline) of the (baseline, trainscout) pairs that measured them."""
    ratios = [t["median_ms"] / b["median_ms"] for b, t in pairs if b["median_ms"] and t["median_ms"]]
    cpu = [t["cpu_ms"] / b["cpu_ms"] for b, t in pairs if b["cpu_ms"] and t["cpu_ms"]]
    return ratios, cpu


def pooled(paths: list[Path]) -> str:
    """Per-pair step-time and CPU ratios over several runs' overhead.jsonl (pairs matched by index)."""
    both: list[tuple[dict, dict]] = []
    for path in paths:
        pairs: dict[int, dict] = {}
        for row in read_jsonl(path):
            pairs.setdefault(int(row["run_id"].rsplit("-", 1)[1]), {})[row["side"]] = row
        both += [(p["base"], p["trainscout"]) for p in pairs.values() if "base" in p and "trainscout" in p]
    ratios, cpu = per_pair_ratios(both)
    if not ratios:
        return "no complete pairs"
    lo, hi = bootstrap_median_ci(ratios)
    out = f"{len(ratios)} pairs: per-pair step-time ratio median {median(ratios):.4f} (95 % {lo:.4f}-{hi:.4f})"
    if cpu:
        clo, chi = bootstrap_median_ci(cpu)
        out += f"; per-pair CPU ratio median {median(cpu):.4f} (95 % {clo:.4f}-{chi:.4f})"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="baseline/trainscout pairs (default 5)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="first steps ignored (default 20)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--load-below", type=float, default=1.0)
    parser.add_argument("--max-wait", type=float, default=1200.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--trainscout-env", action="append", default=[], metavar="K=V")
    parser.add_argument("--baseline-env", action="append", default=[], metavar="K=V")
    parser.add_argument("--label", default="", help="a word for the RESULTS.md title (e.g. an experiment)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md (smoke tests)")
    parser.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="JSONL",
        help="run nothing: pool the pairs of earlier runs' overhead.jsonl files (same code) and "
        "print the per-pair medians with their 95 %% bootstrap intervals",
    )
    args = parser.parse_args()
    if args.pool:
        print(pooled(args.pool))
        return 0
    ts_env, base_env = parse_env(args.trainscout_env), parse_env(args.baseline_env)
    out = args.out_dir or default_out_dir("overhead")
    out.mkdir(parents=True, exist_ok=True)
    info = machine()

    start_load, waited, quiet = wait_for_quiet(args.load_below, args.max_wait)
    info["date"] = date_utc()
    up_before = uptime()
    print(
        f"out dir: {out}\nstarted at 1-min load {start_load:.2f} after waiting {waited:.0f} s "
        f"({'quiet' if quiet else 'NOT quiet: ran anyway'})\nuptime before: {up_before}",
        flush=True,
    )

    rows: list[dict] = []
    for i in range(args.pairs):
        order = (("base", base_env), ("trainscout", ts_env))
        for side, env in order if i % 2 == 0 else order[::-1]:  # ABBA: a load drift hits both sides alike
            row = one_run(side, i, args, out, env)
            rows.append(row)
            with (out / "overhead.jsonl").open("a") as fh:
                fh.write(json.dumps({k: v for k, v in row.items() if k != "steps"}) + "\n")
            print(
                f"{row['run_id']}: median {fmt(row['median_ms'], 3)} ms p95 {fmt(row['p95_ms'], 3)} ms over "
                f"{len(row['steps'])} steps, exit {row['code']}, wall {row['wall_s']:.1f} s, load {row['load']:.2f}"
                + (f", findings {row['findings']}" if row["findings"] else ""),
                flush=True,
            )
    up_after = uptime()

    base = [r for r in rows if r["side"] == "base"]
    ts = [r for r in rows if r["side"] == "trainscout"]
    per_run = markdown_table(
        [
            "pair",
            "baseline median ms",
            "trainscout median ms",
            "ratio",
            "baseline CPU ms/step",
            "trainscout CPU ms/step",
            "CPU ratio",
            "baseline load",
            "trainscout load",
        ],
        [
            [
                str(i),
                fmt(b["median_ms"], 3),
                fmt(t["median_ms"], 3),
                fmt(t["median_ms"] / b["median_ms"], 4) if b["median_ms"] and t["median_ms"] else "-",
                fmt(b["cpu_ms"], 2),
                fmt(t["cpu_ms"], 2),
                fmt(t["cpu_ms"] / b["cpu_ms"], 4) if b["cpu_ms"] and t["cpu_ms"] else "-",
                fmt(b["load"]),
                fmt(t["load"]),
            ]
            for i, (b, t) in enumerate(zip(base, ts))
        ],
    )

    def med_of_medians(side: list[dict]) -> float:
        return median([r["median_ms"] for r in side if r["median_ms"] is not None])

    pooled_b = [x for r in base for x in r["steps"]]
    pooled_t = [x for r in ts for x in r["steps"]]
    pair_ratios, cpu_pairs = per_pair_ratios(list(zip(base, ts)))
    mb, mt = med_of_medians(base), med_of_medians(ts)
    pb50, pt50 = 1000 * median(pooled_b), 1000 * median(pooled_t)
    pb95, pt95 = 1000 * percentile(pooled_b, 95), 1000 * percentile(pooled_t, 95)
    header = ["statistic", "baseline ms", "trainscout ms", "trainscout/baseline"]
    summary = [
        ["median of run medians", fmt(mb, 3), fmt(mt, 3), fmt(mt / mb, 4)],
        ["pooled median (all steps)", fmt(pb50, 3), fmt(pt50, 3), fmt(pt50 / pb50, 4)],
        ["pooled p95 (all steps)", fmt(pb95, 3), fmt(pt95, 3), fmt(pt95 / pb95, 4)],
        ["median of per-pair ratios", "", "", fmt(median(pair_ratios), 4)],
    ]
    cpu_b = [r["cpu_ms"] for r in base if r["cpu_ms"]]
    cpu_t = [r["cpu_ms"] for r in ts if r["cpu_ms"]]
    if cpu_b and cpu_t:
        summary.append(
            [
                "CPU ms per step, all processes (median of runs)",
                fmt(median(cpu_b), 2),
                fmt(median(cpu_t), 2),
                fmt(median(cpu_t) / median(cpu_b), 4),
            ]
        )
        summary.append(["median of per-pair CPU ratios", "", "", fmt(median(cpu_pairs), 4)])
        clo, chi = bootstrap_median_ci(cpu_pairs)
        summary.append(
            ["median of per-pair CPU ratios, 95 % bootstrap interval", "", "", f"{fmt(clo, 4)} - {fmt(chi, 4)}"]
        )
    lo, hi = bootstrap_median_ci(pair_ratios)
    summary.append(["median of per-pair ratios, 95 % bootstrap interval", "", "", f"{fmt(lo, 4)} - {fmt(hi, 4)}"])
    print()
    print(text_table(header, summary))
    print(f"uptime after: {up_after}")
    pr = median(pair_ratios)
    verdict = ("within" if hi <= BAR else "OVER" if lo > BAR else "not shown within") if pair_ratios else "-"
    headline = (
        f"{100 * (pr - 1):+.2f} % (95 % interval {100 * (lo - 1):+.2f} to {100 * (hi - 1):+.2f} %), "
        f"{verdict} the 1 % bar"
    )
    print(f"overhead (median of per-pair ratios): {headline}")
    if cpu_b and cpu_t:
        print(f"CPU per step, all processes: {100 * (median(cpu_t) / median(cpu_b) - 1):+.2f} %")

    findings = [(r["run_id"], r["findings"]) for r in ts if r["findings"]]
    failed = [r["run_id"] for r in rows if r["code"] != 0 or not r["steps"]]
    not_quiet = f"(**never dropped below {args.load_below:g} within {args.max_wait:g} s; ran anyway**)"
    body = [
        f"- load: waited {waited:.0f} s for 1-min load < {args.load_below:g}; started at {start_load:.2f} "
        + ("" if quiet else not_quiet),
        f"- uptime before `{up_before}`; after `{up_after}`",
        f"- {args.pairs} interleaved pairs, {args.nproc} ranks, {args.steps} steps, first {args.warmup} steps "
        f"ignored; step time from rank 0; run dirs under `<out-dir>`",
        f"- env: trainscout side {ts_env or 'defaults'}; baseline side {base_env or 'defaults'}",
        f"- overhead (median of per-pair ratios): **{headline}**; median of run medians {100 * (mt / mb - 1):+.2f} %",
        "- CPU per step: CPU seconds of the whole process tree (ranks, torchrun, and on the trainscout side the "
        "supervisor, agent and coordinator) between rank 0's first logged step after the warm-up and its last "
        "logged step, divided by the steps in between"
        + (f": **{100 * (median(cpu_t) / median(cpu_b) - 1):+.2f} %**" if cpu_b and cpu_t else ": not measured"),
        "",
        markdown_table(header, summary),
        "",
        per_run,
        "",
    ]
    if findings:
        body.append(f"**Findings on healthy trainscout runs:** {findings}")
    if failed:
        body.append(f"**Runs that failed or wrote no timings:** {failed}")
    if not args.no_record:
        title = "Healthy-path overhead (python -m benchmarks overhead pairs)" + (
            f": {args.label}" if args.label else ""
        )
        append_results(title, info, command_line().replace(str(out), "<out-dir>"), "\n".join(body))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
