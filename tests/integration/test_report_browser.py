"""The visual report of a real run, opened in a real headless browser.

A real 4-rank demo job hangs on rank 2 (the session's `demo_hang`); the run's end writes report.html,
`trainscout report RUN --html` rewrites it (in a copy of the run), and Debian's Chromium loads it: the page's
script records how many charts have every line (or bar) drawn with real geometry, and the DOM Chromium dumps
must show all of them. CI installs Chromium (.ci/run); without any Chromium binary the browser part is skipped.
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from conftest import trainscout_cmd

pytestmark = pytest.mark.slow

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.body: dict = {}
        self.charts: list[dict] = []

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "svg" and "chart" in a.get("class", "").split():
            self.charts.append(a)


def dump_dom(browser: str, page, profile) -> _Dom:
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    dom = _Dom()
    dom.feed(out.stdout)
    return dom


def test_report_of_a_real_hang_draws_every_chart_in_chromium(demo_hang, tmp_path):
    result = demo_hang
    hangs = [f for f in result.findings if f["kind"] == "hang"]
    assert [f["culprit_ranks"] for f in hangs] == [[2]], result.describe()
    assert (result.run_path / "report.html").exists(), "the run's end writes report.html\n" + result.describe()

    run = tmp_path / result.run_path.name  # a copy: the job is the session's, other tests read it too
    shutil.copytree(result.run_path, run)
    report = run / "report.html"
    report.unlink()
    out = subprocess.run(trainscout_cmd("report", str(run), "--html"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(report) and report.exists()
    text = report.read_text(encoding="utf-8")
    assert "HANG at step 20" in text and 'data-rank="2"' in text

    browser = find_browser()
    if browser is None:
        pytest.skip("no Chromium binary here (CI installs Debian's chromium)")
    dom = dump_dom(browser, report, tmp_path / "profile")
    # one positions chart for pg 0, and the four timelines the demo's evidence holds
    keys = [c["data-chart"] for c in dom.charts]
    assert keys == ["positions-0", "wall", "wait", "loss", "grad"], keys
    assert dom.body.get("data-charts") == "5", dom.body
    assert dom.body.get("data-charts-drawn") == "5", dom.body
    for chart in dom.charts:
        # in the timelines: 3 peers and the culprit; in the positions chart: waiting ranks and the culprit
        expected = "2" if chart["data-chart"] == "positions-0" else "4"
        assert chart["data-series"] == expected and chart["data-drawn"] == expected, chart
