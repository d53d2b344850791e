"""ZeRO++ hpZ race: the weights a module uses in backward must be the weights it used in forward.

Under ZeRO-3 with hierarchical partitioning the forward gathers each parameter from the primary
partitions (every rank), and the backward gathers it again from the secondary partitions (the ranks of
one intra-node group), which were filled by a copy when the forward released the parameter. If that
gather reads a secondary partition before its copy landed (the hpZ race), backward runs on different
weights than forward did.

The probe (`probe/hpz_check.py`) fingerprints, on a rotation over modules, each checked parameter's
gathered bytes in forward and again in backward of the same step, cut into the byte ranges that came
from each member's secondary partition. This detector compares them per (step, parameter, range):

- the primary value of a range is the forward fingerprint a strict majority of ranks holds (all-gather
  receivers of the primary gather must agree); with no majority, each receiver's own forward value;
- a receiver whose backward fingerprint differs from the primary value got a corrupted secondary
  gather, and the range names its origin: the rank whose secondary partition was read unfilled.

Attribution therefore does not need a majority of replicas: two ranks are enough to name the origin.
Records arrive as replicated-state records (`StateRecord`) whose tensor name starts with `hpz|`; pure
logic, no torch, no I/O.
"""

from __future__ import annotations

from collections import Counter

from trainscout.detectors.interface import DetectorBase, JobView, Judgement, findings_only
from trainscout.detectors.observations import rank_list
from trainscout.findings import HPZ_RACE, Finding
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import NodeDigest, StateRecord

PREFIX = "hpz|"
MAX_LISTED = 12  # parameters and ranges listed in a finding's evidence

FIX_HINTS = {
    "unsafe": "the secondary partition's host stall was removed without ordering (TRAINSCOUT_HPZ_FIX=unsafe): "
    "run with TRAINSCOUT_HPZ_FIX=event (trainscout run's default), which orders the secondary "
    "all-gather after the copy with a CUDA event",
    "event": "the event-ordered fix was active, so this is not the known copy/all-gather race: the secondary "
    "partition was corrupted another way (check the device; set zero_hpz_partition_size: 1 to bypass "
    "hpZ meanwhile)",
    "stall": "trainscout run orders the secondary all-gather after the copy with a CUDA event when "
    "TRAINSCOUT_HPZ_FIX=event (its default; this job ran without it): keep it on, or set "
    "overlap_comm: false or zero_hpz_partition_size: 1 in the DeepSpeed config",
    "none": "this accelerator has no separate streams, so the secondary partition itself was corrupted "
    "(check the device; set zero_hpz_partition_size: 1 to bypass hpZ meanwhile)",
}


def record_name(phase: str, param: str, owner: int, mode: str) -> str:
    """Tensor name of one range's fingerprint: phase fwd|bwd, the rank whose secondary partition the range
    comes from, the fix mode the rank ran with (event|unsafe|stall|none), and the parameter."""
    return f"{PREFIX}{phase}|{owner}|{mode}|{param}"


