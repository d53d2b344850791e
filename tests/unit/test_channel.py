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


def test_every_probe_error_reaches_the_digest_in_order_and_a_burst_is_counted():
    """A second error within one agent interval used to overwrite the first (one header slot)."""
    from trainscout.agent.rank_view import MAX_ERRORS_PER_DIGEST, RankView
    from trainscout.channel.layout import ERROR_PG_INDEX

    run_id = f"chtest-{uuid.uuid4().hex[:8]}"
    writer = ChannelWriter(run_id, 0, 0, 1)
    view = RankView(run_id, 0, writer.path)
    try:
        writer.set("pid", os.getpid())
        for i in range(3):
            writer.append(ERROR_PG_INDEX, i + 1, 0, 0, 0, 5, "error", f"check {i} disabled: boom")
        writer.set("error_text", b"check 2 disabled: boom")
        view.refresh()
        state = view.state()
        assert state is not None
        assert state.probe_errors == [f"check {i} disabled: boom" for i in range(3)]
        for i in range(MAX_ERRORS_PER_DIGEST + 4):
            writer.append(ERROR_PG_INDEX, 10 + i, 0, 0, 0, 6, "error", f"error {i}")
        view.refresh()
        state = view.state()
        assert state is not None
        assert state.probe_errors[:MAX_ERRORS_PER_DIGEST] == [f"error {i}" for i in range(MAX_ERRORS_PER_DIGEST)]
        assert "4 more probe errors" in state.probe_errors[MAX_ERRORS_PER_DIGEST]
    finally:
        writer.close()
        view.reader.close()
        os.unlink(writer.path)  # the channel lives in /dev/shm: a test must not leave it behind


def test_a_long_probe_error_is_shown_once_whole():
    """The ring record holds DESC_BYTES of an error's text, the header 480: both reached the user, the cut copy
    first."""
    from trainscout.agent.rank_view import RankView
    from trainscout.channel.layout import DESC_BYTES, ERROR_PG_INDEX

    run_id = f"chtest-{uuid.uuid4().hex[:8]}"
    writer = ChannelWriter(run_id, 0, 0, 1)
    view = RankView(run_id, 0, writer.path)
    text = "replay disabled: " + "a replica did not join the replay in time " * 6
    assert DESC_BYTES < len(text) < 480
    try:
        writer.set("pid", os.getpid())
        writer.append(ERROR_PG_INDEX, 1, 0, 0, 0, 5, "error", text[:DESC_BYTES])
        writer.set("error_text", text.encode())
        view.refresh()
        state = view.state()
        assert state is not None
        assert state.probe_errors == [text]
    finally:
        writer.close()
        view.reader.close()
        os.unlink(writer.path)


def test_a_run_id_is_claimed_by_one_live_process_at_a_time():
    import subprocess
    import sys

    from trainscout.channel.layout import claim_run_id, remove_run_files

    run_id = f"chtest-{uuid.uuid4().hex[:8]}"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from trainscout.channel.layout import claim_run_id as c; "
            "print(c(sys.argv[1]), flush=True); time.sleep(30)",
            run_id,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "None"  # it claimed the id
        assert claim_run_id(run_id) == holder.pid  # a second run of the same id is told who holds it
        holder.kill()
        holder.wait()
        assert claim_run_id(run_id) is None  # a claim whose process is gone is taken over
        assert claim_run_id(run_id) is None  # and the holder itself may ask again
    finally:
        holder.kill()
        assert remove_run_files(run_id) == 1  # the claim is a run file: the run's clean-up removes it
