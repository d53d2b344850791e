"""Replay recorded runs' per-step evidence through today's straggler and numeric detectors, offline.

Every run writes `evidence.jsonl` (each rank's step timings and numeric records as the coordinator received
them; sinks/evidence_log.py). Feeding those to the current detectors shows what they would say on runs
already recorded, healthy ones (which must give nothing) and faulty ones (which must name the culprit):
a rule change is checked against hundreds of runs in seconds, without rerunning a job. The run's
`findings.jsonl` is shown beside it for comparison; a fault log (`<run>.faults.jsonl` next to the run folder,
or `faults.jsonl` inside it) gives the onset for latency in steps.

    .venv/bin/python -m benchmarks false-positives replay RUN_DIR_PARENT [RUN_DIR_PARENT ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from trainscout.detectors.numerics import NumericDetector
from trainscout.faults.fault_log import read_fault_log
from trainscout.detectors.straggler import StragglerDetector
from trainscout.sinks.evidence_log import read


def replay(evidence_path: str, shared_gpu: bool = False) -> tuple[list[tuple], list[tuple]]:
    """(straggler findings, numeric suspects) the detectors give on one recorded run, in step order."""
    ranks = read(evidence_path)
    steps: dict[int, list] = {}
    numerics: dict[int, list] = {}
    for r, entry in ranks.items():
        for rec in entry["steps"]:
            steps.setdefault(rec.step, []).append((r, rec))
        for rec in entry["numerics"]:
            numerics.setdefault(rec.step, []).append((r, rec))
    layers = next((e["layers"] for e in ranks.values() if e["layers"]), [])
    live = set(ranks)
    strag, num = StragglerDetector(), NumericDetector()
    strag.shared_gpu = shared_gpu  # ranks on one GPU (the coordinator learns it from the probes' device ids)
    found_s, found_n = [], []
    for step in sorted(set(steps) | set(numerics)):
        for r, rec in steps.get(step, []):
            strag.add(r, [rec], 0.0)
        for r, rec in numerics.get(step, []):
            num.add(r, "replicas", layers, [(rec.step, rec.loss, rec.norms)], 0.0)
        for f in strag.update(0.0, live):
            found_s.append(
                (
                    f.kind,
                    f.evidence.get("type"),
                    f.culprit_ranks,
                    f.step,
                    "intermittent" if f.evidence.get("intermittent") else f.evidence.get("basis", "")[:20],
                )
            )
        for s in num.update(0.0, {"replicas": sorted(live)}):
            found_n.append((s.statistic, s.pattern, s.rank, s.step, s.layer, round(s.ratio, 2), round(s.z, 1)))
    return found_s, found_n


def onset(run_dir: str) -> int | None:
    for path in (run_dir + ".faults.jsonl", os.path.join(run_dir, "faults.jsonl")):
        if os.path.exists(path):
            steps = [r["step"] for r in read_fault_log(path)]
            if steps:
                return min(steps)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parents", nargs="+", help="folders holding run dirs (each with evidence.jsonl)")
    parser.add_argument("--shared-gpu", action="store_true", help="the runs' ranks shared one GPU")
    args = parser.parse_args()
    runs = with_findings = 0
    for parent in args.parents:
        for path in sorted(glob.glob(os.path.join(parent, "*", "evidence.jsonl"))):
            run_dir = os.path.dirname(path)
            stragglers, numeric = replay(path, args.shared_gpu)
            runs += 1
            with_findings += bool(stragglers or numeric)
            live = []
            findings_path = os.path.join(run_dir, "findings.jsonl")
            if os.path.exists(findings_path):
                with open(findings_path) as fh:
                    live = [
                        (
                            f["kind"],
                            f["evidence"].get("type") or f["evidence"].get("check"),
                            f["culprit_ranks"],
                            f.get("step"),
                        )
                        for f in map(json.loads, fh)
                    ]
            start = onset(run_dir)
            print(f"{os.path.basename(run_dir)}: onset {start} | replay {stragglers + numeric} | live {live}")
    print(f"{runs} runs replayed, {with_findings} with findings or suspects")
    return 0


if __name__ == "__main__":
    sys.exit(main())
