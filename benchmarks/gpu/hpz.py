"""ZeRO++ hpZ secondary-partition race on 2 GPUs: reproduce it, name it, fix it, and time the fixes.

Runs `benchmarks/gpu/hpz_train.py` (a small GPT under DeepSpeed ZeRO-3, bf16) in these phases, each a fresh
`torchrun --nproc-per-node 2` job:

1. `ref`    ZeRO-3 without hpZ: the reference losses.
2. `unsafe` hpZ 2 with DeepSpeed's host stall removed and nothing in its place, a compute-stream sleep
            before every secondary copy (deterministic race), under `trainscout run`
            (TRAINSCOUT_HPZ_FIX=unsafe): corrupted gathers (ground truth from inside the job), divergent
            losses, and the `hpz_race` finding with its step.
3. `stall`  the same job with DeepSpeed as shipped (its host stall), no trainscout.
4. `event`  the same job under `trainscout run` with the event-ordered fix (its default): losses must be
            bitwise identical to `ref`, and trainscout silent.
5. `bench`  throughput with the three modes interleaved in one job (no injected delay): blocks of K steps,
            R rounds, medians of tokens/s.
6. `socket` the same throughput comparison with NCCL forced onto TCP sockets over loopback (P2P and shared
            memory off), rate-limited with `tc` when the machine allows it, plus plain ZeRO-3 there.

Writes `hpz_results.json` and `hpz_results.md` (and the jobs' log tails) to --out. `--device cpu` runs
the same flow on DeepSpeed's CPU accelerator with a tiny model (no race, no timing): a dry run.

    python -m benchmarks gpu hpz --out /tmp/hpz --steps 200 --delay-ms 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "benchmarks" / "gpu" / "hpz_train.py"
SOCKET_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_NET": "Socket",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
}


def log(text: str) -> None:
    print(f"[hpz_race {time.strftime('%H:%M:%S')}] {text}", flush=True)


class Runner:
    def __init__(self, args) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or (self.out / "work"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.logs: list[str] = []
        self.port = 29700
        self.lock = threading.Lock()

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def worker_args(self, *extra: str) -> list[str]:
        a = self.args
        size = (
            [
                "--layers",
                "2",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--vocab",
                "128",
                "--seq",
                "16",
                "--batch",
                "2",
                "--persistence-threshold",
                "0",
                "--max-live",
                "0",
            ]
            if a.device == "cpu"
            else ["--layers", str(a.layers), "--hidden", str(a.hidden), "--seq", str(a.seq), "--batch", str(a.batch)]
        )
        return [str(WORKER), "--device", a.device, *size, *extra]

    def job(
        self,
        name: str,
        worker: list[str],
        *,
        trainscout: dict | None = None,
        env: dict | None = None,
        timeout: float = 300.0,
    ) -> dict:
        """One torchrun job (under `trainscout run` when trainscout is a dict of its environment)."""
        with self.lock:
            self.port += 1
            port = self.port
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(self.args.nproc),
            "--master-port",
            str(port),
            *worker,
        ]
        run_dir = self.work / "runs"
        run_id = f"hpz-{name}-{uuid.uuid4().hex[:6]}"
        cmd = (
            launch
            if trainscout is None
            else [
                sys.executable,
                "-m",
                "trainscout",
                "run",
                "--run-dir",
                str(run_dir),
                "--run-id",
                run_id,
                "--console",
                "plain",
                "--",
                *launch,
            ]
        )
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), **(trainscout or {})}
        if self.args.device == "cpu":
            full_env.setdefault("DS_ACCELERATOR", "cpu")
            full_env.setdefault("OMP_NUM_THREADS", "1")
        timeout = min(timeout, max(30.0, self.left_s()))
        log(f"{name}: {' '.join(cmd[-len(worker) :])} (timeout {timeout:.0f} s)")
        t0 = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
            rc, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = 124, f"{exc.stdout or ''}{exc.stderr or ''}"
            output = output.decode(errors="replace") if isinstance(output, bytes) else output
        seconds = time.monotonic() - t0
        lines = [ln for ln in output.splitlines() if "Warning" not in ln and "warn(" not in ln]
        self.logs.append(f"===== {name} rc={rc} {seconds:.1f} s\n" + "\n".join(lines[-60:]))
        log(f"{name}: rc={rc} in {seconds:.1f} s")
        findings = []
        if trainscout is not None:
            path = run_dir / run_id / "findings.jsonl"
            if path.exists():
                findings = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        return {"rc": rc, "seconds": seconds, "findings": findings}

    def train_job(self, name: str, extra: list[str], **kw) -> dict:
        result_path = self.work / f"{name}.json"
        if result_path.exists():
            result_path.unlink()
        info = self.job(name, self.worker_args(*extra, "--out", str(result_path)), **kw)
        if result_path.exists():
            info["result"] = json.loads(result_path.read_text())
        return info


def compare_losses(a: list[float], b: list[float]) -> dict:
    n = min(len(a), len(b))
    first = next((i + 1 for i in range(n) if a[i] != b[i]), None)  # 1-based step
    return {
        "steps": n,
        "bitwise_equal": first is None and len(a) == len(b),
        "first_different_step": first,
        "max_abs_diff": max((abs(x - y) for x, y in zip(a, b)), default=0.0),
        "final": [a[n - 1] if n else None, b[n - 1] if n else None],
    }


def medians(blocks: list[dict]) -> dict:
    by: dict[str, list[float]] = {}
    for b in blocks:
        by.setdefault(b["mode"], []).append(b["tokens_per_s"])
    return {
        m: {"median_tokens_per_s": statistics.median(v), "blocks": len(v), "min": min(v), "max": max(v)}
        for m, v in by.items()
    }


def paired_ratios(blocks: list[dict]) -> dict:
    """Median over rounds of each round's mode ratios: the modes of one round ran back to back, so the
    machine's slow drift (which spreads blocks of one mode by +-15 %) cancels in the ratio."""
    rounds: dict[int, dict[str, float]] = {}
    for b in blocks:
        rounds.setdefault(b["round"], {})[b["mode"]] = b["tokens_per_s"]
    pairs = {"event/unsafe": ("event", "unsafe"), "event/stall": ("event", "off"), "stall/unsafe": ("off", "unsafe")}
    out = {}
    for name, (a, b) in pairs.items():
        ratios = [r[a] / r[b] for r in rounds.values() if a in r and b in r]
        if ratios:
            out[name] = statistics.median(ratios)
    return out


