"""The agent's per-group chain: order, gaps, and native collectives described after they were placed."""

from __future__ import annotations

from trainscout.agent.rank_view import PgTrack
from trainscout.probe import protocol
from trainscout.wire.messages import CollectiveRecord


def rec(seq: int, desc: str = "all_reduce Float[] op=SUM", native: bool = False) -> CollectiveRecord:
    h = 0 if native and not desc else protocol.entry_hash((desc,))
    return CollectiveRecord(
        seq=seq,
        op="all_reduce" if desc else "",
        desc=desc,
        entry_hash=h,
        rolling_hash=0,
        wall_ns=0,
        step=seq,
        native=native,
    )


def test_a_native_collective_chains_the_same_described_or_not():
    placeholder, described = PgTrack("0"), PgTrack("0")
    for track, desc in ((placeholder, ""), (described, "all_reduce Float[68]")):
        track.add(rec(1))
        track.add(rec(2, desc, native=True))
        track.add(rec(3))
    assert placeholder.rolling == described.rolling != 0
    assert placeholder.chained_seq == described.chained_seq == 3


def test_describe_fills_the_placed_record_and_leaves_the_chain_alone():
    track = PgTrack("0")
    for s in range(1, 6):
        track.add(rec(s, "" if s % 2 == 0 else "all_reduce Float[] op=SUM", native=s % 2 == 0))
    rolling = track.rolling
    track.describe(4, "all_reduce", "all_reduce Float[68]", 1234)
    by_seq = {r.seq: r for r in track.records}
    assert (by_seq[4].op, by_seq[4].desc, by_seq[4].entry_hash) == ("all_reduce", "all_reduce Float[68]", 1234)
    assert track.rolling == rolling
    track.describe(3, "broadcast", "broadcast Float[1]", 99)  # a Python record is never overwritten
    assert by_seq[3].desc == "all_reduce Float[] op=SUM"


def test_a_native_placeholder_still_pending_is_described_in_place():
    track = PgTrack("0")
    track.add(rec(1))
    track.add(rec(3, "", native=True))  # waits for 2
    track.describe(3, "all_reduce", "all_reduce Float[68]", 7)
    track.add(rec(2))
    assert [r.desc for r in track.records] == ["all_reduce Float[] op=SUM"] * 2 + ["all_reduce Float[68]"]
