"""Every fault class at every scale: `python -m benchmarks scale faults`.

Runs the scale harness (benchmarks/scale.py: the real coordinator, simulated node agents) once per scale, layout
and fault, each fault at a seeded random rank, and tells whether the coordinator named exactly that rank with the
fault's kind and nothing else (a clean run: no finding at all), and how long after the onset. One table, printed
and appended to RESULTS.md (unless --no-record).

    python -m benchmarks scale faults                                   # 1k and 10k, both layouts, every fault
    python -m benchmarks scale faults --scales 100k --interval 2 --faults hang none
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import scale  # noqa: E402
from scale_faults import FAULTS  # noqa: E402

# scale -> (pure DP layout, TP x PP x DP layout), 8 ranks a node
LAYOUTS = {
    "64": ("dp:64", "8x2x4"),
    "1k": ("dp:1024", "8x4x32"),
    "10k": ("dp:10240", "8x16x80"),
    "100k": ("dp:100352", "8x16x784"),
}
STRAGGLER_WARMUP_STEPS = 20  # the straggler rules judge no window before this step (detectors/straggler.py)


def plan(fault: str, step_s: float, onset_s: float, after_s: float) -> tuple[float, float]:
    """(onset, run length) in seconds for a fault: a straggler after the straggler rules' warm-up; an SDC shows
    once the state rotation reaches the corrupted slot (up to 16 steps), so every run gets `after_s` past it."""
    onset = max(onset_s, (STRAGGLER_WARMUP_STEPS + 4) * step_s) if fault == "straggler" else onset_s
    return onset, onset + after_s


def run_case(layout: str, fault: str, seed: int, opts: argparse.Namespace) -> dict:
    onset, seconds = plan(fault, opts.step_s, opts.onset_s, opts.after_s)
    argv = [
        *("--layout", layout, "--fault", fault, "--seed", str(seed)),
        *("--seconds", str(seconds), "--onset-s", str(onset), "--warmup-s", str(min(onset - 1, opts.warmup_s))),
        *("--step-s", str(opts.step_s), "--interval", str(opts.interval), "--procs", str(opts.procs)),
        *("--hang-timeout", str(opts.hang_timeout)),
    ]
    args = scale.build_parser().parse_args(argv)
    started = time.time()
    out = scale.run_once(args)
    out["wall_s"] = round(time.time() - started, 1)
    out["seconds"] = seconds
    out["onset_s"] = onset
    return out


def row(scale_name: str, out: dict) -> list[str]:
    named = [f for f in out["findings"] if f[0] == out["fault"]]
    found = "; ".join(f"{k} {rs if n <= 10 else f'{rs[:3]}... ({n})'}" for k, rs, n, _ in out["findings"]) or "none"
    return [
        scale_name,
        out["layout"],
        out["fault"],
        str(out["culprit"]) if out["culprit"] >= 0 else "-",
        found,
        f"{out['named_after_s']:.1f}" if named and out["named_after_s"] is not None else "-",
        "yes" if out["exact"] else "**no**",
        _common.fmt(out["pass_p99_s"], 2),
        _common.fmt(out["coordinator_rss_gib"], 2),
        f"{out['load1_after']:.1f}",
    ]


HEADER = [
    "scale",
    "layout",
    "fault",
    "culprit",
    "findings (kind, ranks)",
    "named after s",
    "exact",
    "pass p99 s",
    "RSS GiB",
    "load after",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", nargs="+", default=["1k", "10k"], choices=list(LAYOUTS))
    p.add_argument("--layouts", nargs="+", default=["dp", "tp"], choices=["dp", "tp"], help="pure DP, TP x PP x DP")
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--seed", type=int, default=1, help="the first case's seed (each case adds one)")
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between a node's digests")
    p.add_argument("--hang-timeout", type=float, default=5.0)
    p.add_argument("--onset-s", type=float, default=15.0)
    p.add_argument("--after-s", type=float, default=25.0, help="seconds the run goes on after the onset")
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--procs", type=int, default=2, help="simulator processes a run")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--no-record", action="store_true", help="leave RESULTS.md alone")
    opts = p.parse_args()
    out_dir, info, up_before = _common.begin("scale-faults", opts.out_dir)
    info["code_start"] = _common.code_version()
    rows, results = [], []
    seed = opts.seed
    for scale_name in opts.scales:
        for which in opts.layouts:
            layout = LAYOUTS[scale_name][0 if which == "dp" else 1]
            for fault in opts.faults:
                out = run_case(layout, fault, seed, opts)
                out["seed"] = seed
                seed += 1
                results.append(out)
                rows.append(row(scale_name, out))
                print(_common.text_table(HEADER, rows[-1:]), flush=True)
                (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    table = _common.markdown_table(HEADER, rows)
    print(table)
    exact = sum(1 for r in results if r["exact"])
    if not opts.no_record:
        body = "\n".join(
            [
                f"- load: before `{up_before}`; after `{_common.uptime()}`",
                f"- step {opts.step_s} s, digests every {opts.interval} s, hang timeout {opts.hang_timeout} s; "
                f"fault onset {opts.onset_s} s (straggler: after step {STRAGGLER_WARMUP_STEPS + 4}), each run "
                f"{opts.after_s} s past it; {opts.procs} simulator processes; culprit seeded per run",
                "- exact = the fault's kind naming the culprit and no other rank, and no other finding "
                "(clean: no finding); named after = the finding's `confirmed` minus the onset",
                f"- **{exact}/{len(results)} exact**; every run's JSON (with its run folder) in the out dir's "
                "`results.json`",
                "",
                table,
            ]
        )
        _common.append_results(
            "Scale: every fault class at a random rank (benchmarks/scale_matrix.py)",
            info,
            _common.command_line(),
            body,
        )
    return 0 if exact == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
