"""Hangs the sequence numbers alone cannot place: a rank stuck after its work while a strict majority of the job
ended cleanly (named at the stall timeout; before, a stall naming nobody; one still working is not named), and a
rank whose GPU never finishes its queue while every rank is at one collective."""

from __future__ import annotations

from test_detectors import WORLD, _exit, obs, pg

from trainscout.detectors.progress import HangDetector


def _job(left: dict[int, float]):
    """Ranks in `left` still alive with their training thread last moving that long ago; the others ended with 0."""
    ranks = {}
    for r in WORLD:
        if r in left:
            ranks[r] = obs(r, [pg(406)], progress_age=301.0, step=200, moving_age_s=left[r])
        else:
            ranks[r] = obs(r, [pg(406)], exit=_exit("exit", 0, msg="interpreter exit", step=200), seen_at=80.0)
    return ranks


def test_a_rank_stuck_after_the_others_ended_is_named():
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, _job({2: 400.0}))
    f = s.finding
    assert (f.kind, f.culprit_ranks, f.status) == ("hang", [2], "attributed")
    assert s.stack_ranks == [2] and "did not end" in f.summary and f.evidence["ended_ranks"] == [0, 1, 3]


def test_not_before_the_stall_timeout():
    ranks = _job({2: 400.0})
    ranks[2] = obs(2, [pg(406)], progress_age=120.0, step=200, moving_age_s=400.0)
    assert HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, ranks) == []


def test_a_rank_still_working_after_the_others_ended_is_not_named():
    # rank 0 uploading the final checkpoint, its training thread reading and writing
    assert HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, _job({0: 1.0})) == []


def test_half_the_job_left_is_no_majority_and_blames_nobody():
    (s,) = HangDetector(hang_timeout_s=5.0, stall_timeout_s=300.0).update(100.0, _job({1: 400.0, 2: 400.0}))
    assert (s.finding.kind, s.finding.culprit_ranks) == ("stall", [])


def test_a_rank_whose_gpu_never_finishes_its_queue_is_named_though_every_rank_is_at_one_collective():
    # rank 2's stream holds a kernel that does not end; all four entered the all-reduce (gloo on CUDA tensors)
    ranks = {r: obs(r, [pg(80)], progress_age=7.0, gpu_pending_s=6.0 if r == 2 else 0.0) for r in WORLD}
    (s,) = HangDetector(hang_timeout_s=5.0).update(100.0, ranks)
    assert (s.finding.kind, s.finding.culprit_ranks, s.stack_ranks) == ("hang", [2], [2])
    assert "GPU has not finished" in s.finding.summary


def test_no_gpu_verdict_without_a_drained_majority_or_before_the_hang_timeout():
    # NCCL: the waiting peers' streams hold the collective's kernel too
    ranks = {r: obs(r, [pg(80)], progress_age=7.0, gpu_pending_s=6.0 if r in (1, 2) else 0.0) for r in WORLD}
    assert HangDetector(hang_timeout_s=5.0).update(100.0, ranks) == []
    ranks = {r: obs(r, [pg(80)], progress_age=7.0, gpu_pending_s=3.0 if r == 2 else 0.0) for r in WORLD}
    assert HangDetector(hang_timeout_s=5.0).update(100.0, ranks) == []
