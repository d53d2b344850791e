"""Four `trainscout run` invocations form one four-node job (one torchrun per node, `--nnodes 4`) on this machine.

As on four real nodes: the same TRAINSCOUT_SECRET everywhere, the same --coordinator-addr (node 0 serves it,
the others connect), and each node's torchrun with its own --node-rank. Each node gets its own run id so the
simulated nodes share nothing through this machine's /dev/shm, as separate hosts would not. One rank a node
keeps the job at the demo's four ranks on a small machine.

What a real multi-node job does to the monitor and a single node never shows: a node whose `trainscout run`
starts seconds after the others (its agent joins a job whose agents already report), an agent that dies on a
node that is not the coordinator's and is started again there, and a faulty rank whose evidence and stacks
come from another node's agent.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
from pathlib import Path

import psutil
import pytest

from conftest import Job, JobResult, free_port, read_jsonl, torchrun_cmd, trainscout_cmd, unique_run_id

pytestmark = pytest.mark.slow

NODES = 4
LATE_S = 4.0  # the last node's `trainscout run` starts this long after the others


def _node_job(jobs, tmp_path: Path, run_id: str, node: int, coordinator: str, master_port: str, env, options, script):
    node_run_id = run_id if node == 0 else f"{run_id}-n{node}"
    root = tmp_path / f"node{node}"
    launch = torchrun_cmd(
        *("--nnodes", str(NODES), "--nproc-per-node", "1", "--node-rank", str(node)),
        *("--master-addr", "127.0.0.1", "--master-port", master_port),
        *("-m", "trainscout.demo.train", *script),
    )
    args = trainscout_cmd(
        *("run", "--run-dir", str(root), "--run-id", node_run_id, "--console", "plain"),
        *("--coordinator-addr", coordinator, *options),
    )
    if node:
        args += ["--node-rank", str(node)]
    suffix = "" if node == 0 else f"-node{node}"
    return jobs(args + ["--", *launch], root, node_run_id, env=env, node_suffix=suffix)


def _start_nodes(jobs, tmp_path: Path, name: str, options=(), script=(), late_node=None, env=None) -> list[Job]:
    """Start the four nodes; `late_node`'s only LATE_S seconds after the others."""
    env = {"TRAINSCOUT_SECRET": secrets.token_hex(32), **(env or {})}
    coordinator = f"127.0.0.1:{free_port()}"
    master_port = str(free_port())
    run_id = unique_run_id(name)
    started: dict[int, Job] = {}
    order = [n for n in range(NODES) if n != late_node] + ([late_node] if late_node is not None else [])
    for node in order:
        if node == late_node:
            time.sleep(LATE_S)
        started[node] = _node_job(jobs, tmp_path, run_id, node, coordinator, master_port, env, options, script)
    return [started[n] for n in range(NODES)]


def _tool_of(job: Job, component: str) -> psutil.Process | None:
    """The node's live agent or coordinator: the supervisor's child started as `python -m trainscout.<component>`."""
    for child in psutil.Process(job.pid).children():
        try:
            if f"trainscout.{component}" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except psutil.Error:
            continue
    return None


def _supervisor_events(job: Job) -> list[dict]:
    return read_jsonl(job.run_path / "events.supervisor.jsonl")


def _kill_and_await_restart(job: Job, component: str, timeout: float = 40.0) -> float:
    """SIGKILL the node's agent or coordinator; returns when its supervisor has started a new one (wall clock)."""
    victim = _tool_of(job, component)
    assert victim is not None, f"no {component} running\n{job.output()[-3000:]}"
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    deadline = time.monotonic() + timeout
    while True:
        events = _supervisor_events(job)
        back = [e for e in events if e["kind"] == "tool_restarted" and e["component"] == component]
        if back:
            return float(back[0]["t"])
        assert job.proc.poll() is None, f"the node's run ended while its {component} was down\n{job.output()[-4000:]}"
        assert time.monotonic() < deadline, f"the {component} was not restarted\n{job.output()[-4000:]}"
        time.sleep(0.1)


def _await_event(job: Job, kind: str, node: str, count: int, timeout: float = 30.0) -> None:
    """Wait until the coordinator's events.jsonl holds `count` events `kind` of `node`."""
    deadline = time.monotonic() + timeout
    while (
        sum(1 for e in read_jsonl(job.run_path / "events.jsonl") if e["kind"] == kind and e.get("node") == node) < count
    ):
        assert time.monotonic() < deadline, f"no {kind} of {node}\n{job.output()[-4000:]}"
        time.sleep(0.1)


def _wait_all(nodes: list[Job]) -> list[JobResult]:
    return [job.wait() for job in nodes]


def _hellos(result: JobResult) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for e in result.events:
        if e["kind"] == "agent_hello":
            out.setdefault(e["node"], []).append(float(e["t"]))
    return out


