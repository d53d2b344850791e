"""Two `trainscout run` invocations form one two-node job (2 ranks per node) on this machine.

As on two real nodes: the same TRAINSCOUT_SECRET on both, the same --coordinator-addr (node 0 serves it,
node 1 connects), and each node's torchrun with its own --node-rank. Each node gets its own run id so the
two simulated nodes share nothing through this machine's /dev/shm, as two hosts would not.
"""

from __future__ import annotations

import secrets

import pytest

from conftest import JOB_TIMEOUT_S, free_port, torchrun_cmd, trainscout_cmd, unique_run_id

pytestmark = pytest.mark.slow


def _start_two_nodes(jobs, tmp_path, name: str, options: tuple[str, ...] = ()):
    env = {"TRAINSCOUT_SECRET": secrets.token_hex(32)}
    coordinator = f"127.0.0.1:{free_port()}"
    master_port = str(free_port())
    run_id = unique_run_id(name)
    started = []
    for node in (0, 1):
        node_run_id = run_id if node == 0 else f"{run_id}-n1"
        root = tmp_path / f"node{node}"
        launch = torchrun_cmd(
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            master_port,
            "-m",
            "trainscout.demo.train",
            "--steps",
            "40",
        )
        args = trainscout_cmd(
            "run",
            "--run-dir",
            str(root),
            "--run-id",
            node_run_id,
            "--console",
            "plain",
            "--coordinator-addr",
            coordinator,
            *options,
        )
        if node == 1:
            args += ["--node-rank", "1"]
        started.append(
            jobs(args + ["--", *launch], root, node_run_id, env=env, node_suffix="" if node == 0 else "-node1")
        )
    return started


def test_hang_on_the_second_node_is_named_by_the_first(jobs, tmp_path):
    node0, node1 = _start_two_nodes(
        jobs, tmp_path, "mn-hang", ("--inject", "hang:rank=3:step=15", "--abort-on", "hang")
    )
    r0 = node0.wait(JOB_TIMEOUT_S)
    r1 = node1.wait(JOB_TIMEOUT_S)

    assert [f["kind"] for f in r0.findings] == ["hang"], r0.describe()
    f = r0.findings[0]
    assert f["status"] == "attributed", r0.describe()
    assert f["culprit_ranks"] == [3], r0.describe()
    assert f["hosts"] and all(f["hosts"]), r0.describe()
    assert f["step"] == 15, r0.describe()
    assert f["pg"] == "0" and f["collective_seq"] > 0, r0.describe()
    assert sorted(f["evidence"]["waiting_ranks"]) == [0, 1, 2], r0.describe()
    assert "3" in f["stacks"] and "_fire" in f["stacks"]["3"], r0.describe()  # taken by node 1's agent
    # both nodes' training was stopped (--abort-on hang), so both launchers report failure
    # node 0 named the culprit (fault localized); node 1 sees no findings, only its failed launcher
    assert r0.returncode == 3, r0.describe()
    assert r1.returncode == 4, r1.describe()
    # node 1 writes its own folder (suffix -node1) and no findings or summary of its own
    assert r1.run_path.name.endswith("-n1-node1"), r1.run_path
    assert not (r1.run_path / "findings.jsonl").exists(), r1.describe()
    assert any(e["kind"] == "agent_hello" and e["node"] == "node1" for e in r0.events), r0.describe()


def test_clean_two_node_job_has_no_findings(jobs, tmp_path):
    node0, node1 = _start_two_nodes(jobs, tmp_path, "mn-clean")
    r0 = node0.wait(JOB_TIMEOUT_S)
    r1 = node1.wait(JOB_TIMEOUT_S)

    assert r0.returncode == 0, r0.describe()
    assert r1.returncode == 0, r1.describe()
    assert r0.findings == [], r0.describe()
    assert "done: 40 steps" in r0.output, r0.describe()
    nodes = {e["node"] for e in r0.events if e["kind"] == "agent_hello"}
    assert nodes == {"node0", "node1"}, r0.describe()
    goodbyes = {e["node"] for e in r0.events if e["kind"] == "agent_goodbye"}
    assert goodbyes == {"node0", "node1"}, r0.describe()
