"""GPU fingerprint throughput against the ceilings that matter: a plain reduction and a device copy.

The replica checks fingerprint parameters and optimizer state after every step within a time budget, so the
fingerprint's cost is bytes / bandwidth; this script measures it on bf16 tensors of 64 MiB to 4 GiB and sets
it beside torch.sum (a reduction that reads the same bytes, with almost no arithmetic) and a
device-to-device copy (reads and writes; the memory ceiling). It first checks the CUDA value against the
CPU reference, since a fast wrong fingerprint is worse than none.

Run on a CUDA machine, from the repository root, with no install needed:
    python3 -m benchmarks gpu fingerprint            # table; also $OUT/fingerprint_gpu.md if OUT is set
    python3 -m benchmarks gpu fingerprint --sweep    # also time launch configurations (same value each)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from trainscout.fingerprint import cpu, gpu

MiB = 1 << 20
GiB = 1 << 30
SIZES = [64 * MiB, 256 * MiB, 1 * GiB, 4 * GiB]


def _median_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _peer():
    """The peer's tensor signature, if that package is installed (optional)."""
    try:
        from lm_resiliency.detection.c3 import _compute_tensor_signature  # type: ignore[import-not-found]
    except Exception:
        return None
    return _compute_tensor_signature


def _graph_ms(fn, calls: int = 20, reps: int = 25) -> float | None:
    """Median time of fn replayed from a CUDA graph: GPU time without the Python launch overhead. Warm-up and
    capture use one side stream: the fingerprint keeps its scratch per stream and refuses a capture on a
    stream it has not run on (Triton's do_bench_cudagraph warms up and captures on different streams)."""
    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        return float(statistics.median(times))
    except Exception as exc:
        print(f"cuda graph timing failed: {exc!r}", flush=True)
        return None


def host_overhead(device: torch.device, n_calls: int = 2000, profile: bool = False) -> dict:
    """Host time per async call on a small tensor (the GPU never waits for itself here, so this is the
    Python + launch cost a caller pays per tensor), optionally with a cProfile of those calls."""
    t = torch.randn(16384, device=device)
    out = torch.zeros(1, dtype=torch.int64, device=device)
    for _ in range(50):
        gpu.fingerprint_tensor_cuda_async(t, out, 0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        gpu.fingerprint_tensor_cuda_async(t, out, 0)
    host_us = (time.perf_counter() - t0) / n_calls * 1e6
    torch.cuda.synchronize()
    result = {"host_us_per_call": host_us}
    if profile:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n_calls):
            gpu.fingerprint_tensor_cuda_async(t, out, 0)
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        result["profile"] = buf.getvalue()
    return result


def check_equal_to_cpu(device: torch.device) -> list[str]:
    """CUDA == CPU on a 64 MiB bf16 tensor and a few ragged byte lengths; raises on any mismatch."""
    lines = []
    g = torch.Generator(device=device).manual_seed(1234)
    t = torch.randn(32 * MiB, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    host = t.cpu()
    rates = []
    for threads in (1, None):
        t0 = time.perf_counter()
        want = cpu.fingerprint_tensor(host, threads=threads)
        rates.append(64 * MiB / (time.perf_counter() - t0) / 1e9)
    lines.append(
        f"CPU reference (numpy) on this host: {rates[0]:.2f} GB/s on 1 thread, {rates[1]:.2f} GB/s on "
        f"{cpu.default_threads()} threads ({os.cpu_count()} CPUs)"
    )
    got = gpu.fingerprint_tensor_cuda(t)
    if got != want:
        raise SystemExit(f"MISMATCH on 64 MiB bf16: cuda {got:#018x} cpu {want:#018x}")
    lines.append(f"64 MiB bf16: cuda == cpu == {got:#018x}")
    for nbytes in (0, 1, 3, 4, 5, 4095, 16385, 1 << 20 | 3):
        b = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device=device)
        got = gpu.fingerprint_tensor_cuda(b)
        want = cpu.fingerprint_tensor(b.cpu())
        if got != want:
            raise SystemExit(f"MISMATCH on {nbytes} bytes: cuda {got:#018x} cpu {want:#018x}")
    lines.append("ragged lengths 0..1 MiB+3: cuda == cpu")
    return lines


def bench_sizes(device: torch.device) -> list[dict]:
    peer = _peer()
    rows = []
    out = torch.zeros(4, dtype=torch.int64, device=device)
    for nbytes in SIZES:
        t = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(t)
        row = {"bytes": nbytes}
        ms = _median_ms(lambda: gpu.fingerprint_tensor_cuda_async(t, out, 0))
        row["fp_ms"] = ms
        row["fp_gbs"] = nbytes / ms / 1e6
        gms = _graph_ms(lambda: gpu.fingerprint_tensor_cuda_async(t, out, 0))
        row["fp_graph_gbs"] = nbytes / gms / 1e6 if gms else None
        ms = _median_ms(lambda: torch.sum(t, dtype=torch.float32))
        row["sum_gbs"] = nbytes / ms / 1e6
        ms = _median_ms(lambda: dst.copy_(t))
        row["copy_read_gbs"] = nbytes / ms / 1e6
        row["copy_rw_gbs"] = 2 * nbytes / ms / 1e6
        if peer is not None:
            try:
                ms = _median_ms(lambda: peer(t))
                row["peer_gbs"] = nbytes / ms / 1e6
            except Exception as exc:  # the peer's signature may differ between its versions
                row["peer_gbs"] = f"error: {type(exc).__name__}"
        rows.append(row)
        print(f"{nbytes // MiB} MiB: fingerprint {row['fp_gbs']:.0f} GB/s", flush=True)
        del t, dst
        torch.cuda.empty_cache()
    return rows


