"""The end-of-backward check of CPU gradients: the fused finiteness test, the flat-buffer sum and per-gradient
sums it falls back to, and naming."""

from __future__ import annotations

import math

import pytest
import torch

from trainscout.probe import nonfinite
from trainscout.probe.nonfinite import NonFiniteCheck


def _check_with(params: dict[str, torch.Tensor], fused: bool = False):
    """fused=False switches the fused test off, so the sums it falls back to are what is tested."""
    records = []
    check = NonFiniteCheck(lambda *rec: records.append(rec), lambda: 6)
    check._fused_ok = fused
    for name, p in params.items():
        check._cpu_params.append(p)
        check._cpu_names.append(name)

    def run_check():
        check._cpu_armed = True
        check.cpu_backward_done()
        return [rec[-1] for rec in records]  # the record's text: "grad <name>"

    return check, run_check


def _params(dtype=torch.float32, shapes=((4, 3), (3,), (2, 2, 2))):
    out = {}
    for i, shape in enumerate(shapes):
        p = torch.zeros(shape, dtype=dtype, requires_grad=True)
        p.grad = torch.full(shape, 0.5, dtype=dtype)
        out[f"layer{i}.weight"] = p
    return out


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_fused_path_names_the_gradient_and_leaves_every_value_as_it_was(bad):
    params = _params(shapes=((4, 3), (3,), (2, 2, 2), (5,)))
    params["layer3.weight"].grad = torch.tensor([1e-40, -0.0, 3e38, -2.5, 7.0])  # subnormal, signed zero, huge
    check, run_check = _check_with(params, fused=True)
    before = {name: p.grad.clone() for name, p in params.items()}
    assert run_check() == []
    assert check._fused_ok and check._flat is None  # served by the fused test, no flat copy made
    for name, p in params.items():
        assert torch.equal(p.grad, before[name]) and torch.equal(p.grad.signbit(), before[name].signbit())
    params["layer1.weight"].grad[2] = bad
    assert run_check() == ["grad layer1.weight"]
    assert math.isnan(params["layer1.weight"].grad[2]) == math.isnan(bad)


def test_fused_path_does_not_report_a_finite_sum_that_overflows():
    params = _params()
    for p in params.values():
        p.grad.fill_(3e38)
    check, run_check = _check_with(params, fused=True)
    assert run_check() == [] and check._fused_ok


def test_fused_path_never_writes_a_gradient_that_is_part_of_a_graph():
    params = _params()
    x = torch.ones(3, requires_grad=True)
    params["layer1.weight"].grad = x * 2  # as backward(create_graph=True) leaves it
    check, run_check = _check_with(params, fused=True)
    assert run_check() == []
    assert params["layer1.weight"].grad.grad_fn is not None and params["layer1.weight"].grad._version == 0


def test_fused_path_gives_way_to_the_sums_for_a_sparse_gradient():
    params = _params()
    check, run_check = _check_with(params, fused=True)
    emb = params["layer0.weight"]
    emb.grad = torch.sparse_coo_tensor([[1], [2]], [math.nan], emb.shape, check_invariants=True)
    assert run_check() == ["grad layer0.weight"]
    assert not check._fused_ok


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_flat_path_names_the_gradient_that_turned_nonfinite(bad):
    params = _params()
    check, run_check = _check_with(params)
    assert run_check() == []
    assert check._flat is not None  # the flat buffer served this model
    params["layer1.weight"].grad[2] = bad
    assert run_check() == ["grad layer1.weight"]


def test_flat_path_copies_fresh_gradients_every_pass():
    params = _params()
    check, run_check = _check_with(params)
    assert run_check() == []
    # set_to_none between steps: new gradient tensors, same shapes
    for p in params.values():
        p.grad = torch.full_like(p, 0.25)
    params["layer2.weight"].grad[1, 0, 1] = math.nan
    assert run_check() == ["grad layer2.weight"]


def test_mixed_dtypes_and_missing_gradients_use_per_gradient_sums():
    params = _params()
    params["half"] = torch.zeros(5, dtype=torch.bfloat16, requires_grad=True)
    params["half"].grad = torch.ones(5, dtype=torch.bfloat16)
    check, run_check = _check_with(params)
    assert run_check() == []
    assert check._flat is None
    params["layer0.weight"].grad = None  # a parameter unused this step
    params["half"].grad[3] = math.inf
    assert run_check() == ["grad half"]


def test_missing_gradient_falls_back_even_when_a_flat_buffer_exists():
    params = _params()
    check, run_check = _check_with(params)
    assert run_check() == [] and check._flat is not None
    params["layer0.weight"].grad = None
    params["layer2.weight"].grad[0, 0, 0] = math.nan
    assert run_check() == ["grad layer2.weight"]


