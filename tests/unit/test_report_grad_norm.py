"""The report's gradient-norm timeline sums a record's layer norms only: not the gradient buckets as they entered
their reduction (the same gradients again) nor the per-layer counts of odd parameters."""

from __future__ import annotations

import json
import math

from trainscout.sinks.report_series import read_evidence

LAYERS = ["a", "b", "zero-params:a", "zero-params:b", "repeated-params:a", "repeated-params:b", "grad-sync.0"]


def test_the_total_gradient_norm_leaves_out_buckets_and_counts(tmp_path):
    path = tmp_path / "evidence.jsonl"
    lines = [
        {"rank": 0, "layers": LAYERS, "numerics": [[1, 2.0, [3.0, 4.0, 4.0, 0.0, 1.0, 0.0, 5.0]]]},
        {"rank": 1, "layers": LAYERS, "numerics": [[1, 2.0, [6.0, 8.0, 0.0, 0.0, 0.0, 0.0, 10.0]]]},
        {"rank": 0, "numerics": [[2, 2.0, [0.6, 0.8, 1.0, 0.0, 0.0, 0.0, 1.0]]]},  # its layer list from before
        {"rank": 2, "numerics": [[1, 2.0, [3.0, 4.0]]]},  # no layer list known: every entry
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ranks, steps, values = read_evidence(path).metrics["grad"]
    got = {(int(r), int(s)): float(v) for r, s, v in zip(ranks, steps, values)}
    assert got == {(0, 1): 5.0, (1, 1): 10.0, (0, 2): 1.0, (2, 1): 5.0}


def test_ranks_with_different_layer_lists_in_one_batch_each_use_their_own(tmp_path):
    path = tmp_path / "evidence.jsonl"
    lines = [
        {"rank": 0, "layers": ["a", "grad-sync.0"], "numerics": [[1, 1.0, [3.0, 9.0]]]},
        {"rank": 1, "layers": ["a", "b"], "numerics": [[1, 1.0, [3.0, 4.0]]]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ranks, steps, values = read_evidence(path).metrics["grad"]
    assert {int(r): float(v) for r, v in zip(ranks, values)} == {0: 3.0, 1: 5.0}
    assert not any(math.isnan(v) for v in values)
