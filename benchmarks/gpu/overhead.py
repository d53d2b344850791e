"""Healthy-path overhead on CUDA: baseline vs trainscout (default checks) vs the peer (lm-resiliency SCOUT).

One invocation runs, per workload, `--reps` rounds of the three sides, interleaved (the order rotates each
round), each a fresh 2-rank job of benchmarks/gpu/workload.py:

- baseline:   torchrun --nproc-per-node 2 benchmarks/gpu/workload.py ARGS
- trainscout: python -m trainscout run --console plain -- torchrun --nproc-per-node 2 benchmarks/gpu/workload.py ARGS
- peer:       torchrun --nproc-per-node 2 benchmarks/gpu/workload.py ARGS --scout
              (enable_resiliency(model, optimizer, interval=5, enable_detection=True, enable_checkpoint=False,
               replay=ReplayHarnessConfig(check_interval=5, rotate_layers=True)); GEMINI in-memory
               checkpointing, on by default, raises on one 2-GPU node, see gpu/workload.py)

Per run, rank 0's step times (CUDA events, 40 measured steps after 10 warm-up) give a median and a p95; per
side the table shows the median of the run medians and the p95 of all measured steps pooled, with ratios
to the baseline, and each rank's peak GPU memory and host RSS. Raw rows go to `--raw` (JSON lines), the
section to `--markdown`; `--report RAW...` renders a section from raw files of earlier invocations.

    python3 -m benchmarks gpu overhead --workloads a,b,c --reps 3 --raw $OUT/raw.jsonl --markdown $OUT/gpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import REPO, bootstrap_median_ci, free_port, percentile
from benchmarks._demo_job import under_trainscout

WORKLOAD = REPO / "benchmarks" / "gpu" / "workload.py"
SIDES = ("baseline", "trainscout", "peer")
NPROC = 2  # ranks per job, one GPU each (--nproc)
STEPS: list[str] = []  # measured steps per run, when not the workload's default 40 (--steps)
PIN: list[str] = []  # --pin-cpus for the workload: every side's ranks on the same cores
VARIANTS: dict[str, dict] = {}  # extra trainscout sides: name -> environment (--variant), e.g. a check off
WORKLOADS = {
    "a": {
        "label": "DDP, hidden 512 / 4 layers / seq 128 / batch 4",
        "args": ["--hidden", "512", "--layers", "4", "--seq", "128", "--batch", "4"],
    },
    "b": {
        "label": "DDP, hidden 2048 / 12 layers / seq 1024 / batch 8",
        "args": ["--hidden", "2048", "--layers", "12", "--seq", "1024", "--batch", "8"],
    },
    "c": {
        "label": "FSDP2 (fully_shard per block), hidden 2048 / 12 layers / seq 1024 / batch 8",
        "args": ["--hidden", "2048", "--layers", "12", "--seq", "1024", "--batch", "8", "--fsdp"],
    },
    "c-small": {
        "label": "FSDP2 (fully_shard per block), hidden 512 / 4 layers / seq 128 / batch 4",
        "args": ["--hidden", "512", "--layers", "4", "--seq", "128", "--batch", "4", "--fsdp"],
    },
}


def _launcher() -> list[str]:
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def command(side: str, workload: str, timing: str, run_dir: str, run_id: str) -> list[str]:
    job = [
        *_launcher(),
        "--nproc-per-node",
        str(NPROC),
        "--master-port",
        str(free_port()),
        str(WORKLOAD),
        *WORKLOADS[workload]["args"],
        *STEPS,
        *PIN,
        "--timing-file",
        timing,
    ]
    if side == "peer":
        return job + ["--scout"]
    if side == "trainscout" or side in VARIANTS:
        return under_trainscout(job, Path(run_dir), run_id)
    return job


def run_one(side: str, workload: str, rep: int, work: Path, timeout: float, extra_env: dict) -> dict:
    run_id = f"{workload}-{side}-{rep}"
    timing = str(work / f"{run_id}-{{rank}}.json")
    cmd = command(side, workload, timing, str(work / "runs"), run_id)
    env = {**os.environ, **(extra_env if side == "trainscout" else VARIANTS.get(side, {}))}
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = -9, f"timeout after {timeout} s: {exc.stdout or ''}{exc.stderr or ''}"
    row = {"workload": workload, "side": side, "rep": rep, "rc": rc, "wall_s": time.monotonic() - t0, "ranks": {}}
    for rank in range(NPROC):
        path = Path(timing.replace("{rank}", str(rank)))
        if path.exists():
            row["ranks"][str(rank)] = json.loads(path.read_text())
    if rc != 0 or len(row["ranks"]) < NPROC:
        row["tail"] = out[-4000:] if isinstance(out, str) else str(out)[-4000:]
    if side == "trainscout" or side in VARIANTS:
        findings = work / "runs" / run_id / "findings.jsonl"
        row["findings"] = findings.read_text().splitlines() if findings.exists() else []
        row["probe_costs"] = [
            json.loads(c.read_text()) for c in sorted((work / "runs" / run_id).glob("probe-cost.rank*.json"))
        ]
    return row


def summarise(rows: list[dict]) -> dict:
    """(workload, side) -> statistics over the successful runs."""
    out: dict = {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        for side in (*SIDES, *VARIANTS):
            runs = [
                r
                for r in rows
                if r["workload"] == w and r["side"] == side and r["rc"] == 0 and len(r["ranks"]) == NPROC
            ]
            failed = [r for r in rows if r["workload"] == w and r["side"] == side and r not in runs]
            if not runs:
                out[(w, side)] = {"n": 0, "failed": len(failed)}
                continue
            steps0 = [r["ranks"]["0"]["step_ms"] for r in runs]
            ranks = [str(k) for k in range(NPROC)]
            pooled = [t for s in steps0 for t in s]
            out[(w, side)] = {
                "n": len(runs),
                "failed": len(failed),
                "median_ms": statistics.median(statistics.median(s) for s in steps0),
                "run_medians": [statistics.median(s) for s in steps0],
                "mean_ms": statistics.mean(pooled),
                "p95_ms": percentile(pooled, 95),
                "run_p95": [percentile(s, 95) for s in steps0],
                "gpu_peak": [max(r["ranks"][k]["max_memory_allocated"] for k in ranks) for r in runs],
                "rss_kb": {k: statistics.median(r["ranks"][k]["VmRSS"] for r in runs) for k in ranks},
                "hwm_kb": {k: statistics.median(r["ranks"][k]["VmHWM"] for r in runs) for k in ranks},
                "params": runs[0]["ranks"]["0"]["params"],
                "findings": sorted({f for r in runs for f in r.get("findings", [])}),
            }
    return out


def _ok(r: dict) -> bool:
    return r["rc"] == 0 and len(r["ranks"]) == NPROC


def paired(rows: list[dict], w: str) -> list[str]:
    """Each side against the baseline of the same round (run-to-run noise on a host-bound job is far larger
    than the bar, and partly shared by runs close in time): the median of per-round ratios with a 95 %
    bootstrap interval, for the median and p95 of rank 0's step time and for its host time per step; then
    what trainscout's own checks spent on the training thread (the probes' cost reports)."""
    base = {r["rep"]: r for r in rows if r["workload"] == w and r["side"] == "baseline" and _ok(r)}
    out = [
        "",
        "| side | rounds paired | step time vs baseline, median of rounds (95 % CI, or the range under 6 rounds) "
        "| p95 vs baseline, median of rounds | host time per step vs baseline, median of rounds |",
        "| --- | --- | --- | --- | --- |",
    ]
    for side in (*SIDES, *VARIANTS):
        if side == "baseline":
            continue
        pairs = [
            (base[r["rep"]]["ranks"]["0"], r["ranks"]["0"])
            for r in rows
            if r["workload"] == w and r["side"] == side and _ok(r) and r["rep"] in base
        ]
        if not pairs:
            continue
        med = [statistics.median(t["step_ms"]) / statistics.median(b["step_ms"]) for b, t in pairs]
        p95 = [percentile(t["step_ms"], 95) / percentile(b["step_ms"], 95) for b, t in pairs]
        host = [
            statistics.median(t["host_step_ms"]) / statistics.median(b["host_step_ms"])
            for b, t in pairs
            if t.get("host_step_ms") and b.get("host_step_ms")
        ]
        # a bootstrap of fewer than 6 rounds only restates them: give their range instead
        lo, hi = bootstrap_median_ci(med) if len(med) >= 6 else (min(med), max(med))
        spread = "95 % CI" if len(med) >= 6 else "range"
        hmed = f"{statistics.median(host) - 1:+.2%}" if host else "n/a"
        out.append(
            f"| {side} | {len(pairs)} | {statistics.median(med) - 1:+.2%} ({spread} {lo - 1:+.2%} to {hi - 1:+.2%}) "
            f"| {statistics.median(p95) - 1:+.2%} | {hmed} |"
        )
    costs = [c for r in rows if r["workload"] == w and r["side"] == "trainscout" for c in r.get("probe_costs", [])]
    if costs:
        from trainscout.sinks.probe_costs import CHECKS, per_step

        parts = []
        for check in CHECKS:
            ms, share = per_step(costs, check)
            if ms:
                parts.append(f"{check} {statistics.median(ms) * 1000:.0f} us/step ({statistics.median(share):.2f} %)")
        out += [
            "",
            f"trainscout's checks on the training thread (median over {len(costs)} rank reports): "
            + ("; ".join(parts) or "none ran"),
        ]
    return out


def markdown(rows: list[dict], header: list[str]) -> str:
    stats = summarise(rows)
    lines = list(header) + [""]
    for w in dict.fromkeys(r["workload"] for r in rows):
        base = stats.get((w, "baseline"), {})
        lines += [f"### workload {w}: {WORKLOADS[w]['label']}", ""]
        lines += [
            "| side | runs ok | median step ms (run medians) | throughput loss (median) | mean step ms "
            "| throughput loss (mean) | p95 step ms (pooled) | p95 vs baseline "
            "| GPU peak MiB (median of runs, max over ranks) | GPU peak vs baseline "
            "| host RSS MiB per rank (peak) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for side in (*SIDES, *VARIANTS):
            s = stats.get((w, side))
            if not s or not s["n"]:
                lines.append(f"| {side} | 0/{s['failed'] if s else 0} | | | | | | | | | |")
                continue
            loss = 1 - base["median_ms"] / s["median_ms"] if base.get("n") else float("nan")
            mloss = 1 - base["mean_ms"] / s["mean_ms"] if base.get("n") else float("nan")
            p95r = s["p95_ms"] / base["p95_ms"] - 1 if base.get("n") else float("nan")
            peak = statistics.median(s["gpu_peak"])
            bpeak = statistics.median(base["gpu_peak"]) if base.get("n") else float("nan")
            meds = ", ".join(f"{m:.3f}" for m in s["run_medians"])
            lines.append(
                f"| {side} | {s['n']}/{s['n'] + s['failed']} | {s['median_ms']:.3f} ({meds}) | {loss:+.2%} | {s['mean_ms']:.3f} | {mloss:+.2%} | "
                f"{s['p95_ms']:.3f} | {p95r:+.2%} | {peak / 2**20:.1f} | {(peak - bpeak) / bpeak:+.3%} | "
                f"{' / '.join(f'{v / 1024:.0f}' for v in s['rss_kb'].values())} "
                f"({' / '.join(f'{v / 1024:.0f}' for v in s['hwm_kb'].values())}) |"
            )
        lines += paired(rows, w)
        ts = stats.get((w, "trainscout"), {})
        if ts.get("findings"):
            lines += ["", f"trainscout findings on these healthy runs: {ts['findings']}"]
        for r in rows:
            p = r["ranks"].get("0", {}).get("trainscout") if r["workload"] == w else None
            if p:
                lines += [
                    "",
                    f"{r['side']} probe, rank 0, at the end of run {r['rep']}: {json.dumps(p, sort_keys=True)}",
                ]
        lines.append("")
    failures = [r for r in rows if r["rc"] != 0 or len(r["ranks"]) < NPROC]
    for r in failures:
        lines += [
            f"failed run {r['workload']}-{r['side']}-{r['rep']} (exit {r['rc']}), output tail:",
            "",
            "```",
            r.get("tail", "")[-1500:],
            "```",
            "",
        ]
    return "\n".join(lines) + "\n"


def checked_step(loss, opt, nf, autograd, step_no: dict, checked: bool) -> None:
    """The rest of one training step of the in-place measurements after its forward (`loss`), through the
    non-finite check's backward when `checked`."""
    import torch

    (autograd.backward if checked else torch.autograd.backward)(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    step_no["n"] += 1
    if checked:
        nf.check_step()


def one_rank_ddp(workload: str):
    """`workload`'s model as a 1-rank NCCL DDP job on GPU 0, for the in-place measurements:
    (model, DDP wrapper, AdamW, the workload's sizes: hidden, layers, seq, batch)."""
    import torch
    import torch.distributed as dist

    from benchmarks.gpu import workload as gw

    ap = argparse.ArgumentParser()
    for flag in ("--hidden", "--layers", "--seq", "--batch"):
        ap.add_argument(flag, type=int)
    ap.add_argument("--fsdp", action="store_true")
    wargs = ap.parse_args(WORKLOADS[workload]["args"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    with torch.device("cuda", 0):
        model = gw.CausalLM(wargs.hidden, wargs.layers, max(1, wargs.hidden // 64), wargs.seq)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    return model, ddp, torch.optim.AdamW(ddp.parameters(), lr=3e-4), wargs


def probe_cost(workload: str, blocks: int, block_steps: int) -> str:
    """In one process on one GPU (a 1-rank DDP job), alternate blocks of steps with the probe's two per-step
    CUDA checks off / on, in place: the step-time difference without run-to-run noise, and the host time
    the checks themselves spend per step. Covers the non-finite and replicated-state checks only (not the
    step hook, the Flight Recorder or the probe's background thread). "nonfinite-norms" is the non-finite
    check forced onto its fallback (one foreach L1 norm per gradient) instead of the counting kernel."""
    import types

    import torch
    import torch.distributed as dist

    from benchmarks.gpu import workload as gw

    from trainscout.probe import state_check as sc_mod
    from trainscout.probe.nonfinite import NonFiniteCheck
    from trainscout.probe.state_check import StateCheck

    model, ddp, opt, wargs = one_rank_ddp(workload)
    device = torch.device("cuda", 0)
    step_no = {"n": 0}
    records: list = []
    nf = NonFiniteCheck(lambda *r: records.append(r), lambda: step_no["n"])
    autograd = types.SimpleNamespace(backward=torch.autograd.backward)
    nf.patch_autograd(autograd)
    names = {id(p): n for n, p in model.named_parameters()}
    nf.hook_params(model.parameters(), names)
    table = str(Path(tempfile.mkdtemp()) / "table.json")
    sc_mod.tensor_table_path = lambda run_id, rank: table
    sc = StateCheck("cost", 0, lambda *r: records.append(r))
    sc.learn_model(model, "pg0")
    gen = torch.Generator(device=device).manual_seed(0)
    modes = ("off", "nonfinite", "nonfinite-norms", "state", "both")
    times: dict[str, list[float]] = {m: [] for m in modes}
    host: dict[str, list[float]] = {m: [] for m in modes}
    charged: dict[str, list[float]] = {m: [] for m in modes}  # the state check's own budgeted time
    last_wall = [0.0]

    def one_step(mode: str, timed: bool) -> None:
        data = torch.randint(0, gw.VOCAB, (wargs.batch, wargs.seq + 1), device=device, generator=gen)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        h0 = nf.spent_s
        nf._counts_ok = mode != "nonfinite-norms"
        checked_step(
            gw.loss_of(ddp, data), opt, nf, autograd, step_no, mode in ("nonfinite", "nonfinite-norms", "both")
        )
        h2, c0 = time.perf_counter(), sc.spent_s
        if mode in ("state", "both"):
            sc.after_step(opt, step_no["n"], last_wall[0])
        spent = (nf.spent_s - h0) + (time.perf_counter() - h2 if mode in ("state", "both") else 0.0)
        end.record()
        last_wall[0] = time.perf_counter() - t0
        if timed:
            pending.append((mode, start, end))
            host[mode].append(spent * 1e6)
            charged[mode].append((sc.spent_s - c0) * 1e6)

    pending: list = []
    for _ in range(20):
        one_step("both", False)
    for b in range(blocks):
        for mode in modes[b % len(modes) :] + modes[: b % len(modes)]:
            for _ in range(block_steps):
                one_step(mode, True)
    torch.cuda.synchronize()
    for mode, start, end in pending:
        times[mode].append(start.elapsed_time(end))
    base = statistics.median(times["off"])
    lines = [
        f"### probe check cost in place: workload {workload} ({WORKLOADS[workload]['label']}), 1-rank DDP",
        "",
        f"{blocks} rounds x {len(modes)} modes x {block_steps} steps, modes interleaved; state-check stride "
        f"at end: {sc.stride}, slots {len(sc._slots)}; non-finite vectors submitted {nf.device_checks}, "
        f"records {len(records)}, counting-kernel error: {nf.counts_error or 'none'}",
        "",
        "| checks on | median step ms | vs off | p95 step ms | mean host us per step in the checks "
        "| of which the state check's budgeted part |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in modes:
        med = statistics.median(times[m])
        lines.append(
            f"| {m} | {med:.3f} | {med / base - 1:+.2%} | {percentile(times[m], 95):.3f} "
            f"| {statistics.mean(host[m]):.1f} | {statistics.mean(charged[m]):.1f} |"
        )
    dist.destroy_process_group()
    return "\n".join(lines) + "\n"


def _machine() -> str:
    try:
        smi = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            .stdout.strip()
            .splitlines()
        )
    except Exception:
        smi = []
    try:
        import torch

        versions = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    except Exception:
        versions = "torch ?"
    return (
        f"{len(smi)}x {smi[0] if smi else '?'}; {os.cpu_count()} CPUs; {versions}; python {platform.python_version()}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2, help="ranks per job, one GPU each (the bar is for 2)")
    ap.add_argument("--steps", type=int, default=0, help="measured steps per run (default: the workload's 40)")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--pin-cpus", default="", help="CPU sets per local rank for every side's ranks, e.g. '4-7;8-11'")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--raw", default="", help="append raw rows (JSON lines) here")
    ap.add_argument("--markdown", default="", help="write the section here")
    ap.add_argument("--label", default="")
    ap.add_argument("--trainscout-env", action="append", default=[], metavar="K=V")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:K=V[,K=V]",
        help="an extra trainscout side with this environment (e.g. ts-no-state:TRAINSCOUT_STATE_CHECK=0), "
        "interleaved with the others; add NAME to --sides",
    )
    ap.add_argument("--report", nargs="*", help="render a section from raw files instead of running")
    ap.add_argument(
        "--probe-cost",
        default="",
        metavar="WORKLOAD",
        help="instead: the per-step CUDA checks' cost, in place in one process (see probe_cost)",
    )
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-steps", type=int, default=25)
    args = ap.parse_args()
    global NPROC
    NPROC = args.nproc
    if args.steps:
        STEPS[:] = ["--steps", str(args.steps)]
    if args.pin_cpus:
        PIN[:] = ["--pin-cpus", args.pin_cpus]
    if args.probe_cost:
        text = probe_cost(args.probe_cost, args.blocks, args.block_steps)
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text)
        return 0
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.report:
        rows = [json.loads(line) for p in args.report for line in Path(p).read_text().splitlines() if line.strip()]
        for side in dict.fromkeys(r["side"] for r in rows):  # variants of the earlier invocation
            if side not in SIDES:
                VARIANTS.setdefault(side, {})
        text = markdown(
            rows, [f"## GPU healthy-path overhead (python -m benchmarks gpu overhead) {args.label}".rstrip()]
        )
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text)
        return 0
    extra_env = dict(kv.split("=", 1) for kv in args.trainscout_env)
    for spec in args.variant:
        name, _, kvs = spec.partition(":")
        VARIANTS[name] = dict(kv.split("=", 1) for kv in kvs.split(",") if kv)
    sides = [s for s in args.sides.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="trainscout-gpu-overhead-"))
    rows: list[dict] = []
    for w in args.workloads.split(","):
        w_sides = sides
        if NPROC == 1 and "--fsdp" in WORKLOADS[w]["args"] and "peer" in sides:
            # lm-resiliency 0.2.0's replay calls a fully_shard-ed block with a plain tensor on one rank and
            # fails (mixed Tensor and DTensor); it runs on 2 ranks
            print(f"{w}: the peer is skipped on 1 rank (its FSDP2 replay fails there)", flush=True)
            w_sides = [s for s in sides if s != "peer"]
        for rep in range(args.reps):
            order = w_sides[rep % len(w_sides) :] + w_sides[: rep % len(w_sides)]
            for side in order:
                row = run_one(side, w, rep, work, args.timeout, extra_env)
                rows.append(row)
                s0 = row["ranks"].get("0", {}).get("step_ms", [])
                print(
                    f"{w} {side} rep {rep}: rc {row['rc']} wall {row['wall_s']:.1f}s "
                    f"median {statistics.median(s0) if s0 else float('nan'):.3f} ms",
                    flush=True,
                )
                if row["rc"] != 0:
                    print(row.get("tail", "")[-1500:], flush=True)
                if args.raw:
                    with open(args.raw, "a") as fh:
                        fh.write(json.dumps(row) + "\n")
    header = [
        f"## GPU healthy-path overhead (python -m benchmarks gpu overhead) {args.label} — {stamp}".replace("  ", " "),
        "",
        f"- machine: {_machine()}",
        f"- command: `python3 -m {' '.join(sys.argv)}`",
        f"- {NPROC} rank(s), one GPU each; {args.reps} rounds per workload, sides interleaved (order rotates per round); rank 0's CUDA-event "
        f"step times, {args.steps or 40} measured steps after 10 warm-up per run",
        f"- trainscout env: {extra_env or 'defaults'}; variants: {VARIANTS or 'none'}; "
        f"rank CPUs: {args.pin_cpus or 'not pinned'}",
    ]
    text = markdown(rows, header)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
