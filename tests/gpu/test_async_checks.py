"""The probe's CUDA checks, in one process on one GPU: their results equal the CPU reference and name the
right step, although nothing is read back until a later step.

- `PreparedRanges` (the raw-launch path the state check uses) writes the CPU reference fingerprint of each
  byte range, on its first (compiling) and later (raw) calls.
- `StateCheck` on CUDA state publishes, a step or more later, the CPU fingerprint of the bytes the state held
  at the step each record names.
- `NonFiniteCheck` on CUDA names the gradient and the step a NaN appeared in, and a non-finite loss; its kernel
  counts the non-finite elements and sums the squares of each tensor and reads the loss, as torch does.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from trainscout.fingerprint import cpu, gpu
from trainscout.probe import state_check
from trainscout.probe.nonfinite import NONFINITE_PG_INDEX, NonFiniteCheck
from trainscout.probe.state_check import STATE_PG_INDEX, StateCheck


def _model(cuda: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(256, 64), nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256)
    ).to(cuda)


def _train_step(model, gen, cuda, poison=None) -> torch.Tensor:
    x = torch.randint(0, 256, (4, 32), device=cuda, generator=gen)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    loss = nn.functional.cross_entropy(logits.float().view(-1, 256), x.view(-1))
    if poison == "loss":
        loss = loss * float("nan")
    return loss


def test_prepared_ranges_equal_the_cpu_reference(gen, cuda):
    big = torch.randn(3 * (1 << 20) + 5, generator=gen, device=cuda)
    small = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=gen, device=cuda)
    halves = torch.randn(4099, generator=gen, device=cuda).to(torch.bfloat16)
    unaligned = small[1:]  # a view whose first byte is not 4-byte aligned
    items = [
        (big, 0, 4 * (1 << 20)),
        (big, 4 * (1 << 20), big.numel() * 4),
        (small, 0, 1001),
        (small, 4, 7),
        (halves, 0, 8198),
        (halves, 4, 8196),
        (unaligned, 0, 999),
        (big[::2], 0, 4096),
        (small, 8, 8),
    ]
    want = [cpu.fingerprint_range(t.cpu().contiguous(), s, e) for t, s, e in items]
    prepared = gpu.PreparedRanges(items)
    for _ in range(3):  # the first call compiles through the general path; later ones launch raw
        out = torch.zeros(len(items), dtype=torch.int64, device=cuda)
        prepared.enqueue(out)
        assert [cpu.as_unsigned64(v) for v in out.tolist()] == want


def test_state_check_records_on_cuda_equal_the_cpu_fingerprint_of_the_same_step(tmp_path, monkeypatch, cuda):
    monkeypatch.setattr(state_check, "tensor_table_path", lambda run_id, rank: str(tmp_path / f"{run_id}-{rank}.json"))
    records = []
    sc = StateCheck("gpu", 0, lambda *rec: records.append(rec), period=5)
    sc.replica_group = "pg0"
    model = _model(cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device=cuda).manual_seed(1)
    expected = {}
    published_during_training = 0
    for step in range(1, 21):
        _train_step(model, g, cuda).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sc.after_step(opt, step, 0.01)
        if step == 20:
            published_during_training = len(records)
        # the reference, taken after the check enqueued its kernels (.cpu() waits for them)
        for tid, t, start, end in sc._slots[step % len(sc._slots)]:
            expected[(step, tid, start)] = cpu.fingerprint_range(t.detach().cpu(), start, end)
    assert sc._device is not None and sc._device.launched_bytes > 0
    sc.flush(timeout_s=10)
    got = {(r[5], r[1], r[3]): r[2] for r in records}
    assert all(r[0] == STATE_PG_INDEX and r[6] == "state" for r in records)
    assert len(records) == len(got) == len(expected)
    assert got == expected
    assert published_during_training > 0  # landed results are published on later steps, not only at exit


@pytest.mark.parametrize("bucket_views", [False, True])
def test_nonfinite_on_cuda_names_the_gradient_and_the_step(cuda, bucket_views):
    records = []
    state = {"step": 0}
    check = NonFiniteCheck(lambda *rec: records.append(rec), lambda: state["step"])
    autograd = types.SimpleNamespace(backward=torch.autograd.backward)
    check.patch_autograd(autograd)  # the wrapper, without patching torch itself
    model = _model(cuda)
    names = {id(p): n for n, p in model.named_parameters()}
    check.hook_params(model.parameters(), names, bucket_views=bucket_views)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device=cuda).manual_seed(2)
    target = model[1].weight
    for step in range(1, 16):
        loss = _train_step(model, g, cuda, poison="loss" if step == 12 else None)
        if step == 7:  # the local gradient of one parameter turns NaN in step 7
            handle = target.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0], device=cuda), float("nan")))
        autograd.backward(loss)
        if step == 7:
            handle.remove()
            with torch.no_grad():
                target.grad.nan_to_num_(0.0)  # keep training finite after the fault (enqueued after the check)
        if step != 12:  # a NaN loss makes every gradient NaN: skip that update so later steps stay finite
            opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] = step
        check.check_step()
    check.flush(timeout_s=10)
    assert check.device_checks >= 15 and check._device_ok
    found = [(r[5], r[7].split(" ")[0], r[7]) for r in records]
    assert all(r[0] == NONFINITE_PG_INDEX for r in records)
    assert found[0] == (7, "grad", "grad 1.weight")
    assert [f[:2] for f in found[1:]] == [(12, "loss"), (12, "grad")]


def test_prepared_ranges_rebound_to_new_storage_equal_the_cpu_reference(gen, cuda):
    """The all-gather check prepares a unit's launches once and hashes the parameters' current storage,
    which FSDP frees and allocates again around every gather."""
    shapes = [(1000, 37), (4099,), (3,), (1 << 20,)]
    first = [torch.randn(s, generator=gen, device=cuda) for s in shapes]
    prepared = gpu.PreparedRanges([(t, 0, t.numel() * 4) for t in first])
    prepared.items = [(None, s, e) for _, s, e in prepared.items]  # as the gather check keeps them: no tensors
    for round_ in range(3):
        fresh = [torch.randn(s, generator=gen, device=cuda) for s in shapes]
        if round_ == 2:  # a storage at an address that is 4- but not 16-byte aligned
            fresh[1] = torch.randn(4100, generator=gen, device=cuda)[1:]
        out = torch.zeros(len(fresh), dtype=torch.int64, device=cuda)
        prepared.enqueue(out, fresh)
        assert [cpu.as_unsigned64(v) for v in out.tolist()] == [cpu.fingerprint_tensor(t.cpu()) for t in fresh]
    with pytest.raises(ValueError):
        prepared.enqueue(out, [torch.zeros(5, device=cuda)] * len(shapes))  # sizes differ


def test_nonfinite_kernel_counts_and_sums_squares_of_each_tensor_and_reads_the_loss(gen, cuda):
    import numpy as np

    from trainscout.probe import nonfinite_cuda

    big = nonfinite_cuda.CHUNK + nonfinite_cuda.BLOCK + 3  # two items, the second with a ragged tail
    for trial in range(3):
        base = torch.randn(100, generator=gen, device=cuda)
        tensors = [
            -torch.rand((), generator=gen, device=cuda) - 0.5,
            torch.randn(big, generator=gen, device=cuda),
            torch.randn(64, 33, generator=gen, device=cuda).to(torch.bfloat16),
            torch.randn(17, generator=gen, device=cuda).half(),
            torch.randn(9, generator=gen, device=cuda).double(),
            base[1:50] if trial == 2 else base[:49],
        ]  # trial 2: an address not 16-byte aligned
        for t in tensors[1:]:
            flat = t.view(-1)
            picks = torch.randint(0, flat.numel(), (trial,), generator=gen, device=cuda)
            for k, i in enumerate(picks.tolist()):
                flat[i] = (float("nan"), float("inf"), -float("inf"))[k % 3]
        layout = nonfinite_cuda.Layout(tensors)
        slot = types.SimpleNamespace(aux=None)
        n = layout.n_out
        out = torch.full((layout.n_values + 2,), -7.0, device=cuda)  # poisoned: every output must be written
        want_counts = [float((~torch.isfinite(t)).sum()) for t in tensors]
        want_sumsq = [float(t.double().square().sum()) for t in tensors]
        for _ in range(2):  # the first launch compiles, the second launches raw
            out[: layout.n_values] = -7.0
            nonfinite_cuda.enqueue(layout, [t.data_ptr() for t in tensors], out, slot)
            got = out.cpu().numpy().astype(np.float64)
            counts = np.bincount(layout.owner, weights=got[:n], minlength=len(tensors))
            sumsq = np.bincount(layout.owner, weights=got[n : 2 * n], minlength=len(tensors))
            assert list(counts) == want_counts, (trial, counts, want_counts)
            np.testing.assert_allclose(sumsq, want_sumsq, rtol=1e-5, equal_nan=True)  # Inf and NaN propagate
            assert got[2 * n] == float(tensors[0]) < 0  # the loss's value, sign included
            assert list(got[layout.n_values :]) == [-7.0, -7.0]


def test_nonfinite_kernel_at_a_sample_rate_reads_the_groups_of_its_phase_on_raw_launches_too(gen, cuda):
    import numpy as np

    from trainscout.probe import nonfinite_cuda as nc

    tensors = [
        torch.tensor(1.5, device=cuda),
        torch.randn(3 * nc.CHUNK + 77, generator=gen, device=cuda),  # four items, the last ragged and sampled
        torch.randn(nc.CHUNK + 16, generator=gen, device=cuda).to(torch.bfloat16),  # a sampled item, a small one
        torch.randn(300, generator=gen, device=cuda),  # small: always read whole
    ]
    tensors[1][5 * 8 + 1] = float("nan")  # in group 5 (8 fp32 a group)
    tensors[1][3 * nc.CHUNK + 70] = float("inf")  # in the ragged tail: group 9 of its item
    layout = nc.Layout(tensors)
    slot = types.SimpleNamespace(aux=None)
    n = layout.n_out
    out = torch.zeros(layout.n_values, device=cuda)
    for sample, phase in [(8, 5), (8, 5), (4, 1), (64, 9), (2, 0)]:
        nc.enqueue(layout, [t.data_ptr() for t in tensors], out, slot, sample, phase)
        got = out.cpu().numpy().astype(np.float64)
        for j in range(n):  # each item's reads, worked out element by element on the host
            t = tensors[int(layout.owner[j])].reshape(-1)
            first = (j - int(np.flatnonzero(layout.owner == layout.owner[j])[0])) * nc.CHUNK
            item = t[first : first + nc.CHUNK]
            k = sample if item.numel() >= nc.SAMPLE_MIN else 1
            group = nc.SECTOR // t.element_size()
            read = item[(torch.arange(item.numel(), device=cuda) // group) % k == phase % k]
            assert got[j] == float((~torch.isfinite(read)).sum()), (sample, phase, j)
            want = float(read.double().square().sum())
            if np.isfinite(want):
                assert abs(got[n + j] - want) <= 1e-5 * want, (sample, phase, j, got[n + j], want)
            assert layout.read_share(sample, phase)[j] == read.numel() / item.numel()
        assert got[2 * n] == 1.5


def test_nonfinite_check_on_a_gpu_bound_step_samples_within_its_budget_and_its_norms_estimate_the_whole(cuda):
    from trainscout.probe import nonfinite

    evidence = []
    ev = types.SimpleNamespace(
        set_params=lambda names: None, emit_values=lambda step, loss, sumsq: evidence.append((step, list(sumsq)))
    )
    state = {"step": 0}
    check = NonFiniteCheck(lambda *rec: None, lambda: state["step"], budget=1e-5, evidence=ev)
    autograd = types.SimpleNamespace(backward=torch.autograd.backward)
    check.patch_autograd(autograd)
    w = torch.nn.Parameter(torch.randn(8192, 8192, device=cuda) * 0.01)  # 256 MiB of gradient: SAMPLE_FROM_BYTES
    check.hook_params([w], {id(w): "w"})
    x = torch.randn(2048, 8192, device=cuda)  # ms of backward on the GPU: it is busy when the check starts
    grads = []
    for step in range(1, 81):
        loss = (torch.tanh(x @ w) ** 2).mean()
        autograd.backward(loss)
        grads.append(float(w.grad.double().square().sum()))  # the whole gradient's sum of squares, a sync
        w.grad = None
        state["step"] = step
        check.check_step(0.01)  # a 10 ms step: a budget of 0.1 us a step, far below one whole read
    check.flush(timeout_s=10)
    assert check.sample == nonfinite.MAX_SAMPLE and check.gpu_timed >= 1
    by_step = dict(evidence)
    late = [s for s in range(60, 81) if s in by_step]
    assert late  # sampled steps still give each step's evidence
    for s in late:  # 1 sector in 64 of 67 M elements estimates the sum of squares within a few per cent
        assert abs(by_step[s][0] - grads[s - 1]) <= 0.05 * grads[s - 1], (s, by_step[s][0], grads[s - 1])


def test_nonfinite_check_reads_a_smaller_models_gradients_whole_whatever_the_budget(cuda):
    from trainscout.probe import nonfinite

    state = {"step": 0}
    check = NonFiniteCheck(lambda *rec: None, lambda: state["step"], budget=1e-5)
    autograd = types.SimpleNamespace(backward=torch.autograd.backward)
    check.patch_autograd(autograd)
    w = torch.nn.Parameter(torch.randn(4096, 4096, device=cuda) * 0.01)  # 64 MiB: under SAMPLE_FROM_BYTES
    assert 4096 * 4096 * 4 < nonfinite.SAMPLE_FROM_BYTES
    check.hook_params([w], {id(w): "w"})
    x = torch.randn(4096, 4096, device=cuda)
    for step in range(1, 41):
        loss = (torch.tanh(x @ w) ** 2).mean()
        autograd.backward(loss)
        float(loss)  # a training loop's logging: the host waits here, never running far ahead of the GPU
        w.grad = None
        state["step"] = step
        check.check_step(0.01)
    check.flush(timeout_s=10)
    assert check.device_checks == 40 and check.sample == 1 and check.gpu_timed == check.gpu_idle == 0


def test_gather_check_on_cuda_publishes_the_cpu_fingerprint_of_each_gathered_parameter(cuda, gen):
    from trainscout.probe.gather_check import GatherCheck

    records, table = [], {}
    state = {"step": 0}
    check = GatherCheck(
        lambda *rec: records.append(rec),
        lambda: state["step"],
        lambda name, group: table.setdefault(name, len(table)),
        period=1,
        budget=0,
    )
    model = _model(cuda)
    check.watch(model, "0")
    expected = {}
    for step in range(1, 8):
        # as FSDP does around every gather: the full parameters live in new storage each step
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                mod._parameters[name] = nn.Parameter(torch.randn(p.shape, generator=gen, device=cuda))
        model(torch.randint(0, 256, (2, 8), device=cuda, generator=gen))
        for name, p in model.named_parameters():
            expected[(step, table[f"gathered[0]Sequential.{name}"])] = cpu.fingerprint_tensor(p.detach().cpu())
        state["step"] = step
    check.flush(timeout_s=10)
    got = {(r[5], r[1]): r[2] for r in records}
    assert all(r[0] == STATE_PG_INDEX and r[6] == "state" for r in records)
    assert got == expected and check.error == "" and check.dropped == 0
