"""Detectors on plain data: hang, desync, exits, replicated state, non-finite origin, replay."""

from __future__ import annotations

import msgspec

from trainscout.detectors.desync import DesyncDetector
from trainscout.detectors.exits import ExitDetector
from trainscout.detectors.interface import MAX_BACKLOG_S, JobView
from trainscout.detectors.nonfinite import NonFiniteDetector
from trainscout.detectors.observations import RankObs
from trainscout.detectors.progress import OWN_CODE, HangDetector
from trainscout.detectors.replay import ReplayDetector
from trainscout.detectors import state as state_module
from trainscout.detectors.state import ReplicaStateDetector, verified_step
from trainscout.markers import BUSY_ACTIVE, BUSY_CHECKPOINT, BUSY_COMPILE, BUSY_IDLE, BUSY_WHAT, PROBE_GROUP_ROLE
from trainscout.probe import protocol
from trainscout.wire.messages import (
    CollectiveRecord,
    NonFiniteEvent,
    NodeDigest,
    PgState,
    RankExit,
    RankState,
    ReplayRecord,
    StateRecord,
    StepRecord,
)

WORLD = [0, 1, 2, 3]


def record(seq: int, desc: str = "all_reduce Float[4]", op: str = "all_reduce", rolling: int = 0) -> CollectiveRecord:
    sig = (desc,)
    return CollectiveRecord(
        seq=seq, op=op, desc=desc, entry_hash=protocol.entry_hash(sig), rolling_hash=rolling, wall_ns=0, step=0
    )


def native(seq: int, desc: str = "") -> CollectiveRecord:
    """A collective issued outside Python: a placeholder (desc "") or as the Flight Recorder described it."""
    return CollectiveRecord(
        seq=seq,
        op="all_reduce" if desc else "",
        desc=desc,
        entry_hash=protocol.entry_hash((desc,)) if desc else 0,
        rolling_hash=0,
        wall_ns=0,
        step=0,
        native=True,
    )


def chain(records: list[CollectiveRecord]) -> list[CollectiveRecord]:
    h = 0
    for r in records:
        h = protocol.chain(h, protocol.NATIVE_HASH if r.native else r.entry_hash)
        r.rolling_hash = h
    return records


def pg(seq: int, records=None, name: str = "0", members=WORLD, age: float = 0.0) -> PgState:
    records = chain(records if records is not None else [record(s) for s in range(1, seq + 1)])
    chained = [r for r in records if r.rolling_hash]
    return PgState(
        name=name,
        desc="default_pg",
        members=list(members),
        seq=seq,
        rolling_hash=chained[-1].rolling_hash if chained else 0,
        anchors=[],
        recent=records[-4:],
        seq_age_s=age,
        chained_seq=chained[-1].seq if chained else 0,
    )


def obs(rank: int, pgs, *, progress_age=0.0, heartbeat_age=0.0, step=10, exit=None, seen_at=100.0, **extra) -> RankObs:
    st = RankState(
        rank=rank,
        local_rank=rank,
        world_size=4,
        pid=1000 + rank,
        alive=exit is None,
        step=step,
        heartbeat_age_s=heartbeat_age,
        progress_age_s=progress_age,
        collectives=0,
        pgs=pgs,
        exit=exit,
        **extra,
    )
    return RankObs(state=st, host="h", seen_at=seen_at)


# ---- hang ---------------------------------------------------------------------------------------------


def test_hang_names_the_rank_that_never_entered_the_collective():
    ranks = {r: obs(r, [pg(45 if r != 2 else 44)], progress_age=6.0) for r in WORLD}
    suspects = HangDetector(hang_timeout_s=5.0).update(100.0, ranks)
    assert len(suspects) == 1
    f = suspects[0].finding
    assert (f.kind, f.culprit_ranks, f.pg, f.collective_seq, f.status) == ("hang", [2], "0", 45, "attributed")
    assert suspects[0].stack_ranks == [2]


def test_trainscout_s_own_group_is_no_evidence_of_a_hang():
    # ranks 0, 1, 3 wait in a replay's broadcast on trainscout's side group; rank 2, whose node never got the
    # replay's command, waits ahead of them in the job's next all-reduce: the job is stalled by the tool, and
    # rank 2 is no culprit
    def side(seq: int) -> PgState:
        return msgspec.structs.replace(pg(seq, name="1"), role=PROBE_GROUP_ROLE)

    ranks = {r: obs(r, [pg(45 if r == 2 else 44), side(7 if r != 2 else 6)], progress_age=6.0) for r in WORLD}
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, ranks)
    assert (s.finding.status, s.finding.culprit_ranks) == ("inconclusive", [])
    assert s.finding.pg == "0"


def test_no_hang_before_timeout_and_none_for_a_job_wide_pause():
    behind = {r: obs(r, [pg(45 if r != 2 else 44)], progress_age=3.0) for r in WORLD}
    assert HangDetector(hang_timeout_s=5.0).update(100.0, behind) == []
    paused = {r: obs(r, [pg(45)], progress_age=60.0) for r in WORLD}
    assert HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, paused) == []


def test_stall_after_stall_timeout_blames_nobody():
    paused = {r: obs(r, [pg(45)], progress_age=301.0) for r in WORLD}
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, paused)
    assert (s.finding.kind, s.finding.culprit_ranks, s.finding.status) == ("stall", [], "inconclusive")


