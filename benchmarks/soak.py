"""Soak: one long 4-rank CPU job under `trainscout run` with every check on; does anything grow?

Samples, every `--every` seconds, each process of the run (the supervisor, node agent, coordinator, the
launcher and the ranks): RSS and open file descriptors, and the run's shared-memory files in /dev/shm.
After the warm-up, a healthy run keeps all of them flat. The job ends itself at `--minutes` (the demo's
`--stop-file`), so it finishes the way a real job does; 0 findings is part of the bar.

    python -m benchmarks soak run --minutes 60            # the issue's bar: one hour
    python -m benchmarks soak run --quick                 # 2 minutes, RESULTS.md untouched (smoke test)
    python -m benchmarks soak run --variants full,checks-off,bare   # what grows because of trainscout

`--variants` runs the same job side by side under trainscout with every check on (full), under trainscout
with every optional check off (checks-off), and alone (bare): a growth the bare job shows too is the
workload's (torch, the allocator), not trainscout's.

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


def _role(proc: psutil.Process, top: int, top_role: str) -> str | None:
    if proc.pid == top:
        return top_role
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    for role, marker in ROLES:
        if marker in cmd:
            return role
    return None


def _shm_files(run_id: str) -> list[str]:
    """The run's files in /dev/shm (its channels, its run-id claim)."""
    return [f for f in os.listdir("/dev/shm") if run_id in f] if os.path.isdir("/dev/shm") else []


def _sample(top: psutil.Process, run_id: str, top_role: str = "supervisor") -> dict:
    procs = {}
    try:
        family = [top, *top.children(recursive=True)]
    except psutil.Error:
        return {}
    for p in family:
        role = _role(p, top.pid, top_role)
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
    shm = _shm_files(run_id)
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


# what --variants may run, side by side: the job under trainscout with every check at its default, the same
# with every optional check off (the probe still times steps and publishes), and the job alone
CHECKS_OFF = {
    "TRAINSCOUT_STATE_CHECK": "0",
    "TRAINSCOUT_NONFINITE_CHECK": "0",
    "TRAINSCOUT_EVIDENCE": "0",
    "TRAINSCOUT_REPLAY_EVERY": "0",
    "TRAINSCOUT_LINK_PROBE": "0",
}
VARIANTS = ("full", "checks-off", "bare")


