"""Where trainscout's healthy-path overhead goes: CPU per process, and the probe's share inside a rank.

`overhead sliced` / `overhead pairs` say how much slower a step is; this says why. It runs the demo job once
without and once with trainscout (or only with, --only-trainscout), and meanwhile
  * samples utime+stime of every process of the run from /proc (ranks, torchrun, and on the trainscout side
    the supervisor, agent and coordinator), so the CPU the monitoring processes take from a small machine
    shows up next to the ranks' own;
  * records rank --profile-rank with py-spy (`record --nonblocking --threads --format raw`, sampling without
    stopping the process) and splits its on-CPU samples into the training thread's own work, probe code
    (frames under src/trainscout/) called on the training thread, and the probe's background thread.
On a 2-core machine running 4 ranks every CPU-second spent outside training lengthens the steps.

    .venv/bin/python -m benchmarks overhead profile --steps 600
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import (
    PYTHON,
    begin,
    REPO,
    append_results,
    command_line,
    fmt,
    load1,
    markdown_table,
    median,
    parse_env,
    text_table,
    uptime,
)
from benchmarks._demo_job import step_seconds, train_cmd, under_trainscout

PY_SPY = str(Path(PYTHON).parent / "py-spy")
CLK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK  # utime, stime (fields 14, 15 of stat)
    except (OSError, IndexError, ValueError):
        return None


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> set[int]:
    """root and every process below it (the agent and coordinator run in their own sessions, but are
    still children of the supervisor)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def _role(pid: int, root: int) -> str:
    cmd = _cmdline(pid)
    if pid == root:
        return "supervisor" if " trainscout run" in cmd else "torchrun"
    if "trainscout.agent" in cmd:
        return "agent"
    if "trainscout.coordinator" in cmd:
        return "coordinator"
    if "torch.distributed.run" in cmd:
        return "torchrun"
    if "trainscout.demo.train" in cmd:
        for item in _environ(pid):
            if item.startswith(b"RANK="):
                return f"rank {item[5:].decode()}"
        return "rank ?"
    return cmd.split(" ")[0].rsplit("/", 1)[-1] or "?"


