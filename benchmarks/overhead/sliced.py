"""Healthy-path overhead, time-sliced: the baseline job and the trainscout job alive at once, one running at a time.

Sequential A/B runs on a small shared VM differ by 10-30 % between runs of the same job (the host's load
changes over tens of seconds, and 4 ranks on 2 cores settle into different schedules from run to run), which
swamps a 1 % effect: `overhead pairs` needs hundreds of pairs to bound it. Here both jobs (the same 4-rank gloo
DDP demo, `trainscout.demo.train --timing-file F`, one of them under `trainscout run`) start together; once
both are past the warm-up, the harness freezes one job's whole process tree with SIGSTOP (ranks, torchrun,
and on the trainscout side the supervisor, agent and coordinator) while the other runs for --slice seconds,
and alternates. Neighbouring slices see the same machine seconds apart, so the host's drifts cancel.

Per slice: the median wall time of the steps that began and ended inside it (rank 0's timing file gives each
step's end on the monotonic clock), its first --settle steps dropped (caches are cold after the other job
ran), and the CPU seconds of the running tree per step in it (psutil, read while both trees are frozen).
Each B slice is compared with the mean of the A slices before and after it (a linear drift cancels), and a
pair of jobs gives the median of those ratios. Two jobs of the same code also differ for as long as they
live (4 ranks on 2 cores settle into a schedule of their own), so --pairs runs fresh pairs of jobs one after
the other: the headline is the median of the pairs' ratios with a 95 % bootstrap interval over pairs, and
the bar (<= 1 %) is met only when the whole interval is under it. `--a` / `--b` pick each side (`base` or `trainscout`) so an A/A run (`--b base`) shows the
harness's own bias and noise; `--a-env` / `--b-env` K=V change one side's settings.

Slices are kept shorter than the coordinator's agent-silence limit (2 s): a frozen tree is frozen whole,
so trainscout sees a job-wide pause, which it must not report (the run's findings are listed).

    .venv/bin/python -m benchmarks overhead sliced --pairs 6 --seconds 120
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import (
    REPO,
    append_results,
    begin,
    bootstrap_median_ci,
    command_line,
    fmt,
    markdown_table,
    median,
    parse_env,
    read_jsonl,
    uptime,
)
from benchmarks._demo_job import step_spans, train_cmd, under_trainscout

BAR = 1.01


class Job:
    """One side: a demo job (plain torchrun, or under `trainscout run`) whose process tree can be frozen."""

    def __init__(self, label: str, side: str, out: Path, args: argparse.Namespace, env: dict[str, str]) -> None:
        self.label, self.side = label, side
        self.run_id = f"sl-{label}-{side}"
        self.timing = out / f"{self.run_id}.steps.txt"
        self.log = out / f"{self.run_id}.out"
        self.run_dir = out / self.run_id
        self.stop_file = out / f"{self.run_id}.stop"
        job = train_cmd(args.nproc, args.steps, "--timing-file", str(self.timing), "--stop-file", str(self.stop_file))
        cmd = job if side == "base" else under_trainscout(job, out, self.run_id)
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
        self._log_fh = open(self.log, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_fh, stderr=subprocess.STDOUT, env=full_env, cwd=REPO, start_new_session=True
        )
        self.frozen: list = []

    def tree(self) -> list:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def logged_step(self) -> int:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith("step ")]
            return int(lines[-1].split()[1]) if lines else 0
        except (OSError, ValueError, IndexError):
            return 0

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds so far of each kind of process in the tree (ranks, torchrun, trainscout's monitors)."""
        import psutil

        out: dict[str, float] = {}
        for p in self.tree():
            try:
                t = p.cpu_times()
                role = _role(p.cmdline())
            except psutil.Error:
                continue
            out[role] = out.get(role, 0.0) + t.user + t.system + t.children_user + t.children_system
        return out

    def freeze(self) -> None:
        self.frozen = self.tree()
        for p in self.frozen:
            try:
                p.send_signal(signal.SIGSTOP)
            except Exception:
                pass

    def thaw(self) -> None:
        for p in self.frozen or self.tree():
            try:
                p.send_signal(signal.SIGCONT)
            except Exception:
                pass
        self.frozen = []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.thaw()
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                return self.proc.wait()
        finally:
            self._log_fh.close()

    def steps(self) -> list[tuple[float, float]]:
        return step_spans(self.timing)


