"""The fault drills act exactly where, when and how they say, on a real model in one process.

delay, gradnoise, outflip and starve are each implemented in more than one way so that a detection can later be
shown not to rest on how one injector works; these tests hold every way to its real effect (wall and CPU time
of the forward, gradients against a clean twin of the model, layer outputs, element-exact corruption, live
processes and their CPU affinity). No process group: the tests call on_step_end themselves, as the probe does
after each optimizer step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainscout.demo.model import GPTConfig, TinyGPT
from trainscout.faults import ENV_VAR, FaultInjector, FaultSpec, format_faults, parse_faults
from trainscout.faults.outflip import scaled_output

SRC = str(Path(__file__).resolve().parents[2] / "src")
CFG = GPTConfig()


@pytest.fixture(autouse=True)
def one_thread():
    # OpenMP workers spin-wait at barriers and charge the caller's thread CPU time on a busy machine: one thread
    # keeps a forward's time its own.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_injector():
    made: list[FaultInjector] = []

    def make(text: str, rank: int = 0) -> FaultInjector:
        inj = FaultInjector.from_env(rank, {ENV_VAR: text})
        assert inj is not None
        made.append(inj)
        return inj

    yield make
    for inj in made:
        inj.close()


def gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(CFG)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (2, CFG.seq), generator=torch.Generator().manual_seed(seed))


def loss_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).view(-1, CFG.vocab), idx.view(-1))


def names_of(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- parsing -------------------------------------------------------------------------------------------


def test_new_kinds_parse_with_their_defaults() -> None:
    assert parse_faults("delay:rank=1;starve;gradnoise:step=3;outflip;corrupt") == [
        FaultSpec("delay", (1,), 10, {"ms": 100.0, "every": 1, "layer": "", "how": "sleep"}),
        FaultSpec("starve", None, 10, {"hogs": 2}),
        FaultSpec(
            "gradnoise", None, 3, {"scale": 100.0, "count": 1, "layer": "", "how": "tensor", "op": "noise", "param": -1}
        ),
        FaultSpec("outflip", None, 10, {"factor": -1.0, "layer": "", "how": "hook"}),
        FaultSpec(
            "corrupt",
            None,
            10,
            {"target": "param", "tensor": "", "how": "bitflip", "frac": 0.0, "factor": 1000.0, "key": ""},
        ),
    ]


def test_new_parameters_parse_and_round_trip() -> None:
    text = (
        "delay:rank=0:step=4:ms=30:every=3:layer=blocks.1:how=read;starve:hogs=1;"
        "gradnoise:scale=2.5:count=4:how=activation;outflip:factor=0.5:how=patch;"
        "corrupt:target=state:key=exp_avg:how=scale:frac=0.1:factor=1000;corrupt:how=signflip:frac=0.01;"
        "corrupt:how=expflip"
    )
    specs = parse_faults(text)
    assert specs[0].params == {"ms": 30.0, "every": 3, "layer": "blocks.1", "how": "read"}
    assert specs[3].params == {"factor": 0.5, "layer": "", "how": "patch"}
    assert specs[4].params == {
        "target": "state",
        "tensor": "",
        "how": "scale",
        "frac": 0.1,
        "factor": 1000.0,
        "key": "exp_avg",
    }
    assert parse_faults(format_faults(specs)) == specs


@pytest.mark.parametrize(
    "token, message",
    [
        ("delay:how=nap", "how='nap' is not one of sleep, busy, read, lock, gpu, data"),
        ("delay:every=0", "every=0 must be >= 1"),
        ("delay:ms=-1", "ms='-1'"),
        ("delay:factor=2", "unknown key 'factor'; valid keys for delay: rank, step, attempt, ms, every, layer, how"),
        ("starve:hogs=0", "hogs=0 must be >= 1"),
        ("starve:hogs=two", "hogs='two' is not an integer"),
        ("gradnoise:scale=0", "scale='0' must be > 0"),
        ("gradnoise:count=0", "count=0 must be >= 1"),
        ("gradnoise:how=weights", "how='weights' is not one of tensor, activation"),
        ("gradnoise:op=flip", "op='flip' is not one of noise, zero, stale, expflip"),
        ("gradnoise:param=-2", "param=-2 must be >= -1"),
        ("gradnoise:how=activation:op=stale", "op=stale needs how=tensor"),
        ("gradnoise:how=activation:param=0", "param= picks one parameter's gradient; it needs how=tensor"),
        ("outflip:factor=1", "factor='1' changes nothing"),
        ("outflip:factor=inf", "factor='inf' must be a finite number"),
        ("outflip:factor=minus", "factor='minus' is not a number"),
        ("outflip:how=monkey", "how='monkey' is not one of hook, patch"),
        ("corrupt:how=flip", "bitflip, sign, scale, pct1, pct100, expflip, signflip"),
        ("corrupt:frac=1.5", "frac='1.5' must be between 0 and 1"),
        ("corrupt:key=exp_avg", "needs target=state"),
        ("corrupt:factor=10", "how=scale only"),
        ("corrupt:how=pct1:frac=0.1", "frac= does not apply to how=pct1"),
    ],
)
def test_bad_new_parameters_are_refused_naming_the_token(token: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_faults(token)
    assert repr(token) in str(err.value) and message in str(err.value)


# ---- delay ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sleep", "busy", "read", "lock"])
def test_delay_slows_the_forward_of_firing_iterations_only(how: str, make_injector) -> None:
    ms = 60
    inj = make_injector(f"delay:rank=0:step=2:every=3:ms={ms}:how={how}")
    model, idx = gpt(), tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loss_of(model, idx)  # first-call costs out of the way
    share = cpu_share_now(ms / 1000)
    wall, cpu = {}, {}
    for done in range(9):  # `done` optimizer steps completed before this iteration
        if done:
            inj.on_step_end(done, opt, names_of(model), model)
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = loss_of(model, idx)
        wall[done], cpu[done] = time.perf_counter() - t0, time.thread_time() - c0
        loss.backward()
        opt.step()
    firing = {2, 5, 8}  # after steps S, S+every, S+2*every
    assert all(wall[d] >= ms / 1000 for d in firing), wall
    assert all(wall[d] < ms / 1000 for d in set(wall) - firing), wall
    if how == "busy":  # burns the time on CPU: at least half what a CPU-bound thread gets on this machine now
        share = min(share, cpu_share_now(ms / 1000))
        assert sum(cpu[d] for d in firing) >= 0.5 * share * len(firing) * ms / 1000, (share, cpu)
    else:  # asleep, in the kernel or on a lock: off-CPU
        assert all(cpu[d] < 0.3 * ms / 1000 for d in firing), cpu


def cpu_share_now(seconds: float) -> float:
    """The fraction of a CPU a spinning thread gets on this (shared, maybe busy) machine right now."""
    t0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        pass
    return (time.thread_time() - c0) / (time.perf_counter() - t0)


def test_delay_in_data_loading_slows_the_batch_fetch_of_firing_iterations(make_injector) -> None:
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data import dataloader as dl

    originals = dl._SingleProcessDataLoaderIter._next_data, dl._MultiProcessingDataLoaderIter._next_data
    inj = make_injector("delay:rank=0:step=1:every=2:ms=40:how=data:layer=ignored")
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=2)
    fetch: dict[int, float] = {}
    batches = iter(loader)
    for done in range(6):
        if done:
            inj.on_step_end(done)  # no model needed: the fetch is patched, not a layer
        t0 = time.perf_counter()
        next(batches)
        fetch[done] = time.perf_counter() - t0
    assert [d for d in fetch if fetch[d] >= 0.04] == [1, 3, 5], fetch
    inj.close()
    assert (dl._SingleProcessDataLoaderIter._next_data, dl._MultiProcessingDataLoaderIter._next_data) == originals


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_delay_on_the_gpu_without_cuda_logs_once_and_does_nothing(make_injector, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TRAINSCOUT_FAULT_LOG", str(tmp_path / "faults.jsonl"))
    # a delay far longer than a forward on a loaded machine (one of 40 ms was once exceeded by the forward alone)
    inj = make_injector("delay:rank=0:step=1:how=gpu:ms=3000")
    model = gpt()
    for done in (1, 2, 3):
        inj.on_step_end(done, None, {}, model)
        t0 = time.perf_counter()
        model(tokens())
        assert time.perf_counter() - t0 < 1.5
    assert capsys.readouterr().err.count("trainscout-fault: rank 0: delay: not fired: no CUDA") == 1
    assert not (tmp_path / "faults.jsonl").exists()


def test_an_intermittent_fault_logs_once_and_records_every_occurrence(
    make_injector, tmp_path, monkeypatch, capsys
) -> None:
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv("TRAINSCOUT_FAULT_LOG", str(log))
    inj = make_injector("delay:rank=0:step=2:every=3:ms=0;gradnoise:rank=0:step=3:count=2")
    model = gpt()
    for done in range(1, 10):
        inj.on_step_end(done, None, {}, model)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    delays = [(r["step"], r["params"]["occurrence"]) for r in lines if r["kind"] == "delay"]
    assert delays == [(2, 0), (5, 1), (8, 2)]
    noise = [r for r in lines if r["kind"] == "gradnoise"]
    assert [r["step"] for r in noise] == [3] and "occurrence" not in noise[0]["params"]
    err = capsys.readouterr().err
    assert err.count("trainscout-fault: rank 0: delay:") == 1 and err.count("trainscout-fault: rank 0: gradnoise:") == 1


def test_a_layer_fault_without_a_model_or_with_a_wrong_layer_fails_open(make_injector, capsys) -> None:
    make_injector("outflip:rank=0:step=1").on_step_end(1, None, {}, None)  # not DDP: the probe has no model
    make_injector("gradnoise:rank=0:step=1:layer=blocks.9").on_step_end(1, None, {}, gpt())
    err = capsys.readouterr().err
    assert "outflip: not fired: no model seen" in err
    assert "gradnoise: not fired: no layer named 'blocks.9'" in err


# ---- gradnoise -----------------------------------------------------------------------------------------


def gradients_per_iteration(spec: str, make_injector, iterations: int) -> list[tuple[dict, dict]]:
    """(faulty, clean) gradients of a TinyGPT and its clean twin on the same batches, the faulty one's injector
    ticked after every step (lr=0 keeps the twins' weights equal)."""
    inj = make_injector(spec)
    faulty, clean, idx = gpt(), gpt(), tokens()
    opt = torch.optim.SGD(faulty.parameters(), lr=0.0)
    out = []
    for done in range(iterations):
        if done:
            inj.on_step_end(done, opt, names_of(faulty), faulty)
        for model in (faulty, clean):
            model.zero_grad()
            loss_of(model, idx).backward()
        out.append((grads(faulty), grads(clean)))
        opt.step()
    return out


def changed(faulty: dict, clean: dict) -> set[str]:
    return {n for n in clean if not torch.equal(faulty[n], clean[n])}


def test_gradnoise_on_tensors_changes_exactly_the_layer_in_exactly_count_steps(make_injector) -> None:
    per_iteration = gradients_per_iteration("gradnoise:rank=0:step=2:count=2:scale=100", make_injector, 6)
    layer = {n for n in per_iteration[0][1] if n.startswith("blocks.0.")}
    for done, (faulty, clean) in enumerate(per_iteration):
        if done in (2, 3):
            assert changed(faulty, clean) == layer, done  # every tensor of the layer, nothing else
            diff = torch.cat([(faulty[n] - clean[n]).flatten() for n in layer])
            ratio = [(faulty[n] - clean[n]).pow(2).mean().sqrt() / clean[n].pow(2).mean().sqrt() for n in layer]
            assert 80 < float(torch.stack(ratio).median()) < 120  # std = scale x the gradient's RMS
            assert abs(float(diff.mean())) < 0.2 * float(diff.std())  # zero-mean noise
        else:
            assert changed(faulty, clean) == set(), done


def test_gradnoise_zero_on_one_parameter_drops_exactly_its_gradient(make_injector) -> None:
    per_iteration = gradients_per_iteration("gradnoise:rank=0:step=1:count=2:op=zero:param=2", make_injector, 4)
    third = [n for n in per_iteration[0][1] if n.startswith("blocks.0.")][2]
    for done, (faulty, clean) in enumerate(per_iteration):
        assert changed(faulty, clean) == ({third} if done in (1, 2) else set()), done
        if done in (1, 2):
            assert not faulty[third].any() and clean[third].any()


def test_gradnoise_expflip_makes_one_element_of_one_gradient_huge_and_finite(make_injector) -> None:
    per_iteration = gradients_per_iteration("gradnoise:rank=0:step=1:count=1:op=expflip:param=0", make_injector, 3)
    first = [n for n in per_iteration[0][1] if n.startswith("blocks.0.")][0]
    for done, (faulty, clean) in enumerate(per_iteration):
        assert changed(faulty, clean) == ({first} if done == 1 else set()), done
        if done == 1:
            moved = (faulty[first] != clean[first]).flatten()
            assert int(moved.sum()) == 1  # one element: the largest, ~2**128 times larger, still finite
            i = int(moved.nonzero()[0])
            assert i == int(clean[first].abs().flatten().argmax())
            assert torch.isfinite(faulty[first]).all() and float(faulty[first].abs().max()) > 1e30


def test_gradnoise_stale_hands_on_the_gradient_of_the_pass_before(make_injector) -> None:
    """lr=0 and a fixed batch keep the clean gradients equal, so the stale one is told apart by the batch: each
    iteration here uses the batch of its own index."""
    inj = make_injector("gradnoise:rank=0:step=1:count=2:op=stale:param=0")
    model, opt = gpt(), None
    first = next(n for n, _ in model.named_parameters() if n.startswith("blocks.0."))
    seen = []
    for done in range(4):
        if done:
            inj.on_step_end(done, opt, names_of(model), model)
        model.zero_grad()
        loss_of(model, tokens(seed=done)).backward()
        seen.append(dict(model.named_parameters())[first].grad.clone())
    fresh = gpt()
    fresh_grads = []
    for done in range(4):
        fresh.zero_grad()
        loss_of(fresh, tokens(seed=done)).backward()
        fresh_grads.append(dict(fresh.named_parameters())[first].grad.clone())
    assert torch.equal(seen[0], fresh_grads[0])
    assert torch.equal(seen[1], fresh_grads[1])  # armed after step 1: no pass before it to hand on
    assert torch.equal(seen[2], fresh_grads[1])  # step 2's pass gets step 1's gradient
    assert torch.equal(seen[3], fresh_grads[3])  # count=2 over


def test_gradnoise_hooks_come_off_after_their_steps(make_injector) -> None:
    inj = make_injector("gradnoise:rank=0:step=1:count=1")
    model = gpt()
    inj.on_step_end(1, None, {}, model)
    assert all(p._backward_hooks for p in model.blocks[0].parameters())
    inj.on_step_end(2, None, {}, model)
    assert not any(p._backward_hooks for p in model.blocks[0].parameters())


def test_gradnoise_on_the_activation_corrupts_the_layer_and_everything_upstream(make_injector) -> None:
    per_iteration = gradients_per_iteration("gradnoise:rank=0:step=1:how=activation:layer=blocks.1", make_injector, 3)
    upstream = {
        n
        for n in per_iteration[0][1]
        if n.startswith(("blocks.0.", "blocks.1.")) or n in ("tokens.weight", "positions")
    }
    assert changed(*per_iteration[0]) == set()
    assert changed(*per_iteration[1]) == upstream  # not the final norm nor the head, downstream of the layer
    assert changed(*per_iteration[2]) == set()


def test_a_drill_due_before_the_first_step_the_probe_sees_still_fires_in_full(make_injector) -> None:
    per_iteration = gradients_per_iteration("gradnoise:rank=0:step=0:count=2", make_injector, 4)
    assert [bool(changed(*grads)) for grads in per_iteration] == [False, True, True, False]


# ---- outflip -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how, factor", [("hook", -1.0), ("patch", -1.0), ("hook", 2.5), ("patch", 0.5)])
def test_outflip_scales_every_output_of_the_layer_from_its_step(how: str, factor: float, make_injector) -> None:
    inj = make_injector(f"outflip:rank=0:step=3:how={how}:factor={factor:g}")
    faulty, clean, idx = gpt(), gpt(), tokens()
    seen: dict[str, torch.Tensor] = {}  # the input of blocks.1 is the output of blocks.0
    for name, model in (("faulty", faulty), ("clean", clean)):
        model.blocks[1].register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0]))
    x = torch.randn(2, CFG.seq, CFG.hidden)
    reference = clean.blocks[0](x)
    inj.on_step_end(2, None, {}, faulty)
    assert torch.equal(faulty.blocks[0](x), reference)  # not yet
    inj.on_step_end(3, None, {}, faulty)
    with torch.no_grad():
        faulty(idx), clean(idx)
    assert torch.equal(seen["faulty"], seen["clean"] * factor)  # inside the model's forward
    assert torch.equal(faulty.blocks[0](x), reference * factor)  # and for anyone calling the layer later
    inj.close()
    assert torch.equal(faulty.blocks[0](x), reference) and "forward" not in faulty.blocks[0].__dict__


