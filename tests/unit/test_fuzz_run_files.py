"""Property-based fuzzing of the run folder's files as trainscout reads them back: evidence.jsonl, findings.jsonl,
the event logs, probe cost reports, checkpoint certificates and their index, topology.json, the fault log.

A run folder is written by the real writers, then one file is cut short, bit-flipped, or given a line of any
JSON shape or arbitrary bytes (a process killed mid-write, a disk error, a hand edit). Every reader then returns
its documented result (lines it cannot use are skipped, a certificate it cannot read is listed as unreadable)
and never raises; an intact folder reads back as written. Hypothesis prints the falsifying input of a failure.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

from hypothesis import example, given, settings
from hypothesis import strategies as st

from trainscout import checkpoint_list
from trainscout.faults.fault_log import FAULT_LOG_ENV, read_fault_log, record
from trainscout.findings import Finding
from trainscout.probe.checkpoints import CERT_INDEX, record_certificate, write_certificate
from trainscout.runner.handoff import attempt_lines_of
from trainscout.runner.standalone import AgentPresence
from trainscout.runner.supervisor import _topology_line, monitoring_gap_lines
from trainscout.sinks import evidence_log, probe_costs, report_html, report_series, verdict
from trainscout.sinks.jsonl import EventLog, JsonlSink
from trainscout.wire.messages import NumericRecord, StepRecord

FUZZ = settings(max_examples=25, deadline=None)

finite = st.floats(-1e6, 1e6, allow_nan=False)
small = st.integers(0, 10**6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
# a JSON object with the keys the readers look for, holding values of any type
shaped = st.dictionaries(
    st.sampled_from(
        [
            "t",
            "kind",
            "rank",
            "steps",
            "numerics",
            "layers",
            "node",
            "silent_s",
            "seconds",
            "rejected",
            "attempt",
            "command",
            "code",
            "line",
            "certificate",
            "checkpoint",
            "step",
            "status",
            "saved_at",
            "run_dir",
            "summary",
            "state_check",
            "nonfinite",
            "step_wall_s",
            "culprit_ranks",
        ]
    ),
    json_values,
    max_size=6,
)
kinds = st.sampled_from(["agent_lost", "agent_back", "coordinator_stalled", "coordinator_exit", "attempt", "start"])
bad_line = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    shaped.map(lambda v: json.dumps(v).encode()),
    st.tuples(kinds, shaped).map(lambda kv: json.dumps({**kv[1], "kind": kv[0]}).encode()),
    st.binary(max_size=40),
)

steps = st.builds(StepRecord, small, finite, finite, finite, finite, finite)
numerics = st.builds(NumericRecord, small, st.floats(allow_nan=True), st.lists(st.floats(allow_nan=True), max_size=3))
ranks = st.lists(st.tuples(st.integers(0, 7), st.lists(steps, max_size=3), st.lists(numerics, max_size=3)), max_size=5)

RUN_FILES = (
    "evidence.jsonl",
    "findings.jsonl",
    "events.jsonl",
    "events.supervisor.jsonl",
    "topology.json",
    "probe-cost.rank0.json",
    CERT_INDEX,
    "ckpt/model.pt.trainscout-cert.json",
)


def write_run(run_dir: str, evidence_rows) -> list[Finding]:
    """A small run folder, as the real writers leave it."""
    log = evidence_log.EvidenceLog(os.path.join(run_dir, "evidence.jsonl"))
    for rank, st_, num in evidence_rows:
        log.write(rank, st_, num, [f"layer{i}" for i in range(3)], 4)
    log.close()
    findings = [
        Finding(kind="sdc", summary="rank 2 differs", culprit_ranks=[2], step=7),
        Finding(kind="hang", summary="rank 1 never entered", culprit_ranks=[1], step=9, pg="0"),
    ]
    with JsonlSink(os.path.join(run_dir, "findings.jsonl")) as sink:
        for f in findings:
            sink.finding(f)
    with EventLog(os.path.join(run_dir, "events.jsonl")) as events:
        events.write("agent_hello", node="a")
        events.write("agent_lost", node="a")
        events.write("agent_back", node="a", silent_s=3.5)
        events.write("coordinator_stalled", seconds=2.0)
        events.write("attempt", attempt=1)
        events.write("coordinator_exit", rejected={"mac": 2})
        events.write("agent_goodbye", node="a")
    with EventLog(os.path.join(run_dir, "events.supervisor.jsonl")) as events:
        events.write("start", command=["torchrun", "train.py"])
        events.write("launcher_exit", code=0)
    with open(os.path.join(run_dir, "topology.json"), "w") as fh:
        json.dump({"line": "4 ranks, 1 node"}, fh)
    with open(probe_costs.report_path(run_dir, 0), "w") as fh:
        json.dump({"rank": 0, "steps": 10, "step_wall_s": 2.0, "state_check": {"seconds": 0.1, "period_steps": 4}}, fh)
    os.makedirs(os.path.join(run_dir, "ckpt"))
    target = os.path.join(run_dir, "ckpt", "model.pt")
    open(target, "wb").close()
    cert = {"schema": 1, "checkpoint": target, "rank": 0, "step": 5, "saved_at": 1.0, "run_dir": run_dir}
    cert.update(status="certified", reason="every check agreed")
    cert_path = write_certificate(cert, target)
    assert cert_path is not None
    record_certificate(run_dir, cert_path, cert)
    return findings


def read_everything(run_dir: str) -> dict:
    """Every reader of the run folder; none may raise."""
    data = report_html.load_run(run_dir)
    report_html.render_report(data)
    events = os.path.join(run_dir, "events.jsonl")
    evidence = os.path.join(run_dir, "evidence.jsonl")
    presence = AgentPresence(events)
    return {
        "run": data,
        "evidence": evidence_log.read(evidence) if os.path.exists(evidence) else {},  # absent: no evidence written
        "series": report_series.read_evidence(evidence) if os.path.exists(evidence) else report_series.Evidence(),
        "costs": probe_costs.summary_line(run_dir),
        "checkpoints": checkpoint_list.list_checkpoints(run_dir),
        "trusted": verdict.trusted_checkpoint(run_dir),
        "attempts": attempt_lines_of(events),
        "gaps": monitoring_gap_lines(events),
        "topology": _topology_line(run_dir),
        "gone": presence.all_gone(),
    }


class RunDir:
    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="fuzz-run-")
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@FUZZ
@given(ranks)
def test_an_intact_run_folder_reads_back_as_written(rows):
    with RunDir() as run_dir:
        findings = write_run(run_dir, rows)
        got = read_everything(run_dir)
        assert got["run"].findings == findings
        assert got["run"].command == ["torchrun", "train.py"] and got["run"].exit_code == 0
        assert got["topology"] == "4 ranks, 1 node" == got["run"].topology
        expected: dict[int, dict] = {}
        for rank, st_, num in rows:
            if st_ or num:
                entry = expected.setdefault(rank, {"steps": [], "numerics": [], "layers": []})
                entry["steps"] += st_
                entry["numerics"] += num
                entry["layers"] = [f"layer{i}" for i in range(3)]
        back = got["evidence"]
        assert sorted(back) == sorted(expected)
        for rank, entry in expected.items():
            assert back[rank]["steps"] == entry["steps"] and back[rank]["layers"] == entry["layers"]
            for a, b in zip(back[rank]["numerics"], entry["numerics"], strict=True):
                assert a.step == b.step and _same(a.loss, b.loss) and all(map(_same, a.norms, b.norms))
        assert got["series"].ranks == len(expected)
        # the sdc finding came at step 7, after the save at step 5: the checkpoint stays certified
        assert [(e.step, e.status) for e in got["checkpoints"]] == [(5, "certified")]
        assert got["trusted"] is not None and got["trusted"]["step"] == 5
        assert len(got["gaps"]) == 3 and got["attempts"] and got["gone"] is True
        assert "state check" in got["costs"]


def _same(back: float, sent: float) -> bool:
    """JSON has no NaN or infinity: a non-finite value is written as null and read back as NaN."""
    return math.isnan(back) if not math.isfinite(sent) else back == sent


@FUZZ
@given(ranks, st.sampled_from(RUN_FILES), st.data())
def test_a_damaged_run_folder_never_breaks_a_reader(rows, which, data):
    with RunDir() as run_dir:
        write_run(run_dir, rows)
        path = os.path.join(run_dir, which)
        raw = bytearray()
        if os.path.exists(path):  # evidence.jsonl is written only once there is evidence
            with open(path, "rb") as fh:
                raw = bytearray(fh.read())
        how = data.draw(st.sampled_from(["cut", "flip", "line", "replace"]), label="damage")
        if how == "cut":
            raw = raw[: data.draw(st.integers(0, len(raw)), label="keep")]
        elif how == "flip" and raw:
            for _ in range(data.draw(st.integers(1, 4), label="flips")):
                bit = data.draw(st.integers(0, 8 * len(raw) - 1), label="bit")
                raw[bit // 8] ^= 1 << (bit % 8)
        elif how == "line":
            lines = bytes(raw).split(b"\n")
            at = data.draw(st.integers(0, len(lines)), label="at")
            lines.insert(at, data.draw(bad_line, label="line"))
            raw = bytearray(b"\n".join(lines))
        else:
            raw = bytearray(data.draw(bad_line, label="content"))
        with open(path, "wb") as fh:
            fh.write(raw)
        got = read_everything(run_dir)
        assert all(isinstance(line, str) for line in got["gaps"] + got["attempts"])
        assert isinstance(got["evidence"], dict) and isinstance(got["costs"], str)


@FUZZ
@given(st.lists(bad_line, min_size=1, max_size=6))
@example([b'{"status":null}'])  # a certificate with no status listed as one with status None
def test_run_files_made_only_of_bad_lines_read_as_empty_or_skipped(lines):
    with RunDir() as run_dir:
        os.makedirs(os.path.join(run_dir, "ckpt"))
        for name in RUN_FILES:
            with open(os.path.join(run_dir, name), "wb") as fh:
                fh.write(b"\n".join(lines))
        got = read_everything(run_dir)
        assert got["trusted"] is None
        assert all(e.status in ("unreadable", "certified", "suspect", "unverified") for e in got["checkpoints"])


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.integers(0, 63),
            st.text(max_size=10),
            st.integers(-5, 10**6),
            st.dictionaries(st.text(max_size=5), json_values | st.floats(), max_size=3),
        ),
        max_size=5,
    ),
    st.lists(bad_line, max_size=3),
)
def test_the_fault_log_round_trips_and_skips_what_is_not_a_record(faults, junk):
    with RunDir() as run_dir:
        path = os.path.join(run_dir, "faults.jsonl")
        old = os.environ.get(FAULT_LOG_ENV)
        os.environ[FAULT_LOG_ENV] = path
        try:
            for rank, kind, step, params in faults:
                record(rank, kind, step, params)
        finally:
            if old is None:
                del os.environ[FAULT_LOG_ENV]
            else:
                os.environ[FAULT_LOG_ENV] = old
        with open(path, "ab") as fh:
            for line in junk:
                fh.write(line.replace(b"\n", b" ") + b"\n")
        got = read_fault_log(path)
        assert [(r["rank"], r["kind"], r["step"]) for r in got[: len(faults)]] == [f[:3] for f in faults]
        assert all(isinstance(r["step"], int) and isinstance(r["t"], float) for r in got)
