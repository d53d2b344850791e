"""A rank gone before its probe recorded why is read from its zombie's status while torchrun has not reaped it.

`os._exit(0)` after the work (a common way to skip a slow teardown) is a clean exit, not a rank that
vanished: judged as vanished it was named a crash at the end of a job that succeeded.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from trainscout.agent.rank_view import exit_without_record, process_state


_CHILDREN: dict[int, subprocess.Popen] = {}  # held: a Popen collected would reap its child


def _spawn(code: str) -> psutil.Process:
    child = subprocess.Popen([sys.executable, "-c", code])  # not waited for until the test ends: a zombie
    _CHILDREN[child.pid] = child
    return psutil.Process(child.pid)


def _until_zombie(proc: psutil.Process) -> psutil.Process:
    deadline = time.monotonic() + 10
    while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def _zombie(code: str) -> psutil.Process:
    return _until_zombie(_spawn(code))


def _reap(proc: psutil.Process) -> None:
    _CHILDREN.pop(proc.pid).wait()


def test_a_process_ended_by_os_exit_is_a_clean_exit():
    proc = _zombie("import os; os._exit(0)")
    try:
        alive, status = process_state(proc)
        assert not alive and status == (0, None)
        e = exit_without_record(*status, step=40)
        assert (e.how, e.code, e.signal, e.step) == ("exit", 0, None, 40)
    finally:
        _reap(proc)


def test_an_exit_code_and_a_signal_are_told_apart():
    coded = _zombie("import os; os._exit(3)")
    killed = _zombie("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    try:
        assert exit_without_record(*process_state(coded)[1], step=1).how == "exit"
        e = exit_without_record(*process_state(killed)[1], step=1)
        assert (e.how, e.signal) == ("signal", signal.SIGSEGV)
    finally:
        _reap(coded)
        _reap(killed)


def test_a_process_reaped_unseen_is_vanished():
    assert exit_without_record(None, None, step=5).how == "vanished"


def test_a_record_written_after_the_ticks_header_copy_is_not_missed():
    """The agent copies a rank's header, reads its records, then finds the process dead: the rank recorded
    its exit (os._exit's wrapper) and died in between. Read from the stale copy it looked vanished."""
    import os
    import uuid

    from trainscout.agent.rank_view import RankView
    from trainscout.channel.writer import ChannelWriter

    run_id = f"exittest-{uuid.uuid4().hex[:8]}"
    writer = ChannelWriter(run_id, 0, 0, 1)
    view = RankView(run_id, 0, writer.path)
    rank = _spawn("import time; time.sleep(0.5)")  # a zombie once it ends
    try:
        writer.set("pid", rank.pid)
        view.refresh()
        assert view.exit is None
        stale = view.reader.header()  # this tick's copy, taken while the rank still ran
        writer.record_exit("exit", 0, None, "os._exit")  # its last act
        view._check_exit(stale)  # still running: nothing to report
        assert view.exit is None
        _until_zombie(rank)
        view._check_exit(stale)
        assert view.exit is not None
        assert (view.exit.how, view.exit.code, view.exit.message) == ("exit", 0, "os._exit")
    finally:
        _reap(rank)
        writer.close()
        view.reader.close()
        os.unlink(writer.path)
