"""`trainscout checkpoints DIR`: list checkpoint certificates and their trust state.

A certificate says what trainscout knew when the checkpoint was saved. Findings can arrive after the
save (a corruption in a range that was checked later), so each certificate is judged again against the
run's findings.jsonl: an integrity finding (sdc, nonfinite, health) at or before the checkpoint's step
makes it suspect, whatever the certificate said.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from trainscout.probe.checkpoints import CERT_SUFFIX, DIR_CERT_NAME

INTEGRITY_KINDS = ("sdc", "nonfinite", "health")


@dataclass
class Entry:
    checkpoint: str
    step: int
    saved_at: float
    status: str
    reason: str


def find_certificates(root: str) -> list[str]:
    found = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(CERT_SUFFIX) or name == DIR_CERT_NAME:
                found.append(os.path.join(dirpath, name))
    return sorted(found)


def _late_findings(cert: dict) -> list[dict]:
    path = os.path.join(cert.get("run_dir") or "", "findings.jsonl")
    if not cert.get("run_dir") or not os.path.exists(path):
        return []
    out = []
    with open(path, "rb") as fh:  # bytes: a line that is not UTF-8 fails in json.loads, one line, not the file
        for line in fh:
            try:
                f = json.loads(line)
            except ValueError:
                continue
            # a line of another shape is no finding
            if not isinstance(f, dict) or not isinstance(f.get("step"), (int, float, type(None))):
                continue
            if f.get("kind") in INTEGRITY_KINDS and (f.get("step") or 0) <= cert.get("step", 0):
                out.append(f)
    return out


_TEMP_SUFFIXES = (".tmp", ".partial", ".incomplete", ".part")


def resolve_path(path: str) -> str:
    """Savers often write to a temporary name and rename; follow the certificate to the final file."""
    if os.path.exists(path):
        return path
    for suffix in _TEMP_SUFFIXES:
        if path.endswith(suffix) and os.path.exists(path[: -len(suffix)]):
            return path[: -len(suffix)]
    return path


def judge(cert: dict) -> Entry:
    """The certificate judged again; ValueError or TypeError when it is not one (the caller lists it as
    unreadable)."""
    if not isinstance(cert, dict) or not isinstance(cert.get("step", 0), int) or isinstance(cert.get("step"), bool):
        raise ValueError("not a trainscout certificate")
    status, reason = cert.get("status", "unverified"), str(cert.get("reason", ""))
    if status not in ("certified", "suspect", "unverified"):  # (a null or unknown status certifies nothing)
        raise ValueError(f"not a certificate status: {status!r}")
    checkpoint = resolve_path(str(cert.get("checkpoint", "?")))  # a number would be taken for a file descriptor
    if not os.path.exists(checkpoint):
        reason = f"{reason} (checkpoint file missing)"
    late = _late_findings(cert)
    if late and status != "suspect":
        status = "suspect"
        reason = f"finding after the save: {late[0].get('summary', '')}"
    return Entry(checkpoint, int(cert.get("step", -1)), float(cert.get("saved_at", 0.0)), status, reason)


def list_checkpoints(root: str) -> list[Entry]:
    entries = []
    for path in find_certificates(root):
        try:
            with open(path) as fh:
                entries.append(judge(json.load(fh)))
        except (OSError, ValueError, TypeError, OverflowError) as exc:
            entries.append(Entry(path, -1, 0.0, "unreadable", str(exc)))
    return sorted(entries, key=lambda e: (e.step, e.saved_at))


def recovery_choice(entries: list[Entry]) -> Entry | None:
    """The newest certified checkpoint older than every suspect one: the safe place to restart from."""
    first_suspect = min((e.step for e in entries if e.status == "suspect"), default=None)
    certified = [e for e in entries if e.status == "certified" and (first_suspect is None or e.step < first_suspect)]
    return certified[-1] if certified else None


def main(root: str, out) -> int:
    if not os.path.isdir(root):
        print(f"trainscout: {root} is not a directory", file=out)
        return 2
    entries = list_checkpoints(root)
    if not entries:
        print(f"no trainscout certificates under {root}", file=out)
        return 1
    width = max(len(os.path.relpath(e.checkpoint, root)) for e in entries)
    print(f"{'checkpoint'.ljust(width)}  {'step':>6}  status      reason", file=out)
    for e in entries:
        print(f"{os.path.relpath(e.checkpoint, root).ljust(width)}  {e.step:>6}  {e.status:<10}  {e.reason}", file=out)
    pick = recovery_choice(entries)
    if pick is not None:
        print(
            f"\nrecover from: {pick.checkpoint} (step {pick.step}, newest certified before any suspect one)", file=out
        )
    else:
        print("\nno certified checkpoint to recover from", file=out)
    return 0