def sweep(device: torch.device, nbytes: int) -> list[tuple]:
    """Time each launch configuration on one size; each must give the default's value."""
    t = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    out = torch.zeros(1, dtype=torch.int64, device=device)
    gpu.fingerprint_tensor_cuda_async(t, out, 0)
    want = int(out.item())
    results = []
    for rows in (4, 8):
        for warps in (4, 8):
            for pps in (2, 4, 8):
                for mulhi in (0, 1, 2):
                    cfg = gpu.LaunchConfig(rows=rows, num_warps=warps, programs_per_sm=pps, mulhi=mulhi)
                    out.zero_()
                    gpu._enqueue(t, 0, nbytes, 0, out, 0, cfg)
                    ok = int(out.item()) == want
                    ms = _median_ms(lambda cfg=cfg: gpu._enqueue(t, 0, nbytes, 0, out, 0, cfg))
                    results.append((rows, warps, pps, mulhi, ok, nbytes / ms / 1e6))
                    gbs = nbytes / ms / 1e6
                    print(f"rows={rows} warps={warps} pps={pps} mulhi={mulhi} ok={ok} {gbs:.0f} GB/s", flush=True)
    del t
    torch.cuda.empty_cache()
    return results


def _fmt(v) -> str:
    return f"{v:.0f}" if isinstance(v, float) else (str(v) if v is not None else "n/a")


def markdown(
    device: torch.device, checks: list[str], rows: list[dict], sweeps: list[tuple], host: dict, argv: list[str]
) -> str:
    import triton

    props = torch.cuda.get_device_properties(device)
    lines = [
        f"## GPU fingerprint throughput ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"- device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
        f"triton {triton.__version__}, CUDA {torch.version.cuda}; host {platform.node()}",
        f"- command: `python3 -m {' '.join(argv)}`",
        f"- defaults: ROWS={gpu.ROWS} NUM_WARPS={gpu.NUM_WARPS} PROGRAMS_PER_SM={gpu.PROGRAMS_PER_SM}",
        "- timing: triton.testing.do_bench median (L2 flushed between runs); bf16 random data; GB/s = bytes "
        "read / time (copy also shown as read+write)",
        *[f"- check: {c}" for c in checks],
        f"- host time per async call (64 KiB tensor, no GPU wait): {host['host_us_per_call']:.1f} us",
        "",
        "| size | fingerprint ms | fingerprint GB/s | fingerprint GB/s, CUDA graph | torch.sum fp32 GB/s "
        "| copy read GB/s | copy read+write GB/s | peer c3 GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        size = f"{r['bytes'] // GiB} GiB" if r["bytes"] >= GiB else f"{r['bytes'] // MiB} MiB"
        lines.append(
            f"| {size} | {r['fp_ms']:.3f} | {_fmt(r['fp_gbs'])} | {_fmt(r.get('fp_graph_gbs'))} | "
            f"{_fmt(r['sum_gbs'])} | "
            f"{_fmt(r['copy_read_gbs'])} | {_fmt(r['copy_rw_gbs'])} | {_fmt(r.get('peer_gbs'))} |"
        )
    if sweeps:
        lines += ["", "| rows | warps | programs/SM | mulhi | same value | GB/s |"]
        lines += ["| --- | --- | --- | --- | --- | --- |"]
        for s in sorted(sweeps, key=lambda s: -s[-1]):
            lines.append(f"| {s[0]} | {s[1]} | {s[2]} | {s[3]} | {s[4]} | {s[5]:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time launch configurations")
    ap.add_argument("--sweep-bytes", type=int, default=1 * GiB)
    ap.add_argument("--profile", action="store_true", help="cProfile the host side of the async call")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not gpu.HAVE_TRITON:
        print("needs a CUDA device and Triton; nothing measured")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    checks = check_equal_to_cpu(device)
    print("\n".join(checks), flush=True)
    host = host_overhead(device, profile=args.profile)
    print(f"host time per async call: {host['host_us_per_call']:.1f} us", flush=True)
    if args.profile:
        print(host["profile"], flush=True)
    sweeps = sweep(device, args.sweep_bytes) if args.sweep else []
    rows = bench_sizes(device)
    text = markdown(device, checks, rows, sweeps, host, sys.argv)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        text += f"\nnvidia-smi after the runs: `{' / '.join(smi.splitlines())}`\n"
    except Exception:
        pass
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fingerprint_gpu.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
