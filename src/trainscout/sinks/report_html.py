"""The visual run report (`runs/<id>/report.html`): one self-contained file a person opens in a browser.

It is rendered only from what a run leaves in its folder (findings.jsonl, evidence.jsonl, the supervisor's
events, topology.json, summary.md's monitoring notes), so it can be written at the end of a run, rewritten
later by `trainscout report RUN --html`, or made from a run still in progress. Every chart is SVG generated
here, so the page needs no network and reads the same with scripts disabled; a few lines of inline script
only add interaction (hovering a rank lights it up in every chart) and record, in the DOM, how many charts
the browser actually drew (what the browser test reads).

Per-rank timelines (step time, wait in collectives, loss, gradient norm) highlight the culprit ranks and mark
each finding's step; report_series bounds what they read and draw, so the file stays small (tens of KB) and
quick to write whatever the job's length and size.
"""

from __future__ import annotations

import html
import json
import math
import os
import time
from dataclasses import dataclass, field

import msgspec

from trainscout.findings import Finding, from_json
from trainscout.sinks.console import detail_lines, headline, sorted_stacks
from trainscout.sinks.evidence_log import log_files
from trainscout.sinks.jsonl import read_objects
from trainscout.sinks.report_series import (
    CULPRIT_COLOURS,
    EVIDENCE_READ_BYTES,
    MEDIAN_COLOUR,
    PEER_COLOUR,
    Chart,
    Evidence,
    Point,
    build_timelines,
    read_evidence,
)
from trainscout.sinks.summary import KIND_MEANINGS, STATUS_NOTE

REPORT_FILE = "report.html"

# Chart geometry (SVG user units; the page scales the chart to its width).
WIDTH, HEIGHT = 760, 230
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 26, 34


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


# ---- reading a run folder ----------------------------------------------------------------------


@dataclass
class RunData:
    run_id: str
    findings: list[Finding] = field(default_factory=list)
    evidence: Evidence = field(default_factory=Evidence)
    command: list[str] = field(default_factory=list)
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    topology: str = ""
    notes: list[str] = field(default_factory=list)


def _read_findings(path: str) -> list[Finding]:
    out = []
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                if raw.strip():
                    try:
                        out.append(from_json(raw))
                    except msgspec.DecodeError:
                        continue
    except OSError:
        pass
    return out


def _monitoring_notes(summary_path: str) -> list[str]:
    """The bullet lines of summary.md's Monitoring section (the supervisor computed them at the end)."""
    try:
        with open(summary_path) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    notes, inside = [], False
    for line in lines:
        if line.startswith("## "):
            inside = line.strip() == "## Monitoring"
        elif inside and line.startswith("- "):
            notes.append(line[2:])
    return notes


