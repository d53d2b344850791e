"""The CUDA fingerprint equals the CPU reference bit for bit, and its async form never syncs the host."""

from __future__ import annotations

import pytest
import torch

from trainscout import fingerprint as fp
from trainscout.fingerprint import cpu, gpu

MiB = 1 << 20

BYTE_SIZES = [
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    15,
    16,
    17,
    1023,
    4095,
    4096 * 4,
    4096 * 4 + 1,
    65537 * 4 + 3,
    MiB,
    MiB + 2,
    7 * MiB + 1,
    64 * MiB,
    64 * MiB + 3,
]


def _rand_bytes(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen, device=device)


@pytest.mark.parametrize("nbytes", BYTE_SIZES)
def test_cuda_equals_cpu_on_random_bytes(nbytes, gen, cuda):
    t = _rand_bytes(nbytes, gen, cuda)
    assert gpu.fingerprint_tensor_cuda(t) == cpu.fingerprint_tensor(t.cpu())


DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3,), (7, 13), (1000, 1001), (4, 1 << 20)])
def test_cuda_equals_cpu_per_dtype(dtype, shape, gen, cuda):
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, device=cuda, dtype=torch.float32).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen, device=cuda).bool()
    else:
        t = torch.randint(-100, 100, shape, generator=gen, device=cuda).to(dtype)
    assert gpu.fingerprint_tensor_cuda(t) == cpu.fingerprint_tensor(t.cpu())
    assert fp.fingerprint(t) == fp.fingerprint(t.cpu())


def test_non_contiguous_input_is_fingerprinted_in_logical_order(gen, cuda):
    base = torch.randn(513, 1025, generator=gen, device=cuda).to(torch.bfloat16)
    for view in (base.t(), base[:, ::3], base[1::2, 5:]):
        assert not view.is_contiguous()
        want = cpu.fingerprint_tensor(view.cpu().contiguous())
        assert gpu.fingerprint_tensor_cuda(view) == want
        assert gpu.fingerprint_tensor_cuda(view.contiguous()) == want


def test_views_at_unaligned_byte_offsets(gen, cuda):
    raw = _rand_bytes(4 * MiB + 7, gen, cuda)
    for off in (1, 2, 3, 5):
        view = raw[off:]
        assert view.data_ptr() % 4
        assert gpu.fingerprint_tensor_cuda(view) == cpu.fingerprint_tensor(view.cpu())
    halves = torch.randn(MiB + 1, generator=gen, device=cuda).to(torch.bfloat16)[1:]
    assert gpu.fingerprint_tensor_cuda(halves) == cpu.fingerprint_tensor(halves.cpu())


@pytest.mark.parametrize("start,end", [(0, 0), (0, 5), (4, 4099), (4096, 3 * MiB + 1), (8 * MiB - 4, 8 * MiB)])
def test_range_cuda_equals_cpu(start, end, gen, cuda):
    t = torch.randn(2 * MiB, generator=gen, device=cuda)  # 8 MiB of float32
    assert gpu.fingerprint_range_cuda(t, start, end) == cpu.fingerprint_range(t.cpu(), start, end)
    assert fp.fingerprint_range(t, start, end) == gpu.fingerprint_range_cuda(t, start, end)


@pytest.mark.parametrize(
    "kw",
    [
        dict(rows=1, num_warps=1, programs_per_sm=1),
        dict(rows=8, num_warps=4, programs_per_sm=8, mulhi=2),
        dict(rows=4, num_warps=8, programs_per_sm=2, mulhi=1),
        dict(rows=2, num_warps=2, programs_per_sm=16),
    ],
)
def test_launch_configuration_never_changes_the_value(kw, gen, cuda):
    data = _rand_bytes(9 * MiB + 3, gen, cuda)
    want = cpu.fingerprint_tensor(data.cpu())
    out = torch.zeros(1, dtype=torch.int64, device=cuda)
    for _ in range(3):  # the first call compiles through Triton's JIT; later ones launch directly
        out.zero_()
        gpu._enqueue(data, 0, data.numel(), 0, out, 0, gpu.LaunchConfig(**kw))
        assert cpu.as_unsigned64(int(out.item())) == want


def test_many_launches_and_the_2_32_index_boundary(gen, cuda, monkeypatch):
    data = _rand_bytes(3 * MiB + 2, gen, cuda)
    base = (1 << 32) - 100_000  # the range crosses the point where hi(i) changes
    want = cpu.fingerprint_bytes(data.cpu().numpy(), word_base=base)
    monkeypatch.setattr(gpu, "MAX_WORDS_PER_LAUNCH", 65_536)
    out = torch.zeros(1, dtype=torch.int64, device=cuda)
    for _ in range(2):
        gpu._enqueue(data, 0, data.numel(), base, out, 0)
        assert cpu.as_unsigned64(int(out.item())) == want


