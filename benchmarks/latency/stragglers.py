"""Straggler detection latency, in steps and seconds, per slowdown level and kind.

Runs the demo job (4 CPU ranks, gloo DDP, tiny GPT) under `trainscout run` with one slowdown injected on one
rank, N times per case, round-robin over the cases so the load of a shared machine spreads over all of them.
A run stops as soon as the expected finding is in findings.jsonl (or at its last step). Latency in steps is
the finding's step minus the step the slowdown started; in seconds, the finding's `confirmed` minus the
fault's `t` in TRAINSCOUT_FAULT_LOG (same host, same clock). A run is correct when its only straggler
finding has the expected type and names exactly the slowed rank.

    .venv/bin/python -m benchmarks latency stragglers --runs 10
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks._common import (
    append_results,
    begin,
    command_line,
    fmt,
    launch,
    markdown_table,
    median,
    read_jsonl,
    text_table,
    uptime,
)
from benchmarks._demo_job import StopWhenFound, train_cmd, under_trainscout

# case -> (fault spec, rank, onset step, steps, expected type, extra demo-script arguments)
CASES: dict[str, tuple[str, int, int, int, str, list[str]]] = {
    "compute +10%": ("straggle:rank=2:step=20:factor=0.1", 2, 20, 260, "compute", []),
    "compute +30%": ("straggle:rank=2:step=20:factor=0.3", 2, 20, 150, "compute", []),
    "compute 2x": ("straggle:rank=2:step=20:factor=1", 2, 20, 120, "compute", []),
    "communication +20 ms/op": ("commslow:rank=1:step=25:ms=20", 1, 25, 320, "communication", []),
    "data loader +150 ms/batch": ("dataslow:rank=3:step=10:ms=150", 3, 10, 60, "data_loading", []),
    "checkpoint +300 ms/save": (
        "ckptslow:rank=1:step=5:ms=300",
        1,
        5,
        90,
        "checkpoint_write",
        ["--checkpoint-every", "5"],
    ),
    "intermittent 3x every 10th": ("straggle:rank=1:step=10:factor=2:every=10", 1, 10, 150, "compute", []),
}


def one_run(case: str, index: int, args: argparse.Namespace, out: Path) -> dict:
    spec, rank, onset, steps, expected, script_args = CASES[case]
    run_id = f"strag-{index:02d}-{list(CASES).index(case)}-{spec.split(':')[0]}"
    fault_log = out / f"{run_id}.faults.jsonl"
    fault_log.unlink(missing_ok=True)
    if "--checkpoint-every" in script_args:
        script_args = [*script_args, "--checkpoint-dir", str(out / run_id / "ckpt")]
    cmd = under_trainscout(train_cmd(4, steps, *script_args), out, run_id, "--inject", spec)
    findings_path = out / run_id / "findings.jsonl"
    res = launch(
        cmd,
        out / f"{run_id}.out",
        env={"TRAINSCOUT_FAULT_LOG": str(fault_log)},
        timeout_s=args.timeout,
        sampler=StopWhenFound(
            findings_path, lambda f: f.get("kind") == "straggler" and f.get("evidence", {}).get("type") == expected
        ),
    )
    fired = [e for e in read_jsonl(fault_log) if e.get("rank") == rank]
    findings = sorted(read_jsonl(findings_path), key=lambda f: f.get("confirmed", 0.0))
    mine = [f for f in findings if f.get("kind") == "straggler" and f.get("evidence", {}).get("type") == expected]
    others = [f for f in findings if f not in mine]
    latency_s = latency_steps = None
    correct = bool(mine) and mine[0].get("culprit_ranks") == [rank] and not others
    if fired and mine:
        latency_s = mine[0]["confirmed"] - min(e["t"] for e in fired)
        latency_steps = mine[0].get("step", 0) - onset
    ev = mine[0].get("evidence", {}) if mine else {}
    return {
        "case": case,
        "run_id": run_id,
        "code": res.code,
        "wall_s": round(res.wall_s, 1),
        "load": round(res.load_before, 2),
        "timed_out": res.timed_out,
        "fired": bool(fired),
        "latency_s": latency_s,
        "latency_steps": latency_steps,
        "correct": correct,
        "ratio": ev.get("ratio"),
        "period": ev.get("period"),
        "findings": [(f.get("kind"), f.get("evidence", {}).get("type"), f.get("culprit_ranks")) for f in findings],
    }


def summarise(rows: list[dict], cases: list[str]) -> tuple[list[str], list[list[str]]]:
    header = ["case", "n", "correct/n", "median steps", "max steps", "median s", "max s", "median ratio / period"]
    table = []
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        steps = [r["latency_steps"] for r in mine if r["latency_steps"] is not None]
        secs = [r["latency_s"] for r in mine if r["latency_s"] is not None]
        ratios = [r["period"] or r["ratio"] for r in mine if (r["period"] or r["ratio"]) is not None]
        table.append(
            [
                case,
                str(len(mine)),
                f"{sum(r['correct'] for r in mine)}/{len(mine)}",
                fmt(median(steps) if steps else None, 1),
                fmt(max(steps) if steps else None, 0),
                fmt(median(secs) if secs else None),
                fmt(max(secs) if secs else None),
                fmt(median(ratios) if ratios else None),
            ]
        )
    return header, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per case (default 10)")
    parser.add_argument("--cases", default="", help="comma-separated substrings selecting cases (default: all)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a run is stopped")
    parser.add_argument("--out-dir", type=Path, default=None, help="run dirs and logs (default /tmp/...)")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md (smoke tests)")
    args = parser.parse_args()
    wanted = [w for w in args.cases.split(",") if w]
    cases = [c for c in CASES if not wanted or any(w in c for w in wanted)]
    if not cases:
        parser.error(f"no case matches {args.cases!r}; cases: {', '.join(CASES)}")
    out, info, up_before = begin("stragglers", args.out_dir)
    rows: list[dict] = []
    raw = out / "stragglers.jsonl"
    for i in range(args.runs):
        for case in cases:
            row = one_run(case, i, args, out)
            rows.append(row)
            with raw.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(
                f"{row['run_id']} [{case}]: {fmt(row['latency_steps'], 0)} steps, {fmt(row['latency_s'])} s, "
                f"correct={row['correct']}, findings={row['findings']}, load {row['load']}",
                flush=True,
            )
    up_after = uptime()
    header, table = summarise(rows, cases)
    print()
    print(text_table(header, table))
    loads = [r["load"] for r in rows]
    wrong = [r for r in rows if not r["correct"] or r["timed_out"]]
    body = [
        f"- load: before `{up_before}`; after `{up_after}`; 1-min load at run starts median "
        f"{fmt(median(loads))}, max {fmt(max(loads))}",
        f"- {args.runs} runs per case, round-robin; run dirs under `<out-dir>`",
        "- latency in steps = the finding's step − the step the slowdown started; in seconds = its "
        "`confirmed` − the fault's `t` (TRAINSCOUT_FAULT_LOG); ratio = the slowdown the finding estimates "
        "(compute: x its peers; communication: its best exchange over its peers'); period for intermittent",
        "",
        markdown_table(header, table),
        "",
    ]
    if wrong:
        body += ["Runs that were wrong or timed out:", ""]
        body += [
            f"- `{r['run_id']}` [{r['case']}]: exit {r['code']}, timed out {r['timed_out']}, findings {r['findings']}"
            for r in wrong
        ]
        body.append("")
    if not args.no_record:
        append_results(
            "Straggler detection latency (python -m benchmarks latency stragglers)",
            info,
            command_line().replace(str(out), "<out-dir>"),
            "\n".join(body),
        )
    print(f"raw rows: {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
