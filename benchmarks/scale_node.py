"""Per-node cost on a real node: one 8-rank gloo job under `trainscout run`, its monitors sampled with psutil.

`scale coordinator` simulates the node agents to size the coordinator; this runs the real ones on one node of
8 ranks (the demo's tiny GPT under DDP, on gloo) and measures, over a steady window after a warm-up:
  * the agent's, coordinator's and supervisor's CPU seconds per second (utime + stime, psutil) and RSS;
  * the bytes per second the agent sends the coordinator: the kernel's count (`ss -ti` bytes_acked) of the
    agent's one TCP connection, i.e. its digests (and the rare report) as ZeroMQ frames on the wire;
  * what those bytes are: after the window, a second reader of the same channels (trainscout's own `Agent`
    class, its sends going nowhere) builds the digests the agent builds and weighs each part, encoded;
  * the ranks' own median step time with trainscout and, unless --no-baseline, of the same job bare
    (one pair, sequential: a rough figure; `overhead sliced` is the precise step-time measure).
On a small shared machine the monitors compete with 8 CPU-bound ranks: the load average goes with the figures.

    .venv/bin/python -m benchmarks scale node --seconds 90
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks._common import (
    REPO,
    append_results,
    begin,
    command_line,
    fmt,
    markdown_table,
    median,
    text_table,
    uptime,
)
from benchmarks._demo_job import step_spans, train_cmd, under_trainscout

MONITORS = ("agent", "coordinator", "supervisor")
SIMULATED_DIGEST_BYTES_S = 9500  # `scale coordinator`: a simulated 8-rank node's digests, bytes a second


def role_of(proc: psutil.Process, root_pid: int) -> str:
    """What a process of the run is: supervisor (the `trainscout run` process), agent, coordinator, torchrun,
    rank, or other."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if proc.pid == root_pid:
        return "supervisor" if " trainscout run" in cmd else "torchrun"
    for name in ("trainscout.agent", "trainscout.coordinator"):
        if name in cmd:
            return name.split(".")[1]
    if "torch.distributed.run" in cmd:
        return "torchrun"
    if "trainscout.demo.train" in cmd:
        return "rank"
    return "other"


def bytes_sent_of(pid: int, port: int) -> int | None:
    """Bytes the process has sent (and had acknowledged) on its TCP connection to 127.0.0.1:`port`, as the
    kernel counts them (tcp_info via `ss`), or None when it has no such connection."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return None
    local = [c.laddr for c in conns if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED]
    if not local:
        return None
    laddr = local[0]
    try:
        text = subprocess.run(
            ["ss", "-tinH", "src", f"{laddr.ip}:{laddr.port}"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"bytes_acked:(\d+)", text)
    return int(match.group(1)) if match else None


def coordinator_port(run_dir: Path) -> int | None:
    try:
        return int((run_dir / "coordinator.addr").read_text().strip().rsplit(":", 1)[1])
    except (OSError, ValueError, IndexError):
        return None


def logged_step(log: Path) -> int:
    """The last "step N ..." line rank 0 printed."""
    try:
        steps = re.findall(r"^step (\d+) ", log.read_text(errors="replace"), re.M)
    except OSError:
        return 0
    return int(steps[-1]) if steps else 0


class Sampler:
    """Once a second: CPU seconds and RSS of every process of the run, by role, and the agent's bytes sent."""

    def __init__(self, root_pid: int, run_dir: Path | None) -> None:
        self.root_pid, self.run_dir = root_pid, run_dir
        self.rows: list[dict] = []  # {"t", "load1", "cpu": {role: s}, "rss": {role: bytes}, "agent_bytes"}
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (role, last CPU s): exited processes keep theirs

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss: dict[str, int] = {}
        agent_pid = None
        for p in procs:
            role = role_of(p, self.root_pid)
            try:
                t = p.cpu_times()
                mem = p.memory_info().rss
            except psutil.Error:
                continue
            self._cpu[p.pid] = (role, t.user + t.system)
            rss[role] = rss.get(role, 0) + mem
            if role == "agent":
                agent_pid = p.pid
        cpu: dict[str, float] = {}
        for role, seconds in self._cpu.values():
            cpu[role] = cpu.get(role, 0.0) + seconds
        port = coordinator_port(self.run_dir) if self.run_dir else None
        sent = bytes_sent_of(agent_pid, port) if agent_pid and port else None
        self.rows.append(
            {"t": time.monotonic(), "load1": os.getloadavg()[0], "cpu": cpu, "rss": rss, "agent_bytes": sent}
        )

    def summary(self) -> dict:
        """Per role: CPU seconds per second over the window, RSS mean and max; the agent's bytes a second."""
        if len(self.rows) < 2:
            return {}
        first, last = self.rows[0], self.rows[-1]
        span = last["t"] - first["t"]
        out: dict = {"window_s": round(span, 1), "load1_mean": sum(r["load1"] for r in self.rows) / len(self.rows)}
        for role in sorted({r for row in self.rows for r in row["cpu"]}):
            used = last["cpu"].get(role, 0.0) - first["cpu"].get(role, 0.0)
            rss = [row["rss"][role] for row in self.rows if role in row["rss"]]
            out[role] = {
                "cpu_s_per_s": used / span,
                "rss_mib_mean": sum(rss) / len(rss) / 2**20 if rss else None,
                "rss_mib_max": max(rss) / 2**20 if rss else None,
            }
        counted = [(r["t"], r["agent_bytes"]) for r in self.rows if r["agent_bytes"] is not None]
        if len(counted) >= 2 and counted[-1][0] > counted[0][0]:
            out["agent_bytes_per_s"] = (counted[-1][1] - counted[0][1]) / (counted[-1][0] - counted[0][0])
        return out