def test_async_writes_the_same_value_into_its_slot_without_a_host_sync(gen, cuda):
    t = torch.randn(3 * MiB + 1, generator=gen, device=cuda).to(torch.bfloat16)
    small = _rand_bytes(6, gen, cuda)
    out = torch.full((4,), -1, dtype=torch.int64, device=cuda)
    gpu.fingerprint_tensor_cuda_async(t, out, 1)  # compiles the kernels outside the checked region
    gpu.fingerprint_tensor_cuda_async(small, out, 2)
    out.fill_(-1)
    side = torch.cuda.Stream(device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu.fingerprint_tensor_cuda_async(t, out, 1)
        gpu.fingerprint_tensor_cuda_async(small, out, 3, stream=side)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream(cuda).wait_stream(side)
    got = out.cpu().tolist()
    assert got[0] == -1 and got[2] == -1
    assert cpu.as_unsigned64(got[1]) == cpu.fingerprint_tensor(t.cpu())
    assert cpu.as_unsigned64(got[3]) == cpu.fingerprint_tensor(small.cpu())


def test_single_bit_flips_on_device_change_the_value(gen, cuda):
    t = _rand_bytes(MiB, gen, cuda)
    ref = gpu.fingerprint_tensor_cuda(t)
    for pos in (0, 1, 4097, MiB - 1):
        for bit in (0, 7):
            u = t.clone()
            u[pos] ^= 1 << bit
            assert gpu.fingerprint_tensor_cuda(u) != ref


def test_large_tensor_over_one_launch(gen, cuda):
    # 4 GiB + 8 bytes: two stage-1 launches; the CPU reference takes a few seconds on many cores.
    n = (4 << 30) + 8
    t = torch.empty(n, dtype=torch.uint8, device=cuda)
    t.view(torch.int64).random_(generator=gen)
    assert gpu.fingerprint_tensor_cuda(t) == cpu.fingerprint_tensor(t.cpu())


def test_back_to_back_calls_on_one_stream_reuse_the_ticket_counter(gen, cuda):
    sizes = [0, 1, 5, 4096, 4097, 65536 * 4 + 1, MiB + 3, 5 * MiB] * 4
    tensors = [_rand_bytes(n, gen, cuda) for n in sizes]
    out = torch.full((len(sizes),), -1, dtype=torch.int64, device=cuda)
    for k, t in enumerate(tensors):
        gpu.fingerprint_tensor_cuda_async(t, out, k)
    got = out.cpu().tolist()
    for k, t in enumerate(tensors):
        assert cpu.as_unsigned64(got[k]) == cpu.fingerprint_tensor(t.cpu()), k


def test_concurrent_streams_use_separate_counters(gen, cuda):
    a = [_rand_bytes(3 * MiB + k, gen, cuda) for k in range(8)]
    b = [_rand_bytes(2 * MiB + 4 * k, gen, cuda) for k in range(8)]
    out_a = torch.zeros(8, dtype=torch.int64, device=cuda)
    out_b = torch.zeros(8, dtype=torch.int64, device=cuda)
    s1, s2 = torch.cuda.Stream(device=cuda), torch.cuda.Stream(device=cuda)
    for k in range(8):
        gpu.fingerprint_tensor_cuda_async(a[k], out_a, k, stream=s1)
        gpu.fingerprint_tensor_cuda_async(b[k], out_b, k, stream=s2)
    torch.cuda.synchronize()
    for k in range(8):
        assert cpu.as_unsigned64(int(out_a[k])) == cpu.fingerprint_tensor(a[k].cpu())
        assert cpu.as_unsigned64(int(out_b[k])) == cpu.fingerprint_tensor(b[k].cpu())


def test_capture_in_a_cuda_graph_and_replay(gen, cuda):
    t = torch.randn(MiB + 1, generator=gen, device=cuda).to(torch.bfloat16)
    out = torch.zeros(2, dtype=torch.int64, device=cuda)
    side = torch.cuda.Stream(device=cuda)
    side.wait_stream(torch.cuda.current_stream(cuda))
    with torch.cuda.stream(side):  # warm up (compile) on the stream the graph will be captured on
        gpu.fingerprint_tensor_cuda_async(t, out, 1)
    torch.cuda.current_stream(cuda).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        gpu.fingerprint_tensor_cuda_async(t, out, 1)
    for _ in range(3):
        t.copy_(torch.randn(MiB + 1, generator=gen, device=cuda).to(torch.bfloat16))
        out.zero_()
        graph.replay()
        assert cpu.as_unsigned64(int(out[1])) == cpu.fingerprint_tensor(t.cpu())
        assert int(out[0]) == 0


def test_capture_on_a_stream_never_used_before_is_refused(gen, cuda):
    t = _rand_bytes(4096, gen, cuda)
    out = torch.zeros(1, dtype=torch.int64, device=cuda)
    gpu.fingerprint_tensor_cuda_async(t, out, 0)  # compiled already; only the new stream lacks scratch
    fresh = torch.cuda.Stream(device=cuda)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(graph, stream=fresh):
            gpu.fingerprint_tensor_cuda_async(t, out, 0)
    torch.cuda.synchronize()
    assert cpu.as_unsigned64(int(out.item())) == cpu.fingerprint_tensor(t.cpu())
