"""A run's outputs beyond its files, on real demo jobs: Prometheus metrics scraped over HTTP while the job trains
(`--metrics-port`), and findings posted to a webhook (`--notify`) served by this test on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import JOB_TIMEOUT_S, free_port, read_findings, run_demo, trainscout_cmd, unique_run_id

pytestmark = pytest.mark.slow

RANKS = ("0", "1", "2", "3")


def _scrape(url: str) -> dict[str, dict[tuple, float]] | None:
    """sample name -> {label values: value}, or None while nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(s.labels.values())] = s.value
    return out


def test_metrics_are_served_while_a_straggler_job_runs(tmp_path, jobs):
    port = free_port()
    run_id = unique_run_id("metrics")
    job = jobs(
        trainscout_cmd(
            "demo",
            "--fault",
            "straggle",
            "--param",
            "factor=0.3",
            "--rank",
            "2",
            "--step",
            "20",
            "--steps",
            "400",
            "--master-port",
            str(free_port()),
            "--run-dir",
            str(tmp_path),
            "--run-id",
            run_id,
            "--console",
            "plain",
            "--metrics-port",
            str(port),
        ),
        tmp_path,
        run_id,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    scraped, steps_seen, found = None, None, None
    while time.monotonic() < deadline and job.proc.poll() is None:
        scraped = _scrape(url)
        if scraped is not None:
            step_s = scraped.get("trainscout_rank_step_seconds", {})
            if steps_seen is None and all(step_s.get((r,), 0) > 0 for r in RANKS):
                steps_seen = scraped  # every rank's step time, from the first scrape that had them all
            if ("straggler", "attributed") in scraped.get("trainscout_findings_total", {}):
                found = scraped
        if steps_seen and found:
            break
        time.sleep(0.5)
    running = job.proc.poll() is None
    output = job.output()
    job.cleanup()  # stop the job (Ctrl-C) now: what it had to show is scraped
    assert running, f"the job ended before its metrics showed a step time per rank and the finding\n{output[-4000:]}"
    assert f"trainscout: Prometheus metrics at {url}" in output
    assert steps_seen is not None, f"no step time for every rank in {scraped}\n{output[-4000:]}"
    assert found is not None, f"no straggler counted in {scraped}\n{output[-4000:]}"
    step_s = steps_seen["trainscout_rank_step_seconds"]
    assert sorted(step_s) == [(r,) for r in RANKS] and all(v > 0 for v in step_s.values()), step_s
    # by the finding, every rank's gauge follows its steps of the moment (the first step's also held start-up)
    step_s = found["trainscout_rank_step_seconds"]
    assert sorted(step_s) == [(r,) for r in RANKS] and all(0 < v < 5 for v in step_s.values()), step_s
    assert set(steps_seen["trainscout_rank_collective_wait_seconds"]) == {(r,) for r in RANKS}
    assert steps_seen["trainscout_ranks_live"][()] == 4 and steps_seen["trainscout_ranks_seen"][()] == 4
    assert steps_seen["trainscout_step_seconds_median"][()] > 0
    # the finding, once: counted as the coordinator emitted it, while the job trains on
    assert found["trainscout_findings_total"] == {("straggler", "attributed"): 1.0}, found
    assert found["trainscout_rank_step"][("2",)] > 20 and found["trainscout_agents_lost_total"][()] == 0
    assert found["trainscout_coordinator_cpu_seconds_total"][()] > 0
    (finding,) = read_findings(job.run_path)
    assert finding["kind"] == "straggler" and finding["culprit_ranks"] == [2], finding


class _Receiver:
    """A webhook on 127.0.0.1 that keeps every JSON body posted to it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_hang_is_posted_to_the_webhook_with_its_culprit(tmp_path):
    hook = _Receiver()
    try:
        result = run_demo(tmp_path, "notify", fault="hang", rank=1, step=20, steps=100, extra=("--notify", hook.url))
    finally:
        hook.close()
    assert result.returncode == 0, result.describe()
    (posted,) = hook.bodies
    assert posted["kind"] == "hang" and posted["culprit_ranks"] == [1] and posted["status"] == "attributed", posted
    assert posted["text"].startswith(f"trainscout [run {result.run_path.name}]: HANG at step "), posted["text"]
    assert "\n" not in posted["text"] and "culprit ranks: 1;" in posted["text"]
    # the same finding as findings.jsonl holds, field for field
    (saved,) = result.raw_findings
    assert {k: v for k, v in posted.items() if k != "text"} == saved
    assert not [e for e in result.events if e["kind"] == "notify_failed"], result.describe()
