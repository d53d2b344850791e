"""Where a slow rank's extra time goes: its sampled stacks against its peers' (detectors/where_time_goes.py)."""

from __future__ import annotations

from trainscout.detectors.where_time_goes import parse_collapsed, where_time_goes

PEER = """\
thread (7): MainThread;<module> (train.py:10);train (train.py:50);forward (model.py:30);matmul (model.py:31) 110
thread (7): MainThread;<module> (train.py:10);train (train.py:50);backward (train.py:52) 90
thread (9): Thread-1;run (probe.py:1) 200"""


def test_the_function_holding_the_extra_time_is_named_not_its_callers():
    slow = (
        PEER.replace(" 110", " 100").replace(" 90", " 80")
        + "\nthread (3): MainThread;<module> (train.py:10);train (train.py:50);forward (model.py:30)"
        ";hook (inject.py:77);sleep_briefly (inject.py:80) 20"
    )
    where = where_time_goes(slow, [PEER, PEER])
    assert where is not None and where.frame == "sleep_briefly (inject.py:80)"
    assert 0.09 < where.share < 0.11 and where.peer_share == 0.0
    assert "hook (inject.py:77)" in where.line() and "10% of its sampled time" in where.line()


def test_the_same_profile_as_its_peers_names_nothing():
    assert where_time_goes(PEER, [PEER]) is None


def test_only_the_main_thread_is_read_and_no_samples_name_nothing():
    stacks, total = parse_collapsed(PEER)
    assert total == 200 and all("run (probe.py:1)" not in s for s in stacks)
    assert where_time_goes("", [PEER]) is None and where_time_goes(PEER, []) is None


def test_time_in_collectives_is_never_the_excess():
    slow = (
        PEER + "\nthread (3): MainThread;<module> (train.py:10);train (train.py:50);all_reduce (torch/distributed/"
        "distributed_c10d.py:3252) 80"
    )
    assert where_time_goes(slow, [PEER]) is None
