"""The stride every budgeted check shares (probe/budget.py): within half the budget, a power of two, sticky."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainscout.probe.budget import fit_stride

MAX = 64


@given(st.sampled_from([1 << k for k in range(7)]), st.floats(1e-7, 1.0), st.floats(1e-4, 0.5), st.floats(1e-3, 10.0))
def test_the_stride_keeps_the_check_within_half_its_budget_unless_capped(stride, cost_s, budget, wall_s):
    new = fit_stride(stride, cost_s, budget, wall_s, MAX)
    assert 1 <= new <= MAX and new & (new - 1) == 0  # a power of two: its steps are every larger stride's too
    share = cost_s / new / wall_s
    assert share <= budget / 2 or new == MAX
    if new < stride:  # it comes down only when the check fits in an eighth of the budget at the old stride
        assert 8 * cost_s / (budget * wall_s) < stride


def test_a_cost_between_the_two_thresholds_leaves_the_stride_where_it_is():
    # need = cost / (budget x wall) = 2.5: within [stride / 8, stride / 2] for a stride of 8
    assert fit_stride(8, 0.25e-3, 0.01, 0.01, MAX) == 8
    assert fit_stride(16, 0.25e-3, 0.01, 0.01, MAX) == 16
    assert fit_stride(32, 0.25e-3, 0.01, 0.01, MAX) == 16  # 8 x 2.5 = 20 < 32: comes down
    assert fit_stride(1, 0.25e-3, 0.01, 0.01, MAX) == 8  # 2 x 2.5 = 5: goes up to 8
