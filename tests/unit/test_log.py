"""trainscout/log.py: one log per run, every line with the process's role, rank and step."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

from trainscout import log

LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<role>\S+)\s+rank=(?P<rank>\S+) step=(?P<step>\S+) "
    r"(?P<level>[A-Z]+)\s+(?P<name>[\w.]+): (?P<msg>.*)$"
)


def _lines(path) -> list[dict]:
    with open(path) as fh:
        return [m.groupdict() for m in map(LINE.match, fh.read().splitlines()) if m]


def test_each_line_says_role_rank_and_the_step_at_the_time_it_was_written(tmp_path):
    step = [7]
    log.setup("probe", str(tmp_path), rank=3, step=lambda: step[0])
    log.get("probe").warning("state check off: %s", "no memory")
    step[0] = 8
    log.get("probe").info("second")
    log.get("probe").debug("below the level: not written")
    got = _lines(tmp_path / log.LOG_FILE)
    assert [(g["role"], g["rank"], g["step"], g["level"], g["name"], g["msg"]) for g in got] == [
        ("probe", "3", "7", "WARNING", "trainscout.probe", "state check off: no memory"),
        ("probe", "3", "8", "INFO", "trainscout.probe", "second"),
    ]


def test_processes_without_rank_or_step_write_dashes_and_a_failing_step_reader_costs_no_line(tmp_path):
    def broken() -> int:
        raise RuntimeError("no step yet")

    log.setup("coordinator", str(tmp_path), step=broken, level="DEBUG")
    log.get("coordinator").debug("pass took %d ms", 3)
    (g,) = _lines(tmp_path / log.LOG_FILE)
    assert (g["role"], g["rank"], g["step"], g["msg"]) == ("coordinator", "-", "-", "pass took 3 ms")


def test_no_run_folder_means_no_file_and_the_training_scripts_logging_never_sees_our_lines(tmp_path, caplog):
    log.setup("probe", str(tmp_path / "missing"), rank=0)
    with caplog.at_level(logging.DEBUG):  # the user's root logger
        log.get("probe").error("not for the user's handlers")
    assert caplog.records == []
    assert not (tmp_path / "missing").exists()


def test_several_processes_append_to_one_file(tmp_path):
    code = (
        "import sys; from trainscout import log; "
        "log.setup('probe', sys.argv[1], rank=int(sys.argv[2]), step=lambda: 5); "
        "[log.get('probe').info('line %d', i) for i in range(200)]"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(r)]) for r in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    got = _lines(tmp_path / log.LOG_FILE)
    assert len(got) == 800  # whole lines, none torn or lost
    assert sorted({g["rank"] for g in got}) == ["0", "1", "2", "3"]
