"""The host side of the CUDA checks, on plain data: the in-flight ring and the non-finite verdicts.

The device side (kernels, pinned copies, events) runs in tests/gpu; here `InFlight` gets fake "copy
landed" flags and `NonFiniteCheck` judges vectors as they would come back from the device: the non-finite
reports, and the per-step evidence (loss, each gradient's sum of squares) taken from the same vectors. The
kernel itself runs here under Triton's interpreter on CPU tensors when Triton is installed (skipped otherwise).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import types
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


def _kernel_vector(counts, sumsq, loss):
    """A counting kernel's vector as it lands (float32): counts per item, sums of squares per item, the loss."""
    import numpy as np

    return np.asarray(list(counts) + list(sumsq) + [loss], dtype=np.float32)


class _Evidence:
    """Stands in for LocalEvidence: records what the check emits."""

    def __init__(self) -> None:
        self.emitted: list[tuple] = []
        self.params: list[str] = []

    def set_params(self, names) -> None:
        self.params = list(names)

    def emit_values(self, step, loss, sumsq) -> None:
        self.emitted.append((step, loss, None if sumsq is None else [float(v) for v in sumsq]))


def _check_with_evidence(device_names, evidence_names=None):
    """A check whose CUDA gradients are `device_names`, with per-step evidence over `evidence_names` (the
    order hook_params gives the evidence; by default the same)."""
    records = []
    evidence = _Evidence()
    check = NonFiniteCheck(lambda *rec: records.append(rec), lambda: 0, evidence=evidence)
    check._device_names = list(device_names)
    names = list(device_names if evidence_names is None else evidence_names)
    evidence.set_params(names)
    check._evidence_pos = {n: i for i, n in enumerate(names)}
    return check, records, evidence


def test_judge_of_counts_names_the_loss_and_the_first_gradient_in_parameter_order():
    import numpy as np

    check, records = _check()
    owner = np.array([0, 2, 2, 1, 3])  # item -> tensor (0: the loss); items grouped by dtype, not in order
    check._judge((4, ["a", "b", "c"], owner), _kernel_vector([0, 0, 0, 0, 0], [1, 2, 3, 4, 5], 1.0))
    assert records == []
    check._judge((5, ["a", "b", "c"], owner), _kernel_vector([0, 0, 3, 0, 1], [1, 2, math.nan, 4, math.inf], 1.0))
    assert [(r[5], r[7]) for r in records] == [(5, "grad b")]  # b (tensor 2) comes before c (tensor 3)
    check._judge((6, ["a", "b", "c"], owner), _kernel_vector([1, 0, 0, 2, 0], [math.inf, 2, 3, math.nan, 5], math.inf))
    assert [(r[5], r[7]) for r in records][1:] == [(6, "loss"), (6, "grad a")]


def test_judge_of_the_kernel_vector_emits_each_gradients_sum_of_squares_and_the_signed_loss():
    import numpy as np

    check, records, evidence = _check_with_evidence(["blocks.0.w", "blocks.1.w", "head.w"])
    owner = np.array([0, 2, 2, 1, 3])  # tensor 2 (blocks.1.w) spans two items
    check._judge((9, check._device_names, owner), _kernel_vector([0] * 5, [6.25, 1.5, 2.25, 4.0, 9.0], -2.5))
    assert records == []
    assert evidence.emitted == [(9, -2.5, [4.0, 3.75, 9.0])]  # the loss's own square (item 0) is not a gradient


def test_judge_of_the_kernel_vector_reports_the_same_with_and_without_evidence():
    import numpy as np

    owner = np.array([0, 2, 2, 1, 3])
    vectors = [
        (3, _kernel_vector([0, 0, 0, 0, 0], [1, 2, 3, 4, 5], 0.5)),
        (4, _kernel_vector([0, 0, 2, 0, 0], [1, 2, math.nan, 4, 5], 0.25)),
        (5, _kernel_vector([1, 1, 0, 0, 0], [math.inf, math.nan, 3, 4, 5], -math.inf)),
    ]
    plain, plain_records = _check()
    check, records, evidence = _check_with_evidence(["a", "b", "c"])
    for step, values in vectors:
        plain._judge((step, ["a", "b", "c"], owner), values)
        check._judge((step, check._device_names, owner), values)
    assert [r[5:] for r in records] == [r[5:] for r in plain_records]
    assert [(r[5], r[7]) for r in records] == [(4, "grad b"), (5, "loss"), (5, "grad b")]
    assert [e[0] for e in evidence.emitted] == [3, 4, 5]
    assert evidence.emitted[0][1:] == (0.5, [4.0, 5.0, 5.0])
    assert math.isnan(evidence.emitted[1][2][1]) and evidence.emitted[1][2][::2] == [4.0, 5.0]
    assert evidence.emitted[2][1] == -math.inf and math.isnan(evidence.emitted[2][2][1])


