"""report.html from real run-folder files (written by the real sinks): content, escaping, size bounds.

The browser-side check (every chart drawn in a real headless Chromium) is tests/integration/test_report_browser.py.
"""

from __future__ import annotations

import io
import json
import math
import re
from contextlib import redirect_stdout
from html.parser import HTMLParser

import numpy as np

from trainscout import cli
from trainscout.findings import Finding, to_json
from trainscout.sinks import evidence_log, report_html, report_series
from trainscout.sinks.evidence_log import EvidenceLog
from trainscout.wire.messages import NumericRecord, StepRecord


class _Tags(HTMLParser):
    """Every start tag with its attributes, and whether any element opened inside <pre> or <code>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(text: str) -> _Tags:
    p = _Tags()
    p.feed(text)
    return p


def series_paths(text: str, chart: str) -> list[dict]:
    """The drawn lines (path or dot attributes) of one timeline chart."""
    body = text.split(f'data-chart="{chart}"', 1)[1].split("</svg>", 1)[0]
    return [a for t, a in parse("<svg " + body).tags if "series" in a.get("class", "")]


def write_run(
    tmp_path, *, ranks=4, steps=40, culprit=2, findings=(), slow_ms=0.0, nan_at=None, spike_at=None, name="run1"
):
    run = tmp_path / name
    run.mkdir()
    log = EvidenceLog(run / "evidence.jsonl")
    for r in range(ranks):
        step_recs, num_recs = [], []
        for s in range(1, steps + 1):
            wall = 0.04 + (slow_ms / 1e3 if r == culprit and s >= 20 else 0.0)
            if spike_at == s and r == 0:
                wall = 5.0
            step_recs.append(StepRecord(step=s, wall_s=wall, cpu_s=0.01, data_s=0.0, ckpt_s=0.0, wait_s=0.02))
            loss = math.nan if (nan_at == s and r == culprit) else 5.0 - s * 0.01
            num_recs.append(NumericRecord(step=s, loss=loss, norms=[0.3, 0.4]))
        # as the coordinator receives them: a digest of a few steps per line
        for i in range(0, steps, 10):
            log.write(r, step_recs[i : i + 10], num_recs[i : i + 10], ["blocks.0", "blocks.1"], ranks)
    log.close()
    with open(run / "findings.jsonl", "wb") as fh:
        for f in findings:
            fh.write(to_json(f) + b"\n")
    return run


def hang_finding() -> Finding:
    return Finding(
        kind="hang",
        summary="rank 2 never entered all_reduce #45 of pg 0 <script>alert(1)</script>",
        culprit_ranks=[2],
        step=20,
        hosts=["node-a"],
        pids=[4411],
        devices=["cuda:2"],
        pg="0",
        collective_seq=45,
        collective="all_reduce",
        evidence={"quiet_s": 5.9, "waiting_ranks": [1, 3, 0], "positions": {"2": {"0": 44}}},
        stacks={"2": 'Thread 1 "Main" </pre><blink>bold</blink>\n    load_batch (data.py:88)', "0": "x (y.py:1)"},
    )


def test_hang_report_names_culprit_positions_stacks_and_marks_onset(tmp_path):
    run = write_run(tmp_path, findings=[hang_finding()])
    path = report_html.write_report(run)
    text = open(path, encoding="utf-8").read()
    # the finding and its facts
    assert "HANG at step 20" in text and "node-a" in text and "cuda:2" in text and "4411" in text
    # every chart: 4 timelines and one positions chart for pg 0
    charts = [a for t, a in parse(text).tags if t == "svg" and "chart" in a.get("class", "")]
    assert [c["data-chart"] for c in charts] == ["positions-0", "wall", "wait", "loss", "grad"]
    # culprit highlighted, peers grey, in every timeline
    for key in ("wall", "wait", "loss", "grad"):
        lines = series_paths(text, key)
        assert [(a["class"], a.get("data-rank")) for a in lines] == [
            ("series peer", "0"),
            ("series peer", "1"),
            ("series peer", "3"),
            ("series culprit", "2"),
        ]
    # the onset: a marker line at step 20 in each timeline
    assert text.count('class="onset"') == 4 and "#1 hang at step 20" in text
    # where each rank stands: ranks 0, 1, 3 wait in #45, rank 2 never entered it
    assert report_html.positions_by_group(hang_finding()) == {"0": {2: 44, 1: 45, 3: 45, 0: 45}}
    assert "ranks 0-1, 3" in text and "never entered #45 (last #44)" in text and "waits in #45" in text
    # stacks in <pre>, the culprit's open
    assert "<details open><summary>stack of rank 2</summary><pre>" in text


def test_all_text_is_escaped_and_page_is_self_contained(tmp_path):
    run = write_run(tmp_path, findings=[hang_finding()])
    text = open(report_html.write_report(run), encoding="utf-8").read()
    assert "<script>alert(1)</script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "</pre><blink>bold</blink>" not in text and "&lt;/pre&gt;&lt;blink&gt;bold&lt;/blink&gt;" in text
    tags = parse(text).tags
    assert "blink" not in [t for t, _ in tags]  # the stack's tag stayed text
    assert [t for t, _ in tags if t == "script"] == ["script"]  # only the page's own inline script
    assert not [a for _, a in tags if "src" in a], "nothing is loaded from elsewhere"
    assert not [t for t, _ in tags if t in ("link", "img", "iframe", "object", "embed")]
    assert not re.search(r"https?://|@import|url\(", text)


def test_large_run_stays_small_and_keeps_a_spike(tmp_path):
    steps = 5000
    run = write_run(tmp_path, ranks=3, steps=steps, findings=[], spike_at=2500)
    text = open(report_html.write_report(run), encoding="utf-8").read()
    for key in ("wall", "loss"):
        for line in series_paths(text, key):
            points = len(re.findall(r"[ML]", line["d"]))
            assert 10 < points <= report_series.MAX_POINTS, (key, points)
    assert len(text) < 150_000, len(text)
    # the spike of rank 0 at step 2500 survives downsampling (drawn at the clipped top edge)
    xs, ys = np.arange(0, 2 * steps, 2.0), np.ones(steps)
    ys[2500], ys[4000] = 99.0, math.nan
    kept = report_series.downsample(xs, ys, 300)
    assert (5000, 99.0) in kept and len(kept) <= 300
    assert [x for x, _ in kept] == sorted(x for x, _ in kept)
    assert [x for x, y in kept if math.isnan(y)] == [8000.0]  # the gap is kept


def test_a_large_log_is_read_in_windows_across_the_whole_run(tmp_path):
    steps = 3000
    run = write_run(tmp_path, ranks=3, steps=steps, findings=[])
    size = (run / "evidence.jsonl").stat().st_size
    ev = report_series.read_evidence(run / "evidence.jsonl", max_bytes=size // 8)
    assert ev.sampled and ev.read_bytes <= size // 8 and ev.ranks == 3
    rank_a, step_a, value_a = ev.metrics["wall"]
    assert step_a.min() <= 100 and step_a.max() > steps - 100  # windows span the run
    assert len(step_a) < 3 * steps // 4
    assert np.allclose(value_a, 40.0)  # only whole lines were decoded
    text = open(report_html.write_report(run, max_evidence_bytes=size // 8), encoding="utf-8").read()
    assert "read in evenly spaced windows across the run" in text and 'data-chart="grad"' in text


def test_the_evidence_log_rotates_within_its_budget_and_readers_see_both_files(tmp_path):
    # a long job's log stays within max_bytes on disk: the older half becomes evidence.1.jsonl, and the
    # report and the offline reader take both, oldest first, with each file naming the layers its lines need
    run = tmp_path / "long"
    run.mkdir()
    log = EvidenceLog(run / "evidence.jsonl", max_bytes=64 << 10)
    for s in range(1, 2001):
        for r in range(2):
            rec = StepRecord(step=s, wall_s=0.04, cpu_s=0.01, data_s=0.0, ckpt_s=0.0, wait_s=0.02)
            log.write(r, [rec], [NumericRecord(step=s, loss=1.0, norms=[0.5])], ["blocks.0"], 2)
        total = sum(p.stat().st_size for p in run.iterdir())
        assert total <= (64 << 10) + 512, f"{total} bytes on disk at step {s}"
    log.close()
    assert log.rotations >= 2 and sorted(p.name for p in run.iterdir()) == ["evidence.1.jsonl", "evidence.jsonl"]
    for name in ("evidence.1.jsonl", "evidence.jsonl"):
        first = {json.loads(line)["rank"]: json.loads(line) for line in reversed((run / name).read_text().splitlines())}
        assert all(doc.get("layers") == ["blocks.0"] for doc in first.values()), name
    per_rank = evidence_log.read(run / "evidence.jsonl")
    for entry in per_rank.values():
        steps = entry["steps"]
        assert steps[-1].step == 2000 and [x.step for x in steps] == list(range(steps[0].step, 2001))
    # (the oldest kept line may be either rank's: the files rotate between lines, not between steps)
    first = min(entry["steps"][0].step for entry in per_rank.values())
    ev = report_html.load_run(run).evidence
    assert ev is not None and ev.ranks == 2
    step_a = ev.metrics["wall"][1]
    assert step_a.max() == 2000 and step_a.min() == first  # the rotated file's steps come first


def test_many_ranks_draw_peer_median_and_range(tmp_path):
    run = write_run(tmp_path, ranks=64, steps=30, culprit=17, slow_ms=30, findings=[], name="big")
    straggler = Finding(kind="straggler", summary="rank 17 is a straggler", culprit_ranks=[17], step=22)
    with open(run / "findings.jsonl", "wb") as fh:
        fh.write(to_json(straggler) + b"\n")
    text = open(report_html.write_report(run), encoding="utf-8").read()
    lines = series_paths(text, "wall")
    assert [(a["class"], a.get("data-rank")) for a in lines] == [("series median", None), ("series culprit", "17")]
    assert 'class="band"' in text and "median of 63 peers" in text


def test_nonfinite_loss_is_a_gap_and_is_said(tmp_path):
    nonfinite = Finding(kind="nonfinite", summary="loss NaN first on rank 2", culprit_ranks=[2], step=15)
    run = write_run(tmp_path, findings=[nonfinite], nan_at=15)
    text = open(report_html.write_report(run), encoding="utf-8").read()
    culprit = [a for a in series_paths(text, "loss") if a.get("data-rank") == "2"][0]
    assert culprit["d"].count("M") == 2  # the line breaks at the NaN
    assert "1 non-finite values (NaN/Inf) are gaps" in text


def test_first_step_outlier_is_clipped_not_flattening(tmp_path):
    run = write_run(tmp_path, findings=[], spike_at=1)
    text = open(report_html.write_report(run), encoding="utf-8").read()
    assert "Step time — values above" in text and "drawn at the top edge" in text


def test_run_in_progress_with_torn_lines_and_no_evidence(tmp_path):
    run = write_run(tmp_path, findings=[hang_finding()])
    with open(run / "evidence.jsonl", "ab") as fh:
        fh.write(b'{"rank": 1, "steps": [[41, 0.0')  # the writer is mid-line
    with open(run / "findings.jsonl", "ab") as fh:
        fh.write(b'{"kind": "hang", "summ')
    text = open(report_html.write_report(run), encoding="utf-8").read()
    assert text.count('class="finding') == 1 and 'data-chart="wall"' in text
    empty = tmp_path / "empty"
    empty.mkdir()
    text = open(report_html.write_report(empty), encoding="utf-8").read()
    assert "No findings." in text and "No per-step evidence" in text and 'class="chart"' not in text


def test_run_metadata_and_monitoring_notes_from_the_run_files(tmp_path):
    run = write_run(tmp_path, findings=[])
    with open(run / "events.supervisor.jsonl", "w") as fh:
        fh.write(json.dumps({"t": 1.0e9, "kind": "start", "command": ["torchrun", "train.py", "--x=<1>"]}) + "\n")
        fh.write(json.dumps({"t": 1.0e9 + 60, "kind": "launcher_exit", "code": 3}) + "\n")
    (run / "topology.json").write_text(json.dumps({"line": "topology: 4 ranks; DDP: replicate [0-3]"}))
    (run / "summary.md").write_text(
        "# r\n\n## Monitoring\n\n- topology: 4 ranks; DDP: replicate [0-3]\n- monitoring gap: agent silent\n\n## How\n"
    )
    text = open(report_html.write_report(run), encoding="utf-8").read()
    assert "torchrun train.py --x=&lt;1&gt;" in text
    assert "<tr><th>exit code</th><td>3</td></tr>" in text
    assert text.count("topology: 4 ranks; DDP: replicate [0-3]") == 1  # not repeated among the notes
    assert "<li>monitoring gap: agent silent</li>" in text


def test_cli_report_html_writes_and_prints_the_path(tmp_path):
    run = write_run(tmp_path, findings=[hang_finding()])
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(["report", str(run), "--html"])
    assert code == 0
    assert out.getvalue().strip() == str(run / "report.html")
    assert (run / "report.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert cli.main(["report", str(tmp_path / "missing"), "--html"]) == 2


def test_rank_ranges():
    assert report_html.rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert report_html.rank_ranges([]) == ""
