"""Soak: one long 4-rank CPU job under `trainscout run` with every check on; does anything grow?

Samples, every `--every` seconds, each process of the run (the supervisor, node agent, coordinator, the
launcher and the ranks): RSS and open file descriptors, and the run's shared-memory files in /dev/shm.
After the warm-up, a healthy run keeps all of them flat. The job ends itself at `--minutes` (the demo's
`--stop-file`), so it finishes the way a real job does; 0 findings is part of the bar.

    python -m benchmarks soak run --minutes 60            # the issue's bar: one hour
    python -m benchmarks soak run --quick                 # 2 minutes, RESULTS.md untouched (smoke test)

RSS growth is reported as the slope of a least-squares line through the samples after warm-up (MiB per
hour) and as last-minus-first-after-warm-up; descriptor and shared-memory counts as their range after
warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks import _common
from benchmarks._demo_job import train_cmd, under_trainscout

ROLES = (  # first match wins: the launcher's command line names the training module too
    ("coordinator", "trainscout.coordinator"),
    ("agent", "trainscout.agent"),
    ("launcher", "torch.distributed.run"),
    ("rank", "trainscout.demo.train"),
)


def _role(proc: psutil.Process, top: int) -> str | None:
    if proc.pid == top:
        return "supervisor"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    for role, marker in ROLES:
        if marker in cmd:
            return role
    return None


def _sample(top: psutil.Process, run_id: str) -> dict:
    procs = {}
    try:
        family = [top, *top.children(recursive=True)]
    except psutil.Error:
        return {}
    for p in family:
        role = _role(p, top.pid)
        if role is None:
            continue
        try:
            with p.oneshot():
                rss = p.memory_info().rss
                fds = p.num_fds()
                cpu = sum(p.cpu_times()[:2])
        except psutil.Error:
            continue
        if role == "rank":
            try:  # RANK from the environment names the rank; DataLoader workers have no probe of their own
                role = f"rank{p.environ().get('RANK', '?')}"
            except psutil.Error:
                pass
        key = role if role not in procs else f"{role}-{p.pid}"
        procs[key] = {"pid": p.pid, "rss": rss, "fds": fds, "cpu_s": cpu}
    shm = [f for f in os.listdir("/dev/shm") if run_id in f] if os.path.isdir("/dev/shm") else []
    shm_bytes = sum(os.path.getsize(os.path.join("/dev/shm", f)) for f in shm)
    return {"procs": procs, "shm_files": len(shm), "shm_bytes": shm_bytes}


def _slope_mib_per_hour(points: list[tuple[float, float]]) -> float:
    if len(points) < 3:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mt) * (v - mv) for t, v in points)
    return cov / var * 3600 / 2**20


def summarize(samples: list[dict], warmup_s: float) -> dict:
    late = [s for s in samples if s["t"] >= warmup_s]
    roles = sorted({k for s in late for k in s["procs"]})
    out: dict = {"samples_after_warmup": len(late), "processes": {}}
    for role in roles:
        pts = [(s["t"], s["procs"][role]["rss"]) for s in late if role in s["procs"]]
        fds = [s["procs"][role]["fds"] for s in late if role in s["procs"]]
        pids = {s["procs"][role]["pid"] for s in late if role in s["procs"]}
        if not pts:
            continue
        out["processes"][role] = {
            "rss_first_mib": round(pts[0][1] / 2**20, 1),
            "rss_last_mib": round(pts[-1][1] / 2**20, 1),
            "rss_max_mib": round(max(v for _, v in pts) / 2**20, 1),
            "rss_slope_mib_per_h": round(_slope_mib_per_hour(pts), 2),
            "fds_min": min(fds),
            "fds_max": max(fds),
            "pids": len(pids),
        }
    shm = [s["shm_files"] for s in late]
    shm_bytes = [s["shm_bytes"] for s in late]
    out["shm_files"] = [min(shm), max(shm)] if shm else []
    out["shm_mib"] = [round(min(shm_bytes) / 2**20, 2), round(max(shm_bytes) / 2**20, 2)] if shm_bytes else []
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="how long the job trains")
    p.add_argument("--warmup-minutes", type=float, default=5.0, help="samples before this are not judged")
    p.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--slow-ms", type=float, default=20.0, help="each rank sleeps this long a step (the job's pace)")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (certified)")
    p.add_argument("--out-dir", default=None, help="where the run folder goes (default: a temporary folder)")
    p.add_argument("--no-record", action="store_true", help="leave RESULTS.md alone")
    args = p.parse_args(argv)
    out_dir, info, up_before = _common.begin("soak", Path(args.out_dir) if args.out_dir else None)
    run_id = f"soak-{int(time.time())}"
    stop_file = out_dir / "stop"
    ckpt = out_dir / "ckpt"
    job = train_cmd(
        args.nproc,
        10**9,
        "--slow-ms",
        str(args.slow_ms),
        "--stop-file",
        str(stop_file),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--checkpoint-dir",
        str(ckpt),
        "--log-every",
        "500",
    )
    metrics_port = str(_common.free_port())
    cmd = under_trainscout(job, out_dir, run_id, "--metrics-port", metrics_port)
    load_before = os.getloadavg()
    started = time.monotonic()
    log = open(out_dir / "soak.out", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=_common.REPO)
    top = psutil.Process(proc.pid)
    samples: list[dict] = []
    end_at = started + args.minutes * 60
    next_sample = started + 5.0
    while proc.poll() is None:
        now = time.monotonic()
        if now >= end_at and not stop_file.exists():
            stop_file.touch()  # the ranks stop together at their next check (every 10 steps)
        if now >= next_sample:
            s = _sample(top, run_id)
            if s:
                s["t"] = round(now - started, 1)
                s["load1"] = round(os.getloadavg()[0], 2)
                samples.append(s)
                print(
                    f"[soak] {s['t']:7.0f} s  load {s['load1']:5.2f}  "
                    + "  ".join(f"{k} {v['rss'] / 2**20:.0f}M/{v['fds']}fd" for k, v in sorted(s["procs"].items()))
                    + f"  shm {s['shm_files']}",
                    flush=True,
                )
            next_sample += args.every
        if now > end_at + 300:
            proc.terminate()  # the job did not stop within 5 minutes of its stop file: a finding of its own
        time.sleep(0.5)
    wall = time.monotonic() - started
    log.close()
    run_path = out_dir / run_id
    findings = _common.read_jsonl(run_path / "findings.jsonl")
    leftover_shm = [f for f in os.listdir("/dev/shm") if run_id in f] if os.path.isdir("/dev/shm") else []
    result = {
        "minutes": args.minutes,
        "wall_s": round(wall, 1),
        "exit": proc.returncode,
        "findings": [(f.get("kind"), f.get("culprit_ranks")) for f in findings],
        "load1_before": round(load_before[0], 2),
        "load1_median": sorted(s["load1"] for s in samples)[len(samples) // 2] if samples else None,
        "shm_left_after_exit": len(leftover_shm),
        "run_dir": str(run_path),
        **summarize(samples, args.warmup_minutes * 60),
    }
    (out_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    print(json.dumps(result, indent=1))
    if not args.no_record:
        _record(args, result, info)
    return 0 if not findings and proc.returncode == 0 else 1


def _record(args: argparse.Namespace, r: dict, info: dict[str, str]) -> None:
    rows = [
        f"| {role} | {v['pids']} | {v['rss_first_mib']} | {v['rss_last_mib']} | {v['rss_max_mib']} | "
        f"{v['rss_slope_mib_per_h']:+} | {v['fds_min']}-{v['fds_max']} |"
        for role, v in sorted(r["processes"].items())
    ]
    body = [
        f"- job: {args.nproc} ranks of the demo, {args.slow_ms:g} ms sleep a step, metrics endpoint on, a certified "
        f"checkpoint every {args.checkpoint_every} steps, every check at its default (all on)",
        f"- load: 1-min {r['load1_before']} at start, median {r['load1_median']} over the run",
        f"- result: exit {r['exit']}, findings {r['findings'] or 'none'}, wall {r['wall_s']} s; "
        f"shared-memory files after warm-up {r['shm_files']} ({r['shm_mib']} MiB), left after exit: "
        f"{r['shm_left_after_exit']}",
        "",
        f"RSS after the {args.warmup_minutes:g}-minute warm-up (MiB) and open descriptors, per process:",
        "",
        "| process | pids seen | RSS first | RSS last | RSS max | slope MiB/h | fds |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    _common.append_results(
        f"Soak: {args.minutes:g} minutes, {args.nproc} ranks, every check on",
        info,
        _common.command_line(),
        "\n".join(body),
    )


if __name__ == "__main__":
    sys.exit(main())
