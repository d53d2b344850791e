"""The end-of-run markdown report (`runs/<id>/report.md`).

Written once when `trainscout run` finishes: what ran, how it ended, every finding with its evidence
and captured stacks, and where trainscout's own view of the job had gaps, so a reader can tell
"no findings" from "not watched". It ends with a short legend for the finding kinds that appear.
"""

from __future__ import annotations

import os
import shlex
import time

from trainscout import findings as fk
from trainscout.findings import Finding
from trainscout.sinks.console import detail_lines, headline, sorted_stacks

# One line per kind, shown only for kinds that appear in the report.
KIND_MEANINGS = {
    fk.HANG: "some ranks wait inside a collective that the named ranks never entered; the named ranks are stuck "
    "elsewhere (see their stacks).",
    fk.DESYNC: "members of one process group issued different collectives at the same sequence number; the named "
    "ranks deviate from the majority.",
    fk.CRASH: "the named ranks died abnormally (exception or signal) while their peers were healthy.",
    fk.EARLY_EXIT: "the named ranks exited cleanly while their peers went on training.",
    fk.STALL: "the whole job stopped making progress and no single rank could be blamed.",
    fk.STRAGGLER: "the named ranks are persistently slower than their equivalent peers.",
    fk.SDC: "the named ranks hold or compute values that differ from the majority of their replicas (silent data "
    "corruption).",
    fk.NONFINITE: "the named ranks were the first to produce NaN/Inf before it spread through a reduction.",
    fk.HEALTH: "a host or device health check failed on the named ranks.",
    fk.HPZ_RACE: "weights used in backward differ from those used in forward (ZeRO++ hpZ secondary-partition race).",
    fk.MONITORING: "trainscout lost part of its view of the job; findings for that part may be missing.",
}
STATUS_NOTE = (
    '"attributed" means a strict majority of equivalent peers disagreed with the named ranks; '
    '"inconclusive" means a disagreement was seen but could not be pinned on a minority.'
)


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _cell(text: object) -> str:
    """Make text safe inside a markdown table cell."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _fence(text: str) -> str:
    # A fence longer than any backtick run inside the text, so a stack cannot close its own block.
    longest, run = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return "`" * max(3, longest + 1)


def _code_block(text: str) -> list[str]:
    fence = _fence(text)
    return [fence + "text", text.rstrip("\n"), fence]


def render_summary(
    *,
    run_id: str,
    command: list[str],
    exit_code: int | None,
    findings: list[Finding],
    notes: list[str],
    started: float,
    ended: float,
) -> str:
    """The report as markdown text (write_summary writes it; tests and `report` may render directly)."""
    out = [f"# trainscout report: {run_id}", ""]
    out.append(f"- Run id: `{run_id}`")
    out.append(f"- Command: `{shlex.join(command)}`" if command else "- Command: (none)")
    out.append(f"- Started: {_when(started)}, ended: {_when(ended)} ({_duration(ended - started)})")
    out.append(f"- Exit code: {exit_code if exit_code is not None else 'unknown (still running or killed)'}")
    out.append(f"- Findings: {len(findings)}")
    out.append("")

    out += ["## Findings", ""]
    if not findings:
        out += ["No findings.", ""]
    else:
        out += ["| # | kind | step | culprits | summary |", "|---|---|---|---|---|"]
        for i, f in enumerate(findings, 1):
            step = f.step if f.step is not None else "-"
            culprits = ", ".join(str(r) for r in f.culprit_ranks) or "-"
            out.append(f"| {i} | {_cell(f.kind)} | {step} | {_cell(culprits)} | {_cell(f.summary)} |")
        out.append("")
        for i, f in enumerate(findings, 1):
            out += [f"### {i}. {headline(f)}", ""]
            # Stacks are left out here: they follow in full, one code block each.
            out += [f"- {line.strip()}" for line in detail_lines(f, stacks=False)]
            if f.first_seen or f.confirmed:
                out.append("")
                out.append(f"First suspected {_when(f.first_seen)}, confirmed {_when(f.confirmed)}.")
            if f.evidence:
                out += ["", "Evidence:", ""]
                out += [f"- {_cell(k)}: {_cell(v)}" for k, v in f.evidence.items()]
            for rank, stack in sorted_stacks(f):
                out += ["", f"Stack of rank {rank}:", "", *_code_block(stack)]
            out.append("")

    out += ["## Monitoring", ""]
    if notes:
        out += [f"- {note}" for note in notes]
    else:
        out.append("No monitoring gaps were recorded.")
    out.append("")

    kinds = sorted({f.kind for f in findings})
    out += ["## How to read findings", ""]
    for kind in kinds:
        out.append(f"- **{kind}**: {KIND_MEANINGS.get(kind, 'see the trainscout documentation for this kind.')}")
    out.append(
        f"- Status: {STATUS_NOTE}"
        if kinds
        else "- Each finding names a kind, a step, the culprit ranks and the evidence. " + STATUS_NOTE
    )
    out.append("")
    return "\n".join(out)


def write_summary(
    path: str | os.PathLike,
    *,
    run_id: str,
    command: list[str],
    exit_code: int | None,
    findings: list[Finding],
    notes: list[str],
    started: float,
    ended: float,
) -> None:
    text = render_summary(
        run_id=run_id,
        command=command,
        exit_code=exit_code,
        findings=findings,
        notes=notes,
        started=started,
        ended=ended,
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)  # a reader never sees half a report


def write_summary_or_say(console, path: str | os.PathLike, **fields) -> bool:
    """write_summary, or (a full or vanished run folder) one clear line instead of a traceback, the report's
    notes on the terminal so the gaps it would have listed are not lost: the findings were shown as they came."""
    try:
        write_summary(path, **fields)
        return True
    except OSError as exc:
        try:
            os.unlink(f"{os.fspath(path)}.tmp")
        except OSError:
            pass
        console.warn(f"summary.md not written ({exc.strerror or exc}): the run folder is full or gone")
        for note in fields.get("notes", []):
            console.info(note)
        return False