def _is_number(value) -> bool:
    """A wall-clock time the report can print (time.localtime refuses NaN and years beyond its range)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e11


def load_run(run_dir: str | os.PathLike, max_evidence_bytes: int = EVIDENCE_READ_BYTES) -> RunData:
    run_dir = os.fspath(run_dir)
    data = RunData(run_id=os.path.basename(os.path.normpath(run_dir)))
    data.findings = _read_findings(os.path.join(run_dir, "findings.jsonl"))
    logs = log_files(os.path.join(run_dir, "evidence.jsonl"))  # a rotated log first
    if logs:
        data.evidence = read_evidence(logs, max_evidence_bytes)
    for event in read_objects(os.path.join(run_dir, "events.supervisor.jsonl")):
        # values of another type than the supervisor writes are left unknown: the report formats them
        t = event.get("t") if _is_number(event.get("t")) else None
        if event.get("kind") == "start":
            command = event.get("command")
            data.command = [str(a) for a in command] if isinstance(command, list) else []
            data.started = t
        elif event.get("kind") == "launcher_exit":
            code = event.get("code")
            data.exit_code = code if isinstance(code, int) and not isinstance(code, bool) else None
            data.ended = t
    try:
        with open(os.path.join(run_dir, "topology.json")) as fh:
            data.topology = str(json.load(fh).get("line", ""))
    except (OSError, ValueError, AttributeError):
        pass
    notes = _monitoring_notes(os.path.join(run_dir, "summary.md"))
    data.notes = [n for n in notes if n != data.topology]  # shown once, at the top
    return data


# ---- SVG ---------------------------------------------------------------------------------------


def _nice_ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    if not (0 < raw < math.inf):  # values near the float limits (a diverged loss): the span overflows or vanishes
        return [lo, hi]
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    v = first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _y_range(values: list[float]) -> tuple[float, float, bool]:
    """Low, high and whether high was lowered: a few far outliers (a first step that includes start-up)
    must not flatten every other value; values far above the bulk are drawn at the top edge instead."""
    ys = sorted(values)
    lo, hi = ys[0], ys[-1]
    q10, q90 = ys[int(0.1 * (len(ys) - 1))], ys[int(0.9 * (len(ys) - 1))]
    limit = q90 + 4 * max(q90 - q10, 1e-12)
    clipped = False
    if hi > limit:
        kept = max(v for v in ys if v <= limit)
        hi, clipped = kept + 0.1 * (kept - lo), True
    if hi == lo:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    elif lo >= 0 and lo < 0.25 * hi:
        lo = 0.0
    return lo, hi, clipped


class _Scale:
    def __init__(self, x0: float, x1: float, y0: float, y1: float) -> None:
        self.x0, self.x1 = x0, (x1 if x1 > x0 else x0 + 1)
        self.y0, self.y1 = y0, y1

    def x(self, v: float) -> float:
        return LEFT + (v - self.x0) / (self.x1 - self.x0) * (WIDTH - LEFT - RIGHT)

    def y(self, v: float) -> float:
        v = min(max(v, self.y0), self.y1)
        return TOP + (self.y1 - v) / (self.y1 - self.y0) * (HEIGHT - TOP - BOTTOM)


def _path(points: list[Point], s: _Scale) -> str:
    """SVG path data; a non-finite value breaks the line."""
    parts, pen_down = [], False
    for x, y in points:
        if not math.isfinite(y):
            pen_down = False
            continue
        parts.append(f"{'L' if pen_down else 'M'}{s.x(x):.1f} {s.y(y):.1f}")
        pen_down = True
    return "".join(parts)


def _axes(s: _Scale, ticks_y: list[float], unit: str) -> list[str]:
    out = []
    for v in ticks_y:
        y = s.y(v)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{esc(_fmt(v))}</text>')
    for v in _nice_ticks(s.x0, s.x1, 6):
        x = s.x(v)
        out.append(
            f'<text class="tick" x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{esc(_fmt(v))}</text>'
        )
    out.append(
        f'<text class="axis" x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 4}" text-anchor="middle">step</text>'
    )
    if unit:
        out.append(f'<text class="axis" x="4" y="{TOP - 10}">{esc(unit)}</text>')
    out.append(
        f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}"/>'
    )
    return out


def svg_timeline(chart: Chart) -> str:
    xs = [x for line in chart.lines for x, _ in line.points] + [b[0] for b in chart.band]
    ys = [y for line in chart.lines for _, y in line.points if math.isfinite(y)]
    ys += [v for b in chart.band for v in b[1:]]
    y0, y1, clipped = _y_range(ys)
    s = _Scale(min(xs), max(xs), y0, y1)
    out = [
        f'<svg class="chart" data-chart="{esc(chart.key)}" data-series="{len(chart.lines)}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{esc(chart.title)}">',
        f"<title>{esc(chart.title)}</title>",
    ]
    out += _axes(s, _nice_ticks(y0, y1), chart.unit)
    if chart.band:
        upper = " ".join(f"{s.x(x):.1f},{s.y(hi):.1f}" for x, _, hi in chart.band)
        lower = " ".join(f"{s.x(x):.1f},{s.y(lo):.1f}" for x, lo, _ in reversed(chart.band))
        out.append(f'<polygon class="band" points="{upper} {lower}"><title>range of the peers</title></polygon>')
    for line in chart.lines:
        rank_attr = f' data-rank="{line.rank}"' if line.rank is not None else ""
        finite = [p for p in line.points if math.isfinite(p[1])]
        if len(finite) == 1:  # one point is no line: a dot
            x, y = finite[0]
            out.append(
                f'<circle class="series {line.role}"{rank_attr} cx="{s.x(x):.1f}" cy="{s.y(y):.1f}" r="3" '
                f'fill="{line.colour}"><title>{esc(line.label)}</title></circle>'
            )
        elif finite:
            out.append(
                f'<path class="series {line.role}"{rank_attr} d="{_path(line.points, s)}" stroke="{line.colour}">'
                f"<title>{esc(line.label)}</title></path>"
            )
    for step, label in chart.markers:
        if s.x0 <= step <= s.x1:
            x = s.x(step)
            out.append(
                f'<line class="onset" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}">'
                f"<title>{esc(label)} at step {step:g}</title></line>"
            )
            right_half = x > (LEFT + WIDTH - RIGHT) / 2  # the label goes on the side with room
            anchor = f'x="{x - 3:.1f}" text-anchor="end"' if right_half else f'x="{x + 3:.1f}"'
            out.append(f'<text class="onset-label" {anchor} y="{TOP + 11}">{esc(label)}</text>')
    out.append("</svg>")
    notes = []
    if clipped:
        notes.append(f"values above {_fmt(y1)} {esc(chart.unit)} are drawn at the top edge")
    if chart.nonfinite:
        notes.append(f"{chart.nonfinite} non-finite values (NaN/Inf) are gaps")
    caption = f"<figcaption>{esc(chart.title)}{' — ' + '; '.join(notes) if notes else ''}</figcaption>"
    legend = _legend(chart)
    return f"<figure>{caption}{''.join(out)}{legend}</figure>"


def _legend(chart: Chart) -> str:
    items = []
    for line in chart.lines:
        if line.role == "peer":
            continue
        rank_attr = f' data-rank="{line.rank}"' if line.rank is not None else ""
        items.append(f'<span class="key"{rank_attr}><i style="background:{line.colour}"></i>{esc(line.label)}</span>')
    peers = [line for line in chart.lines if line.role == "peer"]
    if peers:
        items.append(f'<span class="key"><i style="background:{PEER_COLOUR}"></i>peers ({len(peers)} ranks)</span>')
    if chart.band:
        items.append('<span class="key"><i class="band-key"></i>range of the peers</span>')
    if chart.markers:
        items.append('<span class="key"><i class="onset-key"></i>a finding\'s step</span>')
    return f'<div class="legend">{"".join(items)}</div>'


# ---- where each rank stands (hangs) --------------------------------------------------------------


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5": a list of thousands of ranks stays one short line."""
    out, ranks = [], sorted(set(ranks))
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def positions_by_group(f: Finding) -> dict[str, dict[int, int]]:
    """pg -> {rank: the last collective sequence number it issued there}, from a hang's evidence: the
    culprits' own positions, the waiting ranks at the collective they wait in (or, when no majority could be
    named, every rank's position)."""
    ev = f.evidence or {}
    groups: dict[str, dict[int, int]] = {}
    for rank, by_pg in (ev.get("positions") or {}).items():
        if isinstance(by_pg, dict):
            for pg, seq in by_pg.items():
                groups.setdefault(str(pg), {})[int(rank)] = int(seq)
    if f.pg is not None and f.collective_seq is not None:
        for rank in ev.get("waiting_ranks") or []:
            groups.setdefault(f.pg, {}).setdefault(int(rank), int(f.collective_seq))
    if f.pg is not None and isinstance(ev.get("seq_by_rank"), dict):
        for rank, seq in ev["seq_by_rank"].items():
            groups.setdefault(f.pg, {})[int(rank)] = int(seq)
    culprit_group = ev.get("culprit_group")
    if isinstance(culprit_group, dict) and "pg" in culprit_group:
        for rank in f.culprit_ranks:
            groups.setdefault(str(culprit_group["pg"]), {})[rank] = int(culprit_group.get("seq", 0))
    return groups


