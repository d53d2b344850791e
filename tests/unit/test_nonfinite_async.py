"""The host side of the CUDA checks, on plain data: the in-flight ring and the non-finite verdicts.

The device side (kernels, pinned copies, events) runs in tests/gpu; here `InFlight` gets fake "copy
landed" flags and `NonFiniteCheck` judges vectors as they would come back from the device.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

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


def test_judge_of_counts_names_the_loss_and_the_first_gradient_in_parameter_order():
    import numpy as np

    check, records = _check()
    owner = np.array([0, 2, 2, 1, 3])  # item -> tensor (0: the loss); items grouped by dtype, not in order
    check._judge((4, ["a", "b", "c"], owner), np.array([0.0, 0.0, 0.0, 0.0, 0.0]))
    assert records == []
    check._judge((5, ["a", "b", "c"], owner), np.array([0.0, 0.0, 3.0, 0.0, 1.0]))
    assert [(r[5], r[7]) for r in records] == [(5, "grad b")]  # b (tensor 2) comes before c (tensor 3)
    check._judge((6, ["a", "b", "c"], owner), np.array([1.0, 0.0, 0.0, 2.0, 0.0]))
    assert [(r[5], r[7]) for r in records][1:] == [(6, "loss"), (6, "grad a")]


INTERPRETER_CHECK = """
import types
import numpy as np, torch
import triton.runtime.interpreter as interp

# Triton 3.6's interpreter turns scalar kernel arguments into 1-element arrays and calls int() on them
# for loop bounds, which numpy >= 2.4 refuses; read the element instead (test-only shim).
_orig = interp._patch_lang_tensor
def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
interp._patch_lang_tensor = _patched

from trainscout.probe import nonfinite_cuda as nc

gen = torch.Generator().manual_seed(3)
base = torch.randn(100, generator=gen)
tensors = [torch.randn((), generator=gen), torch.randn(nc.CHUNK + nc.BLOCK + 3, generator=gen),
           torch.randn(3, 7, generator=gen).to(torch.bfloat16), torch.randn(17, generator=gen).half(),
           torch.randn(9, generator=gen).double(), torch.randn(0), base[1:50]]
for t, idx, v in [(1, 4321, "nan"), (1, nc.CHUNK + nc.BLOCK + 2, "inf"), (1, 5, "-inf"), (2, 11, "nan"),
                  (3, 16, "inf"), (4, 0, "nan"), (6, 7, "-inf"), (0, 0, "inf")]:
    tensors[t].view(-1)[idx] = float(v)
layout = nc.Layout(tensors)
out = torch.full((layout.n_out + 2,), -7.0)
nc.enqueue(layout, [t.data_ptr() for t in tensors], out, types.SimpleNamespace(aux=None))
got = out.numpy()
per = [float(got[:layout.n_out][layout.owner == i].sum()) for i in range(len(tensors))]
want = [float((~torch.isfinite(t.float())).sum()) for t in tensors]
assert per == want and list(got[layout.n_out:]) == [-7.0, -7.0], (per, want)
print("INTERPRETER OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_counting_kernel_under_the_interpreter_counts_each_tensors_nonfinite_elements():
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    out = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "INTERPRETER OK" in out.stdout
