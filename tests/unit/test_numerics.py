"""Numerical outliers among replicas (detectors/numerics.py) and their confirmation (coordinator/confirmation.py),
on plain numbers: each rank's local loss and per-layer gradient norms before the all-reduce."""

from __future__ import annotations

import math
import random

import pytest

from trainscout.coordinator.confirmation import Confirmations, numeric_finding
from trainscout.detectors.numerics import NumericDetector, NumericSuspect
from trainscout.detectors.replay import ReplayDetector
from trainscout.wire.messages import ReplayRecord

WORLD = (0, 1, 2, 3)
LAYERS = ["tokens", "blocks.0", "blocks.1", "head"]


COUNTED = [*LAYERS, *(f"zero-params:{x}" for x in LAYERS), *(f"repeated-params:{x}" for x in LAYERS)]


def _run(steps, loss_of=None, norms_of=None, seed=0, world=WORLD, zeros_of=None, repeats_of=None):
    """Replicas on different batches: losses ~4 +- 3 %, norms ~0.3 +- 8 % per layer, falling slowly. With
    zeros_of / repeats_of (rank, step -> a count), the evidence also carries the per-layer counts of odd
    parameters, the odd ones in blocks.1 (index 2)."""
    rng = random.Random(seed)
    det, found = NumericDetector(), []
    counted = zeros_of is not None or repeats_of is not None
    for s in steps:
        base = 4.0 * math.exp(-s / 400)
        for r in world:
            loss = base * (1 + rng.gauss(0, 0.03))
            norms = [0.3 * (1 + rng.gauss(0, 0.08)) * (1 + i / 10) for i in range(len(LAYERS))]
            if loss_of:
                loss = loss_of(r, s, loss)
            if norms_of:
                norms = norms_of(r, s, norms)
            if counted:
                for count_of in (zeros_of, repeats_of):
                    n = float(count_of(r, s)) if count_of else 0.0
                    norms = norms + [n if i == 2 else 0.0 for i in range(len(LAYERS))]
            det.add(r, "dp", COUNTED if counted else LAYERS, [(s, loss, norms)], 0.0)
        found += det.update(0.0, {"dp": list(world)})
    return found


@pytest.mark.parametrize("seed", range(5))
def test_healthy_replicas_give_no_suspect(seed):
    assert _run(range(1, 500), seed=seed) == []


def test_one_step_of_noise_in_one_layers_gradient_is_a_spike_with_a_calm_loss():
    found = _run(
        range(1, 200),
        norms_of=lambda r, s, n: [x * 300 if r == 1 and s == 120 and i == 1 else x for i, x in enumerate(n)],
    )
    assert [(f.rank, f.statistic, f.pattern, f.layer, f.step) for f in found] == [
        (1, "grad_norm", "spike", "blocks.0", 120)
    ]
    assert found[0].ratio > 100 and abs(found[0].loss_z) < 3


def test_noise_on_two_of_four_ranks_in_one_step_names_those_two_not_their_healthy_peers():
    """Each healthy rank's peers' median is then a corrupted value, so it read 1e-4x its peers' at z -62 and all four
    ranks were named (the peer's injector, large noise on ranks 0 and 3): it sits at the class's usual level."""
    found = _run(
        range(1, 200),
        norms_of=lambda r, s, n: [x * 1e4 if r in (0, 3) and s == 120 and i == 1 else x for i, x in enumerate(n)],
    )
    assert sorted((f.rank, f.pattern, f.layer, f.step) for f in found) == [
        (0, "spike", "blocks.0", 120),
        (3, "spike", "blocks.0", 120),
    ]


