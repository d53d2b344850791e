"""The stride that keeps a periodic check within its share of step time.

The replicated-state, all-gather and CPU non-finite checks each run on steps that are a multiple of a stride,
a power of two: then every stride's steps are steps of the larger strides too, so replicas that settled on
different strides still check some steps in common. The stride keeps the check's cost per checked step,
spread over `stride` steps, within half its budget of the step time; the other half covers what the cost
estimate misses (noisy steps, the occasional slow one). It halves only when the check would fit in an eighth
of that (hysteresis), so it does not flip between two values.
"""

from __future__ import annotations


def fit_stride(stride: int, cost_s: float, budget: float, wall_s: float, max_stride: int) -> int:
    """The stride after a check that cost `cost_s` seconds, for a step of `wall_s` seconds and a `budget` share
    of it (all positive)."""
    need = cost_s / (budget * wall_s)
    while stride < 2 * need and stride < max_stride:
        stride *= 2
    while stride > 1 and 8 * need < stride:
        stride //= 2
    return stride
