"""Unit and property tests for trainscout.consensus: the exact C3 vote, the statistical vote, persistence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainscout.consensus import (
    AGREE,
    ATTRIBUTED,
    INCONCLUSIVE,
    Persistence,
    Verdict,
    median_mad,
    vote_exact,
    vote_exact_array,
    vote_statistical,
)

PROPS = settings(max_examples=200, deadline=None)


# ---------------------------------------------------------------- Verdict


def test_verdict_is_frozen_and_validates_status():
    v = Verdict(AGREE)
    with pytest.raises(AttributeError):
        v.status = ATTRIBUTED  # type: ignore[misc]
    with pytest.raises(ValueError):
        Verdict("maybe")


def test_verdict_only_attribution_names_outliers():
    with pytest.raises(ValueError):
        Verdict(INCONCLUSIVE, (1,))
    with pytest.raises(ValueError):
        Verdict(AGREE, (1,))


# ---------------------------------------------------------------- vote_exact


def test_empty_and_single_member_agree():
    assert vote_exact({}) == Verdict(AGREE, (), None, {"n": 0, "groups": {}, "counts": {}})
    assert vote_exact({7: 0xABC}) == Verdict(AGREE, (), 0xABC, {"n": 1, "groups": {0xABC: [7]}, "counts": {0xABC: 1}})


def test_all_equal_agree():
    v = vote_exact({0: 5, 1: 5, 2: 5, 3: 5})
    assert v.status == AGREE
    assert v.outliers == ()
    assert v.majority_value == 5
    assert v.evidence == {"n": 4, "groups": {5: [0, 1, 2, 3]}, "counts": {5: 4}}


def test_two_members_that_differ_detect_but_never_attribute():
    v = vote_exact({0: 1, 1: 2})
    assert v.status == INCONCLUSIVE
    assert v.outliers == ()
    assert v.majority_value is None
    assert v.evidence["groups"] == {1: [0], 2: [1]}
    assert v.evidence["n"] == 2


def test_two_two_tie_is_inconclusive():
    v = vote_exact({0: "a", 1: "b", 2: "a", 3: "b"})
    assert v.status == INCONCLUSIVE
    assert v.outliers == ()
    assert v.majority_value is None
    assert v.evidence["groups"] == {"a": [0, 2], "b": [1, 3]}
    assert v.evidence["counts"] == {"a": 2, "b": 2}


def test_three_members_one_deviant_is_attributed():
    v = vote_exact({0: 9, 1: 9, 2: 4})
    assert v.status == ATTRIBUTED
    assert v.outliers == (2,)
    assert v.majority_value == 9
    assert v.evidence == {"n": 3, "groups": {9: [0, 1], 4: [2]}, "counts": {9: 2, 4: 1}}


def test_five_members_two_different_deviants_both_attributed():
    v = vote_exact({10: 1, 11: 1, 12: 2, 13: 1, 14: 3})
    assert v.status == ATTRIBUTED
    assert v.outliers == (12, 14)
    assert v.majority_value == 1
    assert v.evidence["groups"] == {1: [10, 11, 13], 2: [12], 3: [14]}


def test_largest_group_without_strict_majority_is_inconclusive():
    # 2 of 5 is the largest group but not > n/2.
    v = vote_exact({0: 1, 1: 1, 2: 2, 3: 3, 4: 4})
    assert v.status == INCONCLUSIVE
    assert v.outliers == ()
    assert v.majority_value is None


def test_tuple_values_as_protocol_fingerprints():
    # (seq, hash) as the protocol detector publishes it.
    v = vote_exact({0: (41, 0xDEAD), 1: (41, 0xDEAD), 2: (41, 0xBEEF), 3: (41, 0xDEAD)})
    assert v.status == ATTRIBUTED
    assert v.outliers == (2,)
    assert v.majority_value == (41, 0xDEAD)


# ---------------------------------------------------------------- vote_exact_array


def _arr(d: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    return np.array(list(d.keys()), dtype=np.int64), np.array(list(d.values()), dtype=np.uint64)


def test_array_vote_matches_examples():
    assert vote_exact_array(*_arr({0: 9, 1: 9, 2: 4})) == Verdict(
        ATTRIBUTED, (2,), 9, {"n": 3, "groups": {9: [0, 1], 4: [2]}, "counts": {9: 2, 4: 1}}
    )
    assert vote_exact_array(*_arr({0: 1, 1: 2})).status == INCONCLUSIVE
    assert vote_exact_array(*_arr({0: 1, 1: 2, 2: 1, 3: 2})).status == INCONCLUSIVE
    v = vote_exact_array(*_arr({14: 3, 10: 1, 12: 2, 11: 1, 13: 1}))
    assert (v.status, v.outliers, v.majority_value) == (ATTRIBUTED, (12, 14), 1)
    assert vote_exact_array(np.array([], np.int64), np.array([], np.uint64)) == vote_exact({})


def test_array_vote_returns_python_scalars_for_full_uint64_range():
    top = 2**64 - 1
    v = vote_exact_array(np.array([0, 1, 2], np.int64), np.array([top, top, 0], np.uint64))
    assert v.majority_value == top and type(v.majority_value) is int
    assert v.outliers == (2,) and all(type(m) is int for m in v.outliers)
    assert v.evidence["groups"] == {top: [0, 1], 0: [2]}


def test_array_vote_large_class_one_deviant():
    n = 100_000
    members = np.arange(n, dtype=np.int64)
    values = np.full(n, 0x1234, dtype=np.uint64)
    values[77_777] = 0x9999
    v = vote_exact_array(members, values)
    assert (v.status, v.outliers, v.majority_value) == (ATTRIBUTED, (77_777,), 0x1234)
    assert v.evidence["counts"] == {0x1234: n - 1, 0x9999: 1}


def test_array_vote_rejects_bad_input():
    with pytest.raises(ValueError):
        vote_exact_array(np.array([0, 0, 1], np.int64), np.array([1, 1, 1], np.uint64))
    with pytest.raises(ValueError):
        vote_exact_array(np.array([0, 1], np.int64), np.array([1, 1, 1], np.uint64))


# ---------------------------------------------------------------- exact vote properties


@st.composite
def class_evidence(draw, min_size: int = 0, max_size: int = 20) -> dict[int, int]:
    members = draw(st.lists(st.integers(0, 10_000), min_size=min_size, max_size=max_size, unique=True))
    # A small alphabet so that ties, majorities and splits all occur.
    alphabet = draw(st.integers(1, 4))
    return {m: draw(st.integers(0, alphabet - 1)) * 0x9E3779B97F4A7C15 % 2**64 for m in members}


@st.composite
def with_strict_majority(draw) -> tuple[dict[int, int], int]:
    n = draw(st.integers(3, 21))
    members = draw(st.lists(st.integers(-5_000, 5_000), min_size=n, max_size=n, unique=True))
    n_majority = draw(st.integers(n // 2 + 1, n))
    majority = draw(st.integers(0, 2**64 - 1))
    others = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n - n_majority, max_size=n - n_majority))
    # Shift any accidental copy of the majority value away from it (cheaper than filtering draws).
    others = [(v + 1) % 2**64 if v == majority else v for v in others]
    # Member ids are drawn in random order, so the majority lands on arbitrary ids without a permutation.
    return dict(zip(members, [majority] * n_majority + others)), majority


@PROPS
@given(with_strict_majority())
def test_prop_strict_majority_attributes_exactly_the_non_majority(case):
    evidence, majority = case
    v = vote_exact(evidence)
    deviants = tuple(sorted(m for m, val in evidence.items() if val != majority))
    if deviants:
        assert v.status == ATTRIBUTED
        assert v.majority_value == majority
        assert v.outliers == deviants
    else:
        assert v == Verdict(AGREE, (), majority, v.evidence)


@PROPS
@given(
    st.lists(st.integers(), min_size=2, max_size=2, unique=True),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
)
def test_prop_two_members_never_attributed(ids, a, b):
    v = vote_exact({ids[0]: a, ids[1]: b})
    assert v.status != ATTRIBUTED
    assert v.status == (AGREE if a == b else INCONCLUSIVE)
    assert v.outliers == ()


@PROPS
@given(class_evidence())
def test_prop_attribution_never_names_a_majority_member(evidence):
    v = vote_exact(evidence)
    n = len(evidence)
    if v.status == ATTRIBUTED:
        holders = [m for m, val in evidence.items() if val == v.majority_value]
        assert 2 * len(holders) > n
        assert not set(v.outliers) & set(holders)
        assert set(v.outliers) | set(holders) == set(evidence)
    else:
        assert v.outliers == ()
    # Every member appears in exactly one evidence group.
    grouped = [m for group in v.evidence["groups"].values() for m in group]
    assert sorted(grouped) == sorted(evidence)


@PROPS
@given(class_evidence(max_size=30))
def test_prop_array_vote_equals_mapping_vote(evidence):
    members, values = _arr(evidence)
    assert vote_exact_array(members, values) == vote_exact(evidence)


@PROPS
@given(class_evidence(min_size=1), st.data())
def test_prop_permuting_member_ids_permutes_outliers(evidence, data):
    old_ids = list(evidence)
    new_ids = data.draw(st.lists(st.integers(0, 10_000), min_size=len(old_ids), max_size=len(old_ids), unique=True))
    rename = dict(zip(old_ids, new_ids))
    v = vote_exact(evidence)
    w = vote_exact({rename[m]: val for m, val in evidence.items()})
    assert w.status == v.status
    assert w.majority_value == v.majority_value
    assert w.outliers == tuple(sorted(rename[m] for m in v.outliers))
    assert w.evidence["counts"] == v.evidence["counts"]


# ---------------------------------------------------------------- robust statistics


def test_median_mad():
    assert median_mad(np.array([1.0, 2.0, 3.0, 4.0, 100.0])) == (3.0, 1.0)
    assert median_mad(np.array([5.0, 5.0, 5.0])) == (5.0, 0.0)
    assert median_mad(np.array([1.0, 3.0])) == (2.0, 1.0)
    with pytest.raises(ValueError):
        median_mad(np.array([]))


STRAGGLER = dict(rel_threshold=0.2, abs_threshold=0.05)


def test_statistical_one_slow_member_attributed():
    v = vote_statistical({0: 1.00, 1: 1.01, 2: 0.99, 3: 2.0, 4: 1.0}, **STRAGGLER)
    assert v.status == ATTRIBUTED
    assert v.outliers == (3,)
    assert v.majority_value == 1.0
    assert v.evidence["median"] == 1.0
    assert v.evidence["ratios"] == {3: 2.0}
    assert v.evidence["n"] == 5


def test_statistical_identical_peers_finite_z():
    # MAD is 0; the floor keeps z finite and the slow member still stands out.
    v = vote_statistical({0: 1.0, 1: 1.0, 2: 3.0}, **STRAGGLER)
    assert (v.status, v.outliers) == (ATTRIBUTED, (2,))
    assert v.evidence["mad"] == 0.0
    assert np.isfinite(v.evidence["z"][2])


def test_statistical_all_equal_agree():
    v = vote_statistical({0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0}, **STRAGGLER)
    assert (v.status, v.outliers) == (AGREE, ())
    assert vote_statistical({}, **STRAGGLER).status == AGREE


def test_statistical_fast_member_is_not_an_outlier():
    v = vote_statistical({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.1}, **STRAGGLER)
    assert (v.status, v.outliers) == (AGREE, ())


def test_statistical_relative_but_not_absolute_is_not_outlier():
    # 3x slower, but 2 ms is below the 50 ms absolute threshold.
    v = vote_statistical({0: 0.001, 1: 0.001, 2: 0.001, 3: 0.003}, **STRAGGLER)
    assert (v.status, v.outliers) == (AGREE, ())


def test_statistical_absolute_but_not_relative_is_not_outlier():
    # 0.5 s later, but only 5% of a 10 s step.
    v = vote_statistical({0: 10.0, 1: 10.0, 2: 10.0, 3: 10.5}, **STRAGGLER)
    assert (v.status, v.outliers) == (AGREE, ())


def test_statistical_z_threshold_guards_a_noisy_class():
    # Widely spread peers: 1.5 is 50% above the median but well inside the spread.
    samples = {0: 0.5, 1: 1.5, 2: 1.0, 3: 0.6, 4: 1.4}
    assert vote_statistical(samples, **STRAGGLER).status == AGREE
    assert vote_statistical(samples, **STRAGGLER, z_threshold=0.5).outliers == (1, 4)


def test_statistical_too_few_members_is_inconclusive():
    v = vote_statistical({0: 1.0, 1: 2.0}, **STRAGGLER)
    assert (v.status, v.outliers, v.majority_value) == (INCONCLUSIVE, (), None)
    assert v.evidence["suspects"] == [1]
    assert vote_statistical({0: 1.0, 1: 1.0}, **STRAGGLER).status == AGREE
    v = vote_statistical({0: 1.0, 1: 1.0, 2: 2.0}, **STRAGGLER, min_members=4)
    assert (v.status, v.outliers) == (INCONCLUSIVE, ())


def test_statistical_no_strict_majority_of_normal_members_is_inconclusive():
    # 2 of 5 slow with MAD 0 among the fast ones: suspects, but normals 3 > 2.5 -> attributed.
    five = {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0}
    assert vote_statistical(five, **STRAGGLER).outliers == (3, 4)
    # 2 of 4 slow: normal members are not a strict majority.
    four = {0: 1.0, 1: 1.0, 2: 3.0, 3: 3.0}
    v = vote_statistical(four, **STRAGGLER, z_threshold=0.1)
    assert (v.status, v.outliers) == (INCONCLUSIVE, ())
    assert v.evidence["suspects"] == [2, 3]


def test_statistical_zero_median_has_no_ratio():
    v = vote_statistical({0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0}, **STRAGGLER)
    assert (v.status, v.outliers) == (ATTRIBUTED, (3,))
    assert v.evidence["ratios"] == {3: None}


def test_statistical_rejects_non_finite():
    with pytest.raises(ValueError):
        vote_statistical({0: 1.0, 1: float("nan"), 2: 1.0}, **STRAGGLER)


def _jitter(seed: int, n: int) -> np.ndarray:
    # Seeded numpy noise (up to 1%) is much cheaper for hypothesis than drawing n floats one by one.
    return np.random.default_rng(seed).uniform(-0.01, 0.01, n)


seeds = st.integers(0, 2**32 - 1)


@PROPS
@given(
    st.integers(3, 50),
    st.floats(1.0, 1000.0),
    st.floats(1e-3, 1e3),
    seeds,
)
def test_prop_uniform_scaling_never_yields_outliers(n, base, scale, seed):
    # The whole class slowing down together (a global slowdown) blames nobody.
    samples = {m: base * scale * (1.0 + e) for m, e in enumerate(_jitter(seed, n).tolist())}
    v = vote_statistical(samples, rel_threshold=0.2, abs_threshold=0.0)
    assert (v.status, v.outliers) == (AGREE, ())


@PROPS
@given(st.integers(3, 50), st.floats(1.0, 1000.0), seeds, st.data())
def test_prop_one_member_slowed_2x_is_the_only_outlier(n, base, seed, data):
    slow = data.draw(st.integers(0, n - 1))
    ids = np.random.default_rng(seed).choice(100_000, size=n, replace=False).tolist()
    samples = {ids[i]: base * (1.0 + e) * (2.0 if i == slow else 1.0) for i, e in enumerate(_jitter(seed, n).tolist())}
    v = vote_statistical(samples, rel_threshold=0.2, abs_threshold=0.5)
    assert (v.status, v.outliers) == (ATTRIBUTED, (ids[slow],))
    assert 1.9 < v.evidence["ratios"][ids[slow]] < 2.1


@PROPS
@given(st.integers(3, 50), st.floats(1e-4, 1e-2), st.floats(1.5, 10.0), st.data())
def test_prop_relative_but_not_absolute_shift_is_not_outlier(n, base, factor, data):
    # Tiny timings: a large relative slowdown stays below the absolute threshold.
    slow = data.draw(st.integers(0, n - 1))
    samples = {m: base * (factor if m == slow else 1.0) for m in range(n)}
    assert vote_statistical(samples, rel_threshold=0.2, abs_threshold=0.1).outliers == ()


@PROPS
@given(st.integers(3, 50), st.floats(10.0, 1000.0), st.floats(0.0, 0.19), st.data())
def test_prop_absolute_but_not_relative_shift_is_not_outlier(n, base, rel, data):
    # Long steps: a large absolute delay stays below the relative threshold.
    slow = data.draw(st.integers(0, n - 1))
    samples = {m: base * (1.0 + rel if m == slow else 1.0) for m in range(n)}
    assert vote_statistical(samples, rel_threshold=0.2, abs_threshold=0.1).outliers == ()


# ---------------------------------------------------------------- Persistence


def test_persistence_needs_k_of_last_m():
    p = Persistence(k=2, m=3)
    everyone = range(4)
    assert p.observe([3], everyone) == set()  # one noisy interval: nothing
    assert p.observe([], everyone) == set()
    assert p.observe([3], everyone) == {3}  # window [hit, miss, hit]: 2 of the last 3
    assert p.observe([3], everyone) == {3}  # [miss, hit, hit]
    assert p.observe([], everyone) == {3}  # [hit, hit, miss]
    assert p.observe([], everyone) == set()  # [hit, miss, miss]: the older hit slid out


def test_persistence_counts_only_observations_a_member_took_part_in():
    p = Persistence(k=2, m=2)
    assert p.observe([1], [0, 1, 2]) == set()
    # Member 1 is absent twice: its window does not move.
    assert p.observe([], [0, 2]) == set()
    assert p.observe([], [0, 2]) == set()
    assert p.observe([1], [0, 1, 2]) == {1}


def test_persistence_outlier_counts_as_observed_and_forget():
    p = Persistence(k=1, m=1)
    assert p.observe([5], []) == {5}
    p.forget(5)
    assert p.observe([], [0]) == set()
    with pytest.raises(ValueError):
        Persistence(k=3, m=2)
    with pytest.raises(ValueError):
        Persistence(k=0, m=2)


def test_persistence_accepts_numpy_ids():
    p = Persistence(k=1, m=2)
    assert p.observe(np.array([7], np.int64), np.arange(10, dtype=np.int64)) == {7}


@PROPS
@given(st.integers(1, 6), st.integers(0, 6), st.lists(st.booleans(), min_size=1, max_size=30))
def test_prop_persistence_needs_k_hits(k, extra, history):
    m = k + extra
    p = Persistence(k=k, m=m)
    for t, is_outlier in enumerate(history):
        confirmed = p.observe([0] if is_outlier else [], [0, 1])
        window = history[max(0, t + 1 - m) : t + 1]
        assert (0 in confirmed) == (sum(window) >= k)
        assert 1 not in confirmed