def test_one_step_of_noise_is_named_whatever_its_peers_spread_that_step():
    """With 4 ranks, one rank far out moves the median of the step's deviations to half its peers' range: the
    step looked 3x wider than usual in about 1 step of 6, was judged on its own spread, and the noise of a
    4-rank PowerSGD job went unnamed. A class-wide widening must last two steps before it is the scale."""
    missed = []
    for step in range(100, 160):
        found = _run(
            range(1, step + 5),
            norms_of=lambda r, s, n, at=step: [
                x * 100 if r == 2 and s == at and i == 2 else x for i, x in enumerate(n)
            ],
        )
        if [(f.rank, f.pattern, f.layer, f.step) for f in found] != [(2, "spike", "blocks.1", step)]:
            missed.append(step)
    assert missed == []


def test_one_layers_gradient_spike_with_a_loss_up_by_chance_is_not_a_hard_batch():
    """A 4-rank CUDA job's 100x noise in one layer came with its loss z +4.1 above its peers' by chance and went
    unnamed. A hard batch raises the gradients of every layer the loss flows back through, not one alone."""
    found = _run(
        range(1, 200),
        loss_of=lambda r, s, x: x * 1.15 if r == 1 and s == 120 else x,
        norms_of=lambda r, s, n: [x * 100 if r == 1 and s == 120 and i == 1 else x for i, x in enumerate(n)],
    )
    assert [(f.rank, f.pattern, f.layer, f.step) for f in found] == [(1, "spike", "blocks.0", 120)]
    assert found[0].loss_z > 3
    summary = numeric_finding(found[0]).summary
    assert "its other layers' gradients agreed with theirs" in summary and "its loss agreed" not in summary


def test_a_gradient_spike_with_a_loss_below_its_peers_is_not_a_hard_batch():
    """A hard batch raises the loss with the gradient; a loss that happens to sit below its peers' does not
    explain a gradient 100x theirs (a 4-rank drill's noisy rank, its loss z -3.8 by chance, went unnamed)."""
    found = _run(
        range(1, 200),
        loss_of=lambda r, s, x: x * 0.85 if r == 1 and s == 120 else x,
        norms_of=lambda r, s, n: [x * 100 if r == 1 and s == 120 and i == 1 else x for i, x in enumerate(n)],
    )
    assert [(f.rank, f.pattern, f.layer, f.step) for f in found] == [(1, "spike", "blocks.0", 120)]
    assert found[0].loss_z < -3


def test_a_gradient_jump_that_comes_with_a_loss_jump_is_a_hard_batch_not_a_spike():
    found = _run(
        range(1, 200),
        loss_of=lambda r, s, x: x * 3 if r == 1 and s == 120 else x,
        norms_of=lambda r, s, n: [x * 20 if r == 1 and s == 120 else x for x in n],
    )
    assert found == []


def test_a_rank_whose_forward_went_wrong_is_a_persistent_loss_outlier():
    found = _run(range(1, 200), loss_of=lambda r, s, x: x * 1.8 if r == 2 and s >= 100 else x)
    assert [(f.rank, f.statistic, f.pattern) for f in found][:1] == [(2, "loss", "persistent")]
    assert found[0].step - 100 <= 6 and found[0].ratio > 1.5


def test_a_persistently_scaled_layer_gradient_is_named_with_its_layer():
    found = _run(
        range(1, 200),
        norms_of=lambda r, s, n: [x * 2.5 if r == 0 and s >= 100 and i == 2 else x for i, x in enumerate(n)],
    )
    assert [(f.rank, f.statistic, f.pattern, f.layer) for f in found] == [(0, "grad_norm", "persistent", "blocks.1")]


def _one_spike(name: str, factor: float, spread: float) -> list:
    rng = random.Random(4)
    det, found = NumericDetector(), []
    for s in range(1, 120):
        for r in WORLD:
            norm = 0.4 * math.exp(rng.gauss(0, spread)) * (factor if (r, s) == (2, 80) else 1)
            det.add(r, "dp", [name], [(s, 4.0 * (1 + rng.gauss(0, 0.03)), [norm])], 0.0)
        found += det.update(0.0, {"dp": list(WORLD)})
    return found


