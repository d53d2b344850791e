"""What the in-rank checks cost: each probe writes a report at exit, the run summary and benchmarks read them.

A report is `{"rank", "steps", "step_wall_s", <check>: {"seconds", ...}}` (see `Probe.costs`); the
seconds are the training thread's time inside the check, compared against the rank's own step time.
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics

CHECKS = (
    "state_check",
    "gather_check",
    "nonfinite",
    "replay",
    "link_probe",
    "flight_recorder",
)  # the last: the probe thread's dumps
_NAME = "probe-cost.rank{}.json"


def report_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, _NAME.format(rank))


def read_reports(run_dir: str) -> list[dict]:
    """Every rank's report that covers more than one step (others say nothing about per-step cost)."""
    reports = []
    for path in sorted(glob.glob(os.path.join(run_dir, _NAME.format("*")))):
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            continue
        if _well_formed(doc) and doc["steps"] > 1 and doc["step_wall_s"] > 0:
            reports.append(doc)
    return reports


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _well_formed(doc) -> bool:
    """A report as `Probe.costs` writes it: the summary divides and compares these numbers, so a report of
    another shape (a hand edit, a file cut short then completed by another writer) is left out."""
    if not isinstance(doc, dict) or not (_number(doc.get("steps")) and _number(doc.get("step_wall_s"))):
        return False
    for check in CHECKS:
        figures = doc.get(check, {})
        if not isinstance(figures, dict) or (check in doc and not _number(figures.get("seconds"))):
            return False
        if not all(_number(figures[k]) for k in ("period_steps", "stride", "layers") if k in figures):
            return False
    return True


def per_step(reports: list[dict], check: str) -> tuple[list[float], list[float]]:
    """(ms per step, % of step time) of `check`, one value per report that ran it."""
    ms = [1000 * r[check]["seconds"] / r["steps"] for r in reports if check in r]
    share = [100 * r[check]["seconds"] / r["step_wall_s"] for r in reports if check in r]
    return ms, share


def summary_line(run_dir: str) -> str:
    """One line for summary.md: each check's median cost over ranks and the state coverage period."""
    reports = read_reports(run_dir)
    parts = []
    for check in CHECKS:
        ms, share = per_step(reports, check)
        if ms:
            parts.append(
                f"{check.replace('_', ' ')} {statistics.median(ms):.3f} ms/step "
                f"({statistics.median(share):.2f} % of step time)"
            )
    periods = [r["state_check"]["period_steps"] for r in reports if "period_steps" in r.get("state_check", {})]
    if periods:
        parts.append(f"state coverage period {max(periods)} steps")
    strides = [r["nonfinite"]["stride"] for r in reports if "stride" in r.get("nonfinite", {})]
    if strides:  # the budget's doing: a NaN born in backward on another step shows a step later, on every rank
        parts.append(f"CPU gradients tested for NaN/Inf every {max(strides)} steps (the loss every step)")
    layers = [r["nonfinite"]["layers"] for r in reports if "layers" in r.get("nonfinite", {})]
    if layers:  # the non-finite pass also measures the per-step evidence
        parts.append(f"loss and {max(layers)} layer gradient norms measured every step (with the non-finite test)")
    if not parts:
        return ""
    return f"trainscout's in-rank checks, median over {len(reports)} ranks: " + "; ".join(parts)
