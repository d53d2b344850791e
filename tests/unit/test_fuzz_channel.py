"""Property-based fuzzing of what the agent decodes from a rank: the shared-memory channel and its sidecar files,
and of the request files the agent writes for the probes.

Real records are written by the real ChannelWriter into a real file in /dev/shm, bytes of that segment are then
corrupted (as a stray write or a half-dead rank could), and the real reader and RankView read it: they never
raise, stay within the ring's bound, and what they hand on still fits the wire. Valid records come back as
written. Hypothesis prints the falsifying input of a failure.
"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainscout.agent.rank_view import RankView
from trainscout.channel.layout import (
    ERROR_PG_INDEX,
    HEADER_BYTES,
    HEADER_DTYPE,
    RECORD_DTYPE,
    RING_SLOTS,
    TOTAL_BYTES,
    evidence_table_path,
    link_probe_request_path,
    pg_table_path,
    remove_run_files,
    replay_request_path,
    tensor_table_path,
    trust_path,
)
from trainscout.channel.reader import ChannelReader
from trainscout.channel.writer import ChannelWriter
from trainscout.probe import protocol
from trainscout.probe.checkpoints import certificate, read_trust
from trainscout.probe.link_probe import LinkProbe
from trainscout.probe.local_evidence import LocalEvidence
from trainscout.probe.nonfinite import NONFINITE_PG_INDEX
from trainscout.probe.replay import REPLAY_PG_INDEX
from trainscout.probe.requests import RequestFile
from trainscout.probe.state_check import STATE_PG_INDEX
from trainscout.probe.step_timing import STEP_PG_INDEX
from trainscout.wire.framing import Codec
from trainscout.wire.messages import NodeDigest

FUZZ = settings(max_examples=40, deadline=None)
SECRET = b"fuzz-secret-0123456789abcdef"
i64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 10**6)
name = st.text(st.characters(blacklist_characters="|,=:", blacklist_categories=("Cs",)), min_size=1, max_size=8)

# any JSON document, to stand where a sidecar or request file expects a particular shape
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


class Channel:
    """A rank's real channel file and the agent's view of it; removed afterwards."""

    def __init__(self) -> None:
        self.run_id = f"fuzz-{uuid.uuid4().hex[:10]}"
        self.writer = ChannelWriter(self.run_id, 0, 0, 4)
        self.writer.set("pid", os.getpid())
        self.groups = {"world": {"desc": "default_pg", "members": [0, 1, 2, 3]}, "dp": {"desc": "", "members": [0, 2]}}
        self.write_json(
            pg_table_path(self.run_id, 0),
            {"index": {"world": 0, "dp": 1}, "groups": self.groups, "roles": {"dp": {"role": "replicate"}}},
        )
        self.writer.set("pg_table_version", 1)
        self.write_json(tensor_table_path(self.run_id, 0), {"tensors": ["w", "b"], "groups": [None, "dp"]})

    @staticmethod
    def write_json(path: str, doc) -> None:
        with open(path, "w") as fh:
            json.dump(doc, fh)

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc) -> None:
        self.writer.close()
        remove_run_files(self.run_id)


# one record of each kind the probe writes, in the probe's own text formats
collective = st.tuples(
    st.just("collective"), st.integers(0, 1), st.integers(1, 40), u64, st.sampled_from([0, protocol.NATIVE]), name
)
described = st.tuples(st.just("detail"), st.integers(0, 1), st.integers(1, 40), u64, name)
state = st.tuples(st.just("state"), st.integers(0, 1), u64, small, small, small)
timing = st.tuples(
    # 7 fields from an older probe, 8 with the time between steps, 9 with the wait for DataLoader workers
    st.just("step"),
    small,
    st.lists(small, min_size=7, max_size=9),
    st.dictionaries(name, small, max_size=2),
)
link = st.tuples(st.just("link"), small, small, st.dictionaries(st.integers(0, 9999), small, max_size=6))
replay = st.tuples(st.just("replay"), small, u64, u64, name, u64)
error = st.tuples(st.just("error"), st.text(max_size=30))
nonfinite = st.tuples(st.just("nonfinite"), small, st.text(max_size=30))
evidence = st.tuples(
    st.just("evidence"), small, st.floats(width=32), st.lists(st.floats(0, 1e6, width=32), max_size=70)
)
records = st.lists(
    st.one_of(collective, described, state, timing, link, replay, error, nonfinite, evidence), max_size=30
)


def write_records(ch: Channel, recs: list) -> None:
    w = ch.writer
    evidence_writer = LocalEvidence(w.append, ch.run_id, 0)
    for rec in recs:
        kind = rec[0]
        if kind == "collective":
            _, pg, seq, h, flags, op = rec
            w.append(pg, seq, h, flags, 1, 0, op, f"{op} f32[4]")
        elif kind == "detail":
            _, pg, seq, h, op = rec
            w.append(pg, seq, h, protocol.DETAIL, 1, 0, op, f"{op} f32[8]")
        elif kind == "state":
            _, tid, digest, step, start, length = rec
            w.append(STATE_PG_INDEX, tid, digest, start, 1, step, "state", f"{start}:{start + length}")
        elif kind == "step":
            _, step, times, pg_wait = rec
            desc = ":".join(map(str, times))
            if pg_wait:
                desc += "|" + ",".join(f"{k}={v}" for k, v in pg_wait.items())
            w.append(STEP_PG_INDEX, step, 1000, 2000, 1, step, "step", desc)
        elif kind == "link":
            _, rid, step, seconds = rec
            w.append(STEP_PG_INDEX, rid, 0, 0, 1, step, "link", ",".join(f"{p}={us}" for p, us in seconds.items()))
        elif kind == "replay":
            _, step, out, grads, layer, params = rec
            w.append(REPLAY_PG_INDEX, step, out, grads, 1, step, "replay", f"{layer}|{params:016x}")
        elif kind == "error":
            w.append(ERROR_PG_INDEX, 1, 0, 0, 1, 0, "error", rec[1].encode()[:120])
        elif kind == "nonfinite":
            w.append(NONFINITE_PG_INDEX, rec[1], 0, 0, 1, rec[1], "nonfinite", rec[2].encode()[:120])
        else:
            _, step, loss, norms = rec
            if len(norms) != len(evidence_writer.layers):
                evidence_writer.set_params([f"layer{i}.weight" for i in range(len(norms))])
            evidence_writer.emit_values(step, loss, np.square(np.asarray(norms, dtype=np.float64)))


def _wire_ok(view: RankView) -> None:
    """What the view decoded is a RankState the real codec can send."""
    state = view.state()
    if state is not None:
        Codec(SECRET).encode(NodeDigest("node", "host", 1, [state]))


@FUZZ
@given(st.lists(st.tuples(st.integers(-8, 8), i64, u64, u64, i64, i64, st.text(max_size=30), st.binary(max_size=130))))
def test_ring_records_read_back_as_written(rows):
    with Channel() as ch:
        reader = ChannelReader(ch.writer.path)
        try:
            for row in rows:
                ch.writer.append(*row)
            got = reader.new_records()
            assert len(got) == len(rows) and reader.lost == 0
            for back, (pg, seq, h1, h2, wall, step, op, desc) in zip(got, rows):
                assert list(back.tolist()[1:7]) == [pg, seq, h1, h2, wall, step]
                assert back["op"] == op.encode()[:24].rstrip(b"\0")  # numpy bytes fields drop trailing NULs
                assert back["desc"] == desc[:120].rstrip(b"\0")
        finally:
            reader.close()


@FUZZ
@given(records)
def test_the_agent_view_reads_valid_records_unchanged(recs):
    with Channel() as ch:
        write_records(ch, recs)
        view = RankView(ch.run_id, 0, ch.writer.path)
        try:
            view.refresh()
            steps, links, replays, state = view.take_steps(), view.take_links(), view.take_replays(), view.take_state()
            want_steps = [r for r in recs if r[0] == "step"]
            assert [(s.step, round(s.data_s * 1e6), s.pg_wait, s.between_s, s.data_workers_s) for s in steps] == [
                (
                    r[1],
                    r[2][0],
                    {k: v / 1e6 for k, v in r[3].items()},
                    r[2][7] / 1e6 if len(r[2]) > 7 else -1.0,
                    r[2][8] / 1e6 if len(r[2]) > 8 else 0.0,
                )
                for r in want_steps
            ]
            assert [(lr.request_id, lr.seconds) for lr in links] == [
                (r[1], {p: us / 1e6 for p, us in r[3].items()}) for r in recs if r[0] == "link"
            ]
            assert [(x.step, x.layer, x.output, x.grads, x.params) for x in replays] == [
                (r[1], r[4], r[2], r[3], r[5]) for r in recs if r[0] == "replay"
            ]
            assert [(s.tensor, s.start, s.end, s.digest) for s in state] == [
                (["w", "b"][r[1]], r[4], r[4] + r[5], r[2]) for r in recs if r[0] == "state"
            ]
            assert not view.malformed
            _wire_ok(view)
        finally:
            view.close()


header_fields = st.sampled_from([n for n in HEADER_DTYPE.names if HEADER_DTYPE[n].kind in "iu"])


@FUZZ
@given(
    records,
    # where the header and the records written lie (a flip in an unused slot is read as nothing)
    st.lists(st.tuples(st.integers(0, HEADER_BYTES + 70 * RECORD_DTYPE.itemsize), st.integers(1, 255)), max_size=40),
    st.lists(st.tuples(header_fields, i64), max_size=4),
    st.data(),
)
def test_a_corrupted_segment_never_breaks_the_reader_or_the_agent_view(recs, flips, header, data):
    with Channel() as ch:
        write_records(ch, recs)
        view = RankView(ch.run_id, 0, ch.writer.path)
        try:
            view.refresh()  # read part of it as written, then the rest after the damage
            write_records(ch, data.draw(records, label="more records"))
            mm = ch.writer._mm
            for offset, mask in flips:
                mm[offset] ^= mask
            for field, value in header:
                if field != "magic":  # a wrong magic only makes the channel not ready: tested below
                    ch.writer.set(field, value & (2**64 - 1) if HEADER_DTYPE[field].kind == "u" else value)
            for _ in range(2):
                view.refresh()
                assert view.reader.read_head >= 0
                _wire_ok(view)
            assert len(view.reader.new_records()) <= RING_SLOTS - 1
            if header and header[0][0] == "ring_head":  # the ring's bound holds whatever the head claims
                assert len(view.reader.new_records()) <= RING_SLOTS - 1
        finally:
            view.close()


@FUZZ
@given(st.binary(min_size=1, max_size=64), st.integers(0, TOTAL_BYTES - 64))
def test_a_channel_file_of_arbitrary_bytes_is_read_without_raising(garbage, at):
    with Channel() as ch:
        ch.writer._mm[at : at + len(garbage)] = garbage
        view = RankView(ch.run_id, 0, ch.writer.path)
        try:
            view.refresh()
            _wire_ok(view)
        finally:
            view.close()


@FUZZ
@given(st.sampled_from(["pgs", "tensors", "evidence"]), json_values, records)
def test_sidecar_tables_of_any_shape_never_break_the_agent_view(which, doc, recs):
    with Channel() as ch:
        path = {"pgs": pg_table_path, "tensors": tensor_table_path, "evidence": evidence_table_path}[which](
            ch.run_id, 0
        )
        write_records(ch, recs)
        Channel.write_json(path, doc)
        ch.writer.set("pg_table_version", 2)
        view = RankView(ch.run_id, 0, ch.writer.path)
        try:
            view.refresh()
            _wire_ok(view)
        finally:
            view.close()


@FUZZ
@given(st.binary(max_size=200))
def test_sidecar_tables_of_arbitrary_bytes_never_break_the_agent_view(raw):
    with Channel() as ch:
        write_records(ch, [("state", 1, 5, 2, 0, 8), ("evidence", 3, 1.5, [1.0, 2.0])])
        for path in (pg_table_path, tensor_table_path, evidence_table_path):
            with open(path(ch.run_id, 0), "wb") as fh:
                fh.write(raw)
        ch.writer.set("pg_table_version", 3)
        view = RankView(ch.run_id, 0, ch.writer.path)
        try:
            view.refresh()
            _wire_ok(view)
        finally:
            view.close()


def test_a_step_description_cut_at_its_size_keeps_its_times_and_its_whole_groups():
    times = [123456] * 11  # every field the probe sends, the forwards' time last
    groups = {f"group{i}": 1000 + i for i in range(8)}  # more process groups than the description holds
    with Channel() as ch:
        write_records(ch, [("step", 7, times, groups)])
        view = RankView(ch.run_id, 0, ch.writer.path)
        try:
            view.refresh()
            (rec,) = view.take_steps()
        finally:
            view.close()
    assert rec.fwd_s == 0.123456 and rec.frozen_s == 0.123456
    assert 0 < len(rec.pg_wait) < len(groups)  # the last one was cut: left out, not misread or raised on
    assert all(rec.pg_wait[k] == groups[k] / 1e6 for k in rec.pg_wait)


def test_a_state_record_naming_a_negative_tensor_id_is_not_read_as_a_tensor_from_the_end():
    with Channel() as ch:
        ch.writer.append(STATE_PG_INDEX, -1, 7, 0, 1, 3, "state", "0:8")
        view = RankView(ch.run_id, 0, ch.writer.path)
        try:
            view.refresh()
            assert [s.tensor for s in view.take_state()] == ["tensor#-1"]
        finally:
            view.close()


def test_a_description_of_a_collective_in_a_gap_given_up_on_is_ignored():
    """Records 1, 2 then 10 chained (the gap 3..9 was given up on): describing seq 5 finds nothing."""
    with Channel() as ch:
        view = RankView(ch.run_id, 0, ch.writer.path)
        try:
            for seq in (1, 2, 10):
                ch.writer.append(0, seq, 11, protocol.NATIVE, 1, 0, "", "")
            view.refresh()
            track = view.pgs["world"]
            track.check_gap(track._gap_since_ns + int(10e9))
            assert [r.seq for r in track.records] == [1, 2, 10]
            ch.writer.append(0, 5, 12, protocol.DETAIL, 1, 0, "all_reduce", "f32[4]")
            view.refresh()
            assert [r.op for r in track.records] == ["", "", ""] and not view.malformed
        finally:
            view.close()


# ---- request files the agent writes and the probes read ----------------------------------------------------


def _valid_request(draw_members):
    return st.fixed_dictionaries({"id": i64, "step": st.integers(0, 10**9), "members": draw_members})


@FUZZ
@given(_valid_request(st.lists(st.integers(0, 64), max_size=8)), st.integers(-1, 10**9))
def test_a_valid_link_probe_request_is_taken_once_and_unchanged(doc, current):
    run_id = f"fuzz-{uuid.uuid4().hex[:10]}"
    try:
        Channel.write_json(link_probe_request_path(run_id), doc)
        missed: list[str] = []
        probe = LinkProbe(rank=doc["members"][0] if doc["members"] else 0, append=None, on_error=missed.append)
        probe.read_request(RequestFile(link_probe_request_path(run_id)), current)
        if doc["step"] > current and doc["members"]:
            assert probe.request == doc and not missed
        else:
            assert probe.request is None
            assert bool(missed) == (doc["step"] <= current)
    finally:
        remove_run_files(run_id)


@FUZZ
@given(st.one_of(json_values.map(lambda d: json.dumps(d).encode()), st.binary(max_size=100)), st.integers(0, 100))
def test_request_files_of_any_shape_are_skipped_not_raised(raw, current):
    run_id = f"fuzz-{uuid.uuid4().hex[:10]}"
    try:
        for path in (link_probe_request_path(run_id), replay_request_path(run_id)):
            with open(path, "wb") as fh:
                fh.write(raw)
        missed: list[str] = []
        requests = RequestFile(replay_request_path(run_id))
        doc = requests.take(current, missed.append)
        assert doc is None or (isinstance(doc, dict) and int(doc["step"]) > current)
        probe = LinkProbe(rank=0, append=None, on_error=missed.append)
        probe.read_request(RequestFile(link_probe_request_path(run_id)), current)
        assert probe.request is None or probe.request["step"] > current
    finally:
        remove_run_files(run_id)


@FUZZ
@given(st.one_of(json_values.map(lambda d: json.dumps(d).encode()), st.binary(max_size=100)))
def test_a_trust_file_of_any_shape_reads_as_a_dict_and_certifies_nothing_it_should_not(raw):
    run_id = f"fuzz-{uuid.uuid4().hex[:10]}"
    try:
        with open(trust_path(run_id), "wb") as fh:
            fh.write(raw)
        trust = read_trust(run_id)
        assert isinstance(trust, dict)
        cert = certificate(run_id, 0, 5, "/nonexistent/ckpt.pt", "torch.save")
        assert cert["status"] in ("certified", "suspect", "unverified")
        json.dumps(cert)
    finally:
        remove_run_files(run_id)


@FUZZ
@given(st.fixed_dictionaries({"verified_step": st.integers(0, 10**6), "suspect_since": st.none() | small}))
def test_a_valid_trust_file_round_trips(doc):
    run_id = f"fuzz-{uuid.uuid4().hex[:10]}"
    try:
        Channel.write_json(trust_path(run_id), doc)
        assert read_trust(run_id) == doc
    finally:
        remove_run_files(run_id)
