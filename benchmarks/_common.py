"""What every benchmark script shares: launching trainscout runs, summary statistics, and RESULTS.md sections.

The benchmarks measure trainscout from outside, the way a user runs it (`python -m trainscout demo|run`), so a
number here includes everything a user waits for: process start-up, the agent's polling, the coordinator's
timeouts. Each script appends one dated section to RESULTS.md with the machine and the exact command, because
a number without them (especially on a shared 2-core machine) cannot be compared with the next one.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_MD = REPO / "benchmarks" / "RESULTS.md"
PYTHON = sys.executable


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick), for torchrun's rendezvous.

    Another engineer's jobs share this machine, so fixed ports would collide sooner or later; a tiny race
    between closing this socket and torchrun binding it remains, and shows up as a failed run, not a wrong one.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:
        return f"uptime failed: {exc!r}"


def load1() -> float:
    return os.getloadavg()[0]


def date_utc() -> str:
    try:
        return subprocess.run(["date", "-u"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return datetime.datetime.now(datetime.timezone.utc).strftime("%a %b %d %H:%M:%S UTC %Y")


def machine() -> dict[str, str]:
    """nproc, CPU model, RAM, torch and python versions: what a reader needs to weigh the numbers."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    try:
        torch_version = subprocess.run(
            [PYTHON, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, timeout=120
        ).stdout.strip()
    except Exception:
        torch_version = "?"
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "ram": ram,
        "torch": torch_version,
        "python": platform.python_version(),
        "code_start": code_version(),
    }


def code_version() -> str:
    """The commit measured, plus uncommitted changes under src/: others commit to this tree while benchmarks run."""
    try:
        head = subprocess.run(
            ["git", "log", "-1", "--format=%h %cd %s", "--date=format:%H:%M:%S"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
        return head + (f" (+ uncommitted: {', '.join(dirty)})" if dirty else "")
    except Exception as exc:
        return f"unknown ({exc!r})"


def command_line() -> str:
    """The command that ran this benchmark, as typed from the repository root (`python -m benchmarks` puts
    "benchmarks QUESTION MODE" in argv[0])."""
    return " ".join([".venv/bin/python", "-m", sys.argv[0], *map(shlex.quote, sys.argv[1:])])


def parse_env(pairs: list[str]) -> dict[str, str]:
    """--...-env K=V options (repeatable) as an environment dict."""
    env = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected K=V, got {item!r}")
        env[key] = value
    return env


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without importing numpy for a handful of values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return percentile(values, 50)


def bootstrap_median_ci(ratios: list[float], rounds: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the median of per-pair ratios, resampling pairs (the machine's noise between
    pairs is far larger than within one pair)."""
    if not ratios:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    meds = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def append_results(title: str, info: dict[str, str], command: str, body: str) -> None:
    """One dated section in RESULTS.md: title, date, machine, command, then the benchmark's own text."""
    head = [
        f"## {title} — {info['date']}",
        "",
        f"- machine: {info['nproc']} cores, {info['cpu']}, {info['ram']} RAM; torch {info['torch']}, "
        f"python {info['python']}",
        f"- command: `{command}`",
        f"- code: at start `{info.get('code_start', '?')}`; at end `{code_version()}`",
        "",
    ]
    if not RESULTS_MD.exists():
        RESULTS_MD.write_text(
            "# trainscout benchmark results\n\nEach section is appended by the benchmark "
            "script named in its command line (see benchmarks/README.md).\n\n"
        )
    with RESULTS_MD.open("a") as fh:
        fh.write("\n".join(head) + body.rstrip() + "\n\n")


@dataclass
class Launch:
    """One finished trainscout (or plain torchrun) process: its exit code, wall time and the load around it."""

    code: int | None
    wall_s: float
    load_before: float
    load_after: float
    timed_out: bool


def launch(
    cmd: list[str], log_path: Path, env: dict[str, str] | None = None, timeout_s: float = 180.0, sampler=None
) -> Launch:
    """Run cmd in its own session with output to log_path; on timeout SIGTERM it (trainscout then stops its
    launcher, agent and coordinator cleanly), then SIGKILL its session if it lingers. sampler(proc), if
    given, is called about once a second while the command runs."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    load_before = load1()
    started = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO, start_new_session=True
        )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    code = proc.wait(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        raise
                    if sampler is not None:
                        sampler(proc)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                code = proc.wait()
    return Launch(
        code=code,
        wall_s=time.perf_counter() - started,
        load_before=load_before,
        load_after=load1(),
        timed_out=timed_out,
    )


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"unparsable": line})
    return out


def default_out_dir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path("/tmp") / f"trainscout-bench-{name}-{stamp}"


class CpuSampler:
    """CPU seconds of a command's whole process tree against rank 0's logged step ("step N ..." lines).

    Wall-clock step times on a small shared VM swing by 10 % and more between runs when the host takes
    CPU away; CPU seconds per training step barely move, so this is the steadier overhead measure. Only
    samples taken after `warmup` logged steps count, so start-up (imports, compiles) is left out.
    """

    def __init__(self, log_path: Path, warmup: int) -> None:
        self.log_path = log_path
        self.warmup = warmup
        self.samples: list[tuple[int, float]] = []  # (logged step, CPU seconds of the tree)
        self._per_pid: dict[int, float] = {}  # a process that exits keeps its last reading

    def __call__(self, proc) -> None:
        import psutil

        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return
        steps = re.findall(r"^step (\d+) ", text, re.M)
        step = int(steps[-1]) if steps else 0
        if step < self.warmup:
            return
        try:
            root = psutil.Process(proc.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    self._per_pid[p.pid] = max(self._per_pid.get(p.pid, 0.0), t.user + t.system)
                except psutil.Error:
                    pass
        except psutil.Error:
            return
        self.samples.append((step, sum(self._per_pid.values())))

    def cpu_ms_per_step(self) -> float | None:
        # up to the last sample at which training still advanced (shutdown is not a training step)
        moving = [b for a, b in zip(self.samples, self.samples[1:]) if b[0] > a[0]]
        if not moving:
            return None
        (s0, c0), (s1, c1) = self.samples[0], moving[-1]
        return 1000 * (c1 - c0) / (s1 - s0)


def begin(name: str, out_dir: Path | None) -> tuple[Path, dict[str, str], str]:
    """Every benchmark's start: its run folder, the machine facts with today's date, and `uptime` now."""
    out = out_dir or default_out_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["date"] = date_utc()
    up_before = uptime()
    print(f"out dir: {out}\nuptime before: {up_before}", flush=True)
    return out, info, up_before
