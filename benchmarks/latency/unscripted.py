"""Faults nobody scripted: latency in steps and seconds, and false blame, per fault class.

Runs the demo job (4 ranks, gloo DDP, tiny GPT; `--device cuda` puts every rank on the one GPU, still over
gloo) under `trainscout run` with one fault injected on one rank, N times per case, round-robin over the
cases. The faults are the classes of the principal issue, each made in more than one way (faults/): a
blocking delay in one block's forward of ~10 % of a step and of ~2x (sleep, blocking pipe read, lock, busy
loop, a blocking read in the DataLoader), the same every 6th step, one step of large noise in one rank's
local gradient (tensor hook, activation hook), a layer's output sign-flipped or scaled (forward hook,
patched forward), one-shot lasting corruptions of weights or optimizer state (exponent bit flip, 1 % sign
flip, exp_avg x1000 in 10 % of a tensor), a rank starved of its core. A run stops once the expected finding
is in findings.jsonl (or at its last step).

A run is correct when a finding of the expected kind names exactly the faulted rank and no finding names any
other rank. Latency in steps = the first such finding's step - the step the fault started; in seconds = its
`confirmed` - the fault's `t` (TRAINSCOUT_FAULT_LOG, same host, same clock).

    .venv/bin/python -m benchmarks latency unscripted --runs 10
    .venv/bin/python -m benchmarks latency unscripted --runs 10 --device cuda --step-ms 20   # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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

ONSET = 60
RANK = 2
# case -> (fault spec with {ten} / {twice} for 10 % / 2x of a step in ms, expected kind(s), steps, cpu only).
# A corrupted weight may make the rank's next loss non-finite (an exponent flip: ~1e38): the non-finite origin
# then names it first, which is as right as an sdc finding.
CORRUPTED = "sdc,nonfinite,health"
CASES: dict[str, tuple[str, str, int, bool]] = {
    "a: sleep 10%": ("delay:how=sleep:ms={ten}", "straggler", 200, False),
    "a: sleep 2x": ("delay:how=sleep:ms={twice}", "straggler", 160, False),
    "a: pipe read 10%": ("delay:how=read:ms={ten}", "straggler", 200, False),
    "a: lock 10%": ("delay:how=lock:ms={ten}", "straggler", 200, False),
    "a: data read 10%": ("delay:how=data:ms={ten}", "straggler", 200, False),
    "a: busy 2x": ("delay:how=busy:ms={twice}", "straggler", 160, False),
    "a: busy 10%": ("delay:how=busy:ms={ten}", "straggler", 300, False),
    "a: gpu spin 2x": ("delay:how=gpu:ms={twice}", "straggler", 160, False),
    "a: gpu spin 10%": ("delay:how=gpu:ms={ten}", "straggler", 200, False),
    "b: sleep 10x every 6th": ("delay:how=sleep:ms={tenfold}:every=6", "straggler", 200, False),
    "b: sleep 10% every 6th": ("delay:how=sleep:ms={ten}:every=6", "straggler", 300, False),
    "b: sleep 2x every 6th": ("delay:how=sleep:ms={twice}:every=6", "straggler", 250, False),
    "b: busy 10% every 6th": ("delay:how=busy:ms={ten}:every=6", "straggler", 300, False),
    "c: gradient noise (tensor)": ("gradnoise:how=tensor", "sdc", 160, False),
    "c: gradient noise (activation)": ("gradnoise:how=activation:layer=blocks.1", "sdc", 160, False),
    "d: output sign flip (hook)": ("outflip:how=hook", "sdc", 200, False),
    "d: output x3 (patch)": ("outflip:how=patch:factor=3", "sdc", 200, False),
    "e: exponent bit flip": ("corrupt:how=expflip", CORRUPTED, 260, False),
    "e: 1% sign flip": ("corrupt:how=signflip:frac=0.01", CORRUPTED, 260, False),
    "e: exp_avg x1000 in 10%": (
        "corrupt:target=state:key=exp_avg:how=scale:frac=0.1:factor=1000",
        CORRUPTED,
        260,
        False,
    ),
    "starved core": ("starve:hogs=2", "straggler", 400, True),
}


def fault_spec(case: str, step_ms: float) -> str:
    spec = CASES[case][0].format(ten=f"{0.1 * step_ms:.1f}", twice=f"{step_ms:.0f}", tenfold=f"{10 * step_ms:.0f}")
    kind, _, rest = spec.partition(":")
    return f"{kind}:rank={RANK}:step={ONSET}:{rest}"


def one_run(case: str, index: int, args: argparse.Namespace, out: Path) -> dict:
    spec = fault_spec(case, args.step_ms)
    _, expected, steps, _ = CASES[case]
    steps = int(steps * args.steps_scale)
    run_id = f"uns-{index:02d}-{list(CASES).index(case):02d}"
    fault_log = out / f"{run_id}.faults.jsonl"
    fault_log.unlink(missing_ok=True)
    job = train_cmd(args.nproc, steps, "--device", args.device, "--seed", str(index))
    cmd = under_trainscout(job, out, run_id, "--inject", spec)
    findings_path = out / run_id / "findings.jsonl"
    res = launch(
        cmd,
        out / f"{run_id}.out",
        env={"TRAINSCOUT_FAULT_LOG": str(fault_log)},
        timeout_s=args.timeout,
        sampler=None
        if args.run_to_end
        else StopWhenFound(
            findings_path, lambda f: f.get("kind") in expected.split(",") and f.get("culprit_ranks") == [RANK]
        ),
    )
    fired = [e for e in read_jsonl(fault_log) if e.get("rank") == RANK]
    findings = sorted(read_jsonl(findings_path), key=lambda f: f.get("confirmed", 0.0))
    mine = [f for f in findings if f.get("kind") in expected.split(",") and f.get("culprit_ranks") == [RANK]]
    blamed = sorted({r for f in findings for r in f.get("culprit_ranks", []) if r != RANK})
    first = min(mine, key=lambda f: f.get("step") or 0, default=None)
    latency_s = latency_steps = None
    if fired and first is not None:
        latency_s = first["confirmed"] - min(e["t"] for e in fired)
        latency_steps = (first.get("step") or 0) - ONSET
    ev = first.get("evidence", {}) if first else {}
    return {
        "case": case,
        "spec": spec,
        "run_id": run_id,
        "code": res.code,
        "wall_s": round(res.wall_s, 1),
        "load": round(res.load_before, 2),
        "timed_out": res.timed_out,
        "fired": bool(fired),
        "latency_s": latency_s,
        "latency_steps": latency_steps,
        "correct": first is not None and not blamed,
        "false_blame": blamed,
        "detail": ev.get("type") or ev.get("check"),
        "confirmation": (ev.get("confirmation") or {}).get("outcome"),
        "findings": [
            (
                f.get("kind"),
                f.get("evidence", {}).get("type") or f.get("evidence", {}).get("check"),
                f.get("culprit_ranks"),
                f.get("step"),
            )
            for f in findings
        ],
    }


def summarise(rows: list[dict], cases: list[str]) -> tuple[list[str], list[list[str]]]:
    header = [
        "case",
        "n",
        "correct/n",
        "named <= 10 steps",
        "median steps",
        "max steps",
        "median s",
        "max s",
        "false blame",
        "by",
    ]
    table = []
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        steps = [r["latency_steps"] for r in mine if r["latency_steps"] is not None]
        secs = [r["latency_s"] for r in mine if r["latency_s"] is not None]
        by = sorted(
            {f"{r['detail']}" + (f" ({r['confirmation']})" if r["confirmation"] else "") for r in mine if r["detail"]}
        )
        table.append(
            [
                case,
                str(len(mine)),
                f"{sum(r['correct'] for r in mine)}/{len(mine)}",
                f"{sum(1 for s in steps if s <= 10)}/{len(mine)}",
                fmt(median(steps) if steps else None, 1),
                fmt(max(steps) if steps else None, 0),
                fmt(median(secs) if secs else None),
                fmt(max(secs) if secs else None),
                str(sum(1 for r in mine if r["false_blame"])),
                ", ".join(by),
            ]
        )
    return header, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per case (default 10)")
    parser.add_argument("--cases", default="", help="comma-separated substrings selecting cases (default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument(
        "--step-ms",
        type=float,
        default=43.0,
        help="the job's step time, which 10 %% and 2x are taken of (4 CPU ranks on 2 cores: ~43)",
    )
    parser.add_argument(
        "--steps-scale",
        type=float,
        default=1.0,
        help="multiply each case's steps (fast GPU steps: a confirmation scheduled 2.5 s ahead is "
        "~200 steps away at 12 ms a step; use 3 there)",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a run is stopped")
    parser.add_argument("--out-dir", type=Path, default=None, help="run dirs and logs (default /tmp/...)")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md (smoke tests)")
    parser.add_argument(
        "--run-to-end",
        action="store_true",
        help="let each run go to its last step (whole recordings for `false-positives replay`), "
        "not stop at the finding",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="start no run after this many minutes and record what was measured (0: no limit)",
    )
    args = parser.parse_args()
    wanted = [w for w in args.cases.split(",") if w]
    cases = [
        c
        for c in CASES
        if (not wanted or any(w in c for w in wanted))
        and not (args.device == "cuda" and CASES[c][3])
        and not (args.device == "cpu" and "gpu" in c)
    ]
    if not cases:
        parser.error(f"no case matches {args.cases!r}; cases: {', '.join(CASES)}")
    out, info, up_before = begin(f"unscripted-{args.device}", args.out_dir)
    rows: list[dict] = []
    raw = out / "unscripted.jsonl"
    stop_at = time.monotonic() + args.max_minutes * 60 if args.max_minutes > 0 else float("inf")
    for i in range(args.runs):
        for case in cases:
            if time.monotonic() >= stop_at:
                print(f"--max-minutes {args.max_minutes:g} reached: no further runs", flush=True)
                break
            row = one_run(case, i, args, out)
            rows.append(row)
            with raw.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(
                f"{row['run_id']} [{case}]: {fmt(row['latency_steps'], 0)} steps, {fmt(row['latency_s'])} s, "
                f"correct={row['correct']}, blamed={row['false_blame']}, findings={row['findings']}, "
                f"load {row['load']}",
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
        f"- {args.runs} runs per case (fewer where --max-minutes cut the campaign: see n), round-robin, "
        f"device {args.device}, {args.nproc} ranks, fault on rank "
        f"{RANK} from step {ONSET}, 10 % / 2x of a {args.step_ms:g} ms step; seeds 0..{args.runs - 1}; run "
        "dirs under `<out-dir>`",
        "- latency in steps = the first correct finding's step - the fault's step; in seconds = its "
        "`confirmed` - the fault's `t` (TRAINSCOUT_FAULT_LOG); false blame = runs with a finding naming "
        "another rank",
        "",
        markdown_table(header, table),
        "",
    ]
    if wrong:
        body += ["Runs that were wrong or timed out:", ""]
        body += [
            f"- `{r['run_id']}` [{r['case']}] `{r['spec']}`: exit {r['code']}, timed out {r['timed_out']}, "
            f"findings {r['findings']}"
            for r in wrong
        ]
        body.append("")
    if not args.no_record:
        append_results(
            f"Faults nobody scripted, {args.device} (python -m benchmarks latency unscripted)",
            info,
            command_line().replace(str(out), "<out-dir>"),
            "\n".join(body),
        )
    print(f"raw rows: {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