def test_a_job_quiet_before_its_first_step_is_starting_up_for_longer_before_a_stall():
    # every rank loading a model or a dataset before the first step: not a stall at the stall timeout ...
    starting = {r: obs(r, [pg(2)], progress_age=400.0, step=0) for r in WORLD}
    assert HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, starting) == []
    # ... but at three times it, still blaming nobody
    stuck = {r: obs(r, [pg(2)], progress_age=901.0, step=0) for r in WORLD}
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, stuck)
    assert (s.finding.kind, s.finding.culprit_ranks) == ("stall", [])
    # one rank behind its peers at start-up is voted on as ever
    behind = {r: obs(r, [pg(2 if r != 1 else 1)], progress_age=6.0, step=0) for r in WORLD}
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, behind)
    assert (s.finding.kind, s.finding.culprit_ranks) == ("hang", [1])


def test_starved_probe_thread_is_reported_as_gil_or_frozen():
    ranks = {
        r: obs(r, [pg(45 if r != 3 else 40)], progress_age=6.0, heartbeat_age=6.0 if r == 3 else 0.1) for r in WORLD
    }
    (s,) = HangDetector().update(100.0, ranks)
    assert s.finding.culprit_ranks == [3] and s.finding.evidence["starved_ranks"] == [3]


def test_a_job_stopped_whole_is_not_a_hang_of_the_ranks_caught_in_their_compute():
    # every rank's probe thread silent as long as its training: the processes were stopped (SIGSTOP, a suspended
    # job), rank 2 inside its compute, the others inside the collective it had not entered yet
    ranks = {r: obs(r, [pg(45 if r != 2 else 44)], progress_age=60.0, heartbeat_age=60.0) for r in WORLD}
    assert HangDetector(hang_timeout_s=5.0).update(100.0, ranks) == []
    # half of them silent is no majority: rank 2 hangs, and its starved probe thread is evidence of it
    ranks = {
        r: obs(r, [pg(45 if r != 2 else 44)], progress_age=6.0, heartbeat_age=6.0 if r in (2, 3) else 0.1)
        for r in WORLD
    }
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, ranks)
    assert s.finding.culprit_ranks == [2] and s.finding.evidence["starved_ranks"] == [2]


def test_two_ranks_can_detect_but_not_attribute_a_hang():
    ranks = {r: obs(r, [pg(45 if r == 0 else 44, members=[0, 1])], progress_age=6.0) for r in (0, 1)}
    (s,) = HangDetector().update(100.0, ranks)
    assert s.finding.status == "inconclusive" and s.finding.culprit_ranks == []


def test_rank_waiting_on_another_group_is_a_process_group_desync():
    def pgs(r):
        return [pg(45 if r != 2 else 44), pg(1 if r == 2 else 0, name="1", records=[record(1)] if r == 2 else [])]

    ranks = {r: obs(r, pgs(r), progress_age=6.0) for r in WORLD}
    (s,) = HangDetector().update(100.0, ranks)
    assert (s.finding.kind, s.finding.culprit_ranks) == ("desync", [2])
    assert s.finding.evidence["culprit_group"] == {"pg": "1", "seq": 1}


def test_hang_names_the_root_not_the_ranks_that_wait_for_it_in_another_group():
    """TP 2 x DP 3: rank 1 stops; its TP peer 0 waits in their TP all-reduce and so never reaches the DP
    all-reduce where ranks 2 and 4 wait for it. Rank 0 is behind in its DP group only because it waits in TP."""
    tp = {0: "t0", 1: "t0", 2: "t1", 3: "t1", 4: "t2", 5: "t2"}
    dp = {0: "d0", 2: "d0", 4: "d0", 1: "d1", 3: "d1", 5: "d1"}
    tp_seq = {0: 9, 1: 8, 2: 12, 3: 12, 4: 12, 5: 12}  # 4 TP all-reduces a step; 0 entered #9, 1 never did
    dp_seq = {0: 2, 1: 2, 2: 3, 3: 3, 4: 3, 5: 3}  # 1 a step; 2..5 entered #3
    tp_members = {"t0": [0, 1], "t1": [2, 3], "t2": [4, 5]}
    dp_members = {"d0": [0, 2, 4], "d1": [1, 3, 5]}
    ranks = {
        r: obs(
            r,
            [
                pg(tp_seq[r], name=tp[r], members=tp_members[tp[r]]),
                pg(dp_seq[r], name=dp[r], members=dp_members[dp[r]]),
            ],
            progress_age=6.0,
        )
        for r in range(6)
    }
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, ranks)
    f = s.finding
    assert (f.kind, f.culprit_ranks, f.pg, f.collective_seq, f.status) == ("hang", [1], "d1", 3, "attributed")
    assert s.stack_ranks == [1]


def _tp2_dp3(exit_of_1=None, tp_seq_1=8) -> dict[int, RankObs]:
    """TP 2 x DP 3 stopped where rank 1 stopped: its TP peer 0 waits in their TP all-reduce #9 (so never reaches
    DP all-reduce #3), ranks 2..5 went on to DP all-reduce #3 and wait there."""
    tp = {0: "t0", 1: "t0", 2: "t1", 3: "t1", 4: "t2", 5: "t2"}
    dp = {0: "d0", 2: "d0", 4: "d0", 1: "d1", 3: "d1", 5: "d1"}
    tp_seq = {0: 9, 1: tp_seq_1, 2: 12, 3: 12, 4: 12, 5: 12}
    dp_seq = {0: 2, 1: 2, 2: 3, 3: 3, 4: 3, 5: 3}
    members = {"t0": [0, 1], "t1": [2, 3], "t2": [4, 5], "d0": [0, 2, 4], "d1": [1, 3, 5]}
    return {
        r: obs(
            r,
            [pg(tp_seq[r], name=tp[r], members=members[tp[r]]), pg(dp_seq[r], name=dp[r], members=members[dp[r]])],
            progress_age=6.0,
            exit=exit_of_1 if r == 1 else None,
        )
        for r in range(6)
    }