@pytest.mark.parametrize("name", ["grad-sync.0", "blocks.0"])
def test_a_large_spike_is_named_while_the_spread_across_ranks_is_still_wide(name):
    """140x one step, at z ~30 where the statistic spreads 20 % across ranks (early in a run), is named in a
    layer as in a gradient bucket: a z bar of 40 let 63x noise at z 30 pass at step 100 of a real run."""
    found = _one_spike(name, 140, 0.2)
    assert [(f.rank, f.step, f.pattern) for f in found] == [(2, 80, "spike")]
    assert 25 <= found[0].z < 40, found[0].z


def test_a_spike_under_the_ratio_bar_is_not_named_however_far_out_in_z():
    """10x where ranks agree within 2 %: z over 100, but a healthy rank's batch moved a layer's norm up to 8.9x."""
    assert _one_spike("blocks.0", 10, 0.02) == []
    assert [(f.rank, f.step) for f in _one_spike("blocks.0", 40, 0.02)] == [(2, 80)]


def test_in_a_class_of_three_only_the_rank_far_from_both_peers_is_named():
    """With two peers their midpoint moves half-way to an outlier: the two healthy ranks of a three-rank class
    (a pipeline's last stages, downstream of one stage computing wrong) were named beside it, once each."""
    world = (0, 1, 2)
    found = _run(range(1, 200), loss_of=lambda r, s, loss: loss * (3 if r == 1 and s >= 60 else 1), world=world)
    assert [(f.rank, f.statistic, f.pattern) for f in found] == [(1, "loss", "persistent")]
    found = _run(range(1, 200), loss_of=lambda r, s, loss: loss * (0.4 if r == 2 and s >= 60 else 1), world=world)
    assert [(f.rank, f.statistic, f.pattern) for f in found] == [(2, "loss", "persistent")]
    assert all(_run(range(1, 300), seed=seed, world=world) == [] for seed in range(3))


def test_two_replicas_cannot_attribute():
    found = _run(range(1, 200), loss_of=lambda r, s, x: x * 3 if r == 1 and s >= 100 else x, world=(0, 1))
    assert found == []


def test_nothing_is_judged_during_warm_up():
    found = _run(range(1, 20), loss_of=lambda r, s, x: x * 5 if r == 1 else x)
    assert found == []


def test_non_finite_values_are_left_to_the_non_finite_check():
    found = _run(
        range(1, 200),
        loss_of=lambda r, s, x: math.nan if r == 1 and s >= 100 else x,
        norms_of=lambda r, s, n: [math.inf] * len(n) if r == 1 and s >= 100 else n,
    )
    assert found == []


# ---- confirmation -----------------------------------------------------------------------------------------


def _suspect(statistic="grad_norm", pattern="spike", layer="blocks.0"):
    found = _run(
        range(1, 130),
        norms_of=lambda r, s, n: [x * 300 if r == 1 and s == 120 and i == 1 else x for i, x in enumerate(n)],
    )
    (s,) = found
    return s


def test_a_confirmation_asks_for_the_deviating_layers_and_the_whole_state_at_one_step():
    c = Confirmations(replay_layers=LAYERS)
    s = _suspect()
    c.add(s, numeric_finding(s))
    payload = c.next_request(150, 7, now=0.0, step_s=0.05)
    assert payload is not None and '"step": 150' in payload and '"state": true' in payload
    assert c.current.layers == LAYERS  # a layer going wrong shows in its neighbours' norms too: all replayed
    assert c.next_request(160, 8, now=0.0, step_s=0.05) is None  # one at a time


def test_a_layer_no_replica_could_replay_does_not_hold_the_confirmation_back():
    """An expert the source's batch routed no token to at the confirmation's step is skipped on every replica;
    the confirmation resolves with the others, before its deadline, and does not list it as replayed."""
    c = Confirmations(replay_layers=LAYERS)
    s = _suspect()
    c.add(s, numeric_finding(s))
    c.next_request(150, 7, now=0.0, step_s=0.05)
    outcomes = {(150, layer): ("agree", []) for layer in LAYERS}
    outcomes[(150, "blocks.1")] = ("skipped", [])
    outcomes[(150, "blocks.0")] = ("attributed", [1])
    (f,) = c.resolve(2.0, outcomes, {150: True}, {})
    assert f.evidence["confirmation"]["outcome"] == "reproduced" and f.evidence["confirmation"]["layers_deviating"] == [
        "blocks.0"
    ]


