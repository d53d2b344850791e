"""Faults made by an independent tool: lm-resiliency's fault campaigns (the peer's injector, `pip install
lm-resiliency==0.2.0`) in a job that enables them itself, with trainscout attached from outside.

Each case is one fault of the peer's vocabulary (type x surface x operation x scope x lifetime) on one rank of a
4-rank gloo DDP job (benchmarks/latency/peer_job.py: the demo's tiny GPT), from iteration ONSET. A case is named
when a finding of the kind the peer itself expects for the fault (`FaultSpec.expected_kind`: sdc -> sdc,
nonfinite or health; straggler -> straggler) names exactly that rank; false blame is any finding naming another
rank. The cases marked `known` are documented as unnamed (docs/integrity.md): their rows say whether that still
holds. The clean case injects nothing: any finding there is false blame.

    .venv/bin/python -m benchmarks latency peer --runs 1
    python3 -m benchmarks latency peer --device cuda --steps 600   # on the GPU machine: 4 ranks on cuda:0, gloo
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks._common import (
    PYTHON,
    append_results,
    begin,
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
from benchmarks._demo_job import StopWhenFound, under_trainscout

ONSET, RANK = 100, 2
JOB = Path(__file__).with_name("peer_job.py")
CPU_STEP_MS = 40.0
KINDS = {"sdc": ("sdc", "nonfinite", "health"), "straggler": ("straggler",), "": ()}


def _fault(kind: str, surface: str, module: str, life=0, every: int = 0, **params) -> dict:
    out = {"type": kind, "surface": surface, "module": module, "params": params, "at": ONSET, "rank": RANK}
    if life:
        out["life"] = life
    if every:
        out.update(every=every, life=1)
    return out


def _scaled(fault: dict, step_ms: float) -> dict:
    """A delay's milliseconds as the case means them: the cases' delays are for the CPU job's ~40 ms step."""
    if fault.get("type") != "delay":
        return fault
    params = dict(fault["params"], delay_ms=round(fault["params"]["delay_ms"] * step_ms / CPU_STEP_MS, 1))
    return {**fault, "params": params}


def _corrupt(surface: str, module: str, life=0, **params) -> dict:
    return _fault("tensor_corruption", surface, module, life, **params)