def test_no_hang_blamed_on_the_peers_of_a_rank_that_exited():
    """Rank 1 crashed where the hang above stopped: its TP peer 0 is behind in DP group d0 and waits on nobody
    alive, but on rank 1, which has exited. The crash is the cause (the exit detector names it), not rank 0."""
    crashed = RankExit(how="exception", code=1, signal=None, message="RuntimeError: boom", step=2, age_s=3.0)
    assert HangDetector(hang_timeout_s=5.0).update(100.0, _tp2_dp3(crashed)) == []
    # the same picture with rank 1 alive and stuck is still its hang
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, _tp2_dp3())
    assert (s.finding.kind, s.finding.culprit_ranks) == ("hang", [1])
    # a rank that exited after entering the collective its peer waits in explains nothing: rank 0 is named
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, _tp2_dp3(crashed, tp_seq_1=9))
    assert s.finding.culprit_ranks == [0]


def test_hang_vote_waits_for_a_rank_saving_compiling_or_evaluating_alone():
    """Rank 2 is behind its peers' barrier doing work of its own (a checkpoint write, a compilation, forwards
    of an evaluation): no hang until the save or compilation outlasts the stall timeout, or the forwards stop."""
    detector = HangDetector(hang_timeout_s=5.0, stall_timeout_s=60.0)

    def job(busy: int, busy_age: float):
        return {
            r: obs(
                r,
                [pg(45 if r != 2 else 44)],
                progress_age=8.0,
                **({"busy": busy, "busy_age_s": busy_age} if r == 2 else {}),
            )
            for r in WORLD
        }

    for busy, age in ((BUSY_CHECKPOINT, 9.0), (BUSY_COMPILE, 59.0), (BUSY_ACTIVE, 0.1)):
        assert detector.update(100.0, job(busy, age)) == [], (busy, age)
        assert detector.waiting_on_work == {2: BUSY_WHAT[busy]}
    seen = job(BUSY_CHECKPOINT, 9.0)
    fresh = HangDetector(hang_timeout_s=5.0, stall_timeout_s=60.0)
    judged = fresh.judge(JobView(now=100.0, ranks=seen, seen=seen, live=set(WORLD), members={}, classes={}))
    assert fresh.judge(JobView(now=101.0, ranks=seen, seen=seen, live=set(WORLD), members={}, classes={})).events == []
    assert judged.asks == [] and judged.events == [
        ("hang_vote_waits", {"ranks": [2], "doing": [BUSY_WHAT[BUSY_CHECKPOINT]]})
    ]
    # a save past the stall timeout, and a rank whose last forward began before its peers stopped, are hangs
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=60.0).update(100.0, job(BUSY_CHECKPOINT, 61.0))
    assert (s.finding.culprit_ranks, s.finding.evidence["inside"]) == ([2], {"2": "writing a checkpoint for 61 s"})
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=60.0).update(100.0, job(BUSY_ACTIVE, 8.5))
    assert s.finding.culprit_ranks == [2] and "inside" not in s.finding.evidence
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, job(BUSY_IDLE, 0.0))
    assert s.finding.culprit_ranks == [2]


def test_hang_vote_waits_for_a_rank_running_code_of_its_own_while_its_stack_keeps_changing():
    """Rank 2 prepares the data alone (no forward, save or compilation: plain Python): no hang while its training
    thread's stack keeps changing, until it has issued no collective for the stall timeout."""

    def job(moving_age: float, progress_age: float = 8.0):
        return {
            r: obs(
                r,
                [pg(45 if r != 2 else 44)],
                progress_age=progress_age,
                **({"moving_age_s": moving_age} if r == 2 else {}),
            )
            for r in WORLD
        }

    detector = HangDetector(hang_timeout_s=5.0, stall_timeout_s=60.0)
    assert detector.update(100.0, job(0.4)) == []
    assert detector.waiting_on_work == {2: OWN_CODE}
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=60.0).update(100.0, job(5.5))  # it stopped moving
    assert s.finding.culprit_ranks == [2] and "inside" not in s.finding.evidence
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=60.0).update(100.0, job(0.4, progress_age=61.0))
    assert (s.finding.culprit_ranks, s.finding.evidence["inside"]) == ([2], {"2": f"{OWN_CODE} for 61 s"})


def test_hang_vote_is_on_the_furthest_collective_a_strict_majority_entered():
    """DDP broadcasts buffers from rank 0 before each forward: with rank 2 stopped after its step, rank 0 waits
    in the broadcast (#126), ranks 1 and 3 got their copy and wait in the gradient all-reduce (#127)."""

    def job(seqs: dict[int, int]):
        members = sorted(seqs)
        return {r: obs(r, [pg(s, members=members)], progress_age=6.0) for r, s in seqs.items()}

    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, job({0: 126, 1: 127, 2: 125, 3: 127}))
    f = s.finding
    assert (f.kind, f.culprit_ranks, f.collective_seq, f.status) == ("hang", [2], 126, "attributed")
    assert sorted(f.evidence["waiting_ranks"]) == [0, 1, 3]
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, job({0: 5, 1: 4, 2: 3}))
    assert (s.finding.culprit_ranks, s.finding.collective_seq) == ([2], 4)
    # two against two: no majority entered anything the others did not
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, job({0: 127, 1: 127, 2: 125, 3: 125}))
    assert (s.finding.status, s.finding.culprit_ranks) == ("inconclusive", [])