def test_replay_records_of_a_layer_skipped_everywhere_are_an_outcome_of_their_own():
    det = ReplayDetector()
    det.add(0, [ReplayRecord(step=150, layer="experts.3", output=0, grads=0, params=0)], 0.0)
    det.add(1, [ReplayRecord(step=150, layer="experts.3", output=0, grads=0, params=0)], 0.0)
    det.add(2, [ReplayRecord(step=150, layer="experts.3", output=0, grads=0, params=0)], 0.0)
    assert det.update(1.0, [0, 1, 2]) == []
    assert det.outcomes[(150, "experts.3")] == ("skipped", []) and "experts.3" not in det.clean_layers


def test_a_deviation_that_reproduces_is_named_with_confidence():
    c = Confirmations(replay_layers=LAYERS)
    s = _suspect()
    c.add(s, numeric_finding(s))
    c.next_request(150, 7, now=0.0, step_s=0.05)
    assert c.resolve(1.0, {}, {}, {}) == []  # still awaited
    outcomes = {(150, layer): ("agree", []) for layer in LAYERS}
    outcomes[(150, "blocks.0")] = ("attributed", [1])
    (f,) = c.resolve(2.0, outcomes, {150: True}, {})
    assert f.culprit_ranks == [1] and f.kind == "sdc" and f.evidence["confirmation"]["outcome"] == "reproduced"
    assert f.confidence > 0.9 and "blocks.0" in f.summary


def test_a_deviation_that_does_not_reproduce_is_a_transient_at_lower_confidence():
    c = Confirmations(replay_layers=LAYERS)
    s = _suspect()
    c.add(s, numeric_finding(s))
    c.next_request(150, 7, now=0.0, step_s=0.05)
    (f,) = c.resolve(2.0, {(150, layer): ("agree", []) for layer in LAYERS}, {150: True}, {})
    assert f.culprit_ranks == [1] and f.evidence["confirmation"]["outcome"] == "transient"
    assert f.confidence <= 0.5 and f.evidence["layer"] == "blocks.0" and f.step == 120


def test_results_that_never_come_release_the_finding_at_the_deadline():
    c = Confirmations(replay_layers=LAYERS)
    s = _suspect()
    c.add(s, numeric_finding(s))
    c.next_request(150, 7, now=0.0, step_s=0.05)
    assert c.resolve(5.0, {}, {}, {}) == []
    (f,) = c.resolve(100.0, {}, {}, {})
    assert f.evidence["confirmation"]["outcome"] == "unconfirmed"


def test_an_unreproduced_persistent_norm_deviation_is_logged_not_named():
    from trainscout.coordinator import confirmation
    from trainscout.detectors.numerics import NumericSuspect

    def judged(statistic: str, pattern: str, outcome: str):
        f = confirmation.numeric_finding(NumericSuspect(2, 100, statistic, pattern, layer="head", ratio=2.0, z=9.0))
        f.evidence["confirmation"] = {"outcome": outcome}
        return confirmation.is_observation(f)

    # a rank's batches alone moved its norms 1.8-2.2x for 4 of 5 steps, twice in a 1-hour clean run
    assert judged("grad_norm", "persistent", "transient") and judged("grad_norm", "persistent", "unconfirmed")
    assert not judged("grad_norm", "persistent", "reproduced")  # a layer computing wrong: named
    assert not judged("loss", "persistent", "transient")  # a forward gone wrong moves the loss
    assert not judged("grad_norm", "spike", "transient")  # one step far beyond what batches do: named


