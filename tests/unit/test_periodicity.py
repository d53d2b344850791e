"""The period of a rank's spikes: found through a missed and a stray spike, never for a persistent or an
irregular rank."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainscout.detectors.periodicity import (
    Period,
    beyond_chance,
    intermittent_period,
    peers_rate,
    regular_period,
    shares_period,
)


def test_regular_spikes_give_their_period():
    found = regular_period([11, 21, 31, 41, 51], 5)
    assert found is not None and (found.period, found.hits) == (10, [11, 21, 31, 41, 51])


def test_a_missed_spike_does_not_hide_the_period():
    # the old rule (last 5 gaps all equal) saw 21 -> 41 and stayed silent until 5 regular spikes followed
    found = regular_period([11, 21, 41, 51, 61], 5)
    assert found is not None and found.period == 10 and found.hits == [11, 21, 41, 51, 61]


def test_a_stray_spike_does_not_hide_the_period():
    found = regular_period([11, 21, 26, 31, 41, 51], 5)
    assert found is not None and found.period == 10 and 26 not in found.hits


def test_a_spike_seen_one_step_late_is_on_the_progression():
    found = regular_period([10, 20, 31, 40, 50], 5)
    assert found is not None and found.period == 10


def test_too_few_spikes_give_nothing():
    assert regular_period([11, 21, 31, 41], 5) is None


def test_a_persistently_slow_rank_is_not_intermittent():
    assert regular_period(range(20, 60), 5) is None
    assert regular_period(range(20, 60, 2), 5) is None  # every other step: below the shortest period


def test_mostly_empty_slots_are_not_a_period():
    # five spikes on period 10 with 3 of its 8 slots empty
    assert regular_period([0, 10, 30, 50, 70], 5) is None


def test_the_period_that_fills_its_slots_wins_over_a_divisor():
    found = regular_period([10, 30, 50, 60, 90, 110, 130], 5)  # period 10 leaves 6 of 13 slots empty
    assert found is not None and found.period == 20


def test_irregular_spikes_give_nothing():
    assert regular_period([3, 7, 19, 24, 40, 43, 58, 71], 5) is None


@settings(max_examples=200, deadline=None)
@given(period=st.integers(3, 40), start=st.integers(0, 100), n=st.integers(6, 12), data=st.data())
def test_one_missed_and_one_stray_spike_leave_the_period(period, start, n, data):
    progression = [start + k * period for k in range(n)]
    missed = data.draw(st.integers(1, n - 2))  # an inner slot (an end missing just shortens the run)
    spikes = [s for k, s in enumerate(progression) if k != missed]
    # a stray spike off the progression: more than a tenth of a period from every slot
    offsets = [o for o in range(1, period) if min(o, period - o) > period // 10]
    if offsets:
        slot = data.draw(st.integers(0, n - 2))
        spikes.append(progression[slot] + data.draw(st.sampled_from(offsets)))
    found = regular_period(spikes, 5)
    assert found is not None and found.period == period, (spikes, found)


def test_exact_allows_no_step_of_slack():
    late = [100, 110, 121, 130, 140, 150]
    assert regular_period(late, 5).period == 10
    assert regular_period(late, 6, exact=True) is None
    assert regular_period([100, 106, 112, 124, 130, 136], 6, exact=True).period == 6


def test_scattered_spikes_over_thousands_of_steps_have_no_period():
    # a clean 1-hour run: rank 2 spiked at these steps, which once fitted "every 1347 steps" within 10 %
    assert regular_period([2599, 3960, 6566, 8098, 10680], min_hits=4) is None
    # a long true period still is one: a checkpoint every 500 steps, seen a step late once
    found = regular_period([1000, 1500, 2001, 2500, 3000], min_hits=4)
    assert found is not None and found.period == 500


def test_a_progression_among_quiet_peers_is_beyond_chance_at_its_third_hit():
    found = regular_period([100, 106, 112], 3)
    assert found is not None and beyond_chance(found, rate=0.005, spikes_seen=3)


def test_three_hits_among_peers_that_spike_in_eight_percent_of_steps_are_chance():
    found = regular_period([31, 44, 57], 3)
    assert found is not None and not beyond_chance(found, rate=0.08, spikes_seen=12)
    six = regular_period([100, 106, 112, 118, 124, 130], 3)
    assert six is not None and beyond_chance(six, rate=0.08, spikes_seen=12)


def test_the_peers_rate_is_their_median_over_the_recent_window_without_the_suspect():
    logs = {0: [30, 40, 50, 60], 1: [55], 2: [45, 58], 3: list(range(21, 101))}
    # over steps 21..100 (80 steps), rank 3's peers spiked 4, 1 and 2 times: median 2
    assert peers_rate(3, logs, step=100, first_step=20) == 2 / 80
    assert peers_rate(0, logs, step=100, first_step=20) == 2 / 80  # ranks 1, 2, 3: 1, 2, 80


def test_a_progression_that_ended_long_ago_is_not_named_at_a_later_spike():
    """A realistic CUDA job (new sequence lengths: ~100 ms on the driver, every rank in turn): rank 1 spiked at
    49, 78 and 105, judged then against its peers' spikes and let go; at its spike of step 616 its peers had
    been quiet for 200 steps and the old progression, 500 steps without a hit, was named."""
    spikes = [49, 78, 105, 270, 616]
    assert regular_period(spikes, 3) is not None  # the old progression is still there to be found
    assert regular_period(spikes, 3, ending_at=616) is None
    assert regular_period([100, 106, 112], 3, ending_at=112).period == 6


def test_the_peers_rate_covers_the_span_of_the_progression():
    logs = {0: [50, 567], 1: [49, 78, 105], 2: [27, 99], 3: [86]}
    assert peers_rate(1, logs, step=616, first_step=20) == 0.0  # the last 200 steps: one peer spike
    assert peers_rate(1, logs, step=616, first_step=20, span_start=49) == 1 / 568  # since step 48: 2, 1, 1
    then = {r: [s for s in steps if s <= 105] for r, steps in logs.items()}
    assert peers_rate(1, then, step=105, first_step=20, span_start=49) == 1 / 85  # the 200 steps reach back further


def test_the_rate_off_the_progression_is_the_ranks_own_over_its_span():
    from trainscout.detectors.periodicity import off_rate

    burst = [150, 152, 155, 157, 158, 161]  # a healthy rank blocked in half the steps of a burst
    found = regular_period(burst, 4, exact=True)
    assert found is not None and found.hits == [152, 155, 158, 161]
    assert off_rate(found, burst) == 1 / 6  # 157, over the span's 6 steps off the slots
    assert not beyond_chance(found, max(0.0, off_rate(found, burst)), len(burst), exact=True)
    clean = regular_period([100, 106, 112, 118], 4, exact=True)
    assert off_rate(clean, [100, 106, 112, 118]) == 0.0 and beyond_chance(clean, 0.005, 4, exact=True)


def test_a_rank_slow_every_sixth_step_among_quiet_peers_is_named():
    logs = {2: list(range(100, 125, 6))}
    found = intermittent_period(2, logs, 3, first_step=20, size=4)
    assert found is not None and found.period == 6


def test_every_rank_slow_every_fourth_step_in_turn_names_none():
    # the job's rhythm (round-robin work): each rank at its own phase, all from step 100 on
    logs = {r: list(range(100 + r, 109 + r, 4)) for r in range(4)}
    logs = {r: [s for s in steps if s <= 108] for r, steps in logs.items()}  # as seen at step 108
    for rank in range(4):
        assert intermittent_period(rank, logs, 3, first_step=20, size=4) is None, rank
    later = {r: list(range(100 + r, 300, 4)) for r in range(4)}
    for rank in range(4):
        assert intermittent_period(rank, later, 3, first_step=20, size=4) is None, rank


def test_a_peer_on_the_same_rhythm_one_hit_behind_shares_it():
    found = regular_period([100, 106, 112, 118], 3)
    assert shares_period(found, [103, 109, 115])  # newest hit still to come
    assert not shares_period(found, [103, 110, 116])  # other gaps
    assert not shares_period(found, [60, 66, 72])  # before the span
    assert shares_period(found, [101, 104, 107, 110, 113, 116])  # every third step: twice the rhythm
    longer = regular_period([100, 106, 112, 118, 124, 130], 3)
    assert shares_period(longer, [97, 109, 121])  # every twelfth: every other spike of the rhythm under a threshold
    assert not shares_period(longer, [97, 109])
    assert not shares_period(found, [101, 104, 107])  # too few at every third step for the span


def test_two_ranks_of_six_on_one_rhythm_are_still_a_minority():
    logs = {1: list(range(100, 125, 6)), 4: list(range(102, 127, 6))}
    assert intermittent_period(1, {1: logs[1], 4: logs[4][:-1]}, 3, first_step=20, size=6) is not None
    assert intermittent_period(1, logs, 3, first_step=20, size=4) is None  # two of four: no majority left


def test_an_exact_progression_of_small_spikes_is_judged_for_the_job_not_one_rank():
    # a clean 4-rank run: one healthy rank's 4 ms blocks at steps 72, 94, 116 and 160 (4 of 5 slots of period 22),
    # its peers spiking at ~1.25 % of steps, 7 spikes seen: 2.5e-6 for that rank alone, under SMALL_CHANCE
    found = Period(period=22, hits=[72, 94, 116, 160], slots=5)
    assert beyond_chance(found, 0.0125, 7, exact=True)
    assert not beyond_chance(found, 0.0125, 7, exact=True, ranks=4)