def digest_parts(run_id: str, digests: int) -> dict[str, float]:
    """Encoded bytes per digest of each part of a node's digest, averaged over `digests` one-second digests
    built from the run's live channels (the real agent's code; the result is sent nowhere)."""
    import msgspec

    from benchmarks._common import free_port
    from trainscout.agent.main import Agent

    observer = Agent(run_id, f"tcp://127.0.0.1:{free_port()}", bytes(32), "observer")
    encode = msgspec.msgpack.Encoder().encode
    totals: dict[str, float] = {}
    try:
        for i in range(digests + 1):
            began = time.monotonic()
            observer.discover()
            for view in observer.views.values():
                view.refresh()
            digest = observer.digest()
            if i == 0:
                continue  # the first holds everything since the channels were opened
            totals["whole digest"] = totals.get("whole digest", 0) + len(encode(digest))
            for rank in digest.ranks:
                for name in rank.__struct_fields__:
                    totals[name] = totals.get(name, 0) + len(encode(getattr(rank, name)))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
    finally:
        observer.endpoint.close()
    return {name: total / digests for name, total in totals.items()}


def run_side(side: str, args: argparse.Namespace, out: Path) -> dict:
    """One job, bare (`base`) or under trainscout: warm up, sample for args.seconds, stop it at the same step
    on every rank (the demo's --stop-file), and read back rank 0's step times inside the window."""
    run_id = f"node-{side}"
    timing, stop, log_path = out / f"{run_id}.steps.txt", out / f"{run_id}.stop", out / f"{run_id}.out"
    job = train_cmd(args.ranks, 10**7, "--timing-file", str(timing), "--stop-file", str(stop), "--log-every", "10")
    cmd = job if side == "base" else under_trainscout(job, out, run_id)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    sampler = Sampler(proc.pid, None if side == "base" else out / run_id)
    try:
        deadline = time.monotonic() + args.timeout
        while logged_step(log_path) < args.warmup_steps:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{side}: the job ended or did not warm up (see {log_path})")
            time.sleep(0.5)
        began = time.monotonic()
        while time.monotonic() - began < args.seconds and proc.poll() is None:
            sampler.sample()
            time.sleep(max(0.0, 1.0 - (time.monotonic() - began) % 1.0))
        sampler.sample()
        ended = time.monotonic()
        parts = digest_parts(run_id, args.parts_digests) if side != "base" and args.parts_digests else {}
        stop.touch()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    in_window = [end - start for start, end in step_spans(timing) if start >= began and end <= ended]
    findings = out / run_id / "findings.jsonl"
    return {
        "side": side,
        "code": proc.returncode,
        "steps_in_window": len(in_window),
        "median_step_ms": 1000 * median(in_window) if in_window else None,
        "steps_per_s": len(in_window) / (ended - began),
        "findings": len(findings.read_text().splitlines()) if findings.exists() else 0,
        "digest_parts": parts,
        **sampler.summary(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8, help="ranks of the one node (default 8)")
    parser.add_argument("--seconds", type=float, default=90.0, help="length of the sampled window of each job")
    parser.add_argument("--warmup-steps", type=int, default=20, help="rank 0's logged step the window starts after")
    parser.add_argument("--no-baseline", action="store_true", help="skip the bare job (no step-time comparison)")
    parser.add_argument("--parts-digests", type=int, default=5, help="digests weighed part by part (0: none)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a job may take to warm up")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true", help="leave RESULTS.md alone")
    args = parser.parse_args()
    out, info, up_before = begin("scale-node", args.out_dir)
    sides = ("trainscout",) if args.no_baseline else ("base", "trainscout")
    results = [run_side(side, args, out) for side in sides]
    up_after = uptime()
    (out / "node_cost.json").write_text(json.dumps(results, indent=1))
    ours = results[-1]
    base = results[0] if not args.no_baseline else None

    header = ["process", "CPU s/s", "RSS MiB mean", "RSS MiB max"]
    rows = [
        [role, fmt(ours[role]["cpu_s_per_s"], 3), fmt(ours[role]["rss_mib_mean"], 1), fmt(ours[role]["rss_mib_max"], 1)]
        for role in (*MONITORS, "torchrun", "rank")
        if role in ours
    ]
    sent = ours.get("agent_bytes_per_s")
    facts = [
        f"agent -> coordinator: {fmt(sent / 1000 if sent else None, 2)} KB/s on the wire "
        f"({fmt(sent / args.ranks if sent else None, 0)} B/s a rank); the scale harness's simulated 8-rank node: "
        f"{SIMULATED_DIGEST_BYTES_S / 1000:.1f} KB/s",
        f"monitors together: {fmt(sum(ours[r]['cpu_s_per_s'] for r in MONITORS if r in ours), 3)} CPU s/s beside "
        f"the ranks' {fmt(ours.get('rank', {}).get('cpu_s_per_s'), 2)}",
        f"rank 0 median step: {fmt(ours['median_step_ms'], 1)} ms with trainscout ({ours['steps_in_window']} steps)"
        + (
            f", {fmt(base['median_step_ms'], 1)} ms bare ({base['steps_in_window']} steps): ratio "
            f"{fmt(ours['median_step_ms'] / base['median_step_ms'], 3)}"
            if base and base["median_step_ms"] and ours["median_step_ms"]
            else ""
        ),
        f"findings on the healthy job: {ours['findings']}; 1-min load during the window: mean "
        f"{fmt(ours['load1_mean'], 2)} (trainscout side)" + (f", {fmt(base['load1_mean'], 2)} (bare)" if base else ""),
    ]
    parts = sorted(ours["digest_parts"].items(), key=lambda kv: -kv[1])
    part_header = ["digest part (all ranks)", "bytes a digest", "bytes a rank-step"]
    per_rank_step = args.ranks * ours["steps_per_s"]
    part_rows = [
        [name, fmt(size, 0), fmt(size / per_rank_step if per_rank_step else None, 0)]
        for name, size in parts
        if size >= 100 or name == "whole digest"
    ]
    facts.insert(1, f"{fmt(ours['steps_per_s'], 2)} steps a second on every rank in the window")
    print(text_table(header, rows))
    if part_rows:
        print(text_table(part_header, part_rows))
    print("\n".join(facts))
    print(f"uptime after: {up_after}")
    if not args.no_record:
        body = [
            f"- load: before `{up_before}`; after `{up_after}`",
            f"- one node of {args.ranks} gloo ranks (the demo job), a {args.seconds:g} s window after rank 0's "
            f"step {args.warmup_steps}; psutil once a second; bytes from `ss -ti` on the agent's connection",
            "",
            markdown_table(header, rows),
            "",
            *([markdown_table(part_header, part_rows), ""] if part_rows else []),
            *[f"- {line}" for line in facts],
        ]
        append_results(
            "Per-node cost on a real 8-rank node (python -m benchmarks scale node)",
            info,
            command_line().replace(str(out), "<out-dir>"),
            "\n".join(body),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
