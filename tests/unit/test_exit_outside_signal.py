"""A SIGTERM or SIGINT aimed at one rank from outside the job is that rank's fault, not the job's teardown.

Launchers and schedulers stop ranks with these signals, so they blame nobody by default. One rank ended by one
first, while the job was not told to stop and its launcher did not send it, is the root; the peers' lost
connections and the launcher's closing signals that follow are collateral.
"""

from __future__ import annotations

import signal

from test_detectors import WORLD, _exit, obs, pg

from trainscout.detectors.exits import ExitDetector
from trainscout.runner.launcher_log import launcher_interrupted, signalled_pids, worker_exits

LOST = "RuntimeError: Connection closed by peer"


def _term_on_2(rank3_how: str = "signal"):
    """Rank 2 ended by SIGTERM; ranks 0 and 1 lost their connection; rank 3 got a SIGTERM (the launcher's
    teardown, when the launcher says it sent it)."""
    ranks = {r: obs(r, [pg(45)], exit=_exit("exception", 1, msg=LOST), seen_at=100.2) for r in (0, 1)}
    ranks[2] = obs(2, [pg(45)], exit=_exit("signal", sig=signal.SIGTERM, msg="received SIGTERM"), seen_at=100.0)
    if rank3_how == "signal":
        ranks[3] = obs(3, [pg(45)], exit=_exit("signal", sig=signal.SIGTERM, msg="received SIGTERM"), seen_at=100.3)
    else:
        ranks[3] = obs(3, [pg(45)], exit=_exit("exception", 1, msg=LOST), seen_at=100.3)
    return ranks


def test_a_sigterm_sent_to_one_rank_from_outside_names_that_rank():
    det = ExitDetector(settle_s=1.0, max_wait_s=4.0)
    (f,) = det.update(101.5, _term_on_2(), {2: -15, 3: -15}, True, launcher_signalled=frozenset({3}))
    assert (f.kind, f.culprit_ranks, f.status, f.evidence["signal"]) == ("crash", [2], "attributed", "SIGTERM")
    assert "from outside the job" in f.summary, f.summary
    assert set(f.evidence["collateral"]) == {"0", "1", "3"}


def test_sigint_to_one_rank_whose_peers_only_lost_it():
    ranks = _term_on_2(rank3_how="exception")
    ranks[2] = obs(2, [pg(45)], exit=_exit("signal", sig=signal.SIGINT, msg="received SIGINT"), seen_at=100.0)
    (f,) = ExitDetector().update(105.0, ranks, {2: -2}, True)
    assert (f.culprit_ranks, f.evidence["signal"]) == ([2], "SIGINT")


def test_the_launchers_word_is_waited_for_while_it_runs():
    det = ExitDetector(settle_s=1.0, max_wait_s=4.0)
    ranks = _term_on_2(rank3_how="exception")
    assert det.update(102.0, ranks, {}, False) == []  # every rank is gone, but the launcher may still speak
    (f,) = det.update(104.1, ranks, {}, False)
    assert f.culprit_ranks == [2]


def test_a_job_told_to_stop_blames_nobody():
    (f,) = ExitDetector().update(105.0, _term_on_2(), {}, True, frozenset({3}), job_interrupted=True)
    assert (f.status, f.culprit_ranks) == ("inconclusive", [])


def test_the_launchers_own_closing_signal_blames_nobody():
    (f,) = ExitDetector().update(105.0, _term_on_2(), {}, True, launcher_signalled=frozenset({2, 3}))
    assert (f.status, f.culprit_ranks) == ("inconclusive", [])


def test_a_signal_nobody_explains_on_two_ranks_is_the_job_being_stopped():
    # pkill or scancel reaching every rank, under a launcher that does not say what it sent
    (f,) = ExitDetector().update(105.0, _term_on_2(), {}, True)
    assert (f.status, f.culprit_ranks) == ("inconclusive", [])


def test_every_rank_ended_by_the_signal_blames_nobody():
    ranks = {r: obs(r, [pg(45)], exit=_exit("signal", sig=15, msg="received SIGTERM")) for r in WORLD}
    assert ExitDetector().update(105.0, ranks, {}, True) == []


def test_a_signal_after_the_others_finished_is_not_a_crash_of_the_job():
    ranks = {r: obs(r, [pg(45)], exit=_exit("exit", 0, msg="sys.exit(0)", step=300), seen_at=100.0) for r in (0, 1, 3)}
    ranks[2] = obs(2, [pg(45)], exit=_exit("signal", sig=15, msg="received SIGTERM", step=300), seen_at=101.0)
    assert ExitDetector().update(105.0, ranks, {}, True) == []


# torchrun's own words, as it prints them (torch.distributed.elastic; module paths shortened)
TORCHRUN = """\
W1207 07:55:23.286000 22900 multiprocessing/api.py:1028] Sending process 22908 closing signal SIGTERM
W1207 07:55:23.291000 22900 multiprocessing/api.py:1028] Sending process 22911 closing signal SIGTERM
E1207 07:55:23.339000 22900 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -15) local_rank: 2
Root Cause (first observed failure):
[0]:
  time      : 2026-12-07_07:55:23
  host      : vm
  rank      : 2 (local_rank: 2)
  exitcode  : -15 (pid: 22910)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 22910
"""


def test_the_launchers_closing_signals_and_failures_are_read():
    assert signalled_pids(TORCHRUN) == {22908, 22911}
    assert worker_exits(TORCHRUN) == [(2, -15, 22910)]
    assert not launcher_interrupted(TORCHRUN)
    said = "W1207 07:56:01.000000 1 server/api.py:753] Received Signals.SIGINT death signal, shutting down workers"
    assert launcher_interrupted(said) and launcher_interrupted("Received 15 death signal, shutting down workers")


def test_a_scripts_own_timeout_or_connection_error_is_its_own_failure():
    # the words of a lost peer, in an exception the script's data service raised: not torch's, so not collateral
    for message in (
        "TimeoutError: timed out waiting for the data service (socket read) at train.py:95",
        "ConnectionResetError: connection reset by the feature store at train.py:97",
        "RuntimeError: DataLoader timed out after 60 seconds at /venv/torch/utils/data/dataloader.py:1288",
    ):
        ranks = {r: obs(r, [pg(45)], exit=_exit("exception", 1, msg=LOST), seen_at=100.3) for r in WORLD}
        ranks[2] = obs(2, [pg(45)], exit=_exit("exception", 1, msg=message), seen_at=100.0)
        (f,) = ExitDetector().update(105.0, ranks, {}, True)
        assert (f.culprit_ranks, f.status) == ([2], "attributed"), message


def test_torchs_own_errors_of_a_lost_peer_stay_collateral():
    ranks = {r: obs(r, [pg(45)], exit=_exit("vanished"), seen_at=100.0) for r in WORLD}
    for r, message in ((0, "DistBackendError: NCCL error: remote process exited"), (1, LOST), (3, LOST)):
        ranks[r] = obs(r, [pg(45)], exit=_exit("exception", 1, msg=message), seen_at=100.4)
    (f,) = ExitDetector().update(105.0, ranks, {2: -9}, True)
    assert f.culprit_ranks == [2] and set(f.evidence["collateral"]) == {"0", "1", "3"}
