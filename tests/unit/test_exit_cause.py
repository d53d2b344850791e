"""A rank that vanished without an exit record (SIGSEGV, SIGKILL) is named with the signal its launcher saw.

The launcher's report trails the death by a moment; the crash finding waits for it (bounded) instead of
saying "unknown status", and a report sent while the launcher still runs counts as much as its final one.
"""

from __future__ import annotations

from test_detectors import WORLD, _exit, obs, pg

from trainscout.detectors.exits import ExitDetector


def _segv_then_collateral():
    lost = _exit("exception", 1, msg="RuntimeError: Connection closed by peer")
    ranks = {r: obs(r, [pg(45)], exit=lost, seen_at=100.3) for r in WORLD}
    ranks[2] = obs(2, [pg(45)], exit=_exit("vanished"), seen_at=100.0)
    return ranks


def test_the_finding_waits_for_the_launchers_code_of_a_vanished_rank():
    det = ExitDetector(settle_s=1.0, launcher_code_wait_s=3.0)
    ranks = _segv_then_collateral()
    assert det.update(101.5, ranks, {}, launcher_done=False) == []  # every rank is gone, but no code yet
    (f,) = det.update(101.6, ranks, {2: -11}, launcher_done=False)  # a report sent while the launcher runs
    assert (f.kind, f.culprit_ranks, f.evidence["signal"]) == ("crash", [2], "SIGSEGV")
    assert "SIGSEGV" in f.summary and "unknown status" not in f.summary


def test_the_wait_is_bounded():
    det = ExitDetector(settle_s=1.0, launcher_code_wait_s=3.0)
    (f,) = det.update(103.1, _segv_then_collateral(), {}, launcher_done=False)
    assert (f.kind, f.culprit_ranks, f.evidence["signal"]) == ("crash", [2], None)


def test_a_finished_launcher_without_a_code_is_not_waited_for():
    det = ExitDetector(settle_s=1.0, launcher_code_wait_s=3.0)
    (f,) = det.update(101.5, _segv_then_collateral(), {}, launcher_done=True)
    assert f.culprit_ranks == [2]


def test_a_rank_that_aborts_in_teardown_after_its_script_ended_is_named_so():
    # torch 2.13's gloo teardown now and then aborts rank 0 after the script's sys.exit(0), with or without
    # trainscout ("terminate called without an active exception"); the launcher then stops the others
    ranks = {r: obs(r, [pg(45)], exit=_exit("exit", 0, msg="sys.exit(0)", step=300), seen_at=100.0) for r in WORLD}
    (f,) = ExitDetector(settle_s=1.0).update(103.0, ranks, {0: -6, 1: -15, 2: -15, 3: -15}, launcher_done=True)
    assert (f.kind, f.culprit_ranks, f.evidence["signal"]) == ("crash", [0], "SIGABRT")
    assert "after its script ended (sys.exit(0))" in f.summary and "teardown" in f.summary, f.summary
    assert "the other 3 rank(s) had ended too" in f.summary, f.summary
