"""What the non-finite check's counting kernel costs on the GPU at each sample rate (probe/nonfinite_cuda.py).

Gradient-shaped fp32 tensors the sizes of workload b's (hidden 2048, 12 blocks, a 32,000-token embedding and head:
2.9 GB), a one-element loss first, as the check lays them out; the kernel timed with CUDA events (median of 30
launches after 3 warm-up launches) reading every element (rate 1) and one 32-byte sector in 2 to 64 of each item
of SAMPLE_MIN elements or more. Prints each rate's time, its saving over the whole read and the whole-read
bandwidth; two rounds.

    python3 -m benchmarks gpu sampled-read
"""

from __future__ import annotations

import argparse
import statistics
import types

import torch

from trainscout.probe import nonfinite_cuda as nc

RATES = (1, 2, 4, 8, 16, 32, 64)


def gradients(hidden: int, layers: int, vocab: int, device) -> list[torch.Tensor]:
    h = hidden
    block = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,), (h,), (h,)]
    shapes = [(vocab, h), *block * layers, (vocab, h)]
    return [torch.tensor(0.5, device=device)] + [torch.randn(s, device=device) for s in shapes]


def timed_ms(layout, ptrs, out, slot, rate: int) -> float:
    for _ in range(3):
        nc.enqueue(layout, ptrs, out, slot, rate, rate - 1)
    torch.cuda.synchronize()
    times = []
    for i in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        nc.enqueue(layout, ptrs, out, slot, rate, i & (rate - 1))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not nc.usable([torch.zeros(1, device="cuda")]):
        print("needs a CUDA device and Triton")
        return 1
    torch.manual_seed(0)
    tensors = gradients(args.hidden, args.layers, args.vocab, torch.device("cuda", torch.cuda.current_device()))
    layout = nc.Layout(tensors)
    out = torch.zeros(layout.n_values, device=tensors[0].device)
    slot = types.SimpleNamespace(aux=None)
    ptrs = [t.data_ptr() for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"{torch.cuda.get_device_name()}: {len(tensors) - 1} gradients, {nbytes / 1e9:.2f} GB, {layout.n_out} items")
    for rnd in range(2):
        whole = timed_ms(layout, ptrs, out, slot, 1)
        print(f"round {rnd}: rate 1 (every element) {whole:.3f} ms, {nbytes / whole / 1e9:.2f} TB/s")
        for rate in RATES[1:]:
            t = timed_ms(layout, ptrs, out, slot, rate)
            print(f"round {rnd}: rate {rate}: {t:.3f} ms, {whole / t:.1f}x less than the whole read")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
