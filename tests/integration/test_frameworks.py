"""Zero-code-change coverage of the distributed frameworks: DDP, FSDP2, HSDP, DTensor TP, DeepSpeed ZeRO-1/2/3.

Each framework's unmodified example script (`examples/`) runs twice under `trainscout run`, the two jobs
side by side: a clean job, which must end with no finding and with the topology the framework set up
(which groups exist, what each is for, which ranks are replicas), and a faulted job in which one rank
desyncs (its next reducing collective uses another reduce op) and later another rank hangs. The faulted
job must name exactly those two ranks with exactly those two kinds, and nothing else. Three ranks (four
for the 2-D HSDP mesh) are the fewest that let a strict majority name a culprit.

The clean job fingerprints all replicated state every step (TRAINSCOUT_STATE_PERIOD=1): frameworks with
replicas (HSDP's replicate groups, ZeRO-1/2's parameters) must have them checked and agreeing, the others
must have nothing to check. A last test corrupts one HSDP replica's shard and expects it named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import JOB_TIMEOUT_S, free_port, torchrun_cmd, trainscout_cmd, unique_run_id
from trainscout.sinks.probe_costs import report_path

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DESYNC_RANK, DESYNC_STEP = 1, 2
HANG_RANK, HANG_STEP = 2, 4


@dataclass(frozen=True)
class Framework:
    script: str
    args: tuple[str, ...]
    nproc: int
    framework: str  # as the integration names it in the topology
    roles: dict  # role -> the member lists of the groups declared with it
    replicas: list  # expected replica classes

    def launch(self, steps: int) -> list[str]:
        return torchrun_cmd(
            "--nproc-per-node",
            str(self.nproc),
            "--master-port",
            str(free_port()),
            str(EXAMPLES / self.script),
            *self.args,
            "--steps",
            str(steps),
        )


ALL3 = [[0, 1, 2]]
FRAMEWORKS = {
    "ddp": Framework("ddp_train.py", ("--hidden", "32"), 3, "DDP", {"replicate": ALL3}, ALL3),
    "fsdp2": Framework("fsdp2_train.py", (), 3, "FSDP2", {"shard": ALL3}, []),
    "hsdp": Framework(
        "hsdp_train.py",
        ("--replicate", "2"),
        4,
        "HSDP",
        {"replicate": [[0, 2], [1, 3]], "shard": [[0, 1], [2, 3]]},
        [[0, 2], [1, 3]],
    ),
    "tp": Framework("tp_train.py", (), 3, "DTensor TP", {"tensor": ALL3}, []),
    "zero1": Framework("deepspeed_train.py", ("--zero-stage", "1"), 3, "DeepSpeed ZeRO-1", {"replicate": ALL3}, ALL3),
    "zero2": Framework("deepspeed_train.py", ("--zero-stage", "2"), 3, "DeepSpeed ZeRO-2", {"replicate": ALL3}, ALL3),
    "zero3": Framework("deepspeed_train.py", ("--zero-stage", "3"), 3, "DeepSpeed ZeRO-3", {"shard": ALL3}, []),
}
# DDP's clean run is covered by test_ddp_coverage (a DDP script, no finding) and the demo's clean runs
CLEAN_ELSEWHERE = {"ddp"}


EVERY_STEP = {"TRAINSCOUT_STATE_PERIOD": "1"}  # the whole replicated state fingerprinted every step


def _start(jobs, tmp_path: Path, name: str, launch: list[str], options: tuple[str, ...] = (), env: dict | None = None):
    run_id = unique_run_id(name)
    args = trainscout_cmd(
        "run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain", *options, "--", *launch
    )
    return jobs(args, tmp_path, run_id, env=env)


def _state_bytes(result, nproc: int) -> list[int]:
    """Bytes of replicated state each rank fingerprinted (from the probes' cost reports)."""
    out = []
    for rank in range(nproc):
        path = Path(report_path(str(result.run_path), rank))
        assert path.exists(), result.describe()
        out.append(int(json.loads(path.read_text())["state_check"]["bytes"]))
    return out


def _topology(result) -> dict:
    path = result.run_path / "topology.json"
    assert path.exists(), result.describe()
    return json.loads(path.read_text())


def _probe_errors(result) -> list[str]:
    events = [json.loads(line) for line in (result.run_path / "events.jsonl").read_text().splitlines() if line]
    return [e["error"] for e in events if e.get("kind") == "probe_error"]


def _check_topology(fw: Framework, result) -> None:
    topo = _topology(result)
    declared: dict[str, list] = {}
    for g in topo["groups"]:
        assert g["role"] != "trainscout", topo  # the probe's own side groups are not the job's
        if g["role"]:
            assert g["framework"] == fw.framework, topo
            declared.setdefault(g["role"], []).append(g["members"])
        else:  # only the default group may have no declared role
            assert g["desc"] == "default_pg", topo
    assert {role: sorted(m) for role, m in declared.items()} == fw.roles, topo
    assert topo["replicas"] == fw.replicas, topo
    assert topo["ranks"] == list(range(fw.nproc)), topo
    line = topo["line"]
    assert line.startswith(f"topology: {fw.nproc} ranks; {fw.framework}: "), line
    assert line in result.output, result.describe()  # shown live
    assert line in (result.run_path / "summary.md").read_text()  # and in the report


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_framework_topology_and_culprits_without_code_change(jobs, tmp_path, name):
    fw = FRAMEWORKS[name]
    inject = f"desync:rank={DESYNC_RANK}:step={DESYNC_STEP}:what=reduce;hang:rank={HANG_RANK}:step={HANG_STEP}"
    faulted = _start(
        jobs, tmp_path, f"{name}-faults", fw.launch(steps=HANG_STEP + 6), ("--inject", inject, "--abort-on", "hang")
    )
    clean = (
        None if name in CLEAN_ELSEWHERE else _start(jobs, tmp_path, f"{name}-clean", fw.launch(steps=6), env=EVERY_STEP)
    )
    got = faulted.wait(JOB_TIMEOUT_S)

    kinds = sorted(f["kind"] for f in got.findings)
    assert kinds == ["desync", "hang"], got.describe()
    desync = next(f for f in got.findings if f["kind"] == "desync")
    hang = next(f for f in got.findings if f["kind"] == "hang")
    assert desync["status"] == "attributed" and desync["culprit_ranks"] == [DESYNC_RANK], got.describe()
    assert "op=MAX" in desync["summary"] or "op=SUM" in desync["summary"], got.describe()
    assert hang["status"] == "attributed" and hang["culprit_ranks"] == [HANG_RANK], got.describe()
    assert hang["step"] == HANG_STEP, got.describe()
    waiting = sorted(hang["evidence"]["waiting_ranks"])
    assert waiting == [r for r in range(fw.nproc) if r != HANG_RANK], got.describe()
    if name == "tp":
        # the script issues two Python collectives a step; the rest are DTensor's functional all-reduces,
        # which only the Flight Recorder sees: counting them puts the hang far beyond 2 per step
        assert hang["collective_seq"] > 2 * HANG_STEP + 2, got.describe()
        assert _probe_errors(got) == [], got.describe()
    _check_topology(fw, got)

    if clean is not None:
        ok = clean.wait(JOB_TIMEOUT_S)
        assert ok.returncode == 0, ok.describe()
        assert ok.findings == [], ok.describe()
        assert _probe_errors(ok) == [], ok.describe()  # e.g. a record described unlike the Flight Recorder's
        _check_topology(fw, ok)
        if name == "tp":  # DTensor's functional all-reduces are put on record before issue
            for rank in range(fw.nproc):
                report = json.loads(Path(report_path(str(ok.run_path), rank)).read_text())
                assert report.get("functional_collectives_recorded", 0) >= 6, report
        if name == "fsdp2":  # the all-gather check's own cost is in each rank's report (and so in summary.md)
            for rank in range(fw.nproc):
                report = json.loads(Path(report_path(str(ok.run_path), rank)).read_text())
                gather = report.get("gather_check", {})
                assert gather.get("units", 0) >= 1, report
                assert gather["seconds"] + gather["setup_seconds"] > 0, report
            assert "gather check" in (ok.run_path / "summary.md").read_text(), ok.describe()
        checked = _state_bytes(ok, fw.nproc)
        if fw.replicas:  # every replica fingerprinted its state and they all agreed (no finding)
            assert all(b > 0 for b in checked), checked
        else:  # no replicas: nothing to compare, nothing hashed
            assert checked == [0] * fw.nproc, checked


def test_corrupted_shard_of_an_hsdp_replica_is_named(jobs, tmp_path):
    """Three replicas of a one-shard HSDP mesh: a bit flipped in rank 1's shard is named by its replicas."""
    fw = Framework(
        "hsdp_train.py", ("--replicate", "3"), 3, "HSDP", {"replicate": ALL3, "shard": [[0], [1], [2]]}, ALL3
    )
    job = _start(
        jobs,
        tmp_path,
        "hsdp-sdc",
        fw.launch(steps=12),
        ("--inject", "corrupt:rank=1:step=2:target=param", "--abort-on", "sdc"),
        env=EVERY_STEP,
    )
    got = job.wait(JOB_TIMEOUT_S)
    assert got.findings, got.describe()
    assert all(
        f["kind"] == "sdc" and f["status"] == "attributed" and f["culprit_ranks"] == [1] for f in got.findings
    ), got.describe()
    state = [f for f in got.findings if f["evidence"]["check"] == "replicated_state"]
    assert state, got.describe()
    topo = _topology(got)
    (replicate,) = [g["name"] for g in topo["groups"] if g["role"] == "replicate"]
    assert state[0]["evidence"]["replica_group"] == replicate, got.describe()
    assert state[0]["step"] == 3, got.describe()  # the first check after the flip
    _check_topology(fw, got)