def _role(cmdline: list[str]) -> str:
    """What a process of a job is, from the module it runs (the launchers' own arguments name the others)."""
    module = next((cmdline[i + 1] for i, arg in enumerate(cmdline[:-1]) if arg == "-m"), "")
    if module == "trainscout":
        return "supervisor"
    return {
        "trainscout.demo.train": "ranks",
        "trainscout.agent": "agent",
        "trainscout.coordinator": "coordinator",
        "torch.distributed.run": "torchrun",
    }.get(module, "other")


def slice_stats(steps: list[tuple[float, float]], t0: float, t1: float, settle: int) -> tuple[float | None, int]:
    """Median seconds of the steps wholly inside [t0, t1] after the first `settle` of them, and how many ended
    inside it (for CPU per step)."""
    inside = [e - s for s, e in steps if s >= t0 and e <= t1]
    ended = sum(1 for _, e in steps if t0 <= e <= t1)
    kept = inside[settle:]
    return (median(kept) if len(kept) >= 3 else None), ended


def neighbour_ratios(a_vals: list[float | None], b_vals: list[float | None]) -> list[float]:
    """B slice k against the mean of A slices k and k+1 (A runs first, then B, alternating)."""
    out = []
    for k, b in enumerate(b_vals):
        around = [a for a in a_vals[k : k + 2] if a]
        if b and len(around) == 2:
            out.append(b / (sum(around) / 2))
    return out