def test_no_inconclusive_hang_while_a_majority_compiles_behind_one_rank():
    """Three ranks still compile their first step; the fourth already waits in the first gradient bucket."""
    ranks = {
        r: obs(
            r,
            [pg(4 if r == 1 else 3)],
            progress_age=6.0,
            **({} if r == 1 else {"busy": BUSY_COMPILE, "busy_age_s": 20.0}),
        )
        for r in WORLD
    }
    assert HangDetector(hang_timeout_s=5.0).update(100.0, ranks) == []
    ranks[3] = obs(3, [pg(3)], progress_age=6.0)  # one of them is not compiling: no exception
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, ranks)
    assert (s.finding.kind, s.finding.status) == ("hang", "inconclusive")


# ---- desync -------------------------------------------------------------------------------------------


def _stream(odd: bool):
    recs = [record(s) for s in range(1, 45)]
    recs.append(record(45, "all_reduce Float[4] op=MAX" if odd else "all_reduce Float[4] op=SUM"))
    return recs


def test_desync_names_the_minority_signature_at_the_first_deviating_seq():
    ranks = {r: obs(r, [pg(45, _stream(r == 1))]) for r in WORLD}
    findings, fetches = DesyncDetector().update(ranks)
    assert fetches == []
    (f,) = findings
    assert (f.kind, f.culprit_ranks, f.collective_seq, f.evidence["differs_in"]) == ("desync", [1], 45, "reduce op")


def test_desync_with_two_members_is_inconclusive():
    ranks = {r: obs(r, [pg(45, _stream(r == 1), members=[0, 1])]) for r in (0, 1)}
    (f,), _ = DesyncDetector().update(ranks)
    assert f.status == "inconclusive" and f.culprit_ranks == []


def test_a_pass_checks_groups_up_to_its_budget_and_the_next_resumes_there():
    names = ["a", "b", "c"]
    ranks = {r: obs(r, [pg(45, _stream(r == 1 and n == "c"), name=n) for n in names]) for r in WORLD}
    budgeted = DesyncDetector(visits_per_pass=4)  # one group of 4 members a pass
    assert [budgeted.update(ranks)[0] for _ in range(2)] == [[], []]
    (f,), _ = budgeted.update(ranks)
    assert (f.pg, f.culprit_ranks, f.collective_seq) == ("c", [1], 45)
    (f,), _ = DesyncDetector().update(ranks)  # the default budget covers small jobs whole every pass
    assert (f.pg, f.culprit_ranks) == ("c", [1])


def test_agreeing_streams_give_nothing():
    ranks = {r: obs(r, [pg(45, _stream(False))]) for r in WORLD}
    assert DesyncDetector().update(ranks) == ([], [])


def _unchained_tail(odd: bool) -> list[CollectiveRecord]:
    """Chained up to 31, then DDP's native bucket collectives never described (the rank died before its Flight
    Recorder was read) between Python ones: the rolling hash cannot pass 31, the records beyond it are at hand."""
    head = chain([record(s) for s in range(1, 32)])
    tail = [native(32), record(33), native(34)]
    tail.append(record(35, "all_reduce Double[] op=SUM" if odd else "all_reduce Float[] op=SUM"))
    return head + tail


def _pg_with(records: list[CollectiveRecord]) -> PgState:
    state = pg(35, records)
    state.recent = records[-6:]
    state.rolling_hash, state.chained_seq = records[30].rolling_hash, 31
    return state


def test_a_mismatch_beyond_the_chained_seq_is_named_once_a_member_has_exited():
    # a collective of another dtype aborts a gloo peer at once: the records that say so are never chained
    alive = {r: obs(r, [_pg_with(_unchained_tail(r == 2))]) for r in WORLD}
    assert DesyncDetector().update(alive) == ([], [])  # running ranks: the chain catches up first
    ended = {r: obs(r, [_pg_with(_unchained_tail(r == 2))], exit=_exit("vanished") if r == 1 else None) for r in WORLD}
    det = DesyncDetector()
    (f,), fetches = det.update(ended)
    assert fetches == []
    assert (f.kind, f.culprit_ranks, f.collective_seq, f.evidence["differs_in"]) == ("desync", [2], 35, "dtype")


def test_a_group_learnt_between_refreshes_is_checked_at_once():
    det = DesyncDetector()
    unknown = {r: obs(r, [pg(45, _stream(r == 1), members=[])]) for r in WORLD}  # members not learnt yet
    assert det.update(unknown, groups_known=0) == ([], [])
    known = {r: obs(r, [pg(45, _stream(r == 1))]) for r in WORLD}
    assert det.update(known, groups_known=0) == ([], [])  # same count: groups are re-read only every 10 passes
    (f,), _ = det.update(known, groups_known=1)
    assert (f.kind, f.culprit_ranks, f.collective_seq) == ("desync", [1], 45)