def test_judge_of_a_sampled_read_scales_each_items_sum_of_squares_by_the_share_it_read():
    import numpy as np

    check, records, evidence = _check_with_evidence(["w", "b"])
    owner = np.array([0, 1, 1, 2])  # w spans two items, one read at 1 in 8, one whole
    share = np.array([1.0, 0.125, 1.0, 1.0])
    check._judge((4, check._device_names, owner, share), _kernel_vector([0] * 4, [1.0, 2.0, 3.0, 5.0], 0.5))
    assert records == [] and evidence.emitted == [(4, 0.5, [19.0, 5.0])]
    check._judge((5, check._device_names, owner, share), _kernel_vector([0, 1, 0, 0], [1.0, math.nan, 3.0, 5.0], 0.5))
    assert [(r[5], r[7]) for r in records] == [(5, "grad w")]  # a non-finite element in the sample names it


def test_judge_of_a_finite_sum_of_squares_past_float32_reads_the_float32_limit_not_inf():
    import numpy as np

    from trainscout.probe.local_evidence import F32_MAX

    check, records, evidence = _check_with_evidence(["w", "b"])
    owner = np.array([0, 1, 2])
    # one element of w with an exponent bit flipped (~1e35): its float32 sum of squares is Inf, no element counted
    check._judge((7, check._device_names, owner), _kernel_vector([0, 0, 0], [1.0, math.inf, 4.0], 0.5))
    assert records == [] and evidence.emitted == [(7, 0.5, [F32_MAX, 4.0])]
    # a real Inf element stays non-finite, in the evidence too
    check._judge((8, check._device_names, owner), _kernel_vector([0, 1, 0], [1.0, math.inf, 4.0], 0.5))
    assert [(r[5], r[7]) for r in records] == [(8, "grad w")] and math.isinf(evidence.emitted[1][2][0])


class _Event:
    """Stands in for a CUDA timing event (none on a CPU machine): passed or not, and a clock reading."""

    def __init__(self, passed: bool, at_ms: float = 0.0) -> None:
        self.passed, self.at_ms = passed, at_ms

    def query(self) -> bool:
        return self.passed

    def elapsed_time(self, end) -> float:
        return end.at_ms - self.at_ms


def test_the_kernels_sample_rate_keeps_its_gpu_time_within_the_budget_and_ignores_idle_gpus():
    check, _ = _check()  # budget 0.001 of the step
    check._wall_s = 0.088  # a GPU-bound step of 88 ms whose whole read takes 0.4 ms: 4.5x the budget
    for _ in range(3):
        check._time_kernel(_Event(False, 0.0), _Event(True, 0.4 / check.sample), check.sample)
        check._read_timer()
    assert check.sample == 16  # 0.4 ms / 16 = 0.025 ms a step: within half the budget (0.044 ms)
    assert check.gpu_timed == 3 and check.gpu_idle == 0
    for _ in range(5):  # the GPU waits on the host (start event already passed): the read costs the step nothing
        check._time_kernel(_Event(True, 0.0), _Event(True, 0.4), check.sample)
        assert check._timer is None
    assert check.sample == 1 and check.gpu_idle == 5
    check.budget = 1.0  # a budget of 1 or more: every element, whatever it costs
    check._time_kernel(_Event(False, 0.0), _Event(True, 40.0), 1)
    check._read_timer()
    assert check.sample == 1


def test_evidence_from_device_vectors_follows_the_evidence_parameter_order_by_name():
    import numpy as np

    # the evidence lists the parameters in another order and one more (say, a bucket-view gradient)
    check, _, evidence = _check_with_evidence(["a", "b", "c"], evidence_names=["hooked", "c", "a", "b"])
    owner = np.array([0, 1, 2, 3])
    check._judge((2, check._device_names, owner), _kernel_vector([0] * 4, [1.0, 2.0, 3.0, 5.0], 1.0))
    check._judge(
        (
            3,
            ("c", "a"),
        ),
        [1.5, 3.0, 0.5],
    )  # the norm path, a gradient missing that step
    assert evidence.emitted == [(2, 1.0, [0.0, 5.0, 2.0, 3.0]), (3, 1.5, [0.0, 9.0, 0.25, 0.0])]


def test_landed_device_vectors_become_evidence_for_the_steps_they_were_taken_at():
    import numpy as np

    from trainscout.probe import nonfinite

    check, _, evidence = _check_with_evidence(["a", "b"])
    owner = np.array([0, 1, 2])
    landed = [((s, check._device_names, owner), _kernel_vector([0] * 3, [0.0, s, 2 * s], -s)) for s in (1, 2, 3)]
    check._results = types.SimpleNamespace(ready=lambda: [landed.pop(0) for _ in range(len(landed))])
    for _ in range(nonfinite.JUDGE_EVERY):  # judged every JUDGE_EVERY calls, all at once, in order
        assert evidence.emitted == []
        check.check_step()
    assert evidence.emitted == [(s, -float(s), [float(s), 2.0 * s]) for s in (1, 2, 3)]