def run_once(side: str, args: argparse.Namespace, out: Path) -> dict:
    run_id = f"prof-{side}"
    timing = out / f"{run_id}.steps.txt"
    job = train_cmd(4, args.steps, "--timing-file", str(timing))
    cmd = job if side == "base" else under_trainscout(job, out, run_id)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(args.base_env if side == "base" else args.trainscout_env))
    load_before = load1()
    log = open(out / f"{run_id}.out", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    cpu: dict[int, float] = {}
    roles: dict[int, str] = {}
    spy = None
    raw = out / f"{run_id}.rank{args.profile_rank}.pyspy.txt"
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in _descendants(proc.pid):
            value = _cpu_s(pid)
            if value is None:
                continue
            role = _role(pid, proc.pid)  # re-read: a fresh child shows torchrun's cmdline until exec
            if role != "?" or pid not in roles:  # an exiting process has no cmdline left to read
                roles[pid] = role
            cpu[pid] = value
            if spy is None and roles[pid] == f"rank {args.profile_rank}" and not args.no_py_spy:
                spy = subprocess.Popen(
                    [
                        PY_SPY,
                        "record",
                        "--nonblocking",
                        "--threads",
                        "--format",
                        "raw",
                        "--rate",
                        str(args.rate),
                        "--pid",
                        str(pid),
                        "--output",
                        str(raw),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=open(out / f"{run_id}.pyspy.err", "w"),
                )
        time.sleep(0.2)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    if spy is not None:
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.send_signal(signal.SIGINT)
            spy.wait()
    by_role: dict[str, float] = collections.defaultdict(float)
    for pid, value in cpu.items():
        by_role[roles[pid]] += value
    steps = step_seconds(timing)
    return {
        "side": side,
        "code": proc.returncode,
        "load": load_before,
        "cpu": dict(by_role),
        "median_ms": 1000 * median(steps[20:]) if len(steps) > 20 else None,
        "profile": analyse(raw) if raw.exists() else None,
    }


_OURS = re.compile(r"\((?:\S*/)?trainscout/(?!demo/)")  # probe, fingerprint, faults: not the demo job
_PASS_THROUGH = re.compile(r"\breal\w*\(|_inner\.|\bcall_fn\(")


def _source_line(frame: str) -> str:
    """The source text of a py-spy frame "func (path:line)", to tell a wrapper's call of the real
    function (its time is the wrapped work's) from work the probe itself does."""
    match = re.search(r"\(([^:()]+):(\d+)\)$", frame)
    if not match:
        return ""
    path = match.group(1)
    if not path.startswith("/"):  # py-spy shortens paths below sys.path entries: trainscout/probe/...
        path = str(REPO / "src" / path)
    try:
        return linecache.getline(path, int(match.group(2)))
    except Exception:
        return ""


def analyse(path: Path) -> dict:
    """Split py-spy's collapsed on-CPU samples of one rank: training thread vs other threads, and on the
    training thread the samples whose innermost trainscout frame is probe work rather than a wrapper
    passing the call through (`return real_backward(...)` etc.)."""
    rows = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            rows.append((stack.split(";"), int(count)))
    main_tid = next(
        (frames[0] for frames, _ in rows if any(f.startswith("train (") and "demo/train.py" in f for f in frames)), None
    )
    main_total = main_probe = other_total = 0
    probe_funcs: collections.Counter = collections.Counter()
    other_funcs: collections.Counter = collections.Counter()
    for frames, n in rows:
        ours = [f for f in frames[1:] if _OURS.search(f)]
        if frames[0] == main_tid:
            main_total += n
            if ours and not _PASS_THROUGH.search(_source_line(ours[-1])):
                main_probe += n
                probe_funcs[_short(ours[-1])] += n
        else:
            other_total += n
            other_funcs[_short(ours[-1] if ours else frames[-1])] += n
    return {
        "main_total": main_total,
        "main_probe": main_probe,
        "other_total": other_total,
        "probe_funcs": probe_funcs.most_common(10),
        "other_funcs": other_funcs.most_common(6),
    }


def _short(frame: str) -> str:
    name, _, where = frame.partition(" (")
    return f"{name.split('.<locals>.')[-1] if '<locals>' in name else name} ({where.rsplit('/src/', 1)[-1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--profile-rank", type=int, default=0)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--only-trainscout", action="store_true")
    parser.add_argument(
        "--base-env",
        action="append",
        default=[],
        metavar="K=V",
        help="e.g. TORCH_FR_BUFFER_SIZE=2000: the Flight Recorder's own cost, without trainscout",
    )
    parser.add_argument(
        "--trainscout-env",
        action="append",
        default=[],
        metavar="K=V",
        help="e.g. TRAINSCOUT_PROBE_TICK_S=1.0 or TRAINSCOUT_STATE_CHECK=0",
    )
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    args.base_env, args.trainscout_env = parse_env(args.base_env), parse_env(args.trainscout_env)
    out, info, up_before = begin("overhead-profile", args.out_dir)
    results = [
        run_once(side, args, out) for side in (("trainscout",) if args.only_trainscout else ("base", "trainscout"))
    ]
    up_after = uptime()
    (out / "profile.json").write_text(json.dumps(results, indent=1, default=str))

    roles = sorted({r for res in results for r in res["cpu"]}, key=lambda r: (not r.startswith("rank"), r))
    cpu_header = ["process"] + [f"{res['side']} CPU s" for res in results]
    cpu_rows = [[role] + [fmt(res["cpu"].get(role), 2) for res in results] for role in roles]
    cpu_rows.append(["all"] + [fmt(sum(res["cpu"].values()), 2) for res in results])
    cpu_rows.append(["median step ms (rank 0)"] + [fmt(res["median_ms"], 2) for res in results])
    cpu_rows.append(["1-min load at start"] + [fmt(res["load"], 2) for res in results])
    lines = [text_table(cpu_header, cpu_rows)]
    md = [
        f"- load: before `{up_before}`; after `{up_after}`",
        f"- {args.steps} steps; run dirs under `<out-dir>`",
        f"- env: baseline {args.base_env or 'defaults'}; trainscout {args.trainscout_env or 'defaults'}",
        "",
        markdown_table(cpu_header, cpu_rows),
        "",
    ]
    for res in results:
        p = res["profile"]
        if not p:
            continue
        total = p["main_total"] + p["other_total"]
        head = (
            f"py-spy, rank {args.profile_rank}, {res['side']} side: {total} on-CPU samples; training thread "
            f"{p['main_total']} of which probe work {p['main_probe']} "
            f"({100 * p['main_probe'] / max(p['main_total'], 1):.1f} %); other threads {p['other_total']} "
            f"({100 * p['other_total'] / max(total, 1):.1f} % of all)"
        )
        lines += ["", head, "  probe work on the training thread (innermost trainscout frame):"]
        lines += [f"    {n:6d}  {name}" for name, n in p["probe_funcs"]]
        lines += ["  other threads (innermost trainscout frame, else leaf):"]
        lines += [f"    {n:6d}  {name}" for name, n in p["other_funcs"]]
        md += [
            f"- {head}",
            "",
            markdown_table(
                ["samples", "probe work on the training thread (innermost trainscout frame)"],
                [[str(n), f"`{name}`"] for name, n in p["probe_funcs"]],
            ),
            "",
            markdown_table(
                ["samples", "other threads (innermost trainscout frame, else leaf)"],
                [[str(n), f"`{name}`"] for name, n in p["other_funcs"]],
            ),
            "",
        ]
    print("\n".join(lines))
    print(f"uptime after: {up_after}")
    if not args.no_record:
        append_results(
            "Overhead breakdown (python -m benchmarks overhead profile)",
            info,
            command_line().replace(str(out), "<out-dir>"),
            "\n".join(md),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