def block_bootstrap_median_ci(
    values: list[float], block: int = 5, rounds: int = 4000, seed: int = 0
) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(values)
    block = max(1, min(block, n))
    starts = list(range(n - block + 1))
    meds = []
    for _ in range(rounds):
        sample: list[float] = []
        while len(sample) < n:
            s = rng.choice(starts)
            sample.extend(values[s : s + block])
        meds.append(median(sample[:n]))
    meds.sort()
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def run_pair(index: int, args: argparse.Namespace, out: Path, a_env: dict, b_env: dict) -> dict:
    """One pair of fresh jobs, sliced for --seconds: per-slice statistics and the pair's ratios."""
    a = Job(f"a{index:02d}", args.a, out, args, a_env)
    b = Job(f"b{index:02d}", args.b, out, args, b_env)
    started = time.monotonic()
    while min(a.logged_step(), b.logged_step()) < args.warmup:
        if not (a.alive() and b.alive()) or time.monotonic() - started > 300:
            break
        time.sleep(0.2)
    slices: list[tuple[Job, float, float, dict]] = []  # (side, start, end, CPU seconds by role)
    if a.alive() and b.alive():
        b.freeze()
        a.freeze()
        deadline = time.monotonic() + args.seconds
        turn = a
        while time.monotonic() < deadline and a.alive() and b.alive():
            cpu0 = turn.cpu_by_role()
            t0 = time.monotonic()
            turn.thaw()
            time.sleep(args.slice)
            turn.freeze()
            t1 = time.monotonic()
            cpu1 = turn.cpu_by_role()
            slices.append((turn, t0, t1, {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}))
            turn = b if turn is a else a
        a.thaw()
        b.thaw()
    for job in (a, b):
        job.stop_file.touch()
    codes = {"a": a.wait(600), "b": b.wait(600)}
    steps = {id(a): a.steps(), id(b): b.steps()}
    per = {"a": [], "b": []}  # (median s, CPU s per step) per slice of each side, in order
    roles: dict[str, dict[str, float]] = {"a": {}, "b": {}}  # CPU seconds by role over a side's slices
    ended_in = {"a": 0, "b": 0}
    inside = {"a": [], "b": []}
    for job, t0, t1, cpu in slices:
        side = "a" if job is a else "b"
        med, ended = slice_stats(steps[id(job)], t0, t1, args.settle)
        per[side].append((med, sum(cpu.values()) / ended if ended else None))
        ended_in[side] += ended
        inside[side] += [e - st for st, e in steps[id(job)] if st >= t0 and e <= t1]
        for role, sec in cpu.items():
            roles[side][role] = roles[side].get(role, 0.0) + sec
    # the pairing assumes A came first and sides alternated; an unfinished last A leaves B's last slice out
    ratios = neighbour_ratios([m for m, _ in per["a"]], [m for m, _ in per["b"]])
    cpu_ratios = neighbour_ratios([c for _, c in per["a"]], [c for _, c in per["b"]])
    findings = [
        (f.get("kind"), f.get("culprit_ranks"))
        for j in (a, b)
        if j.side == "trainscout"
        for f in read_jsonl(j.run_dir / "findings.jsonl")
    ]
    with (out / "slices.jsonl").open("a") as fh:
        for job, t0, t1, cpu in slices:
            fh.write(json.dumps({"pair": index, "side": job.label, "t0": t0, "t1": t1, "cpu_s_by_role": cpu}) + "\n")
    return {
        "index": index,
        "codes": codes,
        "findings": findings,
        "slices": len(slices),
        "ratio": median(ratios) if ratios else None,
        "cpu_ratio": median(cpu_ratios) if cpu_ratios else None,
        "slice_ratios": ratios,
        "median_ms": {k: 1000 * median(v) if v else None for k, v in inside.items()},
        "steps": {k: len(v) for k, v in inside.items()},
        "cpu_ms_by_role": {
            k: {r: 1000 * sec / ended_in[k] for r, sec in roles[k].items()} if ended_in[k] else {} for k in ("a", "b")
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6, help="pairs of fresh jobs, one after the other (default 6)")
    parser.add_argument(
        "--seconds", type=float, default=120.0, help="sliced time per pair (both sides together; default 120)"
    )
    parser.add_argument("--slice", type=float, default=1.0, help="seconds one side runs before the other does")
    parser.add_argument("--settle", type=int, default=2, help="steps dropped at the start of each slice")
    parser.add_argument(
        "--steps",
        type=int,
        default=100_000,
        help="most steps per job; both are told to stop (--stop-file) when the slicing ends",
    )
    parser.add_argument("--warmup", type=int, default=40, help="logged step both jobs reach before slicing")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--a", default="base", choices=("base", "trainscout"), help="side A (default base)")
    parser.add_argument("--b", default="trainscout", choices=("base", "trainscout"), help="side B")
    parser.add_argument("--a-env", action="append", default=[], metavar="K=V")
    parser.add_argument("--b-env", action="append", default=[], metavar="K=V")
    parser.add_argument("--label", default="", help="a word for the RESULTS.md title")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    if not 0.2 <= args.slice <= 1.5:
        raise SystemExit("--slice must be 0.2-1.5 s: longer freezes read as a lost agent to the coordinator")
    if args.pairs < 1:
        raise SystemExit("--pairs must be at least 1")
    out, info, up_before = begin("overhead-sliced", args.out_dir)
    a_env, b_env = parse_env(args.a_env), parse_env(args.b_env)
    pairs = []
    for i in range(args.pairs):
        row = run_pair(i, args, out, a_env, b_env)
        pairs.append(row)
        with (out / "pairs.jsonl").open("a") as fh:
            fh.write(json.dumps({k: v for k, v in row.items() if k != "slice_ratios"}) + "\n")
        print(
            f"pair {i}: step-time ratio {fmt(row['ratio'], 4)}, CPU ratio {fmt(row['cpu_ratio'], 4)} over "
            f"{row['slices']} slices; exits {row['codes']}"
            + (f"; findings {row['findings']}" if row["findings"] else ""),
            flush=True,
        )
    up_after = uptime()

    ratios = [p["ratio"] for p in pairs if p["ratio"]]
    cpu_ratios = [p["cpu_ratio"] for p in pairs if p["cpu_ratio"]]
    lo, hi = bootstrap_median_ci(ratios)
    clo, chi = bootstrap_median_ci(cpu_ratios)
    pooled = [r for p in pairs for r in p["slice_ratios"]]
    plo, phi = block_bootstrap_median_ci(pooled)
    name = {
        "a": f"A ({args.a}{' ' + str(a_env) if a_env else ''})",
        "b": f"B ({args.b}{' ' + str(b_env) if b_env else ''})",
    }
    per_pair = markdown_table(
        [
            "pair",
            "A median step ms",
            "B median step ms",
            "step-time ratio (median of slices)",
            "CPU ratio",
            "slices",
            "A CPU ms/step by process",
            "B CPU ms/step by process",
        ],
        [
            [
                str(p["index"]),
                fmt(p["median_ms"]["a"], 3),
                fmt(p["median_ms"]["b"], 3),
                fmt(p["ratio"], 4),
                fmt(p["cpu_ratio"], 4),
                str(p["slices"]),
                ", ".join(f"{r} {v:.2f}" for r, v in sorted(p["cpu_ms_by_role"]["a"].items())),
                ", ".join(f"{r} {v:.2f}" for r, v in sorted(p["cpu_ms_by_role"]["b"].items())),
            ]
            for p in pairs
        ],
    )
    verdict = ("within" if hi <= BAR else "OVER" if lo > BAR else "not shown within") if ratios else "-"
    headline = (
        (
            f"{100 * (median(ratios) - 1):+.2f} % (95 % interval over pairs {100 * (lo - 1):+.2f} to "
            f"{100 * (hi - 1):+.2f} %), {verdict} the 1 % bar"
        )
        if ratios
        else "no ratios"
    )
    cpu_line = (
        (
            f"{100 * (median(cpu_ratios) - 1):+.2f} % (95 % interval over pairs {100 * (clo - 1):+.2f} to "
            f"{100 * (chi - 1):+.2f} %)"
        )
        if cpu_ratios
        else "not measured"
    )
    pooled_line = (
        (
            f"{100 * (median(pooled) - 1):+.2f} % (block bootstrap {100 * (plo - 1):+.2f} to "
            f"{100 * (phi - 1):+.2f} %, {len(pooled)} slice ratios)"
        )
        if pooled
        else "-"
    )
    print(
        f"\n{per_pair}\n\nB vs A, median step time: {headline}\nB vs A, CPU per step: {cpu_line}\n"
        f"all slices pooled: {pooled_line}\nuptime after: {up_after}"
    )
    failed = [(p["index"], p["codes"]) for p in pairs if any(c != 0 for c in p["codes"].values())]
    findings = [(p["index"], p["findings"]) for p in pairs if p["findings"]]
    body = [
        f"- sides: {name['a']} vs {name['b']}; {args.nproc} ranks; {args.pairs} pairs of fresh jobs, each "
        f"sliced {args.seconds:g} s in {args.slice:g} s slices after both logged step {args.warmup}; first "
        f"{args.settle} steps of a slice dropped; step time from rank 0; run dirs under `<out-dir>`",
        f"- uptime before `{up_before}`; after `{up_after}`",
        f"- **B vs A, median step time: {headline}**",
        f"- B vs A, CPU per step (whole process tree): {cpu_line}",
        f"- all slices of all pairs pooled (ignores the pairs' own offsets): {pooled_line}",
        "",
        per_pair,
        "",
        f"- findings on the trainscout side(s): {findings or 'none'}",
    ]
    if failed:
        body.append(f"- **pairs with a failed job: {failed}**")
    if not args.no_record:
        title = "Healthy-path overhead, time-sliced (python -m benchmarks overhead sliced)" + (
            f": {args.label}" if args.label else ""
        )
        append_results(title, info, command_line().replace(str(out), "<out-dir>"), "\n".join(body))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
