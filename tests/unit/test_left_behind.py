"""A rank stuck after its work while a strict majority of the job ended cleanly keeps the job from ending: it is
named at the stall timeout (before: a stall naming nobody). One still working (an upload, an evaluation) is not."""

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
