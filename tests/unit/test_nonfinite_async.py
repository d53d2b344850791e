"""The host side of the CUDA checks, on plain data: the in-flight ring and the non-finite verdicts.

The device side (kernels, pinned copies, events) runs in tests/gpu; here `InFlight` gets fake "copy
landed" flags and `NonFiniteCheck` judges vectors as they would come back from the device.
"""

from __future__ import annotations

import math

import pytest

from trainscout.probe.device_results import InFlight
from trainscout.probe.nonfinite import NONFINITE_PG_INDEX, NonFiniteCheck


def test_inflight_returns_landed_results_in_submission_order_and_stops_at_the_first_pending():
    landed = {"a": True, "b": False, "c": True}
    ring = InFlight(depth=4)
    for name in "abc":
        ring.push(lambda name=name: landed[name], name)
    assert ring.ready() == ["a"]  # "c" landed too, but results complete in stream order: wait for "b"
    assert len(ring) == 2
    landed["b"] = True
    assert ring.ready() == ["b", "c"]
    assert ring.ready() == [] and len(ring) == 0
    assert (ring.submitted, ring.completed, ring.dropped) == (3, 3, 0)


def test_inflight_is_bounded_and_counts_what_it_could_not_take():
    ring = InFlight(depth=2)
    ring.push(lambda: False, 1)
    ring.push(lambda: False, 2)
    assert not ring.has_room()
    with pytest.raises(RuntimeError):
        ring.push(lambda: True, 3)
    ring.drop()
    assert ring.dropped == 1 and len(ring) == 2


def _check():
    records = []
    check = NonFiniteCheck(lambda *rec: records.append(rec), lambda: 0)
    return check, records


def test_judge_reports_nothing_for_finite_vectors():
    check, records = _check()
    check._judge((5, ("w1", "w2")), [1.0, 2.0, 3.0])
    assert records == []


def test_judge_names_the_first_nonfinite_gradient_at_the_step_it_was_taken():
    check, records = _check()
    check._judge((12, ("blocks.0.w", "blocks.1.w", "head.w")), [0.5, 1.0, math.nan, math.inf])
    assert len(records) == 1
    pg, seq, _, _, _, step, op, desc = records[0]
    assert (pg, seq, step, op, desc) == (NONFINITE_PG_INDEX, 12, 12, "nonfinite", "grad blocks.1.w")


def test_judge_reports_a_nonfinite_loss_and_a_gradient_of_the_same_step_once_each():
    check, records = _check()
    check._judge((3, ("a", "b")), [math.inf, math.nan, 1.0])
    check._judge((3, ("a", "b")), [math.nan, math.nan, math.nan])  # a second micro-batch of step 3
    assert [(r[5], r[7]) for r in records] == [(3, "loss"), (3, "grad a")]
