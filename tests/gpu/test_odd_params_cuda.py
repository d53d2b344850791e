"""One weight's gradient dropped or held stale on one rank, on the CUDA paths (4 gloo ranks sharing the GPU, the
demo under `trainscout run`): the counting kernel's sums of squares give the odd-parameter counts, and the
confirmation's replay on the GPU reproduces the fault, so the rank is named."""

from __future__ import annotations

import sys

import pytest
from job_runs import free_port, run_under_trainscout


@pytest.mark.parametrize(("op", "pattern"), [("zero", "zero-params"), ("stale", "repeated-params")])
def test_one_weights_gradient_dropped_or_held_stale_is_named_on_cuda(tmp_path, op, pattern):
    job = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port())]
    job += ["-m", "trainscout.demo.train", "--device", "cuda", "--steps", "1500"]
    inject = f"gradnoise:rank=2:step=40:layer=blocks.1:param=2:op={op}:count=100000"
    done, findings, _ = run_under_trainscout(tmp_path, f"odd-{op}", job, options=("--inject", inject))
    named = [f for f in findings if f["evidence"].get("pattern") == pattern]
    assert [(f["kind"], f["culprit_ranks"], f["evidence"]["layer"]) for f in named] == [("sdc", [2], "blocks.1")], (
        done.stdout[-3000:]
    )
    assert named[0]["step"] - 40 <= 6 and named[0]["evidence"]["confirmation"]["outcome"] == "reproduced", named
    assert {r for f in findings for r in f["culprit_ranks"]} == {2}, findings