def svg_positions(pg: str, seqs: dict[int, int], f: Finding) -> str:
    """One bar per position in the group (ranks at the same place share a bar), culprits' bars in red."""
    by_seq: dict[int, list[int]] = {}
    for rank, seq in seqs.items():
        by_seq.setdefault(seq, []).append(rank)
    rows = sorted(by_seq.items(), reverse=True)
    bar_h, gap, label_w = 22, 8, 190
    height = TOP + len(rows) * (bar_h + gap) + BOTTOM - 10
    top_seq = max(by_seq)
    lo = max(0, min(by_seq) - max(2, (top_seq - min(by_seq)) * 2))
    span = max(1, top_seq - lo)
    width_px = WIDTH - label_w - RIGHT - 120
    out = [
        f'<svg class="chart" data-chart="positions-{esc(pg)}" data-series="{len(rows)}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="positions in pg {esc(pg)}">',
        f"<title>where each rank stands in pg {esc(pg)}</title>",
    ]
    for i, (seq, ranks) in enumerate(rows):
        y = TOP + i * (bar_h + gap)
        w = max(2.0, (seq - lo) / span * width_px)
        culprit = any(r in f.culprit_ranks for r in ranks)
        role = "culprit" if culprit else "peer"
        colour = CULPRIT_COLOURS[0] if culprit else MEDIAN_COLOUR
        label = f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}"
        if f.collective_seq is not None and pg == f.pg:
            where = "waits in" if seq >= f.collective_seq else "never entered"
            what = f"{where} #{f.collective_seq}" + (f" (last #{seq})" if seq < f.collective_seq else "")
        else:
            what = f"last #{seq}"
        out.append(
            f'<text class="tick" x="{label_w - 8}" y="{y + bar_h * 0.7:.1f}" text-anchor="end">{esc(label)}</text>'
        )
        out.append(
            f'<rect class="series {role}" x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}">'
            f"<title>{esc(label)}: {esc(what)}</title></rect>"
        )
        out.append(f'<text class="tick" x="{label_w + w + 6:.1f}" y="{y + bar_h * 0.7:.1f}">{esc(what)}</text>')
    axis_y = TOP + len(rows) * (bar_h + gap)
    out.append(
        f'<text class="axis" x="{label_w}" y="{axis_y + 8}">collective sequence number in pg {esc(pg)} '
        f"(bars start at #{lo})</text>"
    )
    out.append("</svg>")
    caption = f"<figcaption>Where each rank stands in pg {esc(pg)}</figcaption>"
    return f"<figure>{caption}{''.join(out)}</figure>"


