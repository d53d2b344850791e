"""verdict.json: what a scheduler or an operator acts on once trainscout has named a culprit.

The coordinator rewrites it (atomically: a reader sees the old file or the new one, never half of one)
each time a finding names culprits. It holds the hosts, devices, ranks and pids to drain or inspect, the
findings in the order they were made (the first one, the root cause, stays first) and the newest
checkpoint that can be trusted: the certificates this run wrote (their paths are listed in
`certificates.jsonl` of the run folder by the ranks' probes) judged again against the run's findings,
as `trainscout checkpoints` does. No torch here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from trainscout.checkpoint_list import Entry, judge, recovery_choice
from trainscout.findings import Finding
from trainscout.probe.checkpoints import CERT_INDEX

VERDICT_FILE = "verdict.json"
SCHEMA = 1


def names_culprits(f: Finding) -> bool:
    """A finding a verdict is about: attributed by a strict majority, to at least one rank."""
    return f.status == "attributed" and bool(f.culprit_ranks)


def _ordered_union(groups: Iterable[Iterable]) -> list:
    out: list = []
    for group in groups:
        for item in group:
            if item not in out:
                out.append(item)
    return out


def build(run_id: str, findings: list[Finding], checkpoint: dict | None) -> dict:
    """The verdict over every culprit-naming finding so far (in the order they were made)."""
    named = [f for f in findings if names_culprits(f)]
    return {
        "schema": SCHEMA,
        "run_id": run_id,
        "culprits": {
            "hosts": _ordered_union(f.hosts for f in named),
            "devices": _ordered_union(f.devices for f in named),
            "ranks": _ordered_union(f.culprit_ranks for f in named),
            "pids": _ordered_union(f.pids for f in named),
        },
        "findings": [
            {
                "kind": f.kind,
                "summary": f.summary,
                "step": f.step,
                "attempt": f.attempt,
                "ranks": list(f.culprit_ranks),
                "hosts": list(f.hosts),
                "devices": list(f.devices),
                "pids": list(f.pids),
            }
            for f in named
        ],
        "checkpoint": checkpoint,
    }


def recorded_certificates(run_dir: str) -> list[str]:
    """Paths of the certificates the ranks of this run wrote (one JSON line each in certificates.jsonl)."""
    out: list[str] = []
    try:
        with open(os.path.join(run_dir, CERT_INDEX), "rb") as fh:  # bytes: a non-UTF-8 line is skipped alone
            for line in fh:
                try:
                    path = str(json.loads(line)["certificate"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a rank that died while writing it
                if path not in out:
                    out.append(path)
    except OSError:
        pass
    return out


def trusted_checkpoint(run_dir: str) -> dict | None:
    """The newest certified checkpoint before any suspect one, judged against the findings made since it
    was saved; None when this run certified no checkpoint (or none is known)."""
    entries: list[Entry] = []
    for path in recorded_certificates(run_dir):
        try:
            with open(path) as fh:
                entries.append(judge(json.load(fh)))
        except (OSError, ValueError, TypeError, OverflowError):  # not a certificate (see checkpoint_list.judge)
            continue
    pick = recovery_choice(sorted(entries, key=lambda e: (e.step, e.saved_at)))
    if pick is None:
        return None
    return {"path": pick.checkpoint, "step": pick.step, "status": pick.status, "reason": pick.reason}


def write(path: str, verdict: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(verdict, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)