class _Job:
    """One variant's job: its process tree, samples, and where it writes."""

    def __init__(self, variant: str, args: argparse.Namespace, out_dir: Path, stamp: int) -> None:
        self.variant = variant
        self.dir = out_dir / variant if len(args.variants) > 1 else out_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = f"soak-{variant}-{stamp}"
        self.stop_file = self.dir / "stop"
        job = train_cmd(
            args.nproc,
            10**9,
            "--slow-ms",
            str(args.slow_ms),
            "--stop-file",
            str(self.stop_file),
            "--checkpoint-every",
            str(args.checkpoint_every),
            "--checkpoint-dir",
            str(self.dir / "ckpt"),
            "--log-every",
            "500",
        )
        env = dict(os.environ)
        if variant == "bare":
            cmd = job
        else:
            cmd = under_trainscout(job, self.dir, self.run_id, "--metrics-port", str(_common.free_port()))
            if variant == "checks-off":
                env.update(CHECKS_OFF)
        self.log = open(self.dir / "soak.out", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=_common.REPO, env=env)
        self.top = psutil.Process(self.proc.pid)
        self.samples: list[dict] = []

    def sample(self, t: float) -> None:
        s = _sample(self.top, self.run_id, top_role="launcher" if self.variant == "bare" else "supervisor")
        if s:
            s["t"] = t
            s["load1"] = round(os.getloadavg()[0], 2)
            self.samples.append(s)
            print(
                f"[soak {self.variant}] {t:7.0f} s  load {s['load1']:5.2f}  "
                + "  ".join(f"{k} {v['rss'] / 2**20:.0f}M/{v['fds']}fd" for k, v in sorted(s["procs"].items()))
                + f"  shm {s['shm_files']}",
                flush=True,
            )

    def result(self, args: argparse.Namespace, wall: float, load_before: float) -> dict:
        self.log.close()
        run_path = self.dir / self.run_id
        findings = _common.read_jsonl(run_path / "findings.jsonl") if self.variant != "bare" else []
        leftover = _shm_files(self.run_id)
        (self.dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in self.samples))
        loads = sorted(s["load1"] for s in self.samples)
        return {
            "variant": self.variant,
            "minutes": args.minutes,
            "wall_s": round(wall, 1),
            "exit": self.proc.returncode,
            "findings": [(f.get("kind"), f.get("culprit_ranks")) for f in findings],
            "load1_before": round(load_before, 2),
            "load1_median": loads[len(loads) // 2] if loads else None,
            "shm_left_after_exit": len(leftover),
            "run_dir": str(run_path),
            **summarize(self.samples, args.warmup_minutes * 60),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="how long the job trains")
    p.add_argument("--warmup-minutes", type=float, default=5.0, help="samples before this are not judged")
    p.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--slow-ms", type=float, default=20.0, help="each rank sleeps this long a step (the job's pace)")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (certified)")
    p.add_argument(
        "--variants",
        default="full",
        help=f"comma-separated, run side by side: {', '.join(VARIANTS)} (what grows with trainscout, and without)",
    )
    p.add_argument("--out-dir", default=None, help="where the run folder goes (default: a temporary folder)")
    p.add_argument("--no-record", action="store_true", help="leave RESULTS.md alone")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants or len(set(args.variants)) != len(args.variants):
        p.error(f"--variants: one or more of {', '.join(VARIANTS)}, each once (got {args.variants})")
    out_dir, info, up_before = _common.begin("soak", Path(args.out_dir) if args.out_dir else None)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    stamp = int(time.time())
    jobs = [_Job(v, args, out_dir, stamp) for v in args.variants]
    end_at = started + args.minutes * 60
    next_sample = started + 5.0
    while any(j.proc.poll() is None for j in jobs):
        now = time.monotonic()
        for j in jobs:
            if now >= end_at and not j.stop_file.exists():
                j.stop_file.touch()  # the ranks stop together at their next check (every 10 steps)
            if now > end_at + 300 and j.proc.poll() is None:
                j.proc.terminate()  # the job did not stop within 5 minutes of its stop file: a finding of its own
        if now >= next_sample:
            for j in jobs:
                if j.proc.poll() is None:
                    j.sample(round(now - started, 1))
            next_sample += args.every
        time.sleep(0.5)
    wall = time.monotonic() - started
    results = [j.result(args, wall, load_before) for j in jobs]
    print(json.dumps(results, indent=1))
    if not args.no_record:
        _record(args, results, info)
    return 0 if all(not r["findings"] and r["exit"] == 0 for r in results) else 1


def _record(args: argparse.Namespace, results: list[dict], info: dict[str, str]) -> None:
    body = [
        f"- job: {args.nproc} ranks of the demo, {args.slow_ms:g} ms sleep a step, a checkpoint every "
        f"{args.checkpoint_every} steps; variants side by side: "
        + "; ".join(
            {
                "full": "full (under trainscout, metrics endpoint on, every check at its default)",
                "checks-off": "checks-off (under trainscout, "
                + ", ".join(f"{k}={v}" for k, v in CHECKS_OFF.items())
                + ")",
                "bare": "bare (the job alone)",
            }[r["variant"]]
            for r in results
        ),
    ]
    for r in results:
        body.append(
            f"- {r['variant']}: exit {r['exit']}, findings {r['findings'] or 'none'}, wall {r['wall_s']} s, load 1-min "
            f"{r['load1_before']} at start, median {r['load1_median']}; shared-memory files after warm-up "
            f"{r['shm_files']} ({r['shm_mib']} MiB), left after exit: {r['shm_left_after_exit']}"
        )
    body += [
        "",
        f"RSS after the {args.warmup_minutes:g}-minute warm-up (MiB) and open descriptors, per process:",
        "",
        "| variant | process | pids seen | RSS first | RSS last | RSS max | slope MiB/h | fds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        body += [
            f"| {r['variant']} | {role} | {v['pids']} | {v['rss_first_mib']} | {v['rss_last_mib']} | "
            f"{v['rss_max_mib']} | {v['rss_slope_mib_per_h']:+} | {v['fds_min']}-{v['fds_max']} |"
            for role, v in sorted(r["processes"].items())
        ]
    _common.append_results(
        f"Soak: {args.minutes:g} minutes, {args.nproc} ranks, {', '.join(args.variants)}",
        info,
        _common.command_line(),
        "\n".join(body),
    )


if __name__ == "__main__":
    sys.exit(main())
