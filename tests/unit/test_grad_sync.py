"""Gradient buckets as they enter their data-parallel reduction (probe/grad_sync.py) and their place in a step's
evidence (probe/local_evidence.py): real torch tensors on CPU, a real backward pass, the real sidecar table."""

from __future__ import annotations

import json
import math
import os
import uuid

import numpy as np
import pytest
import torch

from trainscout.channel.layout import evidence_table_path
from trainscout.probe.grad_sync import GradSyncNorms
from trainscout.probe.local_evidence import LocalEvidence, unpack_header

ROLES = {"dp": "replicate", "fsdp": "shard", "tp": "tensor"}


def _in_backward(fn) -> None:
    """Run fn inside a real backward pass (where DDP's communication hooks and FSDP2's reduce-scatter run)."""
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: (fn(), g)[1])
    (x * 3).sum().backward()


def test_only_data_parallel_reductions_inside_a_backward_pass_are_measured():
    errors: list[str] = []
    sync = GradSyncNorms(ROLES.get, errors.append)
    bucket = torch.full((4,), 2.0)
    sync.observe("all_reduce", "dp", {"tensor": bucket, "async_op": True})  # outside backward: an ordinary all-reduce
    _in_backward(
        lambda: sync.observe("all_reduce", "tp", {"tensor": bucket, "async_op": True})
    )  # tensor parallel: parts
    _in_backward(lambda: sync.observe("broadcast", "dp", {"tensor": bucket, "async_op": True}))  # not a reduction
    _in_backward(lambda: sync.observe("all_reduce", "dp", {"tensor": bucket}))  # SyncBatchNorm's statistics
    _in_backward(
        lambda: sync.observe("all_reduce", "dp", {"tensor": torch.ones(3, dtype=torch.int64), "async_op": True})
    )
    sync.end_step(1)
    assert sync.sums_of_squares(1) is None and sync.observed == 0

    _in_backward(lambda: sync.observe("all_reduce", "dp", {"tensor": bucket, "async_op": True}))
    _in_backward(lambda: sync.observe("reduce_scatter_single", "fsdp", {"input": bucket.half(), "output": None}))
    _in_backward(lambda: sync.observe("reduce_scatter", "fsdp", {"input_list": [bucket, torch.ones(2)]}))
    sync.end_step(2)
    assert sync.sums_of_squares(2).tolist() == [16.0, 16.0, 18.0]
    assert sync.sums_of_squares(2) is None  # taken once
    assert errors == []


def _read_table(run_id: str) -> dict:
    with open(evidence_table_path(run_id, 0)) as fh:
        return json.load(fh)


@pytest.fixture
def wired():
    """(evidence, its GradSyncNorms, the records it emits, its run id); its sidecar table removed after."""
    run_id = f"gs-{uuid.uuid4().hex[:8]}"
    records: list[tuple] = []
    evidence = LocalEvidence(lambda *rec: records.append(rec), run_id, 0)
    evidence.grad_sync = GradSyncNorms(ROLES.get, print)
    yield evidence, evidence.grad_sync, records, run_id
    if os.path.exists(evidence_table_path(run_id, 0)):
        os.unlink(evidence_table_path(run_id, 0))


def test_a_steps_reductions_follow_its_layers_in_the_evidence_and_a_new_count_is_a_new_table(wired):
    evidence, sync, records, run_id = wired
    evidence.set_params(["blocks.0.w", "blocks.1.w"])
    first = _read_table(run_id)
    counts = ["zero-params:blocks.0", "zero-params:blocks.1", "repeated-params:blocks.0", "repeated-params:blocks.1"]
    assert first["layers"] == ["blocks.0", "blocks.1", *counts]

    for step, buckets in ((1, [3.0]), (2, [3.0, 4.0]), (3, [])):
        for value in buckets:
            _in_backward(
                lambda value=value: sync.observe(
                    "all_reduce", "dp", {"tensor": torch.tensor([value]), "async_op": True}
                )
            )
        evidence.add_loss(2.0)
        evidence.add_sumsq(np.array([1.0, 4.0]))
        evidence.step_ended(step)
        evidence.emit(step)
    norms = [np.frombuffer(rec[-1], dtype="<f4").tolist() for rec in records]
    # the layers' norms, then their counts of odd parameters (none: sums of squares that never move do not repeat)
    assert norms[0] == [1.0, 2.0, 0, 0, 0, 0, 3.0]
    assert norms[1] == [1.0, 2.0, 0, 0, 0, 0, 3.0, 4.0]  # DDP rebuilt its buckets: two now
    assert norms[2][:6] == [1.0, 2.0, 0, 0, 0, 0] and all(math.isnan(v) for v in norms[2][6:])  # none seen: unknown
    table = _read_table(run_id)
    assert table["layers"] == ["blocks.0", "blocks.1", *counts, "grad-sync.0", "grad-sync.1"]
    versions = [unpack_header(rec[3])[2] for rec in records]
    assert versions[0] < versions[1] == versions[2] == table["version"]


def test_a_sharded_rank_without_layer_norms_still_reports_its_reductions(wired):
    evidence, sync, records, run_id = wired
    evidence.add_loss(2.0)
    evidence.step_ended(1)
    evidence.emit(1)  # nothing measured but the loss
    _in_backward(lambda: sync.observe("reduce_scatter_single", "fsdp", {"input": torch.tensor([6.0, 8.0])}))
    evidence.add_loss(2.0)
    evidence.step_ended(2)
    evidence.emit(2)
    assert records[0][-1] == b""
    assert np.frombuffer(records[1][-1], dtype="<f4").tolist() == [10.0]
    assert _read_table(run_id)["layers"] == ["grad-sync.0"]


def test_a_large_bucket_is_sampled_and_its_norm_estimated_from_the_sample():
    sync = GradSyncNorms(ROLES.get, print)
    g = torch.Generator().manual_seed(0)
    bucket = torch.randn(400_000, generator=g)
    noisy = bucket.clone()
    noisy[100_000:140_000] *= 100  # one layer's worth of elements gone wrong
    for t in (bucket, noisy):
        _in_backward(lambda t=t: sync.observe("all_reduce", "dp", {"tensor": t, "async_op": True}))
    sync.end_step(1)
    clean, wrong = sync.sums_of_squares(1)
    assert math.isclose(clean, float(bucket.double().square().sum()), rel_tol=0.02)
    assert math.isclose(wrong, float(noisy.double().square().sum()), rel_tol=0.15)  # 625 noisy samples
    assert wrong / clean > 500


def test_a_few_thousand_elements_gone_wrong_inside_a_large_bucket_move_its_estimate():
    sync = GradSyncNorms(ROLES.get, print)
    g = torch.Generator().manual_seed(1)
    bucket = torch.randn(1_000_000, generator=g)
    noisy = bucket.clone()
    noisy[300_000:304_096] *= 100  # a LayerNorm's worth of elements
    for t in (bucket, noisy):
        _in_backward(lambda t=t: sync.observe("all_reduce", "dp", {"tensor": t, "async_op": True}))
    sync.end_step(1)
    clean, wrong = sync.sums_of_squares(1)
    truth = float(noisy.double().square().sum()) / float(bucket.double().square().sum())  # ~42x
    assert math.isclose(wrong / clean, truth, rel_tol=0.3), (wrong / clean, truth)