def test_outflip_changes_the_first_element_of_a_tuple_output() -> None:
    hidden, extra = torch.ones(2), torch.ones(1)
    out = scaled_output((hidden, extra), -1.0)
    assert isinstance(out, tuple) and torch.equal(out[0], -hidden) and out[1] is extra


def test_the_default_layer_is_the_first_block_of_any_container() -> None:
    from trainscout.faults.layers import find_layer

    assert find_layer(gpt(), "")[0] == "blocks.0"
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert find_layer(seq, "")[0] == "0"
    flat = nn.Linear(2, 2)
    assert find_layer(flat, "") == ("", flat)


# ---- corrupt -------------------------------------------------------------------------------------------


def stepped_mlp(dtype: torch.dtype = torch.float32):
    """A small MLP after one Adam step: every parameter and its exp_avg dense and non-zero."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).to(dtype)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(16, 32, dtype=dtype)).pow(2).sum().backward()
    opt.step()
    return model, opt


def corrupted(spec: str, make_injector, dtype: torch.dtype = torch.float32, state: str = ""):
    """(before, after) of the tensor the corrupt fault targets: the largest parameter or its state `state`."""
    model, opt = stepped_mlp(dtype)
    target = model[0].weight
    tensor = opt.state[target][state] if state else target.data
    before = tensor.detach().clone()
    make_injector(spec).on_step_end(1, opt, names_of(model), model)
    return before.view(-1), tensor.detach().view(-1)


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("dtype, bit", [(torch.float32, 30), (torch.bfloat16, 14), (torch.float16, 14)])
def test_corrupt_expflip_flips_the_top_exponent_bit_of_one_element(dtype, bit, make_injector) -> None:
    before, after = corrupted("corrupt:rank=0:step=1:how=expflip", make_injector, dtype)
    flipped = (int_view(before) ^ int_view(after)).nonzero().flatten().tolist()
    assert flipped == [0]
    assert int(int_view(before)[0] ^ int_view(after)[0]) & 0xFFFF_FFFF == 1 << bit


@pytest.mark.parametrize("how, xor", [("expflip", 1 << 30), ("signflip", 1 << 31)])
def test_corrupt_with_frac_touches_exactly_that_fraction_of_elements(how, xor, make_injector) -> None:
    before, after = corrupted(f"corrupt:rank=0:step=1:how={how}:frac=0.01", make_injector)
    diff = int_view(before) ^ int_view(after)
    assert int((diff != 0).sum()) == round(0.01 * before.numel())  # 20 of 2048
    assert {v & 0xFFFF_FFFF for v in diff[diff != 0].tolist()} == {xor}  # that bit and no other


def test_corrupt_signflip_without_frac_negates_element_zero(make_injector) -> None:
    before, after = corrupted("corrupt:rank=0:step=1:how=signflip", make_injector)
    assert after[0] == -before[0] and torch.equal(after[1:], before[1:])


def test_corrupt_scale_in_optimizer_state_with_frac_and_factor(make_injector) -> None:
    before, after = corrupted(
        "corrupt:rank=0:step=1:target=state:key=exp_avg:how=scale:frac=0.1:factor=1000", make_injector, state="exp_avg"
    )
    hit = (after != before).nonzero().flatten()
    assert len(hit) == round(0.1 * before.numel())
    assert torch.equal(after[hit], before[hit] * 1000)


def test_corrupt_state_picks_exp_avg_by_default_and_a_named_key_when_asked(make_injector) -> None:
    before, after = corrupted("corrupt:rank=0:step=1:target=state:how=scale", make_injector, state="exp_avg")
    assert (after != before).nonzero().flatten().tolist() == [0]
    before, after = corrupted(
        "corrupt:rank=0:step=1:target=state:key=exp_avg_sq:how=scale", make_injector, state="exp_avg_sq"
    )
    assert after[0] == before[0] * 1000 and torch.equal(after[1:], before[1:])


@pytest.mark.parametrize(
    "how, check",
    [
        ("bitflip", lambda b, a: int(int_view(b)[0] ^ int_view(a)[0]) == 1 << 20),
        ("sign", lambda b, a: a[0] == -b[0]),
        ("scale", lambda b, a: a[0] == b[0] * 1e3),
    ],
)
def test_corrupt_existing_hows_still_touch_element_zero_only(how, check, make_injector) -> None:
    before, after = corrupted(f"corrupt:rank=0:step=1:how={how}", make_injector)
    assert check(before, after) and torch.equal(after[1:], before[1:])


# ---- starve --------------------------------------------------------------------------------------------

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity here")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@needs_affinity
def test_starve_pins_the_rank_and_hogs_to_one_cpu_until_cleanup(make_injector) -> None:
    allowed = os.sched_getaffinity(0)
    inj = make_injector("starve:rank=0:step=2:hogs=2")
    me = psutil.Process()
    inj.on_step_end(1)
    assert me.children() == []
    inj.on_step_end(2)
    hogs = me.children()
    try:
        assert len(hogs) == 2
        (cpu,) = os.sched_getaffinity(0)
        assert all(os.sched_getaffinity(h.pid) == {cpu} for h in hogs)
        assert wait_until(lambda: all(h.cpu_times().user > 0.02 for h in hogs))  # spinning
    finally:
        inj.close()
    assert all(gone(h.pid) for h in hogs)
    assert os.sched_getaffinity(0) == allowed


@needs_affinity
def test_starve_hogs_die_with_a_killed_rank() -> None:
    rank = textwrap.dedent("""
        import os, psutil, sys, time
        from trainscout.faults import FaultInjector
        FaultInjector.from_env(0).on_step_end(1)
        print(" ".join(str(c.pid) for c in psutil.Process().children()), flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", rank],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV_VAR: "starve:rank=0:step=1:hogs=2", "PYTHONPATH": SRC},
    )
    try:
        hogs = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(hogs) == 2 and not any(gone(pid) for pid in hogs)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert wait_until(lambda: all(gone(pid) for pid in hogs))
