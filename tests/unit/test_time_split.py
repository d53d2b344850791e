"""Stragglers by where the step's time went (detectors/time_split.py), on plain step records."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trainscout.detectors.straggler import StragglerDetector
from trainscout.wire.messages import StepRecord

WORLD = (0, 1, 2, 3)


def _record(step, wall, cpu, wait, runq, data=0.0):
    return StepRecord(step=step, wall_s=wall, cpu_s=cpu, data_s=data, ckpt_s=0.0, wait_s=wait, runq_s=runq)


def _feed(
    steps,
    blocked,
    starved=lambda r, s: 0.0,
    seed=0,
    world=WORLD,
    runq_noise=0.03,
    spikes=0.02,
    *,
    wall_s=0.040,
    cpu_s=0.012,
    cpu_jitter=0.1,
    spike_range=(0.005, 0.03),
    off_base=-0.0006,
    own=lambda r, s: None,
):
    """A 4-rank job on a busy machine: 40 ms steps, compute ~12 ms, run-queue delays of 0-30 ms that rotate
    between ranks, the occasional healthy off-CPU spike (GC, a GIL held by another thread); `blocked` and
    `starved` add a rank's own extra, `own` (where not None) replaces a rank's off-CPU time."""
    rng = random.Random(seed)
    det, found = StragglerDetector(), []
    for s in steps:
        extra = {r: blocked(r, s) + starved(r, s) for r in world}
        wall = wall_s + max(extra.values())
        for r in world:
            cpu = cpu_s * (1 + rng.uniform(-cpu_jitter, cpu_jitter))
            runq = rng.uniform(0, runq_noise) + starved(r, s)
            off = off_base + blocked(r, s) + (rng.uniform(*spike_range) if rng.random() < spikes else 0.0)
            off = off if own(r, s) is None else own(r, s)
            wait = max(0.0, wall - cpu - runq - off)
            det.add(r, [_record(s, wall, cpu, wait, runq)], 0.0)
        found += det.update(0.0, set(world))
    return found


@pytest.mark.parametrize("seed", range(5))
def test_healthy_ranks_on_a_busy_machine_give_nothing(seed):
    assert _feed(range(1, 400), lambda r, s: 0.0, seed=seed) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_rank_blocked_ten_percent_of_a_step_is_named_within_ten_steps(seed):
    found = _feed(range(1, 200), lambda r, s: 0.004 if r == 2 and s >= 100 else 0.0, seed=seed)
    assert [(f.culprit_ranks, f.evidence["type"]) for f in found] == [([2], "blocked")]
    assert found[0].step - 100 <= 10 and 0.003 < found[0].evidence["excess_s"] < 0.005


SIX = tuple(range(6))


@pytest.mark.parametrize("seed", range(3))
def test_two_ranks_of_six_blocked_together_are_each_named(seed):
    # two ranks of a slow node, or reading from one slow disk: a strict minority, each clear of the rest
    found = _feed(range(1, 200), lambda r, s: 0.006 if r in (1, 4) and s >= 100 else 0.0, seed=seed, world=SIX)
    assert sorted((f.culprit_ranks, f.evidence["type"]) for f in found) == [([1], "blocked"), ([4], "blocked")]
    assert all(f.step - 100 <= 10 for f in found)


@pytest.mark.parametrize("seed", range(3))
def test_half_of_the_ranks_blocked_together_is_no_minority(seed):
    # three of six blocked: no strict majority agrees on who is slow, so nobody is named
    assert _feed(range(1, 200), lambda r, s: 0.006 if r in (0, 2, 4) and s >= 100 else 0.0, seed=seed, world=SIX) == []


@pytest.mark.parametrize("seed", range(3))
def test_two_ranks_of_four_blocked_together_are_no_minority(seed):
    assert _feed(range(1, 200), lambda r, s: 0.006 if r in (1, 2) and s >= 100 else 0.0, seed=seed) == []


@pytest.mark.parametrize("seed", range(3))
def test_healthy_six_ranks_on_a_busy_machine_give_nothing(seed):
    assert _feed(range(1, 400), lambda r, s: 0.0, seed=seed, world=SIX) == []


def test_a_rank_blocked_every_sixth_step_is_an_intermittent_straggler_within_three_occurrences():
    found = _feed(range(1, 200), lambda r, s: 0.4 if r == 1 and s >= 100 and (s - 100) % 6 == 0 else 0.0)
    assert [(f.culprit_ranks, f.evidence["type"], f.evidence.get("period")) for f in found] == [([1], "blocked", 6)]
    assert found[0].evidence["intermittent"] is True and found[0].step == 112


def test_blocked_on_every_rank_is_a_slow_job_not_a_straggler():
    assert _feed(range(1, 200), lambda r, s: 0.01 if s >= 100 else 0.0) == []


def test_a_starved_rank_is_named_only_when_it_lasts():
    short = _feed(range(1, 200), lambda r, s: 0.0, starved=lambda r, s: 0.04 if r == 3 and 100 <= s < 150 else 0.0)
    assert short == []
    held = _feed(range(1, 260), lambda r, s: 0.0, starved=lambda r, s: 0.04 if r == 3 and s >= 100 else 0.0)
    assert [(f.culprit_ranks, f.evidence["type"]) for f in held] == [([3], "starved")]
    assert held[0].step - 100 <= 90  # 16-step medians, then 56 of 64 evaluations


def test_unmeasured_run_queue_leaves_the_parts_unjudged():
    det = StragglerDetector()
    for s in range(1, 100):
        for r in WORLD:
            off = 0.01 if r == 2 else 0.0
            det.add(r, [_record(s, 0.04, 0.012, 0.028 - off, -1.0)], 0.0)
        assert det.update(0.0, set(WORLD)) == []


@pytest.mark.parametrize("seed", range(5))
def test_bursts_of_blocked_time_in_half_the_steps_of_a_healthy_rank_give_nothing(seed):
    """What oversubscribed machines did to healthy ranks (5 of 35 clean demo runs named one before): for ~10
    steps one rank is 2-6 ms blocked in about half of them, then it passes."""
    rng = random.Random(seed)
    burst = {s: rng.uniform(0.002, 0.006) if rng.random() < 0.55 else 0.0 for s in range(150, 165)}
    assert _feed(range(1, 300), lambda r, s: burst.get(s, 0.0) if r == 3 else 0.0, seed=seed) == []


def test_loosely_regular_small_spikes_are_not_an_intermittent_straggler():
    """Small blocks on one rank at gaps of 13, 42, 16, 13 and 15 steps (a clean run's healthy rank): only an
    exactly regular interval makes small spikes a fault."""
    at = {139, 152, 194, 210, 223, 238, 251}
    assert _feed(range(1, 300), lambda r, s: 0.005 if r == 3 and s in at else 0.0) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_steady_rank_beside_peers_whose_blocked_time_scatters_both_ways_gives_nothing(seed):
    """A rank pinned to a core with busy loops beside it: its peers' run-queue and wait readings overlap, and
    their blocked time reads 3-10 ms below its usual in a third of their steps, while one healthy rank stays
    steady. Its lowest steps are then
    higher than theirs, but not higher than their usual: not a straggler."""
    rng = random.Random(100 + seed)
    scatter = {
        (r, s): rng.uniform(-0.010, -0.003) if rng.random() < 0.35 else rng.uniform(-0.0003, 0.0003)
        for r in WORLD
        for s in range(1, 300)
    }
    assert _feed(range(1, 300), lambda r, s: 0.0 if r == 1 else scatter[(r, s)], seed=seed) == []


def _feed_data(steps, data, seed=0, world=WORLD, workers=True):
    """As _feed, with each rank's time inside DataLoader iteration given by data(r, s): waiting for its worker
    processes' batches (workers=True) or loading them itself."""
    rng = random.Random(seed)
    det, found = StragglerDetector(), []
    for s in steps:
        own = {r: data(r, s) for r in world}
        wall = 0.160 + max(own.values())
        for r in world:
            cpu = 0.05 * (1 + rng.uniform(-0.1, 0.1))
            runq = rng.uniform(0, 0.03)
            wait = max(0.0, wall - cpu - runq - own[r])
            rec = _record(s, wall, cpu, wait, runq, data=own[r])
            if workers:
                rec.data_workers_s = own[r]
            det.add(r, [rec], 0.0)
        found += det.update(0.0, set(world))
    return found


@pytest.mark.parametrize("seed", range(5))
def test_data_loader_workers_starved_in_turn_on_a_busy_machine_give_nothing(seed):
    """4 ranks and their DataLoader workers on 2 cores (a real script's num_workers=1): each rank in turn waits
    10-46 ms for its worker's batch in about half the steps of a 5-10-step episode, ~2 ms otherwise. A 5-step
    median named 4 healthy ranks in one 300-step run."""
    rng = random.Random(seed)
    slow: dict[tuple[int, int], float] = {}
    s = 21
    while s < 300:
        r, length = rng.choice(WORLD), rng.randint(5, 10)
        for t in range(s, s + length):
            if rng.random() < 0.5:
                slow[(r, t)] = rng.uniform(0.010, 0.046)
        s += length + rng.randint(0, 4)
    found = _feed_data(range(1, 300), lambda r, s: slow.get((r, s), rng.uniform(0.0015, 0.0025)), seed=seed)
    assert found == []


@pytest.mark.parametrize("workers", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_rank_whose_every_batch_is_read_slowly_is_named(seed, workers):
    """Every batch 17 ms (10 % of a step) late on one rank: within 10 steps when the rank loads its batches
    itself, within 30 when it waits for worker processes (whose healthy waits come in bursts)."""
    rng = random.Random(seed)
    found = _feed_data(
        range(1, 200),
        lambda r, s: rng.uniform(0.0015, 0.0025) + (0.017 if r == 1 and s >= 100 else 0.0),
        seed=seed,
        workers=workers,
    )
    assert [(f.culprit_ranks, f.evidence["type"]) for f in found] == [([1], "data_loading")]
    assert found[0].step - 100 <= (30 if workers else 10)


@pytest.mark.parametrize("seed", range(3))
def test_blocked_time_in_bursts_out_of_step_with_the_steps_is_named_from_its_mean(seed):
    """A rank stopped from outside 12 ms of every ~120 ms (SIGSTOP / SIGCONT, a spent CPU quota): a third of its
    40 ms steps take a stop, at no regular interval, so neither its low order statistic nor a period shows it;
    its 32-step mean does."""
    rng = random.Random(seed)
    stops = {s: rng.choice((0.0, 0.0, 0.012)) for s in range(100, 400)}
    found = _feed(range(1, 400), lambda r, s: stops.get(s, 0.0) if r == 2 else 0.0, seed=seed)
    assert [(f.culprit_ranks, f.evidence["type"]) for f in found] == [([2], "blocked")]
    assert found[0].step - 100 <= 90
    if seed != 1:  # (seed 1's stops fell every third step often enough to make a period)
        assert found[0].evidence.get("duty") is True


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_ranks_blocked_burst_of_a_dozen_steps_is_not_a_duty_cycle(seed):
    """A busy machine's burst on a healthy rank: 12 steps of 2-20 ms blocked in about half of them, then nothing
    (its mean over 32 steps is over the duty rule's threshold while the burst is in the window)."""
    rng = random.Random(seed)
    burst = {s: rng.uniform(0.002, 0.020) if rng.random() < 0.5 else 0.0 for s in range(150, 162)}
    assert _feed(range(1, 300), lambda r, s: burst.get(s, 0.0) if r == 3 else 0.0, seed=seed) == []


def _spiky(rate, seed):
    """Healthy ranks that each spike ~80 ms off the CPU at random in `rate` of their steps: a real job on CUDA
    whose first step at each new sequence length waits on the driver (kernel loading, allocations)."""
    rng = random.Random(1000 + seed)
    hits = {(r, s) for r in WORLD for s in range(1, 400) if rng.random() < rate}
    return lambda r, s: 0.08 if (r, s) in hits else 0.0


@pytest.mark.parametrize("seed", range(12))
def test_healthy_ranks_that_spike_at_random_are_not_intermittent_stragglers(seed):
    assert _feed(range(1, 400), _spiky(0.08, seed), seed=seed) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_rank_blocked_every_sixth_step_among_spiky_peers_is_still_named(seed):
    noise = _spiky(0.03, seed)
    found = _feed(range(1, 300), lambda r, s: 0.4 if r == 1 and s >= 100 and (s - 100) % 6 == 0 else noise(r, s))
    assert [(f.culprit_ranks, f.evidence.get("period")) for f in found] == [([1], 6)]
    assert found[0].step - 100 <= 6 * 6  # a few more occurrences than among quiet peers


def test_a_small_block_every_sixth_step_is_named_at_its_fifth_exactly_regular_occurrence():
    """10 % of a step (4 ms) every 6th step: under the big-spike size, so it must be exactly regular, and
    named at its 5th occurrence where its peers spike rarely (small spikes are what healthy ranks show on a
    busy machine: their progressions must be rarer by chance than a big spike's)."""
    found = _feed(range(1, 200), lambda r, s: 0.004 if r == 1 and s >= 100 and (s - 100) % 6 == 0 else 0.0)
    assert [(f.culprit_ranks, f.evidence["type"], f.evidence.get("period")) for f in found] == [([1], "blocked", 6)]
    assert found[0].evidence["intermittent"] is True and found[0].step == 124


@pytest.mark.parametrize("seed", range(3))
def test_a_regular_block_on_a_rank_its_peers_did_not_wait_for_is_no_intermittent_straggler(seed):
    """A healthy rank on a busy machine (the job's fault was on another rank) blocked 2.5-4 ms at steps 215, 218,
    221, 224: exactly regular and rarer than its peers' spikes, but in those steps it had the core to itself (no
    run-queue delay) and still waited longer than they did: they were not waiting for it, and it must not be named."""
    hits = {215, 218, 221, 224}
    rng = random.Random(seed)
    det, found = StragglerDetector(), []
    for s in range(1, 260):
        for r in WORLD:
            cpu = 0.012 * (1 + rng.uniform(-0.1, 0.1))
            mine = r == 1 and s in hits
            runq = 0.0 if mine else rng.uniform(0.005, 0.03)
            off = 0.0035 if mine else 0.0
            det.add(r, [_record(s, 0.040, cpu, max(0.0, 0.040 - cpu - runq - off), runq)], 0.0)
        found += det.update(0.0, set(WORLD))
    assert found == []


def test_a_small_block_too_rare_to_cost_the_job_anything_is_not_named():
    """4.5 ms of a 40 ms step at exactly every 30th step (a clean library job's healthy rank showed that every
    23rd of its 70 ms steps): 0.4 % of the job's time; the same block every 6th step (1.9 %) is named."""
    rare = _feed(range(1, 300), lambda r, s: 0.0045 if r == 1 and s >= 30 and s % 30 == 0 else 0.0)
    assert rare == []
    often = _feed(range(1, 300), lambda r, s: 0.0045 if r == 1 and s >= 24 and s % 6 == 0 else 0.0)
    assert [(f.culprit_ranks, f.evidence.get("period")) for f in often] == [([1], 6)]


def _feed_sharded(steps, blocked, seed=0, world=WORLD, own=lambda r, s: None):
    """An FSDP2 job on a busy CPU machine: 200 ms steps, most of them in its many collectives, and every rank
    off the CPU outside them 0-15 ms in half its steps (gloo's threads and the ranks compete for the cores),
    none of them steady; `blocked` adds a rank's own extra, `own` (where not None) replaces its noise."""
    return _feed(
        steps,
        blocked,
        seed=seed,
        world=world,
        runq_noise=0.01,
        spikes=0.5,
        wall_s=0.200,
        cpu_s=0.035,
        cpu_jitter=0.05,
        spike_range=(0.0, 0.015),
        off_base=0.0,
        own=own,
    )


@pytest.mark.parametrize("seed", range(3))
def test_a_healthy_rank_whose_few_steps_sit_where_its_noisy_peers_often_are_is_not_named(seed):
    """In a clean 4-rank FSDP2 job one rank's blocked time sat at 9-14 ms for 6 steps while its peers' medians
    were near zero, and it was named; its peers' own steps reached that in 1 of 10. A level its peers' single
    steps commonly reach is no outlier; 10 % of a step blocked in every step still is."""
    chance = _feed_sharded(
        range(1, 300),
        lambda r, s: 0.0,
        seed=seed,
        own=lambda r, s: rng_level(seed, s) if r == 2 and 150 <= s < 160 else None,
    )
    assert chance == []
    found = _feed_sharded(range(1, 300), lambda r, s: 0.020 if r == 2 and s >= 150 else 0.0, seed=seed)
    assert [(f.culprit_ranks, f.evidence["type"]) for f in found] == [([2], "blocked")]
    assert found[0].step - 150 <= 10


def rng_level(seed: int, step: int) -> float:
    """9-14 ms: the upper tenth of what the noisy peers of _feed_sharded show, without the rank's own noise."""
    return 0.009 + 0.005 * random.Random(seed * 1000 + step).random()


def test_a_block_beyond_anything_its_noisy_peers_show_is_still_named_every_sixth_step():
    """The peers' noise floor does not hide a real intermittent block: 20 ms every 6th step, above every step
    its peers show, among peers blocked 0-15 ms in half their steps (named late there: those peers' steps
    are seldom clear of it, which is the same before the floor)."""
    found = _feed_sharded(range(1, 300), lambda r, s: 0.020 if r == 1 and s >= 150 and s % 6 == 0 else 0.0)
    assert [(f.culprit_ranks, f.evidence.get("period")) for f in found] == [([1], 6)]


def test_a_recorded_clean_job_whose_ranks_spike_together_makes_no_period():
    """A clean Hugging Face Trainer job (recorded): rank 1's blocked time was highest at steps 71, 76, 81 and 86
    (7-22 ms), a progression of period 5, while its peers reached such values in the same steps and others.
    Spikes its peers' own steps reach that often line up by chance; it was named an intermittent straggler."""
    trace = json.loads((Path(__file__).parent / "traces" / "hf_clean_blocked.json").read_text())["steps"]
    det, found = StragglerDetector(), []
    for step, (wall_ms, blocked_ms) in enumerate(trace, start=1):
        wall = wall_ms / 1e3
        for r in WORLD:
            cpu, off = 0.3 * wall, blocked_ms[r] / 1e3
            det.add(r, [_record(step, wall, cpu, max(0.0, wall - cpu - off), 0.0)], 0.0)
        found += det.update(0.0, set(WORLD))
    assert found == []


def _feed_freezes(frozen_ranks, seed=0):
    """Every 40th step from step 100 the job stops for 1 s: rank 2 inside its compute (1 s off the CPU outside
    collectives), the others inside the gradient sync (1 s more waiting); the ranks in `frozen_ranks` were
    stopped whole (their probe threads woke late: `frozen_s`), the others were not."""
    rng = random.Random(seed)
    det, found = StragglerDetector(), []
    for s in range(1, 400):
        freeze = s >= 100 and (s - 100) % 40 == 0
        wall = 0.040 + (1.0 if freeze else 0.0)
        for r in WORLD:
            cpu = 0.012 * (1 + rng.uniform(-0.1, 0.1))
            runq = rng.uniform(0, 0.003)
            wait = max(0.0, wall - cpu - runq - (1.0 if freeze and r == 2 else 0.0))
            rec = StepRecord(step=s, wall_s=wall, cpu_s=cpu, data_s=0.0, ckpt_s=0.0, wait_s=wait, runq_s=runq)
            if freeze and r in frozen_ranks:
                rec.frozen_s = 0.9
            det.add(r, [rec], 0.0)
        found += det.update(0.0, set(WORLD))
    return found, det


@pytest.mark.parametrize("seed", range(3))
def test_a_job_stopped_whole_now_and_then_names_no_rank_caught_inside_its_compute(seed):
    found, det = _feed_freezes(frozen_ranks=WORLD, seed=seed)
    assert found == [] and det.frozen_steps == list(range(100, 400, 40))  # those steps were left unjudged
    # the same steps with no rank seen stopped: rank 2 is the one its peers waited for, every 40 steps
    unseen, _ = _feed_freezes(frozen_ranks=(), seed=seed)
    assert [(f.culprit_ranks, f.evidence["type"], f.evidence.get("period")) for f in unseen] == [([2], "blocked", 40)]


def test_a_rank_stopped_alone_is_still_the_one_its_peers_wait_for():
    found, _ = _feed_freezes(frozen_ranks=(2,))
    assert [(f.culprit_ranks, f.evidence["type"], f.evidence.get("period")) for f in found] == [([2], "blocked", 40)]