def parse_record_name(name: str) -> tuple[str, int, str, str] | None:
    """(phase, owner, mode, param) of a name made by `record_name`, or None for any other tensor."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX) :].split("|", 3)
    if len(parts) != 4 or parts[0] not in ("fwd", "bwd"):
        return None
    try:
        owner = int(parts[1])
    except ValueError:
        return None
    return parts[0], owner, parts[2], parts[3]


def is_hpz_record(rec: StateRecord) -> bool:
    return rec.tensor.startswith(PREFIX)


class HpzRaceDetector(DetectorBase):
    name = "hpz"

    def __init__(self, wait_s: float = 5.0) -> None:
        self.wait_s = wait_s
        # step -> {"t": first seen, "keys": {(param, start, end): {"fwd": {rank: digest},
        #                                                         "bwd": {rank: (digest, owner)}}}, "modes": set}
        self._steps: dict[int, dict] = {}
        self._latest: dict[int, int] = {}  # rank -> highest step it reported (its records arrive in order)
        self.compared = 0  # ranges compared
        self.steps_judged = 0

    def observe(self, digest: NodeDigest, now: float) -> None:
        for st in digest.ranks:
            records = [r for r in st.state if is_hpz_record(r)]  # forward/backward weights (hpZ check)
            if records:
                self.add(st.rank, records, now)

    def judge(self, view: JobView) -> Judgement:
        return findings_only(self.update(view.waited_until, view.live))

    def add(self, rank: int, records: list[StateRecord], now: float) -> None:
        for rec in records:
            parsed = parse_record_name(rec.tensor)
            if parsed is None:
                continue
            phase, owner, mode, param = parsed
            entry = self._steps.setdefault(rec.step, {"t": now, "keys": {}, "modes": set(), "ranks": set()})
            slot = entry["keys"].setdefault((param, rec.start, rec.end), {"fwd": {}, "bwd": {}})
            if phase == "fwd":
                slot["fwd"][rank] = rec.digest
            else:
                slot["bwd"][rank] = (rec.digest, owner)
            entry["modes"].add(mode)
            entry["ranks"].add(rank)
            self._latest[rank] = max(self._latest.get(rank, 0), rec.step)

    def update(self, now: float, live: set[int] | None = None) -> list[Finding]:
        """Judge every step whose records are all in (each reporting rank has moved past it, or the wait
        ran out); steps in order, so the earliest corrupted step is the one named."""
        findings: list[Finding] = []
        for step in sorted(self._steps):
            entry = self._steps[step]
            reporters = entry["ranks"]
            moved_on = all(self._latest.get(r, 0) > step or (live is not None and r not in live) for r in reporters)
            if not moved_on and now - entry["t"] < self.wait_s:
                break  # later steps wait for this one: judge in order
            del self._steps[step]
            self.steps_judged += 1
            finding = self._judge(step, entry)
            if finding is not None:
                findings.append(finding)
        return findings

    def _judge(self, step: int, entry: dict) -> Finding | None:
        bad: list[tuple[str, int, int, int, list[int]]] = []  # (param, start, end, owner, receivers)
        majority_ok = True
        for (param, start, end), slot in sorted(entry["keys"].items()):
            fwd, bwd = slot["fwd"], slot["bwd"]
            if not bwd:
                continue
            primary = _strict_majority(fwd)
            if primary is None:
                majority_ok = False
            by_owner: dict[int, list[int]] = {}  # owner -> receivers that got a different range
            for rank, (digest, owner) in sorted(bwd.items()):
                reference = primary if primary is not None else fwd.get(rank)
                if reference is None:
                    continue  # this rank's forward value never came: nothing to compare with
                self.compared += 1
                if digest != reference:
                    by_owner.setdefault(owner, []).append(rank)
            for owner, ranks in sorted(by_owner.items()):
                bad.append((param, start, end, owner, ranks))
        if not bad:
            return None
        owners = sorted({b[3] for b in bad})
        receivers = sorted({r for b in bad for r in b[4]})
        params = sorted({b[0] for b in bad})
        modes = sorted(entry["modes"])
        mode = "unsafe" if "unsafe" in modes else modes[0] if modes else "stall"
        fix = FIX_HINTS.get(mode, FIX_HINTS["stall"])
        shown = ", ".join(params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "")
        how = (
            "read before its copy was filled"
            if mode in ("unsafe", "stall")
            else "which no longer matches the primary partitions"
        )
        summary = (
            f"backward on {rank_list(receivers)} gathered different weights than forward in {len(params)} "
            f"parameter(s) ({shown}): the differing bytes come from the ZeRO++ hpZ secondary partition of "
            f"{rank_list(owners)}, {how}. Fix: {fix}"
        )
        evidence = {
            "check": "hpz_forward_backward",
            "params": params[:MAX_LISTED],
            "params_total": len(params),
            "ranges": [
                {"param": p, "bytes": [s, e], "secondary_of": o, "receivers": rs} for p, s, e, o, rs in bad[:MAX_LISTED]
            ],
            "ranges_total": len(bad),
            "receivers": receivers,
            "fix_mode": mode,
            "fix": fix,
        }
        return Finding(
            kind=HPZ_RACE,
            summary=summary,
            culprit_ranks=owners,
            step=step,
            confidence=1.0 if majority_ok else 0.8,
            evidence=evidence,
        )


def _strict_majority(values: dict[int, int]) -> int | None:
    if not values:
        return None
    value, count = Counter(values.values()).most_common(1)[0]
    return value if 2 * count > len(values) else None
