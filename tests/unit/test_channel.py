"""The shared-memory channel: what the probe writes, the agent reads back field for field."""

from __future__ import annotations

import os
import uuid

from trainscout.channel.layout import RING_SLOTS
from trainscout.channel.reader import ChannelReader
from trainscout.channel.writer import ChannelWriter


def _record(i: int) -> tuple:
    return (
        i % 7,
        1000 + i,
        (2**64 - 1) - i,
        2**63 + i,
        1_700_000_000_000_000_000 + i,
        i // 3,
        f"op{i}",
        "desc " * (i % 40),
    )


def test_records_read_back_as_written_across_a_ring_wrap():
    writer = ChannelWriter(f"chtest-{uuid.uuid4().hex[:8]}", 0, 0, 1)
    reader = ChannelReader(writer.path)
    try:
        assert reader.ready()
        first = [_record(i) for i in range(10)]
        for rec in first:
            writer.append(*rec)
        got = reader.new_records()
        assert len(got) == 10 and reader.lost == 0
        for row, rec in zip(got, first):
            assert (
                int(row["pg_index"]),
                int(row["seq"]),
                int(row["entry_hash"]),
                int(row["rolling_hash"]),
                int(row["wall_ns"]),
                int(row["step"]),
            ) == rec[:6]
            assert row["op"].decode() == rec[6] and row["desc"].decode() == rec[7].encode()[:120].decode()
            assert int(row["lock"]) % 2 == 0 and int(row["lock"]) > 0
        # lap the ring: the reader keeps the newest RING_SLOTS - 1 and counts the rest as lost
        total = RING_SLOTS + 50
        for i in range(10, 10 + total):
            writer.append(*_record(i))
        got = reader.new_records()
        assert len(got) == RING_SLOTS - 1 and reader.lost == total - (RING_SLOTS - 1)
        assert int(got[-1]["seq"]) == 1000 + 9 + total and int(got[0]["seq"]) == int(got[-1]["seq"]) - len(got) + 1
    finally:
        reader.close()
        writer.close()
        os.unlink(writer.path)
