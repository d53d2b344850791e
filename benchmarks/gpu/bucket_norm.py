"""What the sampled norm of a gradient bucket costs on the GPU (probe/grad_sync.py), beside the ways it could be read.

For each size and dtype, one random tensor on the current CUDA device, and three norms of it timed with CUDA events
(median of 30 calls after 3 warm-up calls, event and launch included): the whole norm; every 64th element (the
sample before runs, the same fraction of elements); and `grad_sync._norm` (runs of SAMPLE_RUN contiguous elements,
one every SAMPLE_STRIDE runs). Prints each time and each estimate over the true norm.

    python3 -m benchmarks gpu bucket-norm
"""

from __future__ import annotations

import statistics
import sys

import torch

from trainscout.probe.grad_sync import SAMPLE_STRIDE, _norm

SIZES = (
    (607_000_000, torch.float32),
    (607_000_000, torch.bfloat16),
    (50_000_000, torch.float32),
    (25_000_000, torch.float32),
)


def every_64th(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t.reshape(-1)[::SAMPLE_STRIDE], dtype=torch.float32) * SAMPLE_STRIDE**0.5


def timed_ms(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def measure(numel: int, dtype: torch.dtype) -> str:
    t = torch.randn(numel, device="cuda", dtype=dtype)
    true = float(torch.linalg.vector_norm(t.float()))
    whole = timed_ms(lambda: torch.linalg.vector_norm(t, dtype=torch.float32))
    single = timed_ms(lambda: every_64th(t))
    runs = timed_ms(lambda: _norm(torch, t, torch.float32))
    return (
        f"{numel / 1e6:.0f}M {dtype}: whole {whole:.4f} ms | every 64th element {single:.4f} ms "
        f"(estimate/true {float(every_64th(t)) / true:.5f}) | runs {runs:.4f} ms "
        f"(estimate/true {float(_norm(torch, t, torch.float32)) / true:.5f})"
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    for numel, dtype in SIZES:
        print(measure(numel, dtype))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
