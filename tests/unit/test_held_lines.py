"""A full disk holds the run's lines in memory, in order, and writes them once there is space.

"Full" here is real: the kernel's file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) makes a write past it
fail with EFBIG as a full disk fails with ENOSPC; raising the limit again is the space coming back.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal

from trainscout.findings import Finding
from trainscout.sinks import EventLog, JsonlSink
from trainscout.sinks.held_lines import FullFolderNotice, HeldLines


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_lines_held_while_full_are_written_in_order_once_there_is_space(tmp_path):
    said: list[str] = []
    notice = FullFolderNotice(lambda t: said.append("warn: " + t), lambda t: said.append("info: " + t))
    log = HeldLines(str(tmp_path / "x.jsonl"), notice.full, notice.space)
    log.append(b"first\n")
    with _file_size_limit(10):
        for i in range(5):
            log.append(f"held {i}\n".encode())  # the first fits in part: its rest waits at the head
        assert log.held == 5 and log.full
    assert (tmp_path / "x.jsonl").read_bytes() == b"first\nheld"
    log.append(b"last\n")  # there is space again: everything goes, in order
    assert (tmp_path / "x.jsonl").read_bytes().decode().splitlines() == [
        "first",
        *[f"held {i}" for i in range(5)],
        "last",
    ]
    assert not log.full and log.held == 0
    assert len(said) == 2 and said[0].startswith("warn: the run folder is full") and "x.jsonl" in said[0]
    assert said[1].startswith("info: the run folder has space again")
    log.close()


def test_a_finding_made_on_a_full_disk_reaches_findings_jsonl_at_close(tmp_path):
    sink = JsonlSink(tmp_path / "findings.jsonl")
    events = EventLog(tmp_path / "events.jsonl")
    with _file_size_limit(1):
        sink.finding(Finding(kind="hang", culprit_ranks=[3], step=20, summary="rank 3 hung"))
        events.write("finding", finding_kind="hang")  # neither raises
        assert sink.held == 1
    sink.close()
    events.close()
    lines = [json.loads(x) for x in (tmp_path / "findings.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["culprit_ranks"]) for f in lines] == [("hang", [3])]
    assert json.loads((tmp_path / "events.jsonl").read_text())["kind"] == "finding"


def test_holding_is_bounded(tmp_path):
    log = HeldLines(str(tmp_path / "x"), max_held_bytes=20)
    with _file_size_limit(1):
        for _ in range(10):
            log.append(b"0123456789\n")
        assert log.held == 1 and log.dropped == 9
    log.close()
    assert (tmp_path / "x").read_bytes() == b"0123456789\n"