def test_four_nodes_late_node_restarted_agent_and_a_hang_on_the_third_node(jobs, tmp_path):
    """Node 3 starts LATE_S late; mid-job node 2's agent is killed and restarted, then the coordinator (node 0),
    so every node's agent reconnects to its successor; then rank 2 (node 2) hangs.

    Every rank sleeps 100 ms a step, so the hang's step comes well after both restarts on a loaded machine too.
    """
    fault_log = tmp_path / "faults.jsonl"
    nodes = _start_nodes(
        jobs,
        tmp_path,
        "mn4-hang",
        options=("--inject", "hang:rank=2:step=75;slow:rank=all:step=0:ms=100", "--abort-on", "hang"),
        script=("--steps", "400", "--log-every", "5"),
        late_node=3,
        env={"TRAINSCOUT_FAULT_LOG": str(fault_log)},
    )
    nodes[0].wait_for_launcher_text("step 5")  # every node's rank trains: the late one has joined
    agent_back = _kill_and_await_restart(nodes[2], "agent")
    _await_event(nodes[0], "agent_hello", "node2", 2)  # the new agent reached the coordinator
    coordinator_back = _kill_and_await_restart(nodes[0], "coordinator")
    results = _wait_all(nodes)
    r0 = results[0]

    fired = [json.loads(line) for line in fault_log.read_text().splitlines() if line.strip()]
    hang_fired = [f for f in fired if f["kind"] == "hang"]
    assert [f["rank"] for f in hang_fired] == [2], fired
    assert hang_fired[0]["t"] > max(agent_back, coordinator_back), "the hang fired before the restarts: raise its step"

    # the one finding, by the restarted coordinator from the digests of all four reconnected agents: the hang,
    # on rank 2 of node 2, with the stack node 2's restarted agent took
    assert [f["kind"] for f in r0.findings] == ["hang"], r0.describe()
    f = r0.findings[0]
    assert f["status"] == "attributed", r0.describe()
    assert f["culprit_ranks"] == [2], r0.describe()
    assert f["step"] == 75, r0.describe()
    assert sorted(f["evidence"]["waiting_ranks"]) == [0, 1, 3], r0.describe()
    assert "2" in f["stacks"] and "_fire" in f["stacks"]["2"], r0.describe()
    assert f["confirmed"] - hang_fired[0]["t"] <= 15.0, r0.describe()

    # every node's agent said hello, node 3's though its node started late; node 2's twice (restarted)
    hellos = _hellos(r0)
    assert sorted(hellos) == [f"node{n}" for n in range(NODES)], r0.describe()
    # (hellos queue at their agents until the coordinator is up, so their times say little of who came when)
    started = {n: next(e["t"] for e in _supervisor_events(nodes[n]) if e["kind"] == "start") for n in (1, 2, 3)}
    assert started[3] - max(started[1], started[2]) >= LATE_S / 2, started
    assert len(hellos["node2"]) == 2 and max(hellos["node2"]) >= agent_back - 1.0, hellos
    for n in (0, 1, 3):
        assert len(hellos[f"node{n}"]) == 1, hellos
    for job, component in ((nodes[2], "agent"), (nodes[0], "coordinator")):
        died = [e for e in _supervisor_events(job) if e["kind"] == "tool_died"]
        assert [(e["component"], e["code"]) for e in died] == [(component, -signal.SIGKILL)], died
    summary = (r0.run_path / "summary.md").read_text()
    assert summary.count("monitoring gap: the coordinator was down from") == 1, summary

    # the coordinator's node stops the job (exit 3: fault localized); the others see their launchers fail
    assert r0.returncode == 3, r0.describe()
    for n in range(1, NODES):
        assert results[n].returncode == 4, results[n].describe()
        assert not (results[n].run_path / "findings.jsonl").exists(), results[n].describe()
    assert "monitoring was lost" not in "".join(r.output for r in results), r0.describe()


def test_four_nodes_a_rank_killed_on_the_second_node_is_the_one_crash(jobs, tmp_path):
    """Rank 1 (node 1) is SIGKILLed; its peers on the other nodes then fail in gloo: one crash, on rank 1."""
    nodes = _start_nodes(
        jobs, tmp_path, "mn4-crash", options=("--inject", "crash:rank=1:step=10:how=kill"), script=("--steps", "300")
    )
    results = _wait_all(nodes)
    r0 = results[0]

    assert [f["kind"] for f in r0.findings] == ["crash"], r0.describe()
    f = r0.findings[0]
    assert f["status"] == "attributed" and f["culprit_ranks"] == [1], r0.describe()
    assert len(f["pids"]) == 1 and f["pids"][0] > 0, r0.describe()
    assert f["step"] == 10 and f["evidence"]["signal"] == "SIGKILL", r0.describe()
    collateral = f["evidence"].get("collateral") or {}
    assert set(collateral) <= {"0", "2", "3"}, r0.describe()
    assert r0.returncode == 3, r0.describe()
    for r in results[1:]:
        assert r.returncode != 0 and not (r.run_path / "findings.jsonl").exists(), r.describe()


def test_clean_four_node_job_has_no_findings(jobs, tmp_path):
    nodes = _start_nodes(jobs, tmp_path, "mn4-clean", script=("--steps", "40"))
    results = _wait_all(nodes)
    r0 = results[0]

    for r in results:
        assert r.returncode == 0, r.describe()
    assert r0.findings == [], r0.describe()
    assert "done: 40 steps" in r0.output, r0.describe()
    assert sorted(_hellos(r0)) == [f"node{n}" for n in range(NODES)], r0.describe()
    goodbyes = {e["node"] for e in r0.events if e["kind"] == "agent_goodbye"}
    assert goodbyes == {f"node{n}" for n in range(NODES)}, r0.describe()