def _mixed(rank: int, described: dict[int, str], odd_python: int | None = None):
    """Streams of a Python all_reduce and a native (DDP-like) one in turn; `described`: rank -> the native
    collective 45's description on that rank (others still hold a placeholder)."""
    recs = []
    for s in range(1, 45):
        recs.append(record(s) if s % 2 else native(s, "all_reduce Float[68]" if rank != 3 else ""))
    if odd_python == rank:
        recs.append(record(45, "all_reduce Float[] op=SUM"))
    else:
        recs.append(native(45, described.get(rank, "")))
    return recs


def test_native_collectives_described_on_some_ranks_only_agree():
    ranks = {r: obs(r, [pg(45, _mixed(r, {0: "all_reduce Float[68]", 2: "all_reduce Float[68]"}))]) for r in WORLD}
    assert DesyncDetector().update(ranks) == ([], [])


def test_native_collectives_described_differently_name_the_minority_of_those_described():
    desc = {0: "all_reduce Float[68]", 1: "all_reduce Float[68]", 2: "all_reduce Float[72]"}
    ranks = {r: obs(r, [pg(45, _mixed(r, desc))]) for r in WORLD}
    (f,), fetches = DesyncDetector().update(ranks)
    assert fetches == []
    assert (f.kind, f.status, f.culprit_ranks, f.collective_seq, f.evidence["differs_in"]) == (
        "desync",
        "attributed",
        [2],
        45,
        "shape",
    )


def test_a_python_collective_where_peers_issued_a_native_one_is_named():
    ranks = {r: obs(r, [pg(45, _mixed(r, {}, odd_python=1))]) for r in WORLD}
    (f,), _ = DesyncDetector().update(ranks)
    assert (f.culprit_ranks, f.collective_seq, f.evidence["differs_in"]) == ([1], 45, "origin")
    assert "outside Python" in f.summary


def test_old_deviation_outside_the_window_is_pulled_then_named():
    def stream(odd):
        recs = [record(s, "all_reduce Float[8]" if (odd and s == 10) else "all_reduce Float[4]") for s in range(1, 46)]
        return recs

    ranks = {r: obs(r, [pg(45, stream(r == 3))]) for r in WORLD}
    det = DesyncDetector()
    findings, (req,) = det.update(ranks)
    assert findings == [] and (req.pg, req.seq_from, req.seq_to) == ("0", 1, 45)
    pulled = {r: chain(stream(r == 3)) for r in WORLD}
    f = det.resolve(req, pulled)
    assert (f.culprit_ranks, f.collective_seq, f.evidence["differs_in"]) == ([3], 10, "shape")


def test_a_pull_that_comes_back_without_the_deviation_is_retried():
    """An agent busy elsewhere (capturing stacks) answers a pull too late: the deadline resolves it with a
    rank's records missing. The group must stay checked, not be given up for the rest of the run."""

    def stream(odd):
        return [record(s, "all_reduce Float[8]" if (odd and s == 10) else "all_reduce Float[4]") for s in range(1, 46)]

    ranks = {r: obs(r, [pg(45, stream(r == 3))]) for r in WORLD}
    det = DesyncDetector()
    _, (req,) = det.update(ranks)
    assert det.resolve(req, {r: chain(stream(r == 3)) for r in (0, 1, 2)}) is None  # rank 3 did not answer
    findings, (again,) = det.update(ranks)
    assert findings == [] and (again.seq_from, again.seq_to) == (1, 45)
    f = det.resolve(again, {r: chain(stream(r == 3)) for r in WORLD})
    assert (f.culprit_ranks, f.collective_seq) == ([3], 10)
    assert det.update(ranks) == ([], [])  # reported once


def test_pulls_that_never_find_the_deviation_stop():
    def stream(odd):
        return [record(s, "all_reduce Float[8]" if (odd and s == 10) else "all_reduce Float[4]") for s in range(1, 46)]

    ranks = {r: obs(r, [pg(45, stream(r == 3))]) for r in WORLD}
    det = DesyncDetector()
    pulls = 0
    while True:
        _, fetches = det.update(ranks)
        if not fetches:
            break
        pulls += 1
        assert det.resolve(fetches[0], {}) is None
    assert pulls == 3


# ---- exits --------------------------------------------------------------------------------------------


def _exit(how, code=None, sig=None, msg="", step=20, age=0.0):
    return RankExit(how=how, code=code, signal=sig, message=msg, step=step, age_s=age)


def test_first_own_crash_is_blamed_and_peers_are_collateral():
    ranks = {
        0: obs(0, [pg(45)], exit=_exit("exception", 1, msg="RuntimeError: Connection closed by peer"), seen_at=101.0),
        1: obs(1, [pg(45)], exit=_exit("vanished"), seen_at=100.5),
        2: obs(2, [pg(45)], exit=_exit("signal", sig=15, msg="received SIGTERM"), seen_at=101.0),
        3: obs(3, [pg(45)], exit=_exit("signal", sig=15, msg="received SIGTERM"), seen_at=101.0),
    }
    (f,) = ExitDetector().update(103.0, ranks, {1: -9}, launcher_done=True)
    assert (f.kind, f.culprit_ranks, f.evidence["signal"]) == ("crash", [1], "SIGKILL")
    assert set(f.evidence["collateral"]) == {"0", "2", "3"}


def test_clean_end_of_training_gives_no_finding():
    ranks = {r: obs(r, [pg(45)], step=100, exit=_exit("exit", 0, step=100), seen_at=100.0 + r * 0.1) for r in WORLD}
    assert ExitDetector().update(110.0, ranks, {}, launcher_done=True) == []


