"""Did `trainscout demo` name the fault it injected? The demo's exit status says so.

The demo stops its training job on purpose once it finds a hang, desync or early exit, so the job's own
exit status (torchrun's 1) says nothing about whether trainscout worked. The demo's status does: 0 when
every injected fault was named with the expected kind and exactly the injected rank(s) as culprits (or,
with nothing injected, when the job finished cleanly with no finding), 1 otherwise.

Pure logic: fault specs and the run's findings in, a verdict out. No torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscout import config
from trainscout.faults.spec import FaultSpec, format_value
from trainscout.findings import Finding

# The finding each fault on one rank (or a few) must produce.
_EXPECTED_KIND = {
    "hang": "hang",
    "gil": "hang",  # a rank spinning with the GIL held never enters the next collective
    "pause": "hang",  # one rank sleeping past --hang-timeout while its peers wait
    "crash": "crash",
    "desync": "desync",
    "straggle": "straggler",
    "dataslow": "straggler",
    "commslow": "straggler",
    "slow": "straggler",  # it sleeps after its steps: time blocked off the CPU, which its peers wait for
    "corrupt": "sdc",
    "nan": "nonfinite",
    "delay": "straggler",  # held up inside its forward or its batch fetch, whatever the mechanism
    "starve": "straggler",  # its CPU shared with busy processes
    "gradnoise": "sdc",  # a wrong local gradient before the all-reduce
    "outflip": "sdc",  # a layer that computes wrong on this rank
}
# Faults on one rank that the demo, as launched, has no finding to expect for.
_NOT_JUDGED = {
    "ckptslow": "the demo writes no checkpoint unless its script is given --checkpoint-every",
    "perturb": "replay recomputes a layer every 200 steps or more, one layer at a time: longer than a demo",
    "gpuslow": "the demo runs on CPU ranks",
}
# Faults that, on every rank at once, leave nobody slower or different than the others: a healthy verdict
# (the demo's "uniformly slow" and "long pause on all ranks" cases).
_UNIFORM_IS_CLEAN = ("slow", "pause", "straggle", "dataslow", "ckptslow", "commslow", "gpuslow", "delay")


@dataclass(frozen=True)
class Verdict:
    ok: bool | None  # None: no expectation to judge by (the job's own exit status stands)
    lines: tuple[str, ...]


def expected_kind(spec: FaultSpec) -> str | None:
    """The finding kind a fault on one rank must produce; None for those the demo cannot judge."""
    if spec.kind == "exit":  # a clean exit leaves peers waiting; a non-zero one is a crash
        return "early_exit" if spec.params.get("code", 0) == 0 else "crash"
    return _EXPECTED_KIND.get(spec.kind)


def _describe(spec: FaultSpec) -> str:
    ranks = "every rank" if spec.ranks is None else "rank " + ",".join(str(r) for r in spec.ranks)
    params = "".join(f" {k}={format_value(v)}" for k, v in spec.params.items() if v != "")
    return f"{spec.kind}{params} on {ranks} from step {spec.step}"


def _finding_text(f: Finding) -> str:
    culprits = ",".join(str(r) for r in f.culprit_ranks) or "none"
    return f"{f.kind} (culprit ranks {culprits}, {f.status})"


def _not_judged(spec: FaultSpec, hang_timeout_s: float) -> str | None:
    if spec.ranks is None:
        return None
    if spec.kind == "pause" and spec.params.get("seconds", 0) <= hang_timeout_s:
        return "a pause no longer than --hang-timeout is not a hang"
    return _NOT_JUDGED.get(spec.kind)


def judge(
    specs: list[FaultSpec], findings: list[Finding], job_exit: int, hang_timeout_s: float = config.RUN.hang_timeout
) -> Verdict:
    """The demo's verdict on one finished run."""
    found = "; ".join(_finding_text(f) for f in findings) or "no finding"
    exit_line = f"the training job's exit status: {job_exit}"
    if not specs or all(s.ranks is None and s.kind in _UNIFORM_IS_CLEAN for s in specs):
        what = (
            "nothing injected"
            if not specs
            else "; ".join(_describe(s) for s in specs) + " (nobody slower than the others)"
        )
        ok = not findings and job_exit == 0
        verdict = "PASS: a clean run, no finding" if ok else "FAIL: expected a clean run with no finding"
        return Verdict(ok, (f"demo {verdict} ({what}); found: {found}; {exit_line}",))
    reasons = [(s, why) for s in specs if (why := _not_judged(s, hang_timeout_s))]
    if reasons:
        return Verdict(
            None, tuple(f"demo: {_describe(s)} is not judged: {why}; found: {found}; {exit_line}" for s, why in reasons)
        )
    if any(s.ranks is None for s in specs):
        return Verdict(
            None,
            (
                f"demo: {'; '.join(_describe(s) for s in specs)}: a fault on every rank has no "
                f"single culprit to check; found: {found}; {exit_line}",
            ),
        )
    lines, ok = [], True
    for spec in specs:
        kind, ranks = expected_kind(spec), sorted(spec.ranks or ())
        named = [
            f for f in findings if f.kind == kind and f.status == "attributed" and sorted(f.culprit_ranks) == ranks
        ]
        want = f"a {kind} finding naming rank {','.join(map(str, ranks))}"
        if named:
            lines.append(f"demo PASS: injected {_describe(spec)}; trainscout found {want}")
        else:
            ok = False
            lines.append(f"demo FAIL: injected {_describe(spec)}; expected {want}; found: {found}")
    lines.append(f"demo: {exit_line} (the demo stops the job once it finds a hang, desync, early exit or stall)")
    return Verdict(ok, tuple(lines))