def test_with_evidence_the_backward_end_uses_the_kernel_and_falls_back_to_norms_only_when_it_cannot():
    check, _, _ = _check_with_evidence([])
    calls = []
    kernel_takes = [True]
    check._submit_counts = lambda step, loss: calls.append(("counts", step)) or kernel_takes[0]
    check._submit = lambda step, loss, grads, names, norms=False: calls.append(("norms", step))
    check._armed = (7, "loss")
    check._backward_done()
    kernel_takes[0] = False  # e.g. a strided gradient this step
    check._armed = (8, "loss")
    check._backward_done()
    assert calls == [("counts", 7), ("counts", 8), ("norms", 8)]
    assert check._device_ok


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

C, B = nc.CHUNK, nc.BLOCK
gen = torch.Generator().manual_seed(3)
def randn(shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

def tensors_of(loss_dtype, loss_value, poison):
    base = randn(100)
    tensors = [torch.tensor(loss_value, dtype=loss_dtype),
               randn(C + B + 3),                     # fp32: two items, the second with a ragged tail
               randn((3, 7), torch.bfloat16),
               randn(C + 17, torch.bfloat16, 30.0),  # bf16: two items
               randn(C, torch.float16, 0.01),        # fp16: exactly one full item
               randn(B + 1, torch.float64, 1e10),    # fp64: one full block and one element
               torch.randn(0),
               base[1:50],                           # not 16-byte aligned: offsets in elements
               randn(5000, torch.float32, 1e12),     # squares ~1e24: within float32's range
               randn(nc.SAMPLE_MIN + 5)]             # sampled at rates above 1, with a ragged tail
    spots = [(1, 4321, "nan"), (1, C + B + 2, "inf"), (1, 5, "-inf"), (2, 11, "nan"), (3, C + 16, "inf"),
             (4, C - 1, "-inf"), (5, 0, "nan"), (7, 7, "-inf"), (0, 0, "inf"), (9, nc.SAMPLE_MIN + 4, "nan"),
             (9, 8 * 13 + 2, "inf")] if poison else []
    for t, i, v in spots:
        tensors[t].view(-1)[i] = float(v)
    return tensors

def read_by(tensors, sample, phase):
    # what a check at this sample rate reads of each tensor, worked out element by element: per item of
    # CHUNK elements, 32-byte groups whose index is phase mod the rate (items under SAMPLE_MIN: all)
    parts = []
    for t in tensors:
        flat, kept = t.reshape(-1), []
        for first in range(0, flat.numel(), C):
            item = flat[first:first + C]
            k = sample if item.numel() >= nc.SAMPLE_MIN else 1
            group = nc.SECTOR // t.element_size()
            kept.append(item[(torch.arange(item.numel()) // group) % k == phase % k])
        parts.append(torch.cat(kept) if kept else flat)
    return parts

def check(tensors, sample=1, phase=0):
    layout = nc.Layout(tensors)
    assert layout.has_value and layout.n_values == 2 * layout.n_out + 1
    out = torch.full((layout.n_values + 2,), -7.0)  # poisoned: every output must be written, nothing past them
    nc.enqueue(layout, [t.data_ptr() for t in tensors], out, types.SimpleNamespace(aux=None), sample, phase)
    got = out.numpy().astype(np.float64)
    n = layout.n_out
    counts = np.bincount(layout.owner, weights=got[:n], minlength=len(tensors))
    sumsq = np.bincount(layout.owner, weights=got[n:2 * n], minlength=len(tensors))
    read = read_by(tensors, sample, phase)
    share = np.bincount(layout.owner, weights=layout.read_share(sample, phase) * layout.item_numel,
                        minlength=len(tensors))
    assert list(share) == [float(r.numel()) for r in read], (share, [r.numel() for r in read])
    if sample > 1:
        assert share[1] < tensors[1].numel() and share[9] < tensors[9].numel()  # the large items were sampled
    want_counts = [float((~torch.isfinite(t)).sum()) for t in read]
    want_sumsq = [float(t.double().square().sum()) for t in read]
    assert list(counts) == want_counts, (counts, want_counts)
    for i, (g, w) in enumerate(zip(sumsq, want_sumsq)):
        if np.isnan(w):
            assert np.isnan(g), (i, g, w)  # NaN and Inf propagate as they do in float64
        elif np.isinf(w):
            assert g == w, (i, g, w)
        else:
            assert abs(g - w) <= 1e-5 * w, (i, g, w)  # float32 accumulation per item
    assert got[2 * n] == float(tensors[0].float()), (got[2 * n], tensors[0])  # the loss, sign included
    assert list(got[layout.n_values:]) == [-7.0, -7.0]

for loss_dtype, value, poison in [(torch.float32, -2.75, True), (torch.float32, 1.3e-3, False),
                                  (torch.bfloat16, -1.5, False), (torch.float16, 0.0999, True),
                                  (torch.float64, -3.25, False)]:
    check(tensors_of(loss_dtype, value, poison))
for sample, phase in [(2, 1), (8, 0), (8, 5), (64, 63)]:
    check(tensors_of(torch.float32, 0.5, True), sample, phase)
print("INTERPRETER OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_check_kernel_under_the_interpreter_counts_sums_squares_and_reads_the_loss_as_torch_does():
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    out = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "INTERPRETER OK" in out.stdout