W, MLP, BLOCK = {"parameter": "weight"}, "blocks.1.mlp.0", "blocks.1"
# case -> (fault, expected kind, known to go unnamed)
CASES: dict[str, tuple[dict, str, bool]] = {
    "delay 300 ms in a block's output": (_fault("delay", "output", BLOCK, delay_ms=300), "straggler", False),
    "delay 400 ms every 6th iteration": (_fault("delay", "output", BLOCK, every=6, delay_ms=400), "straggler", False),
    "delay 10 % at a block's input": (_fault("delay", "input", BLOCK, delay_ms=4), "straggler", False),
    "delay 2x in a block's compute": (_fault("delay", "compute", BLOCK, delay_ms=40), "straggler", False),
    "delay 10 % every 6th iteration": (_fault("delay", "compute", BLOCK, every=6, delay_ms=4), "straggler", False),
    "gradient: large noise, 1 iteration": (
        _corrupt("gradient", MLP, 1, operation="noise", magnitude="large", scope="100%", **W),
        "sdc",
        False,
    ),
    "gradient: exponent bit flip, 1 iteration": (
        _corrupt("gradient", MLP, 1, operation="single_bitflip", magnitude="catastrophic", scope="single", **W),
        "sdc",
        False,
    ),
    "gradient: NaN, 1 iteration": (
        _corrupt("gradient", MLP, 1, operation="set_value", value="nan", scope="single", **W),
        "sdc",
        False,
    ),
    "gradient: x2 for good": (  # a small share of its block here: 1.075x the block's norm (docs/integrity.md)
        _corrupt("gradient", MLP, operation="scale", factor=2.0, scope="100%", **W),
        "sdc",
        True,
    ),
    "gradient: dropped for good": (_fault("drop", "gradient", MLP, scope="100%", **W), "sdc", False),
    "gradient: stale for good": (_fault("stale_state", "gradient", MLP, scope="100%", **W), "sdc", False),
    "gradient: duplicated for good": (_fault("duplicate", "gradient", MLP, scope="100%", **W), "sdc", False),
    "gradient: sign flip for good": (
        _corrupt("gradient", MLP, operation="sign_flip", scope="100%", **W),
        "sdc",
        True,
    ),
    "gradient: reordered for good": (_fault("reorder", "gradient", MLP, **W), "sdc", True),
    "output: sign flip": (_corrupt("output", BLOCK, operation="sign_flip", scope="100%"), "sdc", False),
    "output: x3": (_corrupt("output", BLOCK, operation="scale", factor=3.0, scope="100%"), "sdc", False),
    "output: noise (medium)": (
        _corrupt("output", BLOCK, operation="noise", magnitude="medium", scope="100%"),
        "sdc",
        False,
    ),
    "output: stale": (_fault("stale_state", "output", BLOCK, scope="100%"), "sdc", False),
    "output: dropped": (_fault("drop", "output", BLOCK, scope="100%"), "sdc", False),
    "output: reordered": (_fault("reorder", "output", BLOCK), "sdc", False),
    "input: sign flip": (_corrupt("input", BLOCK, operation="sign_flip", scope="100%"), "sdc", False),
    "input: stale": (_fault("stale_state", "input", BLOCK, scope="100%"), "sdc", False),
    "input: 10 % dropped": (_fault("drop", "input", BLOCK, scope="10%"), "sdc", True),
    "weight: exponent bit flip": (
        _corrupt("weight", MLP, "recovery", operation="single_bitflip", magnitude="catastrophic", scope="single", **W),
        "sdc",
        False,
    ),
    "weight: 1 % sign flip": (_corrupt("weight", MLP, 1, operation="sign_flip", scope="1%", **W), "sdc", False),
    "weight: subtle noise": (
        _corrupt("weight", MLP, 1, operation="noise", magnitude="subtle", scope="100%", **W),
        "sdc",
        False,
    ),
    "weight: stale": (_fault("stale_state", "weight", MLP, 1, scope="100%", **W), "sdc", False),
    "bias: NaN": (
        _corrupt("bias", MLP, "recovery", operation="set_value", value="nan", scope="single", parameter="bias"),
        "sdc",
        False,
    ),
    "exp_avg x1000 in 10 %": (
        _corrupt("optimizer_state", MLP, 1, operation="scale", factor=1000.0, scope="10%", state_key="exp_avg", **W),
        "sdc",
        False,
    ),
    "exp_avg_sq x0.001": (
        _corrupt("optimizer_state", MLP, 1, operation="scale", factor=0.001, scope="100%", state_key="exp_avg_sq", **W),
        "sdc",
        False,
    ),
    "clean (nothing injected)": ({}, "", False),
}