def test_clean_exit_while_peers_issue_more_collectives_and_fail_is_early_exit():
    ranks = {
        r: obs(r, [pg(46)], exit=_exit("exception", 1, msg="RuntimeError: Connection closed by peer"), seen_at=101.0)
        for r in (0, 1, 3)
    }
    ranks[2] = obs(2, [pg(45)], exit=_exit("exit", 0), seen_at=100.0)
    (f,) = ExitDetector().update(103.0, ranks, {}, launcher_done=True)
    assert (f.kind, f.culprit_ranks) == ("early_exit", [2])


def test_a_rank_out_of_data_that_shadows_its_peers_to_the_end_did_not_exit_early():
    """DDP with uneven inputs (the Join context manager): rank 2 ran out of batches at step 140 and shadowed its
    peers' collectives until they finished at step 200; then all left, rank 2 a moment first."""
    ranks = {r: obs(r, [pg(900)], step=200, exit=_exit("exit", 0, step=200), seen_at=100.05 + r * 0.01) for r in WORLD}
    ranks[2] = obs(2, [pg(900)], step=140, exit=_exit("exit", 0, step=140), seen_at=100.0)
    assert ExitDetector().update(110.0, ranks, {}, launcher_done=True) == []


def test_a_clean_exit_whose_peers_step_on_without_it_is_early_exit():
    """Rank 2 left after step 20 and its peers, sharing no collective with it, went on."""
    det = ExitDetector()
    gone = obs(2, [pg(45)], step=20, exit=_exit("exit", 0, step=20), seen_at=100.0)
    found = {}
    for now, step in ((99.0, 21), (100.0, 21), (101.0, 22)):  # the first: a state from before the exit
        ranks = {r: obs(r, [pg(45 + step)], step=step, seen_at=now) for r in (0, 1, 3)}
        found[now] = det.update(now, {**ranks, 2: gone}, {}, launcher_done=False)
    assert found[99.0] == found[100.0] == []  # ahead of it, but not seen to step on after it left
    (f,) = found[101.0]
    assert (f.kind, f.culprit_ranks, f.step) == ("early_exit", [2], 20)
    assert "went on to step 22" in f.summary


def test_only_teardown_signals_blame_nobody():
    ranks = {r: obs(r, [pg(45)], exit=_exit("signal", sig=2, msg="received SIGINT")) for r in WORLD}
    assert ExitDetector().update(105.0, ranks, {}, launcher_done=True) == []


# ---- replicated state, non-finite, replay ----------------------------------------------------------------


def test_replicated_state_names_the_corrupted_replica_once():
    det = ReplicaStateDetector()
    for step in (30, 31):
        for r in WORLD:
            det.add(r, "0", [StateRecord(step=step, tensor="w", start=0, end=64, digest=7 if r != 2 else 9)], 0.0)
    findings = det.update(1.0, {"0": WORLD}, set(WORLD))
    assert len(findings) == 1
    f = findings[0]
    assert (f.kind, f.culprit_ranks, f.step, f.evidence["tensor"]) == ("sdc", [2], 30, "w")
    assert det.step_clean == {30: False, 31: False}


def test_replicated_state_waits_for_all_replicas_then_times_out():
    det = ReplicaStateDetector(wait_s=5.0)
    for r in (0, 1, 3):
        det.add(r, "0", [StateRecord(step=5, tensor="w", start=0, end=64, digest=7)], 0.0)
    assert det.update(1.0, {"0": WORLD}, set(WORLD)) == [] and det.compared == 0
    assert det.update(6.0, {"0": WORLD}, set(WORLD)) == [] and det.compared == 1


def test_two_of_four_replicas_that_differ_name_nobody_and_leave_the_step_unclean():
    """Replicas hash on strides of their own: a step hashed by two of four only, one of them corrupted, gave
    "corruption detected, culprit unknown" beside the finding that had named the corrupted rank."""
    det = ReplicaStateDetector(wait_s=5.0)
    for r, digest in ((0, 9), (1, 7)):
        det.add(r, "0", [StateRecord(step=119, tensor="w", start=0, end=64, digest=digest)], 0.0)
    assert det.update(6.0, {"0": WORLD}, set(WORLD)) == [] and det.step_clean == {119: False}
    for r, digest in ((0, 9), (1, 7), (2, 7), (3, 9)):  # the whole class, two against two: no majority, said
        det.add(r, "0", [StateRecord(step=120, tensor="w", start=0, end=64, digest=digest)], 7.0)
    (f,) = det.update(8.0, {"0": WORLD}, set(WORLD))
    assert (f.status, f.culprit_ranks, f.step) == ("inconclusive", [], 120)


def test_a_named_replica_against_the_one_peer_left_at_the_jobs_end_is_no_new_finding():
    """Rank 1 named; at the job's end ranks 0 and 2 have exited and rank 1's last hash is compared with rank 3's
    alone: "corruption detected, culprit unknown" followed the finding that had named it."""
    det = ReplicaStateDetector(wait_s=5.0)
    for r in WORLD:
        det.add(r, "0", [StateRecord(step=31, tensor="w", start=0, end=64, digest=9 if r == 1 else 7)], 0.0)
    (f,) = det.update(1.0, {"0": WORLD}, set(WORLD))
    assert f.culprit_ranks == [1]
    for r, digest in ((1, 5), (3, 6)):
        det.add(r, "0", [StateRecord(step=77, tensor="w", start=0, end=64, digest=digest)], 2.0)
    assert det.update(3.0, {"0": WORLD}, {1, 3}) == [] and det.step_clean[77] is False