# ---- HTML --------------------------------------------------------------------------------------


def _value_html(value: object) -> str:
    if isinstance(value, (dict, list)):
        text = json.dumps(value, indent=1, sort_keys=True, default=str)
        if len(text) < 90:
            return f"<code>{esc(json.dumps(value, sort_keys=True, default=str))}</code>"
        return f"<pre>{esc(text)}</pre>"
    if isinstance(value, str) and "\n" in value:
        return f"<pre>{esc(value)}</pre>"
    return esc(value)


def _finding_html(i: int, f: Finding) -> str:
    culprits = set(f.culprit_ranks)
    out = [f'<section class="finding kind-{esc(f.kind)}" id="finding-{i}">', f"<h3>{i}. {esc(headline(f))}</h3>"]
    facts = [
        ("kind", f.kind),
        ("step", f.step if f.step is not None else "-"),
        ("culprit ranks", ", ".join(map(str, f.culprit_ranks)) or "none named"),
        ("hosts", ", ".join(f.hosts) or "-"),
        ("pids", ", ".join(map(str, f.pids)) or "-"),
        ("devices", ", ".join(f.devices) or "-"),
    ]
    out.append('<table class="facts">')
    out += [f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts]
    out += [f"<tr><th></th><td>{esc(line.strip())}</td></tr>" for line in detail_lines(f, stacks=False)[1:]]
    out.append("</table>")
    if f.first_seen or f.confirmed:
        out.append(f"<p>First suspected {esc(_when(f.first_seen))}, confirmed {esc(_when(f.confirmed))}.</p>")
    if f.evidence:
        out.append('<h4>Evidence</h4><table class="evidence">')
        out += [f"<tr><th>{esc(k)}</th><td>{_value_html(v)}</td></tr>" for k, v in f.evidence.items()]
        out.append("</table>")
    groups = positions_by_group(f)
    if groups:
        out.append("<h4>Where each rank stands</h4>")
        for pg, seqs in sorted(groups.items()):
            out.append(svg_positions(pg, seqs, f))
    stacks = sorted_stacks(f)
    if stacks:
        out.append("<h4>Stacks</h4>")
        for rank, stack in stacks:
            is_culprit = rank.isdigit() and int(rank) in culprits
            out.append(
                f"<details{' open' if is_culprit else ''}><summary>stack of rank {esc(rank)}</summary>"
                f"<pre>{esc(stack.rstrip())}</pre></details>"
            )
    out.append("</section>")
    return "\n".join(out)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "unknown"


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:980px;padding:16px;
color:#1b1f24;background:#fff}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:28px}
h3{font-size:15px;margin:18px 0 6px}h4{font-size:13px;margin:12px 0 4px;color:#57606a;text-transform:uppercase}
table{border-collapse:collapse;margin:4px 0}th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f6f8fa;font-weight:600}
pre{background:#f6f8fa;border:1px solid #d0d7de;padding:8px;overflow:auto;font-size:12px;margin:4px 0}
code{font-size:12px}
.finding{border-left:4px solid #d62728;padding-left:12px;margin:18px 0}
.finding.kind-monitoring{border-color:#9aa5b1}
figure{margin:10px 0}figcaption{font-weight:600;margin-bottom:2px}
svg.chart{width:100%;height:auto;display:block}
svg .grid{stroke:#eaeef2}svg .frame{fill:none;stroke:#d0d7de}
svg .tick{font-size:11px;fill:#57606a}svg .axis{font-size:11px;fill:#57606a}
svg path.series{fill:none;stroke-width:1.2;stroke-linejoin:round}
svg path.series.culprit{stroke-width:2.4}svg path.series.median{stroke-width:1.8}
svg .band{fill:#1f77b4;opacity:.15}
svg .onset{stroke:#1b1f24;stroke-dasharray:4 3}svg .onset-label{font-size:11px;fill:#1b1f24}
svg .series.lit{stroke-width:3.2;opacity:1}svg.dim .series:not(.lit){opacity:.25}
.legend{font-size:12px;color:#57606a}.key{margin-right:14px;white-space:nowrap;cursor:default}
.key i{display:inline-block;width:14px;height:4px;margin-right:4px;vertical-align:middle}
.key i.band-key{background:#1f77b4;opacity:.3;height:10px}
.key i.onset-key{border-top:2px dashed #1b1f24;height:0}
.muted{color:#57606a}
"""

# Interaction only: the page is complete without it. Hovering a rank's line or legend entry lights that
# rank in every chart; on load it records how many charts have every series drawn (non-empty geometry), so a
# headless browser can tell that the SVG rendered.
SCRIPT = """
(function(){
  var charts=document.querySelectorAll('svg.chart'),drawn=0;
  charts.forEach(function(svg){
    var n=0;
    svg.querySelectorAll('.series').forEach(function(el){
      var b=el.getBBox();if(b.width>0||b.height>0)n++;});
    svg.setAttribute('data-drawn',n);
    if(n>0&&n==Number(svg.getAttribute('data-series')))drawn++;});
  document.body.setAttribute('data-charts',charts.length);
  document.body.setAttribute('data-charts-drawn',drawn);
  function light(rank,on){
    charts.forEach(function(svg){
      var hit=svg.querySelectorAll('.series[data-rank="'+rank+'"]');
      hit.forEach(function(el){el.classList.toggle('lit',on);});
      svg.classList.toggle('dim',on&&hit.length>0);});}
  document.querySelectorAll('[data-rank]').forEach(function(el){
    var r=el.getAttribute('data-rank');
    el.addEventListener('mouseenter',function(){light(r,true);});
    el.addEventListener('mouseleave',function(){light(r,false);});});
})();
"""


def render_report(run: RunData) -> str:
    """The whole page as one string (write_report writes it)."""
    findings = run.findings
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>trainscout report: {esc(run.run_id)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>trainscout report: {esc(run.run_id)}</h1>",
        '<table class="facts">',
        f"<tr><th>command</th><td><code>{esc(' '.join(run.command) or '(unknown)')}</code></td></tr>",
        f"<tr><th>started</th><td>{esc(_when(run.started))}</td></tr>",
        f"<tr><th>launcher ended</th><td>{esc(_when(run.ended) if run.ended else 'not yet (or unknown)')}</td></tr>",
        f"<tr><th>exit code</th><td>{esc(run.exit_code if run.exit_code is not None else 'unknown')}</td></tr>",
        f"<tr><th>findings</th><td>{len(findings)}</td></tr>",
    ]
    if run.topology:
        out.append(f"<tr><th>topology</th><td>{esc(run.topology)}</td></tr>")
    out.append("</table>")

    out.append("<h2>Findings</h2>")
    if not findings:
        out.append("<p>No findings.</p>")
    else:
        out.append("<table><tr><th>#</th><th>kind</th><th>step</th><th>culprits</th><th>summary</th></tr>")
        for i, f in enumerate(findings, 1):
            out.append(
                f'<tr><td><a href="#finding-{i}">{i}</a></td><td>{esc(f.kind)}</td>'
                f"<td>{esc(f.step if f.step is not None else '-')}</td>"
                f"<td>{esc(rank_ranges(f.culprit_ranks) or '-')}</td><td>{esc(f.summary)}</td></tr>"
            )
        out.append("</table>")
        out += [_finding_html(i, f) for i, f in enumerate(findings, 1)]

    out.append("<h2>Timelines</h2>")
    onsets: dict[int, list[str]] = {}
    for i, f in enumerate(findings, 1):
        if f.step is not None:
            onsets.setdefault(f.step, []).append(f"#{i} {f.kind}")
    culprits = [r for f in findings for r in f.culprit_ranks]
    charts = build_timelines(run.evidence, culprits, onsets)
    if charts:
        ev = run.evidence
        sampled = (
            f" The log holds {ev.log_bytes / 2**20:.0f} MiB: these charts are drawn from {ev.read_bytes / 2**20:.0f}"
            " MiB of it, read in evenly spaced windows across the run."
            if ev.sampled
            else ""
        )
        out.append(
            f'<p class="muted">Per-rank evidence from evidence.jsonl ({ev.ranks} ranks). Culprits in colour, peers '
            "in grey; a dashed line marks the step of each finding. Hover a line to follow its rank through every "
            f"chart.{sampled}</p>"
        )
        out += [svg_timeline(c) for c in charts]
    else:
        out.append('<p class="muted">No per-step evidence was recorded for this run (evidence.jsonl).</p>')

    out.append("<h2>Monitoring</h2>")
    if run.notes:
        out.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in run.notes) + "</ul>")
    else:
        out.append('<p class="muted">No monitoring notes (see summary.md once the run has ended).</p>')

    out.append("<h2>How to read findings</h2><ul>")
    for kind in sorted({f.kind for f in findings}):
        meaning = KIND_MEANINGS.get(kind, "see the trainscout documentation for this kind.")
        out.append(f"<li><b>{esc(kind)}</b>: {esc(meaning)}</li>")
    out.append(f"<li>Status: {esc(STATUS_NOTE)}</li></ul>")
    out.append(f"<script>{SCRIPT}</script></body></html>")
    return "\n".join(out) + "\n"


def write_report(run_dir: str | os.PathLike, max_evidence_bytes: int = EVIDENCE_READ_BYTES) -> str:
    """Render `run_dir` into `run_dir/report.html` (written whole, then renamed) and return its path."""
    run_dir = os.fspath(run_dir)
    path = os.path.join(run_dir, REPORT_FILE)
    text = render_report(load_run(run_dir, max_evidence_bytes))
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


def write_report_at_exit(run_dir: str | os.PathLike) -> str | None:
    """write_report for the end of a run: a report that cannot be rendered must not hide the job's own exit
    status or stop the cleanup after it, so any failure is reported and swallowed."""
    try:
        return write_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        import sys

        print(f"trainscout: report.html not written: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