def test_a_loss_spike_every_replica_goes_through_names_nobody():
    """Steps 230-245 of a clean CUDA vision job: every rank's loss left its usual 1 % spread for a 20x wider one,
    and rank 1, 10-30 % above its peers' median in 4 of 5 of those steps, was named. The class's own spread of
    such a step is the scale then; one rank alone gone wrong does not widen it that far and is still named."""
    rng = random.Random(3)
    turbulent = {}
    for s in range(230, 246):
        peers = {r: 1 + rng.uniform(0, 0.8) for r in (0, 2, 3)}
        lead = sorted(peers.values())[1] * (1.2 if s % 5 else 0.9)
        turbulent[s] = {**peers, 1: lead}
    found = _run(range(1, 300), loss_of=lambda r, s, x: x * turbulent[s][r] if s in turbulent else x)
    assert found == []
    alone = _run(range(1, 300), loss_of=lambda r, s, x: x * 1.5 if r == 1 and s >= 230 else x)
    assert [(f.rank, f.statistic, f.pattern) for f in alone] == [(1, "loss", "persistent")]
    assert alone[0].step - 230 <= 5


def test_experts_no_token_of_a_ranks_batch_chose_name_nobody():
    """A mixture-of-experts job: in each step, each expert layer has a gradient only on the ranks whose batch
    routed a token to it (zero elsewhere). Against a peers' median of zero, every rank was a 1e29x spike."""
    rng = random.Random(5)

    def routed(r, s, norms):
        return [x if i == 0 or rng.random() < 0.4 else 0.0 for i, x in enumerate(norms)]

    assert _run(range(1, 300), norms_of=routed) == []


def test_a_layer_gradient_zeroed_on_one_rank_is_named_once_it_stays_zero():
    """A hook or a device writing zeros: the log-norm statistics leave a 0 out, and a 0.75x average of the layer
    shows nowhere else."""
    found = _run(
        range(1, 200), norms_of=lambda r, s, n: [0.0 if r == 1 and s >= 100 and i == 2 else x for i, x in enumerate(n)]
    )
    assert [(f.rank, f.statistic, f.pattern, f.layer) for f in found] == [(1, "grad_norm", "zero", "blocks.1")]
    assert found[0].step == 107 and found[0].steps == list(range(100, 108))
    assert "exactly 0 in 8 steps in a row" in numeric_finding(found[0]).summary


@pytest.mark.parametrize(
    "zeroed",
    [
        lambda r, s: r == 1 and 100 <= s < 107,  # seven steps, then its gradient came back: not for good
        lambda r, s: r == 1,  # zero from the start (a rank's data never reaches the layer): no history of not 0
        lambda r, s: r in (1, 2) and s >= 100,  # two ranks alike: no minority
    ],
)
def test_a_zero_gradient_that_is_brief_always_so_or_shared_names_nobody(zeroed):
    found = _run(
        range(1, 200), norms_of=lambda r, s, n: [0.0 if zeroed(r, s) and i == 2 else x for i, x in enumerate(n)]
    )
    assert found == []


def _sharded_digest(step: int, losses: dict[int, float], norms: dict[int, list[float]], layers=LAYERS):
    from trainscout.wire.messages import NodeDigest, NumericRecord, PgState, RankState

    ranks = []
    for r, loss in losses.items():
        pg = PgState("0", "default_pg", list(losses), step, 0, [], [], 0.0, role="shard", framework="FSDP2")
        numerics = [NumericRecord(step, loss, norms[r])]
        ranks.append(
            RankState(
                r, r, len(losses), 100 + r, True, step, 0.1, 0.1, step, [pg], numerics=numerics, numeric_layers=layers
            )
        )
    return NodeDigest("n0", "h0", step, ranks)