def test_a_backlog_of_frames_is_no_missing_evidence():
    # three replicas reported at t=0; the fourth's report (the odd one) waits in the coordinator's queue, which
    # last ran empty at t=0.5: at t=8 the wait has not run out on the evidence clock, and the vote waits for it
    det = ReplicaStateDetector(wait_s=5.0)
    for r in (0, 1, 3):
        det.add(r, "0", [StateRecord(step=5, tensor="w", start=0, end=64, digest=7)], 0.0)
    members = {"0": WORLD}
    behind = JobView(now=8.0, ranks={}, seen={}, live=set(WORLD), members=members, classes={}, caught_up=0.5)
    assert behind.waited_until == 0.5
    assert det.judge(behind).findings == [] and det.compared == 0
    det.add(2, "0", [StateRecord(step=5, tensor="w", start=0, end=64, digest=9)], 8.5)
    caught_up = JobView(now=9.0, ranks={}, seen={}, live=set(WORLD), members=members, classes={}, caught_up=9.0)
    (f,) = det.judge(caught_up).findings
    assert (f.kind, f.culprit_ranks, det.compared) == ("sdc", [2], 1)
    # a coordinator that never catches up still judges, MAX_BACKLOG_S behind
    stuck = JobView(now=100.0, ranks={}, seen={}, live=set(), members={}, classes={}, caught_up=0.5)
    assert stuck.waited_until == 100.0 - MAX_BACKLOG_S


def test_verified_step_needs_a_whole_clean_rotation():
    assert verified_step({1: True, 2: True, 3: True, 4: False, 5: True, 6: True}, 3) == 3
    assert verified_step({1: True, 3: True, 4: True}, 2) == 4
    assert verified_step({}, 2) == -1


def test_replicated_state_history_is_bounded_and_only_ever_claims_less(monkeypatch):
    # a long job compares a range every few steps: the kept outcomes stop at HISTORY_STEPS, and a dirty
    # step forgotten leaves only steps after it, so what is verified never grows by forgetting
    monkeypatch.setattr(state_module, "HISTORY_STEPS", 40)
    det = ReplicaStateDetector()
    for step in range(1, 201):
        for r in WORLD:
            digest = 9 if (r == 2 and step == 100) else 7
            det.add(r, "0", [StateRecord(step=step, tensor="w", start=0, end=64, digest=digest)], 0.0)
        det.update(float(step), {"0": WORLD}, set(WORLD))
        assert len(det.step_clean) <= 50
        if step == 105:  # the dirty step is kept: the state is verified as of the step before it, not after
            assert det.outliers_at == {100: {2}} and verified_step(det.step_clean, 8) == 99
    assert min(det.step_clean) > 200 - 50 and 100 not in det.outliers_at
    assert verified_step(det.step_clean, 8) == 200
    assert verified_step(det.step_clean, 64) == -1  # a rotation longer than the history is never verified


def test_nonfinite_origin_is_the_early_minority():
    ranks = {r: obs(r, [pg(1)], step=31, nonfinite=[NonFiniteEvent(step=32, what="loss")]) for r in WORLD}
    ranks[2] = obs(2, [pg(1)], step=31, nonfinite=[NonFiniteEvent(step=31, what="grad blocks.0.w")])
    (f,) = NonFiniteDetector().update(0.0, ranks)
    assert (f.kind, f.culprit_ranks, f.step, f.status) == ("nonfinite", [2], 31, "attributed")


def test_nonfinite_origin_unsettled_at_the_end_of_the_job_is_decided_then():
    # a loss scaler skipping every step holds the peers at step 12: they never pass the origin's step 13
    ranks = {r: obs(r, [pg(1)], step=12) for r in WORLD}
    ranks[2] = obs(2, [pg(1)], step=12, nonfinite=[NonFiniteEvent(step=13, what="grad 0.weight")])
    det = NonFiniteDetector(wait_s=3.0)
    view = JobView(now=0.0, ranks=ranks, seen=ranks, live=set(WORLD), members={}, classes={})
    assert det.judge(view).findings == [] and det.close().findings == []  # no digest brought an event yet
    det.observe(NodeDigest(node_id="n", host="h", number=1, ranks=[o.state for o in ranks.values()]), 0.0)
    assert det.judge(view).findings == []
    (f,) = det.close().findings
    assert (f.kind, f.culprit_ranks, f.step, f.status) == ("nonfinite", [2], 13, "attributed")
    assert NonFiniteDetector().close().findings == []  # nothing reported, nothing named


def test_nonfinite_everywhere_at_once_is_inconclusive():
    ranks = {r: obs(r, [pg(1)], step=31, nonfinite=[NonFiniteEvent(step=31, what="loss")]) for r in WORLD}
    (f,) = NonFiniteDetector().update(0.0, ranks)
    assert f.status == "inconclusive" and f.culprit_ranks == []


def test_replay_deviation_then_recurrence_confirms_the_device():
    det = ReplayDetector()
    for step in (5, 25):
        for r in WORLD:
            det.add(r, [ReplayRecord(step=step, layer="blocks.1", output=1 if r != 2 else 2, grads=3)], 0.0)
    first, confirm = det.update(1.0, WORLD)
    assert (first.kind, first.culprit_ranks, first.evidence["differs_in"]) == ("sdc", [2], "outputs")
    assert (confirm.kind, confirm.culprit_ranks, confirm.evidence["deviation_steps"]) == ("health", [2], [5, 25])


