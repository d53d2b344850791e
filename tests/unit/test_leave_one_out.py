"""Each member's peers' median and maximum off one sorted copy equal the brute-force leave-one-out ones."""

from __future__ import annotations

import random
import statistics

import pytest

from trainscout.consensus.leave_one_out import max_without, median_without


@pytest.mark.parametrize("n", [2, 3, 4, 5, 10, 101])
def test_equal_to_sorting_the_others_for_every_member(n):
    rng = random.Random(n)
    for _ in range(20):
        values = [rng.choice([0.5, 1.0, 1.0, 2.0]) if rng.random() < 0.3 else rng.random() for _ in range(n)]
        ordered = sorted(values)
        for i, v in enumerate(values):
            others = values[:i] + values[i + 1 :]
            assert median_without(ordered, v) == statistics.median(others)
            assert max_without(ordered, v) == max(others)


def test_one_member_has_no_peers():
    with pytest.raises(ValueError):
        median_without([1.0], 1.0)
    with pytest.raises(ValueError):
        max_without([1.0], 1.0)
