"""Replay recorded straggler traces through the current straggler detector, offline.

The coordinator writes the last 400 compute steps it judged into `events.jsonl` (`straggler_trace`: each
rank's compute and collective wait per step). Feeding them to today's detector shows what it would have said
on those runs, next to what was said live: a cheap check of a rule change against the false findings and the
detections already recorded. Traces of older code (`waits` not "per-step") kept the 8-step median waits
arrival order read instead; for them arrival order is read from those medians in both tiers (the fine tier
uses its full window live), so the fine tier can name a rank earlier than it did live. Runs whose trace does
not start at step 2 (older code kept fewer steps) are skipped.

    .venv/bin/python -m benchmarks false-positives straggler-replay RUN_DIR_PARENT [RUN_DIR_PARENT ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from trainscout.detectors.straggler import StragglerDetector, _keep_against_peers
from trainscout.wire.messages import StepRecord


class ReplayedDetector(StragglerDetector):
    """Arrival order from the traced waits instead of raw per-step waits (which the trace does not keep)."""

    def __init__(self, waits_by_step: dict[int, dict[str, float]]) -> None:
        super().__init__()
        self.waits_by_step = waits_by_step
        self.current_step = 0

    def _arrive_last(self, outliers: set[int], window: int) -> set[int]:
        waits = self.waits_by_step.get(self.current_step)
        if not outliers or not waits:
            return outliers
        return _keep_against_peers(outliers, {int(q): v for q, v in waits.items()}, lambda own, peers: own <= peers)


def replay(events_path: str) -> list[tuple[list[int], int, str]] | None:
    with open(events_path) as fh:
        events = [json.loads(line) for line in fh if line.strip()]
    traces = [e for e in events if e.get("kind") == "straggler_trace"]
    if not traces:
        return None
    rows = [t for t in traces[-1]["steps"] if t[1] == "compute" and len(t) > 6]
    if not rows or rows[0][0] > 3:
        return None
    per_step = traces[-1].get("waits") == "per-step"
    det = StragglerDetector() if per_step else ReplayedDetector({t[0]: t[6] for t in rows})
    found = []
    for step, _label, samples, *rest in rows:
        det.current_step = step
        waits = rest[3] if per_step else {}
        for r, x in samples.items():
            det.add(
                int(r),
                [
                    StepRecord(
                        step=step,
                        wall_s=0.0,
                        cpu_s=x,
                        data_s=0.0,
                        ckpt_s=0.0,
                        wait_s=float(waits.get(r, 0.0)),
                        gpu_s=-1.0,
                        gpu_wait_s=-1.0,
                        pg_wait={},
                    )
                ],
                0.0,
            )
        for f in det.update(0.0, {int(r) for r in samples}):
            found.append((f.culprit_ranks, f.step, f.evidence.get("basis") or "fast"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parents", nargs="+", help="folders holding run dirs (each with events.jsonl)")
    args = parser.parse_args()
    changed = total = 0
    for parent in args.parents:
        for events_path in sorted(glob.glob(os.path.join(parent, "*", "events.jsonl"))):
            got = replay(events_path)
            if got is None:
                continue
            run_dir = os.path.dirname(events_path)
            live = []
            findings_path = os.path.join(run_dir, "findings.jsonl")
            if os.path.exists(findings_path):
                with open(findings_path) as fh:
                    live = [
                        (f["culprit_ranks"], f["step"])
                        for f in map(json.loads, fh)
                        if f["kind"] == "straggler" and f["evidence"].get("type") == "compute"
                    ]
            total += 1
            same = [(r, s) for r, s, _ in got] == live
            changed += not same
            print(
                f"{os.path.basename(run_dir)}: live {live} replay {[(r, s) for r, s, _ in got]}"
                f"{'' if same else '  <- differs'}"
            )
    print(f"{total} runs replayed, {changed} differ from what was said live")


if __name__ == "__main__":
    main()