def test_replays_still_waiting_when_the_job_has_ended_are_compared_at_the_final_pass():
    det = ReplayDetector()
    for r in WORLD:  # every rank's record came in the last reports; the ranks have exited: no class is live
        det.add(r, [ReplayRecord(step=16, layer="blocks.1", output=1 if r != 2 else 2, grads=3)], 99.0)
    view = JobView(now=100.0, ranks={}, seen={}, live=set(), members={}, classes={})
    assert det.judge(view).findings == [] and det.replays_compared == 0  # waiting, as while the job runs
    (f,) = det.judge(JobView(now=100.0, ranks={}, seen={}, live=set(), members={}, classes={}, final=True)).findings
    assert (f.kind, f.culprit_ranks, f.step) == ("sdc", [2], 16) and det.replays_compared == 1


def test_clean_replays_mark_layers_clean():
    det = ReplayDetector()
    for r in WORLD:
        det.add(r, [ReplayRecord(step=5, layer="head", output=1, grads=3)], 0.0)
    assert det.update(1.0, WORLD) == [] and det.clean_layers == {"head"}


def test_replay_with_different_parameters_is_state_corruption_not_a_faulty_device():
    det = ReplayDetector()
    for step in (5, 25):
        for r in WORLD:
            det.add(
                r,
                [
                    ReplayRecord(
                        step=step, layer="tokens", output=1 if r != 2 else 2, grads=3, params=10 if r != 2 else 11
                    )
                ],
                0.0,
            )
    findings = det.update(1.0, WORLD)
    assert [(f.kind, f.culprit_ranks, f.evidence["differs_in"]) for f in findings] == [
        ("sdc", [2], "parameters"),
        ("sdc", [2], "parameters"),
    ]


# ---- stragglers -------------------------------------------------------------------------------------------


def _steps(det, first, last, cpu_of, data_of=lambda r, s: 0.001):
    import random

    rng = random.Random(0)
    for step in range(first, last + 1):
        for r in WORLD:
            noise = 1 + rng.uniform(-0.03, 0.03)
            det.add(
                r,
                [StepRecord(step=step, wall_s=0.1, cpu_s=cpu_of(r, step) * noise, data_s=data_of(r, step), ckpt_s=0.0)],
                0.0,
            )


def test_compute_straggler_is_named_with_its_slowdown():
    from trainscout.detectors.straggler import StragglerDetector

    det = StragglerDetector()
    _steps(det, 1, 55, lambda r, s: 0.03 * (1.3 if r == 2 and s > 10 else 1.0))
    (f,) = det.update(1.0, set(WORLD))
    assert (f.kind, f.culprit_ranks, f.evidence["type"]) == ("straggler", [2], "compute")
    assert 1.2 < f.evidence["ratio"] < 1.4 and 11 < f.step <= 11 + 35


def test_uniformly_slow_job_has_no_straggler():
    from trainscout.detectors.straggler import StragglerDetector

    det = StragglerDetector()
    _steps(det, 1, 60, lambda r, s: 0.03 * (2.0 if s > 20 else 1.0))
    assert det.update(1.0, set(WORLD)) == []


def test_intermittent_straggler_is_named_with_its_period():
    from trainscout.detectors.straggler import StragglerDetector

    det = StragglerDetector()
    _steps(det, 1, 70, lambda r, s: 0.03 * (3.0 if r == 1 and s % 10 == 0 else 1.0))
    (f,) = det.update(1.0, set(WORLD))
    assert (f.culprit_ranks, f.evidence["intermittent"], f.evidence["period"]) == ([1], True, 10)


def test_data_loading_stall_is_named_as_such():
    from trainscout.detectors.straggler import StragglerDetector

    det = StragglerDetector()
    _steps(det, 1, 30, lambda r, s: 0.03, data_of=lambda r, s: 0.2 if r == 3 and s > 5 else 0.001)
    (f,) = det.update(1.0, set(WORLD))
    assert (f.culprit_ranks, f.evidence["type"]) == ([3], "data_loading")


def test_replays_are_compared_within_each_replica_class():
    # two pipeline stages, each replicated 3 times, both with a layer "0" of their own: stage 1's rank 3 deviates
    # (each stage's replicas recompute the input of their lowest rank, which the records name as their source)
    det = ReplayDetector()
    stages = {"stage0": [0, 2, 4], "stage1": [1, 3, 5]}
    for cls, ranks in stages.items():
        for r in ranks:
            out = 10 if cls == "stage0" else (21 if r == 3 else 20)
            det.add(r, [ReplayRecord(step=10, layer="0", output=out, grads=1, source=min(ranks))], 0.0)
    (f,) = det.update(1.0, stages)
    assert (f.kind, f.culprit_ranks, f.status) == ("sdc", [3], "attributed")
    assert det.outcomes[(10, "0")] == ("attributed", [3])
    det.add(0, [ReplayRecord(step=20, layer="0", output=10, grads=1, source=0)], 1.0)
    assert det.update(2.0, stages) == [] and (20, "0") not in det.outcomes  # waits for the class's other members
    # before the coordinator knows the classes, each group's records are still compared only among themselves
    for r in (0, 1, 2, 3, 4, 5):
        det.add(r, [ReplayRecord(step=30, layer="0", output=10 if r % 2 == 0 else 20, grads=1, source=r % 2)], 3.0)
    assert det.update(3.0 + det.wait_s, {}) == [] and det.outcomes[(30, "0")] == ("agree", [])
