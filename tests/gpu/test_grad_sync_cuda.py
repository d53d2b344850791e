"""Gradient buckets entering their reduction, on CUDA (probe/grad_sync.py): the norm is taken on the device
before the collective overwrites the bucket, lands with the step's evidence a few steps later without a host
sync, and one rank's bucket changed in a DDP communication hook is named in a live job (4 ranks sharing the GPU
over gloo: 3 replicas for a majority)."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from trainscout.probe import local_evidence
from trainscout.probe.grad_sync import GradSyncNorms
from trainscout.probe.local_evidence import EVIDENCE_PG_INDEX, LocalEvidence
from trainscout.probe.nonfinite import NonFiniteCheck

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
from test_probe_cuda_live import _trainscout  # noqa: E402


def test_a_buckets_norm_is_taken_before_the_reduction_and_lands_with_its_step(cuda, tmp_path, monkeypatch):
    table = tmp_path / "layers.json"
    monkeypatch.setattr(local_evidence, "evidence_table_path", lambda run_id, rank: str(table))
    records: list = []
    evidence = LocalEvidence(lambda *rec: records.append(rec), "gpu", 0)
    evidence.grad_sync = sync = GradSyncNorms({"dp": "replicate"}.get, pytest.fail)
    state = {"step": 0}
    check = NonFiniteCheck(lambda *rec: None, lambda: state["step"], evidence=evidence)
    autograd = types.SimpleNamespace(backward=torch.autograd.backward)
    check.patch_autograd(autograd)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(cuda)
    check.hook_params(model.parameters(), {id(p): n for n, p in model.named_parameters()})
    handed: dict[int, torch.Tensor] = {}

    def bucket_ready(p) -> None:  # as a communication hook: the bucket is handed over, then overwritten
        handed[state["step"] + 1] = p.grad.detach().clone()
        sync.observe("all_reduce", "dp", {"tensor": p.grad, "async_op": True})
        p.grad.mul_(1000.0)

    model[0].weight.register_post_accumulate_grad_hook(bucket_ready)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = 12
    for step in range(1, steps + 1):
        if step == 3:  # past warm-up (first allocations): any host sync from here on raises
            torch.cuda.set_sync_debug_mode("error")
        x = torch.randn(32, 64, device=cuda)
        autograd.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] = step
        evidence.step_ended(step)  # as the probe does after each step
        check.check_step()
        evidence.emit(step)
    torch.cuda.set_sync_debug_mode("default")
    check.flush(timeout_s=10)
    evidence.flush()
    names = json.loads(table.read_text())["layers"]
    assert names[-1] == "grad-sync.0"
    got = {}
    for rec in records:
        assert rec[0] == EVIDENCE_PG_INDEX
        part, count, _ = local_evidence.unpack_header(rec[3])
        norms = np.frombuffer(rec[7], dtype=np.float32)
        start = part * local_evidence.NORMS_PER_RECORD
        if start <= len(names) - 1 < start + count:
            got[rec[1]] = float(norms[len(names) - 1 - start])
    assert sorted(got) == list(range(1, steps + 1))
    for step, bucket in handed.items():
        norm = float(bucket.double().norm())
        assert math.isclose(got[step], norm, rel_tol=1e-5), (step, got[step], norm)


def test_noise_in_one_ranks_communication_hook_is_named_on_cuda(tmp_path):
    job = REPO / "tests" / "integration" / "wrapped_lm_job.py"
    done, findings = _trainscout(
        tmp_path, "hook-noise-cuda", job, ["--cuda", "--steps", "300", "--sync-noise", "2:150"], nproc=4
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [(f["kind"], f["culprit_ranks"], f["step"]) for f in findings] == [("sdc", [2], 150)], findings
    assert findings[0]["evidence"]["layer"].startswith("grad-sync."), findings
