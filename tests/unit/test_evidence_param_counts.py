"""The per-step evidence's counts of odd parameters (probe/local_evidence.py): per layer, the parameters whose
local gradient is exactly 0, and those whose sum of squares repeats the step just before bit for bit."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from trainscout.channel.layout import evidence_table_path
from trainscout.probe.local_evidence import LocalEvidence

PARAMS = ["blocks.0.w", "blocks.0.b", "blocks.1.w", "head.w"]  # layers blocks.0, blocks.1, head


@pytest.fixture
def evidence():
    run_id = f"ev-{uuid.uuid4().hex[:8]}"
    records: list[tuple] = []
    ev = LocalEvidence(lambda *rec: records.append(rec), run_id, 0)
    ev.set_params(PARAMS)
    yield ev, records
    if os.path.exists(evidence_table_path(run_id, 0)):
        os.unlink(evidence_table_path(run_id, 0))


def _emit(ev, records, step, sumsq):
    ev.add_loss(1.0)
    ev.add_sumsq(np.asarray(sumsq, dtype=np.float64))
    ev.emit(step)
    values = np.frombuffer(records[-1][-1], dtype="<f4").tolist()
    return values[3:6], values[6:9]  # (zero counts, repeat counts) per layer


def _batches(ev, records, steps):
    """Steps of sums of squares that move as a new batch's do (+-30 %)."""
    rng = np.random.default_rng(0)
    for step in steps:
        last = rng.uniform(0.7, 1.3, size=len(PARAMS))
        assert _emit(ev, records, step, last) == ([0, 0, 0], [0, 0, 0])
    return last


def test_zero_and_repeated_gradients_are_counted_per_layer(evidence):
    ev, records = evidence
    last = _batches(ev, records, range(1, 31))
    # blocks.0's bias dropped to 0; blocks.1's weight repeats step 30 bit for bit
    assert _emit(ev, records, 31, [1.5, 0.0, last[2], 4.5]) == ([1, 0, 0], [0, 1, 0])
    # a 0 that stays 0 is a zero, not a repeat
    assert _emit(ev, records, 32, [1.7, 0.0, 3.5, 4.7]) == ([1, 0, 0], [0, 0, 0])


def test_a_repeat_counts_only_against_the_step_just_before(evidence):
    ev, records = evidence
    last = _batches(ev, records, range(1, 31))
    assert _emit(ev, records, 32, list(last)) == ([0, 0, 0], [0, 0, 0])  # step 31 was not measured
    again = [last[0], last[1], last[2], np.inf]
    assert _emit(ev, records, 33, again) == ([0, 0, 0], [2, 1, 0])  # Inf is the non-finite check's


def test_a_sum_of_squares_that_barely_moves_may_repeat_by_chance_and_is_not_counted(evidence):
    """Read at float32 precision, a gradient norm that moves by 1e-3 a step repeats by chance often."""
    ev, records = evidence
    for step in range(1, 31):
        assert _emit(ev, records, step, [1.0 + step * 1e-3, 1.0, 1.0, 1.0]) == ([0, 0, 0], [0, 0, 0])


def test_a_layer_norm_past_the_float32_limit_is_sent_as_the_limit(evidence):
    ev, records = evidence
    ev.add_loss(1.0)
    ev.add_sumsq(np.asarray([1e78, 1.0, 4.0, 9.0]))  # blocks.0: a norm of 1e39, beyond float32
    ev.emit(1)
    values = np.frombuffer(records[-1][-1], dtype="<f4")
    assert values[0] == np.finfo(np.float32).max and values[1:3].tolist() == [2.0, 3.0]
