"""Sinks write real streams and files: console text, findings.jsonl, the event log, the report."""

from __future__ import annotations

import io
import json
import time

from trainscout.findings import Finding, from_json
from trainscout.sinks import ConsoleSink, EventLog, JsonlSink, write_summary

LONG_STACK = "\n".join(f'  File "train.py", line {i}, in frame_{i}' for i in range(60))


def _hang() -> Finding:
    return Finding(
        kind="hang",
        summary="rank 13 (host b-07, pid 4411) never entered all_reduce #9921 of pg dp; 15/16 ranks wait there",
        culprit_ranks=[13],
        step=812,
        hosts=["b-07"],
        pids=[4411],
        devices=["cuda:5"],
        pg="dp",
        collective_seq=9921,
        collective="all_reduce",
        confidence=0.97,
        evidence={"waiting": 15, "world": 16},
        stacks={"13": "Thread 4411 (idle)\n    __next__ (data.py:88)\n    train_step (train.py:40)", "2": LONG_STACK},
        first_seen=time.time() - 5,
        confirmed=time.time(),
    )


def _desync() -> Finding:
    return Finding(
        kind="desync",
        summary="rank 3 issued broadcast | where peers issued all_reduce at seq 17 of pg 0",
        culprit_ranks=[3],
        status="inconclusive",
        pg="0",
        collective_seq=17,
    )


def test_console_plain_output_is_grep_friendly() -> None:
    out = io.StringIO()
    sink = ConsoleSink(out)  # StringIO is not a TTY -> plain text
    assert not sink.is_rich
    sink.finding(_hang())
    sink.info("watching 16 ranks on 2 nodes")
    sink.warn("agent on b-08 stopped reporting")
    text = out.getvalue()
    assert "\x1b" not in text
    lines = text.splitlines()
    assert lines[0] == f"HANG at step 812: {_hang().summary}"
    assert any("culprit ranks: 13" in line and "b-07" in line and "4411" in line for line in lines)
    assert any("pg dp" in line and "#9921" in line for line in lines)
    assert any("attributed" in line and "0.97" in line for line in lines)
    assert "        __next__ (data.py:88)" in lines  # stack lines keep their own indent
    # Long stacks are cut to 25 lines with a note.
    assert '      File "train.py", line 24, in frame_24' in lines
    assert not any("frame_25" in line for line in lines)
    assert any("35 more lines" in line for line in lines)
    assert lines[-2] == "trainscout: watching 16 ranks on 2 nodes"
    assert lines[-1].startswith("trainscout:") and "b-08" in lines[-1]


def test_console_without_step_and_forced_rich() -> None:
    out = io.StringIO()
    ConsoleSink(out, rich=False).finding(_desync())
    assert out.getvalue().splitlines()[0].startswith("DESYNC: rank 3")

    out = io.StringIO()
    sink = ConsoleSink(out, rich=True)
    assert sink.is_rich
    sink.finding(_hang())
    assert "HANG at step 812" in out.getvalue()
    assert "data.py:88" in out.getvalue()


def test_jsonl_lines_decode_to_equal_findings(tmp_path) -> None:
    path = tmp_path / "run" / "findings.jsonl"
    findings = [_hang(), _desync()]
    with JsonlSink(path) as sink:
        for f in findings:
            sink.finding(f)
        # Flushed per line: readable before close.
        assert len(path.read_bytes().splitlines()) == 2
    assert [from_json(line) for line in path.read_bytes().splitlines()] == findings

    # Appends, never truncates.
    with JsonlSink(path) as sink:
        sink.finding(_desync())
    assert len(path.read_bytes().splitlines()) == 3


def test_event_log_lines_are_json(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.write("agent_joined", node="node-a", ranks=[0, 1])
    log.write("odd", obj=object(), items={1, 2}, nested={(1, 2): "tuple key"})
    log.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["kind"] for e in events] == ["agent_joined", "odd"]
    assert events[0]["node"] == "node-a" and events[0]["ranks"] == [0, 1]
    assert all(isinstance(e["t"], float) for e in events)
    assert "object" in events[1]["obj"]