def test_a_sharded_jobs_shard_group_compares_losses_only_and_names_without_confirmation():
    """FSDP2 on a 1-D mesh has no replicas, but its ranks compute the whole model on their own batches: an
    output sign flip on one rank went unnamed for the whole run. Their losses are compared; their gradients,
    read after the reduce-scatter, are different shards and are not (rank 2's differ wildly here)."""
    from trainscout.detectors.interface import JobView

    rng = random.Random(1)
    det, found = NumericDetector(), []
    for s in range(1, 200):
        losses = {r: 4.0 * (1 + rng.gauss(0, 0.03)) * (2.5 if r == 1 and s >= 100 else 1) for r in WORLD}
        norms = {r: [0.3 * (40 if r == 2 else 1)] * len(LAYERS) for r in WORLD}
        det.observe(_sharded_digest(s, losses, norms), 0.0)
        view = JobView(now=0.0, ranks={}, seen={}, live=set(WORLD), members={"0": list(WORLD)}, classes={})
        found += [ask.suspect for ask in det.judge(view).asks]
    assert [(f.rank, f.statistic, f.pattern, f.confirmable) for f in found] == [(1, "loss", "persistent", False)]
    assert found[0].step - 100 <= 5


def test_a_sharded_jobs_reduce_scatter_inputs_are_compared_and_its_shards_are_not():
    """FSDP2's reduce-scatter input is each rank's whole local gradient (probe/grad_sync.py): one step of noise
    there, on rank 3, is a spike of that bucket; the parameters' shards (rank 2's far off here) stay ignored."""
    from trainscout.detectors.interface import JobView

    layers = LAYERS + ["grad-sync.0", "grad-sync.1"]
    rng = random.Random(2)
    det, found = NumericDetector(), []
    for s in range(1, 200):
        losses = {r: 4.0 * (1 + rng.gauss(0, 0.03)) for r in WORLD}
        norms = {
            r: [0.3 * (40 if r == 2 else 1)] * len(LAYERS)
            + [0.5 * math.exp(rng.gauss(0, 0.1)) * (500 if (r, s) == (3, 120) else 1) for _ in range(2)]
            for r in WORLD
        }
        det.observe(_sharded_digest(s, losses, norms, layers), 0.0)
        view = JobView(now=0.0, ranks={}, seen={}, live=set(WORLD), members={"0": list(WORLD)}, classes={})
        found += [ask.suspect for ask in det.judge(view).asks]
    assert [(f.rank, f.step, f.statistic, f.pattern, f.confirmable) for f in found] == [
        (3, 120, "grad_norm", "spike", False)
    ]
    assert found[0].layer.startswith("grad-sync.")
    assert "gradient bucket" in numeric_finding(found[0]).summary


def _tp_digest(step: int, losses: dict[int, float]):
    """Ranks of one data-parallel class, each also in a tensor-parallel group (TP 2 x DP 3: the class is 0, 2, 4)."""
    from trainscout.wire.messages import NodeDigest, NumericRecord, PgState, RankState

    ranks = []
    for r, loss in losses.items():
        dp = PgState("dp", "dp", list(losses), step, 0, [], [], 0.0, role="replicate", framework="DDP")
        tp = PgState(f"tp{r}", "tp", [r, r + 1], step, 0, [], [], 0.0, role="tensor", framework="DTensor TP")
        ranks.append(
            RankState(
                r,
                r,
                6,
                100 + r,
                True,
                step,
                0.1,
                0.1,
                step,
                [dp, tp],
                numerics=[NumericRecord(step, loss, [])],
                replica_group="dp",
            )
        )
    return NodeDigest("n0", "h0", step, ranks)