def test_a_finite_sum_that_overflows_names_nothing():
    params = _params()
    for p in params.values():
        p.grad.fill_(3e38)  # finite, but their float32 sum is inf
    _, run_check = _check_with(params)
    assert run_check() == []


def test_a_huge_finite_gradient_keeps_a_finite_sum_of_squares():
    from trainscout.probe.nonfinite import cpu_sums_of_squares

    grads = [torch.full((4,), 0.5), torch.full((3,), 0.5), None]
    grads[1][1] = 3.4e35  # an exponent bit flipped: its float32 norm overflows, its float64 one does not
    sums = cpu_sums_of_squares(torch, grads)
    assert sums[0] == 1.0 and sums[1] == pytest.approx(3.4e35**2, rel=1e-6) and sums[2] == 0.0
    grads[1][2] = math.inf  # a real Inf stays one
    assert math.isinf(cpu_sums_of_squares(torch, grads)[1])


def test_large_models_skip_the_second_copy(monkeypatch):
    monkeypatch.setattr(nonfinite, "FLAT_MAX_BYTES", 16)
    params = _params()
    check, run_check = _check_with(params)
    params["layer0.weight"].grad[0, 0] = math.nan
    assert run_check() == ["grad layer0.weight"]
    assert check._flat is None


def test_a_sparse_gradient_falls_back_to_per_gradient_sums():
    params = _params()
    check, run_check = _check_with(params)
    emb = params["layer0.weight"]
    emb.grad = torch.sparse_coo_tensor(
        [[1], [2]], [math.nan], emb.shape, check_invariants=True
    )  # as nn.Embedding(sparse=True) gives
    assert run_check() == ["grad layer0.weight"]
    assert check._flat is None


# ---- the budget: CPU gradients are tested on every `stride`-th step, the loss on every step --------------


def _budgeted(budget: float):
    """A check driven through its backward wrapper (real autograd), with the step counter under test control."""
    import types

    records, state = [], {"step": 0}
    check = NonFiniteCheck(lambda *rec: records.append(rec), lambda: state["step"], budget=budget)
    autograd = types.SimpleNamespace(backward=torch.autograd.backward)
    check.patch_autograd(autograd)
    w = torch.nn.Parameter(torch.ones(4))
    check.hook_params([w], {id(w): "w"})

    def step(poison_grad=False, poison_loss=False, wall_s=0.01):
        w.grad = None
        x = torch.full((4,), math.nan if poison_grad else 1.0)
        # a NaN input: the gradient of w turns NaN, the loss of (w * x) stays finite only if masked below
        loss = (w * x).nan_to_num(0.0).sum() if poison_grad else (w * x).sum()
        if poison_loss:
            loss = loss * math.nan
        autograd.backward(loss)
        state["step"] += 1
        check.check_step(wall_s)
        return [(r[5], r[7]) for r in records[-1:]] if records else []

    return check, step, records


def test_every_step_is_tested_at_a_budget_of_one():
    check, step, records = _budgeted(budget=1.0)
    for _ in range(5):
        step()
    assert check.cpu_checks == 5 and check.stride == 1
    step(poison_grad=True)
    assert records and records[-1][5] == 6 and records[-1][7] == "grad w"


def test_the_stride_fits_the_budget_and_unchecked_steps_are_not_tested(monkeypatch):
    check, step, records = _budgeted(budget=0.001)
    clock = {"t": 0.0}

    def fake_perf_counter():  # read twice per test: each test appears to take 50 us; a step's wall time is 10 ms
        clock["t"] += 0.00005
        return clock["t"]

    monkeypatch.setattr(nonfinite.time, "perf_counter", fake_perf_counter)
    for _ in range(40):
        step(wall_s=0.01)
    # 50 us per test within half of 0.1 % of a 10 ms step: a stride of at least 10, a power of two
    assert check.stride == 16, check.stride
    tested_before = check.cpu_checks
    assert tested_before < 40
    while (check.get_step() + 1) % check.stride == 0:  # the next step is not a multiple of the stride
        step()
    step(poison_grad=True)  # a NaN gradient on an unchecked step: not tested, nothing named
    assert records == [] and check.cpu_checks == tested_before
    while (check.get_step() + 1) % check.stride:
        step()
    step(poison_grad=True)  # on a multiple of the stride the gradient is tested and named
    assert [(r[5], r[7]) for r in records] == [(check.get_step(), "grad w")]


