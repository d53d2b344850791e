"""The run's Prometheus metrics, fed real digests and events, scraped over HTTP from a real server and parsed
with prometheus-client's own parser."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainscout.detectors.observations import RankObs
from trainscout.findings import Finding
from trainscout.sinks.jsonl import EventLog
from trainscout.sinks.metrics import RunMetrics, spread
from trainscout.wire.messages import NumericRecord, RankState, StepRecord


def _obs(rank: int, step: int, walls: list[float], *, loss: float = 2.0, seen_at: float = 100.0) -> RankObs:
    steps = [
        StepRecord(
            step=step - len(walls) + 1 + i,
            wall_s=w,
            cpu_s=w / 2,
            data_s=0.0,
            ckpt_s=0.0,
            wait_s=w / 4,
            probe_thread_s=0.001,
        )
        for i, w in enumerate(walls)
    ]
    state = RankState(
        rank=rank,
        local_rank=rank,
        world_size=4,
        pid=100 + rank,
        alive=True,
        step=step,
        heartbeat_age_s=0.1,
        progress_age_s=0.5,
        collectives=10,
        pgs=[],
        steps=steps,
        numerics=[NumericRecord(step=step, loss=loss)],
    )
    return RankObs(state=state, host="h", seen_at=seen_at)


def _scrape(url: str) -> dict[str, dict[tuple, float]]:
    """sample name -> {labels as sorted tuples: value}"""
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture
def served():
    m = RunMetrics(clock=lambda: 102.0)
    url = m.serve(0, "127.0.0.1")
    yield m, url
    m.close()


def test_per_rank_figures_spread_and_findings_are_served(tmp_path, served):
    m, url = served
    assert url.startswith("http://127.0.0.1:") and not url.startswith("http://127.0.0.1:0/")
    ranks = {r: _obs(r, 10, [0.1, 0.1], loss=2.0 + r / 10) for r in range(3)}
    ranks[3] = _obs(3, 10, [0.3, 0.5], loss=2.3)  # the slow one
    m.on_pass(ranks, live={0, 1, 2, 3}, nodes={b"n0": {"agent": True, "lost": False}})
    m.on_finding(Finding(kind="straggler", summary="s", culprit_ranks=[3]))
    got = _scrape(url)
    step_s = got["trainscout_rank_step_seconds"]
    assert step_s == pytest.approx(
        {(("rank", "0"),): 0.1, (("rank", "1"),): 0.1, (("rank", "2"),): 0.1, (("rank", "3"),): 0.4}
    )
    assert got["trainscout_rank_collective_wait_seconds"][(("rank", "3"),)] == pytest.approx(0.1)
    assert got["trainscout_rank_probe_seconds"][(("rank", "0"),)] == pytest.approx(0.001)
    assert got["trainscout_rank_step"][(("rank", "2"),)] == 10
    # progress age as the agent measured it plus the time since the digest arrived (clock 102 - seen 100)
    assert got["trainscout_rank_progress_age_seconds"][(("rank", "1"),)] == pytest.approx(2.5)
    assert got["trainscout_step_seconds_median"][()] == pytest.approx(0.1)
    assert got["trainscout_step_seconds_max"][()] == pytest.approx(0.4)
    assert got["trainscout_step_seconds_spread_ratio"][()] == pytest.approx(4.0)
    assert got["trainscout_loss_spread"][()] == pytest.approx(0.3)
    assert got["trainscout_ranks_seen"][()] == 4 and got["trainscout_ranks_live"][()] == 4
    assert got["trainscout_findings_total"] == {(("kind", "straggler"), ("status", "attributed")): 1.0}
    assert got["trainscout_detection_passes_total"][()] == 1
    assert got["trainscout_coordinator_cpu_seconds_total"][()] > 0


def test_a_digest_without_steps_keeps_the_last_step_time_and_a_dead_rank_is_down(served):
    m, url = served
    m.on_pass({0: _obs(0, 5, [0.2]), 1: _obs(1, 5, [0.2])}, live={0, 1}, nodes={})
    m.on_pass({0: _obs(0, 5, []), 1: _obs(1, 5, [0.2])}, live={1}, nodes={})
    got = _scrape(url)
    assert got["trainscout_rank_step_seconds"][(("rank", "0"),)] == pytest.approx(0.2)
    assert got["trainscout_rank_up"] == {(("rank", "0"),): 0.0, (("rank", "1"),): 1.0}
    assert got["trainscout_ranks_live"][()] == 1


def test_monitoring_gaps_are_counted_from_the_events(tmp_path, served):
    m, url = served
    events = EventLog(tmp_path / "events.jsonl")
    events.observers.append(m.on_event)
    events.write("agent_lost", node="n1")
    events.write("agent_back", node="n1", silent_s=4.0)
    events.write("agent_lost", node="n1")
    events.write("coordinator_stalled", seconds=7.5)
    events.write("notify_failed", endpoint="http://x", tries=4, error="e")
    m.on_pass({}, live=set(), nodes={b"n1": {"agent": True, "lost": True}, b"sup": {"lost": True}})
    got = _scrape(url)
    assert got["trainscout_agents_lost_total"][()] == 2
    assert got["trainscout_agents_silent"][()] == 1  # the launcher report's node is no agent
    assert got["trainscout_coordinator_stalls_total"][()] == 1
    assert got["trainscout_coordinator_stalled_seconds_total"][()] == pytest.approx(7.5)
    assert got["trainscout_notify_failures_total"][()] == 1


def test_spread_of_nothing_is_nan():
    assert all(math.isnan(v) for v in spread([math.nan]))
    assert spread([1.0, 2.0, 4.0]) == (2.0, 4.0, 2.0)


def test_the_flag_without_prometheus_client_stops_the_run_with_how_to_install_it(tmp_path):
    # prometheus-client made unimportable in that process only, as on an install without the extra
    code = (
        "import sys; sys.modules['prometheus_client'] = None; from trainscout.cli import main; "
        f"sys.exit(main(['run', '--run-dir', {str(tmp_path)!r}, '--metrics-port', '9100', '--', 'true']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--metrics-port needs prometheus-client: pip install 'trainscout[metrics]'" in out.stderr
    assert not list(tmp_path.iterdir())  # refused before any run folder was made


def test_a_port_in_use_leaves_the_run_without_metrics_and_says_so(tmp_path):
    import socket

    from trainscout.sinks.metrics import start

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        warnings: list[str] = []
        events = EventLog(tmp_path / "events.jsonl")
        assert start(port, "127.0.0.1", print, warnings.append, events) is None
    assert len(warnings) == 1 and f"cannot listen on 127.0.0.1:{port}" in warnings[0]
    assert '"kind":"metrics_failed"' in (tmp_path / "events.jsonl").read_text()
    assert events.observers == []


def test_docs_list_every_metric(served):
    from pathlib import Path

    m, url = served
    m.on_pass({r: _obs(r, 3, [0.1], loss=1.0 + r) for r in range(2)}, live={0, 1}, nodes={})
    m.on_finding(Finding(kind="hang", summary="h", culprit_ranks=[1]))
    names = {name for name in _scrape(url) if not name.endswith("_created")}
    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert len(names) == 22 and not [n for n in names if f"| `{n}` |" not in docs]


def test_a_large_job_gets_series_for_its_slowest_ranks_and_aggregates_over_all():
    m = RunMetrics(max_ranks=2)
    url = m.serve(0, "127.0.0.1")
    try:
        walls = {0: 0.1, 1: 0.3, 2: 0.1, 3: 0.2, 4: 0.1}
        m.on_pass({r: _obs(r, 5, [w]) for r, w in walls.items()}, live=set(walls), nodes={})
        got = _scrape(url)
    finally:
        m.close()
    assert got["trainscout_rank_step_seconds"] == pytest.approx({(("rank", "1"),): 0.3, (("rank", "3"),): 0.2})
    assert set(got["trainscout_rank_up"]) == {(("rank", "1"),), (("rank", "3"),)}
    assert got["trainscout_ranks_exported"][()] == 2 and got["trainscout_ranks_seen"][()] == 5
    assert got["trainscout_step_seconds_median"][()] == pytest.approx(0.1)  # over every rank


def test_tool_restarts_and_their_gaps_are_served_from_the_supervisors_events(tmp_path):
    """A restarted coordinator serves the gaps of every earlier death, its own included: they are read from the
    supervisor's event log (written by the real EventLog) at scrape time."""
    path = tmp_path / "events.supervisor.jsonl"
    log = EventLog(str(path))
    m = RunMetrics(supervisor_events=str(path))
    url = m.serve(0, "127.0.0.1")
    try:
        got = _scrape(url)
        assert got["trainscout_tool_restarts_total"] == {
            (("component", "agent"),): 0.0,
            (("component", "coordinator"),): 0.0,
        }
        for component in ("agent", "coordinator", "agent"):
            log.write("tool_died", component=component, code=-9, restart_in_s=0.5)
            log.write("tool_restarted", component=component, restart=1, pid=1)
        log.write("tool_died", component="coordinator", code=-9, restart_in_s=1.0)  # down now: not yet a restart
        log.close()
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        died = [e["t"] for e in lines if e["kind"] == "tool_died"]
        back = [e["t"] for e in lines if e["kind"] == "tool_restarted"]
        got = _scrape(url)
        assert got["trainscout_tool_restarts_total"] == {
            (("component", "agent"),): 2.0,
            (("component", "coordinator"),): 1.0,
        }
        down = got["trainscout_tool_down_seconds_total"]
        assert down[(("component", "agent"),)] == pytest.approx(back[0] - died[0] + back[2] - died[2])
        assert down[(("component", "coordinator"),)] == pytest.approx(back[1] - died[1])
    finally:
        m.close()


def test_tool_restarts_skip_lines_of_another_shape():
    from trainscout.sinks.metrics import tool_restarts

    events = [
        {"kind": "tool_died", "component": "agent", "t": 10.0},
        {"kind": "tool_restarted", "component": 7, "t": 11.0},  # not a name
        {"kind": "tool_restarted", "component": "agent", "t": "late"},  # not a time
        {"kind": "tool_restarted", "component": "agent", "t": 12.5},
        {"kind": "tool_restarted", "component": "coordinator", "t": 20.0},  # its death was never written
    ]
    assert tool_restarts(events) == {"agent": (1, 2.5), "coordinator": (1, 0.0)}