def test_a_tensor_parallel_ranks_deviation_is_named_only_where_replay_reproduces_it():
    """A rank computes each layer with its tensor-parallel peers: a flip on one of them moves both ranks' loss
    alike, and its healthy peer was named. Such a suspect is coupled; unreproduced, it is logged, not named."""
    from trainscout.coordinator.confirmation import is_observation
    from trainscout.detectors.interface import JobView

    rng = random.Random(3)
    det, found = NumericDetector(), []
    for s in range(1, 120):
        losses = {r: 4.0 * (1 + rng.gauss(0, 0.03)) * (3 if r == 2 and s >= 60 else 1) for r in (0, 2, 4)}
        det.observe(_tp_digest(s, losses), 0.0)
        view = JobView(now=0.0, ranks={}, seen={}, live={0, 2, 4}, members={}, classes={"dp": [0, 2, 4]})
        found += [ask.suspect for ask in det.judge(view).asks]
    assert [(f.rank, f.statistic, f.coupled) for f in found] == [(2, "loss", True)]
    finding = numeric_finding(found[0])
    finding.evidence["confirmation"] = {"outcome": "transient"}
    assert is_observation(finding)
    finding.evidence["confirmation"] = {"outcome": "reproduced"}
    assert not is_observation(finding)
    plain = numeric_finding(NumericSuspect(1, 80, "loss", "persistent", ratio=3.0, z=60.0, steps=[77, 78, 79, 80]))
    plain.evidence["confirmation"] = {"outcome": "transient"}
    assert not is_observation(plain)  # a replica computing alone: its loss is its own


def test_a_sharded_finding_is_named_at_once_and_says_why_it_is_not_confirmed():
    from trainscout.coordinator.confirmation import without_replicas
    from trainscout.detectors.numerics import NumericSuspect

    f = without_replicas(
        numeric_finding(
            NumericSuspect(
                1, 104, "loss", "persistent", ratio=2.5, z=60.0, steps=[101, 102, 103, 104], confirmable=False
            )
        )
    )
    assert f.culprit_ranks == [1] and f.kind == "sdc" and f.evidence["confirmation"]["outcome"] == "unconfirmed"
    assert "data-parallel peers" in f.summary and "sharded job" in f.summary


def test_one_parameters_gradient_zeroed_on_one_rank_is_a_suspect_after_three_steps():
    """A hook dropping one weight's gradient moves its block's norm by less than its batches do (0.89-0.97x in a
    4-rank causal LM): the count of exactly-0 gradients shows it."""
    found = _run(range(1, 200), zeros_of=lambda r, s: 1 if r == 2 and s >= 100 else 0)
    assert [(f.rank, f.statistic, f.pattern, f.layer, f.steps, f.count) for f in found] == [
        (2, "grad_norm", "zero-params", "blocks.1", [100, 101, 102], 1)
    ]
    assert (
        "1 parameter(s) of blocks.1 have a local gradient of exactly 0 in 3 steps" in numeric_finding(found[0]).summary
    )


def test_one_parameters_gradient_repeating_its_step_before_is_a_suspect_at_once():
    found = _run(range(1, 200), repeats_of=lambda r, s: 2 if r == 1 and s == 150 else 0)
    assert [(f.rank, f.pattern, f.layer, f.step, f.count) for f in found] == [
        (1, "repeated-params", "blocks.1", 150, 2)
    ]
    assert "bit for bit the one of its step before" in numeric_finding(found[0]).summary


@pytest.mark.parametrize(
    "zeros_of",
    [
        lambda r, s: 1 if r == 2 and s % 10 in (0, 1) else 0,  # two steps at a time (an expert now and then)
        lambda r, s: 1 if r == 2 else 0,  # from the start: no history of not 0
        lambda r, s: 1 if r in (1, 2) and s >= 100 else 0,  # two ranks alike: no minority
        lambda r, s: 3 if s >= 100 else (1 if r == 2 else 0),  # every rank the same from step 100
    ],
)
def test_odd_parameters_that_are_brief_always_so_or_shared_name_nobody(zeros_of):
    assert _run(range(1, 200), zeros_of=zeros_of) == []