def tc_limit(rate: str) -> str:
    """Rate-limit loopback with a token bucket; returns what happened (the machine may not allow it)."""
    tc = shutil.which("tc")
    if tc is None:
        return "no tc on this machine: sockets unthrottled"
    subprocess.run([tc, "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    done = subprocess.run(
        [tc, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "8mb", "latency", "100ms"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return f"tc refused ({done.stderr.strip()[:200]}): sockets unthrottled"
    return f"loopback limited to {rate} (tc tbf)"


def tc_clear() -> None:
    tc = shutil.which("tc")
    if tc:
        subprocess.run([tc, "qdisc", "del", "dev", "lo", "root"], capture_output=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--delay-ms", type=float, default=2.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bench-rounds", type=int, default=8)
    ap.add_argument("--bench-steps", type=int, default=10)
    ap.add_argument("--socket-rounds", type=int, default=3)
    ap.add_argument("--socket-steps", type=int, default=4)
    ap.add_argument("--socket-rate", default="12500mbit")
    ap.add_argument("--phases", default="ref,unsafe,stall,event,bench,socket")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip phases once this much time has passed")
    ap.add_argument(
        "--side-by-side",
        action="store_true",
        help="run ref, a second ref, unsafe and event at once on the same GPUs (correctness only: "
        "their timings mean nothing), then the other phases",
    )
    args = ap.parse_args(argv)
    r = Runner(args)
    phases = args.phases.split(",")
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args)}
    try:
        res["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception:
        res["nvidia_smi"] = "?"
    delay = ["--delay-ms", str(args.delay_ms)] if args.device == "cuda" else []
    steps = ["--steps", str(args.steps)]

    def save() -> None:
        (r.out / "hpz_results.json").write_text(json.dumps(res, indent=1, default=str))
        (r.out / "hpz_logs.txt").write_text("\n\n".join(r.logs)[-2_000_000:])
        (r.out / "hpz_results.md").write_text(report(res))

    def want(name: str, need_s: float) -> bool:
        if name not in phases:
            return False
        if r.left_s() < need_s:
            res.setdefault("skipped", []).append(f"{name} (budget: {r.left_s():.0f} s left)")
            return False
        return True

    if args.side_by_side:
        from concurrent.futures import ThreadPoolExecutor

        jobs = {
            "ref": (["--hpz", "1", *steps], None),
            "ref2": (["--hpz", "1", *steps], None),
            "unsafe": (
                ["--hpz", "2", "--fix", "unsafe", "--truth", *delay, *steps],
                {"TRAINSCOUT_HPZ_FIX": "unsafe", "TRAINSCOUT_REPLAY_EVERY": "0"},
            ),
            "event": (
                ["--hpz", "2", "--fix", "event", "--truth", *delay, *steps],
                {"TRAINSCOUT_HPZ_FIX": "event", "TRAINSCOUT_REPLAY_EVERY": "0"},
            ),
        }
        jobs = {k: v for k, v in jobs.items() if k in phases}
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {k: pool.submit(r.train_job, k, extra, trainscout=ts) for k, (extra, ts) in jobs.items()}
            for k, fut in futures.items():
                res[k] = fut.result()
        phases = [p for p in phases if p not in jobs]
        save()
    if want("ref", 30):
        res["ref"] = r.train_job("ref", ["--hpz", "1", *steps])
        save()
    if want("unsafe", 30):
        res["unsafe"] = r.train_job(
            "unsafe",
            ["--hpz", "2", "--fix", "unsafe", "--truth", *delay, *steps],
            trainscout={"TRAINSCOUT_HPZ_FIX": "unsafe", "TRAINSCOUT_REPLAY_EVERY": "0"},
        )
        save()
    if want("stall", 30):
        res["stall"] = r.train_job("stall", ["--hpz", "2", "--fix", "off", "--truth", *delay, *steps])
        save()
    if want("event", 30):
        res["event"] = r.train_job(
            "event",
            ["--hpz", "2", "--fix", "event", "--truth", *delay, *steps],
            trainscout={"TRAINSCOUT_HPZ_FIX": "event", "TRAINSCOUT_REPLAY_EVERY": "0"},
        )
        save()
    if args.device == "cuda" and want("bench", 40):
        res["bench"] = r.train_job(
            "bench", ["--hpz", "2", "--bench-rounds", str(args.bench_rounds), "--bench-steps", str(args.bench_steps)]
        )
        save()
    if args.device == "cuda" and want("socket", 60):
        res["socket_tc"] = tc_limit(args.socket_rate)
        try:
            sock = ["--bench-rounds", str(args.socket_rounds), "--bench-steps", str(args.socket_steps), "--warmup", "3"]
            res["socket_hpz"] = r.train_job("socket_hpz", ["--hpz", "2", *sock], env=SOCKET_ENV)
            save()
            if want("socket", 40):
                res["socket_plain"] = r.train_job(
                    "socket_plain", ["--hpz", "1", "--bench-modes", "plain", *sock], env=SOCKET_ENV
                )
        finally:
            tc_clear()
        save()
    res["total_s"] = time.monotonic() - r.started
    save()
    print(report(res))
    return 0


def report(res: dict) -> str:
    lines = [f"# hpZ race results {res.get('date')}", f"GPUs: {res.get('nvidia_smi')}", ""]
    ref = res.get("ref", {}).get("result", {})
    if ref and res.get("ref2", {}).get("result"):
        same = compare_losses(ref["losses"], res["ref2"]["result"]["losses"])
        res["ref2"]["summary"] = {"vs_ref": same}
        lines.append(f"- ref2 (ZeRO-3 without hpZ again: run-to-run control): {same}")
    for name in ("unsafe", "stall", "event"):
        ph = res.get(name)
        if not ph:
            continue
        out = ph.get("result", {})
        cmp = compare_losses(ref.get("losses", []), out.get("losses", [])) if ref and out else {}
        corrupted = out.get("corrupted", [])
        first_bad = next((i + 1 for i, c in enumerate(corrupted) if c), None)
        finds = [(f["kind"], f.get("step"), f.get("culprit_ranks")) for f in ph.get("findings", [])]
        ph["summary"] = {
            "vs_ref": cmp,
            "corrupted_gathers": sum(corrupted),
            "steps_with_corruption": sum(1 for c in corrupted if c),
            "first_corrupted_step": first_bad,
            "findings": finds,
            "fix": out.get("fix"),
        }
        lines.append(
            f"- {name}: rc={ph['rc']} {ph['seconds']:.0f} s; vs ZeRO-3 without hpZ: {cmp}; corrupted "
            f"gathers {sum(corrupted)} in {ph['summary']['steps_with_corruption']} steps "
            f"(first at step {first_bad}); trainscout findings {finds}; fix {out.get('fix')}"
        )
    for name in ("bench", "socket_hpz", "socket_plain"):
        ph = res.get(name)
        if not ph:
            continue
        blocks = ph.get("result", {}).get("blocks", [])
        med = medians(blocks)
        ph["medians"] = med
        text = ", ".join(
            f"{m} {v['median_tokens_per_s']:.0f} tok/s (n={v['blocks']}, {v['min']:.0f}-{v['max']:.0f})"
            for m, v in med.items()
        )
        if "unsafe" in med and "event" in med and "off" in med:
            u, s, e = (med[m]["median_tokens_per_s"] for m in ("unsafe", "off", "event"))
            text += f"; event/unsafe {e / u:.4f}, event/stall {e / s:.4f}, stall/unsafe {s / u:.4f}"
            paired = paired_ratios(blocks)
            ph["paired"] = paired
            text += "; paired per round (median): " + ", ".join(f"{k} {v:.4f}" for k, v in paired.items())
            # unsafe blocks whose corrupted gathers made DeepSpeed skip optimizer steps are shorter for that
            # reason alone: the fair comparison keeps only rounds where no block skipped a step
            clean = [b for b in blocks if b.get("skipped_steps", 0) == 0]
            dirty_rounds = {b["round"] for b in blocks if b.get("skipped_steps", 0)}
            paired_clean = paired_ratios([b for b in blocks if b["round"] not in dirty_rounds])
            ph["paired_clean"] = paired_clean
            ph["skipped_steps"] = {m: sum(b.get("skipped_steps", 0) for b in blocks if b["mode"] == m) for m in med}
            text += (
                f"; optimizer steps skipped by mode {ph['skipped_steps']}; rounds without a skipped step "
                f"{len({b['round'] for b in blocks}) - len(dirty_rounds)}: paired (median) "
                + ", ".join(f"{k} {v:.4f}" for k, v in paired_clean.items())
                + "; medians of blocks without a skipped step: "
                + ", ".join(f"{m} {v['median_tokens_per_s']:.0f}" for m, v in medians(clean).items())
            )
        lines.append(f"- {name}: rc={ph['rc']}: {text}")
    if res.get("socket_tc"):
        lines.append(f"- sockets: {res['socket_tc']}")
    hp, pl = res.get("socket_hpz", {}).get("medians", {}), res.get("socket_plain", {}).get("medians", {})
    if "event" in hp and "plain" in pl:
        lines.append(
            f"- sockets: hpZ (event) / plain ZeRO-3 = "
            f"{hp['event']['median_tokens_per_s'] / pl['plain']['median_tokens_per_s']:.4f}"
        )
    if res.get("skipped"):
        lines.append(f"- skipped: {res['skipped']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