def test_summary_mentions_each_finding(tmp_path) -> None:
    path = tmp_path / "report.md"
    started = time.time() - 125
    write_summary(
        path,
        run_id="run-1",
        command=["torchrun", "--nproc-per-node", "8", "train.py"],
        exit_code=1,
        findings=[_hang(), _desync()],
        notes=["monitoring was lost at 12:00:03 for node b-08"],
        started=started,
        ended=started + 125,
    )
    text = path.read_text()
    assert "run-1" in text
    assert "torchrun --nproc-per-node 8 train.py" in text
    assert "2m 05s" in text
    assert "No findings." not in text
    assert _hang().summary in text
    assert "broadcast \\| where" in text  # escaped inside the table
    assert "data.py:88" in text and "frame_59" in text  # stacks in full in the report
    assert "monitoring was lost" in text
    assert "**hang**" in text and "**desync**" in text


def test_summary_without_findings(tmp_path) -> None:
    path = tmp_path / "report.md"
    write_summary(
        path,
        run_id="run-2",
        command=["python", "train.py"],
        exit_code=0,
        findings=[],
        notes=[],
        started=1.0,
        ended=2.5,
    )
    text = path.read_text()
    assert "No findings." in text
    assert "Exit code: 0" in text


def test_probe_cost_summary_line_gives_median_cost_per_check_over_ranks(tmp_path):
    import json

    from trainscout.sinks import probe_costs

    for rank, state_s in enumerate((0.1, 0.3, 0.2)):
        doc = {
            "rank": rank,
            "steps": 100,
            "step_wall_s": 10.0,
            "state_check": {"seconds": state_s, "period_steps": 288 + rank},
            "replay": {"seconds": 0.05},
        }
        with open(probe_costs.report_path(str(tmp_path), rank), "w") as fh:
            json.dump(doc, fh)
    with open(probe_costs.report_path(str(tmp_path), 9), "w") as fh:
        json.dump({"rank": 9, "steps": 1, "step_wall_s": 0.0}, fh)  # one step says nothing per step
    line = probe_costs.summary_line(str(tmp_path))
    assert line == (
        "trainscout's in-rank checks, median over 3 ranks: state check 2.000 ms/step (2.00 % of step "
        "time); replay 0.500 ms/step (0.50 % of step time); state coverage period 290 steps"
    )
    assert probe_costs.summary_line(str(tmp_path / "none")) == ""


def test_probe_cost_summary_line_says_how_often_cpu_gradients_were_tested(tmp_path):
    import json

    from trainscout.sinks import probe_costs

    for rank, stride in enumerate((16, 32)):
        doc = {
            "rank": rank,
            "steps": 100,
            "step_wall_s": 10.0,
            "nonfinite": {"seconds": 0.01, "setup_seconds": 0.0, "cpu_checks": 100 // stride, "stride": stride},
        }
        with open(probe_costs.report_path(str(tmp_path), rank), "w") as fh:
            json.dump(doc, fh)
    line = probe_costs.summary_line(str(tmp_path))
    assert line.endswith(
        "nonfinite 0.100 ms/step (0.10 % of step time); CPU gradients tested for NaN/Inf every 32 "
        "steps (the loss every step)"
    ), line


def test_monitoring_gaps_and_refused_frames_reach_the_report(tmp_path):
    """A run that says "no findings" must also say when nobody was looking (the agent silent, the coordinator
    stopped) and what it refused to read."""
    import json

    from trainscout.runner.supervisor import monitoring_gap_lines

    events = tmp_path / "events.jsonl"
    rows = [
        {"t": 1000.0, "kind": "agent_lost", "node": "node0"},
        {"t": 1012.5, "kind": "agent_back", "node": "node0", "silent_s": 15.5},
        {"t": 1100.0, "kind": "coordinator_stalled", "seconds": 30.2},
        {"t": 1200.0, "kind": "agent_lost", "node": "node1"},
        {"t": 1300.0, "kind": "coordinator_exit", "findings": 0, "rejected": {"bad_mac": 3, "oversize": 1}},
    ]
    events.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = monitoring_gap_lines(str(events))
    assert len(lines) == 4, lines
    assert "agent of node0 was silent" in lines[0] and "15.5 s" in lines[0]
    assert "coordinator did not run for 30.2 s" in lines[1]
    assert "3 bad_mac" in lines[2] and "1 oversize" in lines[2]
    assert "agent of node1 went silent" in lines[3] and "never reported again" in lines[3]
    assert monitoring_gap_lines(str(tmp_path / "absent.jsonl")) == []