def test_a_whole_layer_at_zero_is_left_to_the_zero_rule():
    zeroed = lambda r, s: r == 3 and s >= 100  # noqa: E731
    found = _run(
        range(1, 200),
        norms_of=lambda r, s, n: [0.0 if zeroed(r, s) and i == 2 else x for i, x in enumerate(n)],
        zeros_of=lambda r, s: 4 if zeroed(r, s) else 0,
    )
    assert [(f.rank, f.pattern, f.layer) for f in found] == [(3, "zero", "blocks.1")]


@pytest.mark.parametrize("pattern", ["zero-params", "repeated-params"])
def test_odd_parameters_are_named_only_where_replay_reproduces_them(pattern):
    from trainscout.coordinator import confirmation

    def judged(outcome: str) -> bool:
        f = numeric_finding(NumericSuspect(2, 100, "grad_norm", pattern, layer="blocks.1", steps=[100], count=1))
        f.evidence["confirmation"] = {"outcome": outcome}
        return confirmation.is_observation(f)

    assert judged("transient") and judged("unconfirmed")  # an expert without a token now and then; gone by replay
    assert not judged("reproduced")


def test_a_small_bias_that_never_changes_side_is_a_suspect_for_replay():
    """One weight's gradient doubled by a hook moved its block's norm 1.14x (in the middle), above its peers' in
    92 % of steps: at z 1-2, far under the persistent rule's bars."""
    rng = random.Random(9)
    found = _run(
        range(1, 300),
        norms_of=lambda r, s, n: [
            x * 1.14 * (1 + rng.gauss(0, 0.02)) if r == 3 and s >= 100 and i == 2 else x for i, x in enumerate(n)
        ],
    )
    assert [(f.rank, f.statistic, f.pattern, f.layer) for f in found] == [(3, "grad_norm", "biased", "blocks.1")]
    assert 100 < found[0].step <= 100 + 80 and 1.08 < found[0].ratio < 1.2
    assert "above its peers' median in" in numeric_finding(found[0]).summary


@pytest.mark.parametrize("seed", range(5, 25))
def test_healthy_replicas_are_not_biased(seed):
    assert _run(range(1, 500), seed=seed) == []


def test_a_biased_rank_is_named_only_where_replay_reproduces_it():
    from trainscout.coordinator import confirmation

    for statistic in ("loss", "grad_norm"):
        f = numeric_finding(NumericSuspect(1, 100, statistic, "biased", layer="", ratio=1.1, steps=list(range(30))))
        f.evidence["confirmation"] = {"outcome": "transient"}
        assert confirmation.is_observation(f)  # a rank's own data (a domain of its own) biases it too
        f.evidence["confirmation"] = {"outcome": "reproduced"}
        assert not confirmation.is_observation(f)


def test_a_loss_off_its_peers_since_judging_began_is_biased_not_a_fault_that_set_in():
    """A 4-rank job whose ranks read different token ranges: rank 0's loss 0.82x its peers' from the start, named
    at step 41. Off since the start, it is the rank's data; replay decides. One that sets in later is named."""
    always = _run(range(1, 300), loss_of=lambda r, s, x: x * 0.8 if r == 0 else x)
    assert [(f.rank, f.statistic, f.pattern) for f in always] == [(0, "loss", "biased")]
    later = _run(range(1, 300), loss_of=lambda r, s, x: x * 0.8 if r == 0 and s >= 100 else x)
    assert [(f.rank, f.statistic, f.pattern) for f in later] == [(0, "loss", "persistent")]


def test_a_loss_deviation_that_sets_in_while_its_start_is_still_in_the_recent_steps_is_named():
    """A sharded job's rank 2 flipped at step 60, flagged at 69-73: its last 32 steps held the deviation's own
    start, above its peers under the persistent bars, 3 in 4 in all, and it was taken for a rank biased by its
    data. Its first judged steps were balanced: it set in."""

    def loss_of(r, s, x):
        if r != 2 or s < 50:
            return x
        return x * (1.05 if s < 69 else 1.45)

    found = _run(range(1, 200), loss_of=loss_of)
    assert [(f.rank, f.statistic, f.pattern) for f in found] == [(2, "loss", "persistent")]
