"""Property-based fuzzing of the wire decoders: the framing Codec (both directions), memberships, throttle masks.

Whatever arrives on the coordinator's port (or the agent's), the Codec returns a message of the expected union
or None with exactly one counted reason; valid messages built by the real encoder come back unchanged; no input
makes it allocate far beyond the frame it was given. Hypothesis prints the falsifying input of a failure.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import tracemalloc

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from trainscout.wire.device import THROTTLE_REASONS, DeviceReading, decode_throttle
from trainscout.wire.framing import MAC_SIZE, VERSION, Codec
from trainscout.wire.membership import MAX_RANKS, pack_members, unpack_members
from trainscout.wire.messages import (
    CollectiveRecord,
    Command,
    GroupInfo,
    Goodbye,
    Hello,
    LauncherReport,
    NodeDigest,
    NonFiniteEvent,
    NumericRecord,
    PgState,
    RankExit,
    RankState,
    RecordsReport,
    StackReport,
    StepRecord,
)

SECRET = b"fuzz-secret-0123456789abcdef"
FUZZ = settings(max_examples=60, deadline=None)
TO_COORDINATOR = (Hello, NodeDigest, StackReport, RecordsReport, LauncherReport, Goodbye)

i64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=12)  # any unicode, surrogates excluded by hypothesis (msgpack strings are UTF-8)
finite = st.floats(allow_nan=False, allow_infinity=True, width=64)


def _records():
    return st.builds(CollectiveRecord, i64, text, text, u64, u64, i64, i64, st.booleans())


def _rank_states():
    pg = st.builds(
        PgState,
        name=text,
        desc=text,
        members=st.lists(i64, max_size=4),
        seq=i64,
        rolling_hash=u64,
        anchors=st.lists(st.tuples(i64, u64), max_size=2),
        recent=st.lists(_records(), max_size=2),
        seq_age_s=finite,
        chained_seq=i64,
        complete=st.booleans(),
    )
    exit_ = st.none() | st.builds(RankExit, text, st.none() | i64, st.none() | i64, text, i64, finite)
    step = st.builds(
        StepRecord,
        i64,
        finite,
        finite,
        finite,
        finite,
        finite,
        finite,
        finite,
        st.dictionaries(text, finite, max_size=2),
    )
    return st.builds(
        RankState,
        rank=i64,
        local_rank=i64,
        world_size=i64,
        pid=i64,
        alive=st.booleans(),
        step=i64,
        heartbeat_age_s=finite,
        progress_age_s=finite,
        collectives=i64,
        pgs=st.lists(pg, max_size=2),
        exit=exit_,
        probe_errors=st.lists(text, max_size=2),
        steps=st.lists(step, max_size=2),
        nonfinite=st.lists(st.builds(NonFiniteEvent, i64, text), max_size=2),
        numerics=st.lists(st.builds(NumericRecord, i64, finite, st.lists(finite, max_size=3)), max_size=2),
    )


def to_coordinator_messages():
    return st.one_of(
        st.builds(Hello, text, text, i64),
        st.builds(
            NodeDigest,
            node_id=text,
            host=text,
            number=i64,
            ranks=st.lists(_rank_states(), max_size=2),
            devices=st.lists(st.builds(DeviceReading, index=i64, uuid=text, power_w=finite), max_size=2),
            groups=st.lists(st.builds(GroupInfo, text, st.lists(st.tuples(i64, i64, i64), max_size=3)), max_size=2),
        ),
        st.builds(StackReport, text, i64, i64, i64, text, st.text(max_size=200)),
        st.builds(RecordsReport, text, i64, i64, text, st.lists(_records(), max_size=3)),
        st.builds(LauncherReport, text, i64, st.lists(st.tuples(i64, i64, i64), max_size=3), st.booleans()),
        st.builds(Goodbye, text, text),
    )


def commands():
    return st.builds(Command, text, i64, st.lists(i64, max_size=4), text, i64, i64, st.text(max_size=100))


# msgpack-encodable values of every type, to put where a field expects another
any_value = st.recursive(
    st.none() | st.booleans() | i64 | u64 | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _signed(payload: bytes) -> list[bytes]:
    return [VERSION, hmac.new(SECRET, payload, hashlib.sha256).digest(), payload]


def _one_rejection(codec: Codec, before: int) -> bool:
    return sum(codec.rejected.values()) == before + 1


@FUZZ
@given(to_coordinator_messages())
def test_every_valid_message_to_the_coordinator_round_trips_unchanged(msg):
    codec = Codec(SECRET)
    assert codec.decode_to_coordinator(codec.encode(msg)) == msg
    assert not codec.rejected


@FUZZ
@given(commands())
def test_every_valid_command_to_an_agent_round_trips_unchanged(cmd):
    codec = Codec(SECRET)
    assert codec.decode_to_agent(codec.encode(cmd)) == cmd
    assert not codec.rejected


@FUZZ
@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True))
def test_nan_and_infinities_cross_the_wire(loss, norm):
    codec = Codec(SECRET)
    msg = RecordsReport("n", 1, 0, "pg", [])
    digest = NodeDigest(
        "n",
        "h",
        1,
        [RankState(0, 0, 1, 1, True, 0, 0.0, 0.0, 0, [], numerics=[NumericRecord(3, loss, [norm])])],
    )
    assert codec.decode_to_coordinator(codec.encode(msg)) == msg
    got = codec.decode_to_coordinator(codec.encode(digest)).ranks[0].numerics[0]
    for sent, back in ((loss, got.loss), (norm, got.norms[0])):
        assert (math.isnan(sent) and math.isnan(back)) or sent == back


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_arbitrary_frames_are_rejected_and_counted_once(frames):
    codec = Codec(SECRET)
    assert codec.decode_to_coordinator(frames) is None
    assert codec.decode_to_agent(frames) is None
    assert sum(codec.rejected.values()) == 2


@FUZZ
@given(to_coordinator_messages(), st.data())
def test_a_bit_flip_or_truncation_of_a_valid_frame_is_refused_by_the_mac(msg, data):
    codec = Codec(SECRET)
    frames = codec.encode(msg)
    which = data.draw(st.integers(0, 2), label="frame")
    frame = bytearray(frames[which])
    if data.draw(st.booleans(), label="truncate") or not frame:
        frame = frame[: data.draw(st.integers(0, max(0, len(frame) - 1)), label="keep")]
    else:
        bit = data.draw(st.integers(0, 8 * len(frame) - 1), label="bit")
        frame[bit // 8] ^= 1 << (bit % 8)
    frames[which] = bytes(frame)
    assert codec.decode_to_coordinator(frames) is None
    assert codec.rejected == {("version", "mac", "mac")[which]: 1}


@FUZZ
@given(st.binary(max_size=256))
def test_signed_arbitrary_payloads_decode_to_a_message_or_a_counted_rejection(payload):
    """A peer holding the secret (or a bug of our own) can sign anything: still never a raise."""
    codec = Codec(SECRET)
    got = codec.decode_to_coordinator(_signed(payload))
    assert got is None or isinstance(got, TO_COORDINATOR)
    cmd = codec.decode_to_agent(_signed(payload))
    assert cmd is None or isinstance(cmd, Command)
    assert sum(codec.rejected.values()) == (got is None) + (cmd is None)
    assert set(codec.rejected) <= {"malformed"}


@FUZZ
@given(to_coordinator_messages(), st.data())
def test_signed_corruptions_of_valid_payloads_never_raise(msg, data):
    codec = Codec(SECRET)
    payload = bytearray(codec.encode(msg)[2])
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        bit = data.draw(st.integers(0, 8 * len(payload) - 1), label="bit")
        payload[bit // 8] ^= 1 << (bit % 8)
    payload = payload[: data.draw(st.integers(0, len(payload)), label="keep")]
    before = sum(codec.rejected.values())
    got = codec.decode_to_coordinator(_signed(bytes(payload)))
    assert got is None or isinstance(got, TO_COORDINATOR)
    assert sum(codec.rejected.values()) == before + (got is None)


@FUZZ
@given(to_coordinator_messages(), st.data())
def test_wrong_types_in_valid_msgpack_are_rejected_or_decoded_as_declared(msg, data):
    """Replace one field (at any depth) of a valid message by a value of any type, sign it, decode it."""
    codec = Codec(SECRET)
    doc = msgspec.to_builtins(msg)
    containers = []

    def walk(node):
        if isinstance(node, dict):
            containers.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            containers.append(node)
            for v in node:
                walk(v)

    walk(doc)
    target = data.draw(st.sampled_from(containers), label="container")
    keys = list(target) if isinstance(target, dict) else list(range(len(target)))
    value = data.draw(any_value, label="value")
    if keys:
        target[data.draw(st.sampled_from(keys), label="key")] = value
    got = codec.decode_to_coordinator(_signed(msgspec.msgpack.encode(doc)))
    assert got is None or isinstance(got, TO_COORDINATOR)
    assert sum(codec.rejected.values()) == (got is None)


@FUZZ
@given(st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6"]), st.binary(max_size=32))
def test_huge_declared_lengths_are_refused_without_allocating_them(header, tail):
    """A msgpack array, map, str or bin header claiming 2**32 - 1 items, followed by a few bytes."""
    codec = Codec(SECRET)
    for prefix in (b"", b"\x82\xa4type\xaaNodeDigest\xa5ranks"):  # at the top, and as a field's value
        payload = prefix + header + b"\xff\xff\xff\xff" + tail
        tracemalloc.start()
        try:
            assert codec.decode_to_coordinator(_signed(payload)) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
    assert codec.rejected == {"malformed": 2}


def test_an_oversize_payload_is_refused_before_its_mac_is_computed():
    codec = Codec(SECRET, max_payload=1000)
    frames = _signed(b"\x00" * 1001)
    assert codec.decode_to_coordinator(frames) is None
    assert codec.rejected == {"oversize": 1}
    assert codec.decode_to_agent([VERSION, b"m" * MAC_SIZE, b"\x00" * 1000]) is None
    assert codec.rejected == {"oversize": 1, "mac": 1}


@FUZZ
@given(st.lists(st.integers(0, 2**40), max_size=40))
def test_memberships_round_trip(members):
    assert unpack_members(pack_members(members)) == sorted(set(members))


# counts that expand cheaply, and the extremes a hostile run would claim (expanding MAX_RANKS per example is slow)
counts = st.integers(-3, 300) | st.sampled_from([MAX_RANKS + 1, 2**63 - 1, -(2**63)])


@FUZZ
@given(st.lists(st.tuples(i64, i64, counts), max_size=12))
def test_membership_runs_from_the_wire_are_bounded_and_never_raise(runs):
    ranks = unpack_members(runs)
    assert len(ranks) <= MAX_RANKS
    assert ranks == sorted(set(ranks)) and all(r >= 0 for r in ranks)


def test_many_runs_of_the_largest_count_stay_within_the_rank_bound():
    """Each run alone is within MAX_RANKS; a digest of many such runs must not expand to all of them."""
    runs = [(i * MAX_RANKS, 1, MAX_RANKS) for i in range(4)]
    assert len(unpack_members(runs)) == MAX_RANKS


@FUZZ
@given(i64)
def test_throttle_masks_decode_to_known_names_only(mask):
    names = decode_throttle(mask)
    known = dict(THROTTLE_REASONS)
    assert names == ([] if mask <= 0 else [name for bit, name in known.items() if mask & bit])
