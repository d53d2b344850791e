"""CPU fingerprint throughput on one thread: the C kernel (each variant the CPU supports) against numpy.

The replicated-state check fingerprints a rotating slice of parameters and optimizer state every step on
CPU jobs, so how many bytes a step can cover is the fingerprint's single-thread GB/s. This script times
`cpu.fingerprint_bytes` (the public call, threads=1) on random 1 MiB, 16 MiB and 256 MiB buffers with the
path forced either way, beside a plain memory copy (`np.copyto`, GB/s = bytes copied / s; it reads and
writes each byte) as the machine's reference for memory speed. Every value is checked native == numpy
before anything is timed. The methods take turns within each repetition, so a burst of load from other
jobs on a shared machine hits them alike; the figure is the median over repetitions, each repetition
timing enough calls to last >= 20 ms.

    .venv/bin/python -m benchmarks throughput fingerprint                 # table + a section in RESULTS.md
    .venv/bin/python -m benchmarks throughput fingerprint --no-record --reps 3
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._common import (
    RESULTS_MD,
    append_results,
    command_line,
    date_utc,
    machine,
    markdown_table,
    median,
    text_table,
    uptime,
)

from trainscout.fingerprint import cpu  # python -m benchmarks puts src/ on the path when not installed

MiB = 1 << 20


def timed_gbs(fn, nbytes: int, min_s: float = 0.02) -> float:
    """GB/s of one repetition: enough calls of fn to take >= min_s (the first call also counts)."""
    calls = 0
    start = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return nbytes * calls / elapsed / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--reps", type=int, default=7, help="repetitions per size and method (median)")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()

    info = machine()
    info["date"] = date_utc()
    up_before = uptime()
    print(f"uptime before: {up_before}\nCPU path: {cpu.backend_detail()}", flush=True)
    variants = list(cpu._native.variants()) if cpu.native_available() else []
    best = cpu._native.variant() if variants else None
    methods = [*(f"native-{v}" for v in variants), "numpy", "copy"]

    rng = np.random.default_rng(0)
    rows_gbs: dict[int, dict[str, float]] = {}
    rows_range: dict[int, dict[str, tuple[float, float]]] = {}
    for size_mib in args.sizes_mib:
        nbytes = size_mib * MiB
        data = rng.integers(0, 1 << 32, nbytes // 4, dtype=np.uint32).view(np.uint8)
        dst = np.empty_like(data)
        np.copyto(dst, data)  # fault the destination's pages in before anything is timed
        # correctness first: every variant against numpy, on the whole buffer
        previous = cpu.use_native(False) if variants else None
        want = cpu.fingerprint_bytes(data, threads=1)
        if variants:
            cpu.use_native(True)
            for v in variants:
                cpu._native.set_variant(v)
                got = cpu.fingerprint_bytes(data, threads=1)
                if got != want:
                    raise SystemExit(f"{size_mib} MiB: native-{v} gives {got:#x}, numpy {want:#x}")

        def run(method: str) -> float:
            if method == "copy":
                return timed_gbs(lambda: np.copyto(dst, data), nbytes)
            if method == "numpy":
                if variants:
                    cpu.use_native(False)
                return timed_gbs(lambda: cpu.fingerprint_bytes(data, threads=1), nbytes)
            cpu.use_native(True)
            cpu._native.set_variant(method.removeprefix("native-"))
            return timed_gbs(lambda: cpu.fingerprint_bytes(data, threads=1), nbytes)

        samples: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.reps):
            for m in methods:
                samples[m].append(run(m))
        if variants:
            cpu._native.set_variant(None)
            cpu.use_native(bool(previous))
        rows_gbs[size_mib] = {m: median(v) for m, v in samples.items()}
        spread = rows_range[size_mib] = {m: (min(v), max(v)) for m, v in samples.items()}
        print(
            f"{size_mib} MiB: "
            + ", ".join(
                f"{m} {rows_gbs[size_mib][m]:.2f} GB/s ({spread[m][0]:.2f}-{spread[m][1]:.2f})" for m in methods
            ),
            flush=True,
        )
        del data, dst
    up_after = uptime()

    header = [
        "size",
        *(f"{m} GB/s" + (" (default)" if m == f"native-{best}" else "") for m in methods[:-2]),
        "numpy GB/s",
        "copy GB/s",
        "native / numpy",
        "native / copy",
    ]
    table = []
    for size_mib, r in rows_gbs.items():
        nat = r.get(f"native-{best}") if best else None
        table.append(
            [
                f"{size_mib} MiB",
                *(f"{r[m]:.2f}" for m in methods),
                f"{nat / r['numpy']:.1f}x" if nat else "-",
                f"{nat / r['copy']:.2f}" if nat else "-",
            ]
        )
    print()
    print(text_table(header, table))
    print(f"uptime after: {up_after}")
    # the recorded table also gives each median's range over the repetitions: on a shared machine it moves
    md_table = [
        [
            row[0],
            *(
                f"{rows_gbs[size_mib][m]:.2f} ({rows_range[size_mib][m][0]:.2f}-{rows_range[size_mib][m][1]:.2f})"
                for m in methods
            ),
            *row[-2:],
        ]
        for row, size_mib in zip(table, rows_gbs)
    ]

    body = [
        f"- load: before `{up_before}`; after `{up_after}`",
        f"- CPU path: {cpu.backend_detail()}",
        f"- one thread; `cpu.fingerprint_bytes(buf, threads=1)` on random bytes, path forced with "
        f"`cpu.use_native`; GB/s = bytes / s, median (min-max) of {args.reps} repetitions (methods interleaved, "
        "each repetition >= 20 ms of calls); copy = `np.copyto` (bytes copied / s; at 1 MiB both buffers sit in "
        "cache, so it is no memory ceiling there); ratios of medians; values checked native == numpy first",
        "",
        markdown_table(header, md_table),
    ]
    if not args.no_record:
        if RESULTS_MD.exists() and not RESULTS_MD.read_text().endswith("\n\n"):
            with RESULTS_MD.open("a") as fh:  # a section written by hand may end without a blank line
                fh.write("\n")
        append_results(
            "CPU fingerprint throughput, C kernel vs numpy (python -m benchmarks throughput fingerprint)",
            info,
            command_line(),
            "\n".join(body),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