def one_run(case: str, index: int, args: argparse.Namespace, out: Path) -> dict:
    fault, expected, known = CASES[case]
    run_id = f"peer-{index:02d}-{list(CASES).index(case):02d}"
    job = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port())]
    fault = _scaled(fault, args.step_ms)
    cmd = under_trainscout([*job, str(JOB), str(args.steps), args.device], out, run_id)
    findings_path = out / run_id / "findings.jsonl"
    kinds = KINDS[expected]
    res = launch(
        cmd,
        out / f"{run_id}.out",
        env={"PEER_FAULT": json.dumps(fault) if fault else ""},
        timeout_s=args.timeout,
        sampler=StopWhenFound(findings_path, lambda f: f.get("kind") in kinds and f.get("culprit_ranks") == [RANK]),
    )
    log = (out / f"{run_id}.out").read_text(errors="replace")
    findings = read_jsonl(findings_path)
    mine = [f for f in findings if f.get("kind") in kinds and f.get("culprit_ranks") == [RANK]]
    first = min(mine, key=lambda f: f.get("step") or 0, default=None)
    blamed = sorted({r for f in findings for r in f.get("culprit_ranks", []) if r != RANK or not fault})
    return {
        "case": case,
        "fault": fault,
        "run_id": run_id,
        "code": res.code,
        "load": round(res.load_before, 2),
        "timed_out": res.timed_out,
        "fired": not fault or "peer injection:" in log,
        "known": known,
        "named": first is not None,
        "latency_steps": (first.get("step") or 0) - ONSET if first else None,
        "false_blame": blamed,
        "by": (first.get("evidence", {}).get("check") or first.get("evidence", {}).get("type")) if first else None,
        "findings": [(f.get("kind"), f.get("culprit_ranks"), f.get("step")) for f in findings],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs per case (default 1)")
    parser.add_argument("--cases", default="", help="comma-separated substrings selecting cases (default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=300, help="steps per run (fast GPU steps: 600)")
    parser.add_argument(
        "--step-ms", type=float, default=CPU_STEP_MS, help="the job's step time, which the delays are scaled to"
    )
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds before a run is stopped")
    parser.add_argument("--out-dir", type=Path, default=None, help="run dirs and logs (default /tmp/...)")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md (smoke tests)")
    args = parser.parse_args()
    try:
        import lm_resiliency.fault_injection  # noqa: F401
    except ImportError:
        parser.error("needs the peer's injector: pip install lm-resiliency==0.2.0 (pure Python)")
    wanted = [w for w in args.cases.split(",") if w]
    cases = [c for c in CASES if not wanted or any(w in c for w in wanted)]
    if not cases:
        parser.error(f"no case matches {args.cases!r}; cases: {', '.join(CASES)}")
    out, info, up_before = begin(f"peer-injector-{args.device}", args.out_dir)
    rows = []
    for i in range(args.runs):
        for case in cases:
            row = one_run(case, i, args, out)
            rows.append(row)
            with (out / "peer.jsonl").open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(
                f"{row['run_id']} [{case}]: named={row['named']} +{fmt(row['latency_steps'], 0)} by {row['by']}, "
                f"blamed={row['false_blame']}, fired={row['fired']}, findings={row['findings']}, load {row['load']}",
                flush=True,
            )
    header = ["case", "expected", "n", "named/n", "median steps", "max steps", "false blame", "by", "documented"]
    table = []
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        steps = [r["latency_steps"] for r in mine if r["latency_steps"] is not None]
        _, expected, known = CASES[case]
        table.append(
            [
                case,
                expected or "nothing",
                str(len(mine)),
                f"{sum(r['named'] for r in mine)}/{len(mine)}" if expected else "-",
                fmt(median(steps) if steps else None, 1),
                fmt(max(steps) if steps else None, 0),
                str(sum(1 for r in mine if r["false_blame"])),
                ", ".join(sorted({str(r["by"]) for r in mine if r["by"]})),
                "unnamed" if known else "",
            ]
        )
    print()
    print(text_table(header, table))
    loads = [r["load"] for r in rows]
    body = [
        f"- load: before `{up_before}`; after `{uptime()}`; 1-min load at run starts median {fmt(median(loads))}, "
        f"max {fmt(max(loads))}",
        f"- {args.runs} run(s) per case, device {args.device} (4 ranks, gloo); fault on rank {RANK} from iteration "
        f"{ONSET} of {args.steps}, delays scaled to a {args.step_ms:g} ms step; each run stops once "
        "named; latency in steps = the finding's step - the onset; false blame = runs with a finding naming "
        "another rank (any rank in the clean case)",
        "- injector: lm-resiliency 0.2.0's `enable_fault_injection` (local executor), called by the job itself",
        "",
        markdown_table(header, table),
        "",
    ]
    odd = [r for r in rows if not r["fired"] or r["timed_out"] or (r["named"] == r["known"] and CASES[r["case"]][1])]
    if odd:
        body += ["Runs worth a look (not fired, timed out, or named against the documented expectation):", ""]
        body += [f"- `{r['run_id']}` [{r['case']}]: exit {r['code']}, findings {r['findings']}" for r in odd]
        body.append("")
    if not args.no_record:
        append_results(
            f"Faults made by the peer's injector, {args.device} (python -m benchmarks latency peer)",
            info,
            command_line().replace(str(out), "<out-dir>"),
            "\n".join(body),
        )
    print(f"raw rows: {out / 'peer.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