def test_the_loss_is_tested_on_every_step_whatever_the_stride():
    check, step, records = _budgeted(budget=0.001)
    check.stride = 64
    for _ in range(3):
        step()
    step(poison_loss=True)
    assert [(r[5], r[7].strip()) for r in records] == [(4, "loss")]


def _watched_scaler(monkeypatch, check, enabled=True):
    """A real torch.amp GradScaler whose `scale` the check watches (the class is restored after the test)."""
    from torch.amp import grad_scaler

    for name in ("scale", "update"):
        monkeypatch.setattr(grad_scaler.GradScaler, name, getattr(grad_scaler.GradScaler, name))
    monkeypatch.setattr(grad_scaler.GradScaler, "_trainscout_watched", False, raising=False)
    check.watch_loss_scaler(grad_scaler)
    return grad_scaler.GradScaler("cpu", init_scale=2.0**16, enabled=enabled)


def test_a_loss_scalers_overflow_is_named_only_once_it_persists(monkeypatch):
    params = _params()
    check, run_check = _check_with(params, fused=True)
    scaler = _watched_scaler(monkeypatch, check)
    loss = torch.tensor(2.0, requires_grad=True)
    assert scaler.scale(loss).item() == 2.0**17 and check.loss_scaling
    grad = params["layer1.weight"].grad
    dummy = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([dummy], lr=0.1)

    def step_ends():  # the scaler's step (taken or skipped) and update, as a training loop calls them
        dummy.grad = torch.zeros(1)
        scaler.step(opt)
        scaler.update()

    # overflows now and then, on this replica only: the scaler skips those steps, nobody is named
    for overflow in (True, False, True, True, False):
        grad[0] = math.inf if overflow else 0.5
        assert run_check() == []
        step_ends()
    # one overflow carried through 12 accumulated micro-batches of one step: one scale, nobody is named
    grad[0] = math.inf
    assert [run_check() for _ in range(12)] == [[]] * 12
    step_ends()
    grad[0] = 0.5
    assert run_check() == []
    # non-finite in every pass, step after step, whatever the scale: named at the 8th pass in a row
    grad[0] = math.nan
    for _ in range(nonfinite.SCALED_OVERFLOW_PASSES - 1):
        assert run_check() == []
        step_ends()
    (text,) = run_check()
    assert text.startswith("grad layer1.weight (in 8 backward passes in a row")


def test_a_disabled_loss_scaler_leaves_the_check_as_it_is(monkeypatch):
    params = _params()
    check, run_check = _check_with(params, fused=True)
    scaler = _watched_scaler(monkeypatch, check, enabled=False)
    scaler.scale(torch.tensor(2.0, requires_grad=True))
    assert not check.loss_scaling
    params["layer1.weight"].grad[0] = math.inf
    assert run_check() == ["grad layer1.weight"]


def test_deepspeeds_dynamic_loss_scaler_is_watched_too(monkeypatch):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    cls = loss_scaler.DynamicLossScaler
    for name in ("scale_loss", "update_scale"):  # restored after the test
        monkeypatch.setattr(cls, name, getattr(cls, name))
    monkeypatch.setattr(cls, "_trainscout_watched", False, raising=False)
    check, _ = _check_with(_params())
    check.watch_loss_scaler(loss_scaler)
    check.watch_loss_scaler(loss_scaler)  # a second import hook call wraps nothing twice
    scaler = cls(init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=1, consecutive_hysteresis=False)
    assert scaler.scale_loss(torch.tensor(3.0)).item() == 3.0 * 2.0**16 and check.loss_scaling
    scaler.update_scale(False)  # (an overflow logs through DeepSpeed's process group)
    assert check._scaler_updates == 1 and scaler.cur_iter == 1


def test_a_scaler_subclass_inheriting_a_watched_method_counts_each_update_once(monkeypatch):
    from torch.amp import grad_scaler

    class Inheriting(grad_scaler.GradScaler):  # overrides neither scale nor update
        pass

    class Module:  # a module exposing only the subclass, as FSDP's sharded_grad_scaler does
        ShardedGradScaler = Inheriting

    check, _ = _check_with(_params())
    _watched_scaler(monkeypatch, check)  # the base class watched first
    monkeypatch.setattr(Inheriting, "_trainscout_watched", False, raising=False)
    check.watch_loss_scaler(Module)
    assert "scale" not in vars(Inheriting) and "update" not in vars(Inheriting)
    sub = Inheriting("cpu", init_scale=2.0**16)
    sub.scale(torch.tensor(1.0, requires_grad=True))
    dummy = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([dummy], lr=0.1)
    dummy.grad = torch.zeros(1)
    sub.step(opt)
    sub.update()
    assert check._scaler_updates == 1 and check.loss_scaling
