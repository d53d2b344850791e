"""Numerical integrity, end to end: corrupted state, a NaN's origin and a device that computes wrong are
named live, with the exact rank, in real 4-rank gloo DDP jobs; healthy jobs stay silent; replay never
changes training; checkpoints carry a certificate that `trainscout checkpoints` judges.

Every job is the unmodified demo script under `trainscout run`, with faults injected through `--inject`
and the checks' schedules set through the job's environment (see probe/probe.py):
TRAINSCOUT_STATE_PERIOD (steps per replicated-state rotation), TRAINSCOUT_REPLAY_EVERY (steps between
replays, 0 = off), TRAINSCOUT_NONFINITE_BUDGET=1 (CPU gradients tested every step). Jobs are few and shared
between tests (module fixtures) because each costs half a minute on the small CI machine; a job that carries
several faults puts them on different ranks, and every check asserts which rank, tensor or layer was named,
so the faults cannot stand in for each other.

Rotation facts the window assertions rely on (demo model, AdamW): the state is fingerprinted after the
optimizer step and before an injected fault fires in the same hook, so a corruption after step S is first
visible at step S + 1 and is covered within one rotation of TRAINSCOUT_STATE_PERIOD steps (the plan may
pack it into fewer). Replay takes one layer per replay, in the order tokens, blocks.0, blocks.1, norm,
head.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import (
    Job,
    JobResult,
    free_port,
    of_kind,
    stop_once_found,
    torchrun_cmd,
    trainscout_cmd,
    unique_run_id,
)

pytestmark = pytest.mark.slow

TIMEOUT_S = 180.0  # per job: the machine is small and shared
STATE_PERIOD = 8  # TRAINSCOUT_STATE_PERIOD of the corruption jobs
REPLAY_LAYERS = ("tokens", "blocks.0", "blocks.1", "norm", "head")  # the demo model's replay rotation


# ---- helpers -------------------------------------------------------------------------------------


def _knobs(*, state_period: int = 16, replay_every: int = 0) -> dict[str, str]:
    """The integrity checks' environment, every knob set so an outer environment cannot leak in."""
    return {
        "TRAINSCOUT_STATE_CHECK": "1",
        "TRAINSCOUT_STATE_PERIOD": str(state_period),
        "TRAINSCOUT_REPLAY_EVERY": str(replay_every),
        "TRAINSCOUT_REPLAY_BUDGET": "0",
        "TRAINSCOUT_NONFINITE_BUDGET": "1",
    }


def _demo_script_job(
    tmp_path: Path,
    name: str,
    *,
    env: dict[str, str],
    inject: str = "",
    nproc: int = 4,
    train_args: tuple[str, ...] = (),
) -> Job:
    """`trainscout run [--inject SPEC] -- torchrun ... -m trainscout.demo.train TRAIN_ARGS` in env, started."""
    run_id = unique_run_id(name)
    launch = torchrun_cmd(
        "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "-m", "trainscout.demo.train", *train_args
    )
    options = ("--inject", inject) if inject else ()
    args = trainscout_cmd("run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain", *options)
    return Job([*args, "--", *launch], tmp_path, run_id, env=env)


def _run_demo_script(tmp_path: Path, name: str, **kwargs) -> JobResult:
    """The same, run to its end."""
    return _finish([_demo_script_job(tmp_path, name, **kwargs)])[0]


def _finish(started: list[Job]) -> list[JobResult]:
    """Wait for jobs started side by side; whatever is left of any of them is stopped afterwards."""
    try:
        return [job.wait(TIMEOUT_S) for job in started]
    finally:
        for job in started:
            job.cleanup()


def _state_findings(result: JobResult) -> list[dict]:
    return [f for f in of_kind(result.findings, "sdc") if f["evidence"].get("check") == "replicated_state"]


def _replay_findings(result: JobResult) -> list[dict]:
    return [f for f in result.findings if f["evidence"].get("check") == "replay"]


def _coordinator_exit(result: JobResult) -> dict:
    exits = [e for e in result.events if e["kind"] == "coordinator_exit"]
    assert exits, result.describe()
    return exits[-1]


def _logged_losses(result: JobResult) -> list[str]:
    """Rank 0's "step N loss X" lines, in order, from the launcher's output."""
    text = (result.run_path / "launcher.log").read_text(errors="replace")
    return re.findall(r"^step \d+ loss \S+$", text, flags=re.MULTILINE)


def _assert_bitwise_equal(a, b, where: str) -> None:
    """Same structure, and every tensor equal in value (torch.equal) and in bytes."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
        assert torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_bitwise_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@dataclass(frozen=True)
class Listing:
    """What `trainscout checkpoints DIR` printed: one row per certificate and the recovery line."""

    returncode: int
    rows: list[tuple[str, int, str, str]]  # (checkpoint, step, status, reason)
    recover: str | None  # the checkpoint named by "recover from:"
    text: str

    def status_by_step(self) -> dict[int, str]:
        return {step: status for _, step, status, _ in self.rows}


def _list_checkpoints(directory: Path) -> Listing:
    proc = subprocess.run(trainscout_cmd("checkpoints", str(directory)), capture_output=True, text=True, timeout=60)
    text = proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = []
    for line in lines[1:]:  # after the header
        if not line.strip():
            break
        name, step, status, reason = line.split(None, 3)
        rows.append((name, int(step), status, reason))
    recover = None
    for line in lines:
        if line.startswith("recover from: "):
            recover = line[len("recover from: ") :].split(" (step ", 1)[0]
    return Listing(proc.returncode, rows, recover, text)


def _certificates(directory: Path) -> dict[int, dict]:
    """Certificate JSON per step, as written next to each checkpoint (rank 0's temp name + suffix)."""
    import json

    certs = {}
    for path in sorted(directory.glob("*.trainscout-cert.json")):
        cert = json.loads(path.read_text())
        certs[cert["step"]] = cert
    return certs


# ---- 1. replicated-state corruption --------------------------------------------------------------


@dataclass(frozen=True)
class Corruption:
    name: str
    rank: int
    step: int
    how: str
    target: str
    tensor: str  # the parameter the fault is given
    named: str  # the tensor the finding must name

    def spec(self) -> str:
        return f"corrupt:rank={self.rank}:step={self.step}:target={self.target}:how={self.how}:tensor={self.tensor}"


# Four corruptions on four different ranks in one job: each tensor's vote is 3 against 1, so each names
# its own rank. Optimizer-state corruption reaches its parameter at the next optimizer step, after which
# both differ; the finding names the range the rotation reaches first. With period 8 (a 7-step rotation
# from step 1 for the demo model), blocks.0.mlp.2.weight is fingerprinted at steps 3, 10, 17 and its
# exp_avg one step later, so the state corrupted after step 10 is named (at step 11) before the
# parameter comes round again at step 17.
SHARED_JOB = (
    Corruption("bitflip-param", 1, 12, "bitflip", "param", "tokens.weight", "tokens.weight"),
    Corruption("sign-state", 2, 10, "sign", "state", "blocks.0.mlp.2.weight", "blocks.0.mlp.2.weight:exp_avg"),
    Corruption("scale-param", 3, 12, "scale", "param", "head.weight", "head.weight"),
    Corruption("pct1-param", 0, 12, "pct1", "param", "blocks.1.attn.qkv.weight", "blocks.1.attn.qkv.weight"),
)
# Rides in the replay job on another rank: `positions` belongs to no replay layer, so replay cannot see it.
PCT100 = Corruption("pct100-param", 1, 12, "pct100", "param", "positions", "positions")

# perturb: from step 4 on, rank 2's blocks.1 adds eps to its output (a device that computes wrong)
PERTURB_RANK, PERTURB_STEP, PERTURB_LAYER = 2, 4, "blocks.1"
REPLAY_EVERY = 2


@pytest.fixture(scope="module")
def corruption_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("corrupt4")
    return _run_demo_script(
        tmp,
        "corrupt4",
        env=_knobs(state_period=STATE_PERIOD, replay_every=0),
        inject=";".join(c.spec() for c in SHARED_JOB),
        train_args=("--steps", "30"),
    )


@pytest.fixture(scope="module")
def replay_job(tmp_path_factory):
    """A device that computes wrong (perturb, rank 2) and corrupted state (pct100, rank 1), one job."""
    tmp = tmp_path_factory.mktemp("replay")
    perturb = f"perturb:rank={PERTURB_RANK}:step={PERTURB_STEP}:layer={PERTURB_LAYER}"
    return _run_demo_script(
        tmp,
        "replay",
        env=_knobs(state_period=STATE_PERIOD, replay_every=REPLAY_EVERY),
        inject=f"{perturb};{PCT100.spec()}",
        train_args=("--steps", "40"),
    )


@pytest.mark.parametrize(
    "case,job",
    [(c, "corruption_job") for c in SHARED_JOB] + [(PCT100, "replay_job")],
    ids=lambda v: v.name if isinstance(v, Corruption) else None,
)
def test_corrupted_replica_state_is_named_within_one_rotation(case: Corruption, job: str, request):
    result: JobResult = request.getfixturevalue(job)

    assert result.returncode == 0, result.describe()
    assert (
        f"trainscout-fault: rank {case.rank}: corrupt: {case.how} in {case.named} after step {case.step}"
        in result.output
    ), result.describe()
    mine = [f for f in _state_findings(result) if case.rank in f["culprit_ranks"]]
    assert len(mine) == 1, result.describe()
    f = mine[0]
    assert f["status"] == "attributed", result.describe()
    assert f["culprit_ranks"] == [case.rank], result.describe()
    assert f["evidence"]["tensor"] == case.named, result.describe()
    assert case.step < f["step"] <= case.step + STATE_PERIOD + 2, result.describe()
    digests = f["evidence"]["fingerprints"]
    others = {h for r, h in digests.items() if r != str(case.rank)}
    assert len(digests) == 4 and len(others) == 1 and digests[str(case.rank)] not in others, result.describe()


def test_corruption_job_names_each_corrupted_rank_once_and_nothing_else(corruption_job):
    result = corruption_job

    assert result.returncode == 0, result.describe()
    assert "done: 30 steps" in result.output, result.describe()
    assert [f["kind"] for f in result.findings] == ["sdc"] * len(SHARED_JOB), result.describe()
    assert len(_state_findings(result)) == len(SHARED_JOB), result.describe()
    assert sorted(f["culprit_ranks"][0] for f in result.findings) == [0, 1, 2, 3], result.describe()


# ---- 2. two replicas detect but cannot attribute --------------------------------------------------


def test_two_replicas_detect_state_corruption_but_name_nobody(tmp_path):
    case = Corruption("bitflip-param", 1, 12, "bitflip", "param", "tokens.weight", "tokens.weight")
    result = _run_demo_script(
        tmp_path,
        "corrupt2",
        nproc=2,
        env=_knobs(state_period=STATE_PERIOD, replay_every=0),
        inject=case.spec(),
        train_args=("--steps", "30"),
    )

    assert result.returncode == 0, result.describe()
    assert "trainscout-fault: rank 1: corrupt: bitflip in tokens.weight after step 12" in result.output
    assert len(result.findings) == 1, result.describe()
    f = result.findings[0]
    assert f["kind"] == "sdc" and f["evidence"]["check"] == "replicated_state", result.describe()
    assert f["status"] == "inconclusive", result.describe()
    assert f["culprit_ranks"] == [], result.describe()
    assert f["evidence"]["tensor"] == "tokens.weight", result.describe()
    assert case.step < f["step"] <= case.step + STATE_PERIOD + 2, result.describe()
    digests = f["evidence"]["fingerprints"]
    assert sorted(digests) == ["0", "1"] and digests["0"] != digests["1"], result.describe()


# ---- 3. non-finite origin -------------------------------------------------------------------------


def _assert_nonfinite_origin(result: JobResult, rank: int, step: int, what: str) -> None:
    """The only finding: rank `rank` turned non-finite first, at `step` (the step being computed)."""
    assert result.returncode == 0, result.describe()  # NaN training runs on; it does not crash
    assert [f["kind"] for f in result.findings] == ["nonfinite"], result.describe()
    f = result.findings[0]
    assert f["status"] == "attributed", result.describe()
    assert f["culprit_ranks"] == [rank], result.describe()
    assert f["step"] == step, result.describe()
    ev = f["evidence"]
    assert ev["origin_step"] == step, result.describe()
    assert ev["first_nonfinite"][str(rank)].startswith(f"{what} ") and ev["first_nonfinite"][str(rank)].endswith(
        f" at step {step}"
    ), result.describe()
    assert all(s > step for s in ev["later_ranks"].values()), result.describe()
    assert str(rank) not in ev["later_ranks"], result.describe()


def test_nan_in_a_parameter_names_its_rank(tmp_path):
    # NaN written into a weight every forward reads, after step 10: rank 3's loss of step 11 is NaN;
    # the others turn NaN one step later, from the all-reduced gradient.
    result = _run_demo_script(
        tmp_path,
        "nan-param",
        env=_knobs(),
        inject="nan:rank=3:step=10:where=param:tensor=blocks.0.mlp.0.weight",
        train_args=("--steps", "30"),
    )

    assert "trainscout-fault: rank 3: nan: NaN in parameter blocks.0.mlp.0.weight after step 10" in result.output
    _assert_nonfinite_origin(result, rank=3, step=11, what="loss")


def test_nan_in_a_gradient_names_its_rank_before_the_reduction(tmp_path):
    # the next local gradient of tokens.weight on rank 1 (step 11) is NaN before DDP reduces it
    result = _run_demo_script(
        tmp_path, "nan-grad", env=_knobs(), inject="nan:rank=1:step=10:where=grad", train_args=("--steps", "30")
    )

    assert "trainscout-fault: rank 1: nan: NaN in the next gradient of tokens.weight after step 10" in result.output
    _assert_nonfinite_origin(result, rank=1, step=11, what="grad tokens.weight")


# ---- 4. replay names a device that computes wrong --------------------------------------------------


def _replay_steps_of(layer: str, after: int, count: int) -> list[int]:
    """The first `count` replay steps of `layer` after step `after` (replay at every REPLAY_EVERY-th step)."""
    steps, step = [], after + 1
    while len(steps) < count:
        if step % REPLAY_EVERY == 0 and REPLAY_LAYERS[(step // REPLAY_EVERY - 1) % len(REPLAY_LAYERS)] == layer:
            steps.append(step)
        step += 1
    return steps


def test_replay_names_the_rank_that_computes_a_layer_wrong_and_confirms_it(replay_job):
    result = replay_job
    first, second = _replay_steps_of(PERTURB_LAYER, PERTURB_STEP, 2)

    assert result.returncode == 0, result.describe()
    assert f"trainscout-fault: rank {PERTURB_RANK}: perturb: layer {PERTURB_LAYER} now adds" in result.output
    replay = _replay_findings(result)
    assert [f["kind"] for f in replay] == ["sdc", "health"], result.describe()
    sdc, health = replay
    for f in replay:
        assert f["status"] == "attributed", result.describe()
        assert f["culprit_ranks"] == [PERTURB_RANK], result.describe()
        assert f["evidence"]["layer"] == PERTURB_LAYER, result.describe()
        assert f["evidence"]["differs_in"] == "outputs", result.describe()  # its parameters agree
    assert sdc["evidence"]["confirmed"] is False and sdc["step"] == first, result.describe()
    assert health["evidence"]["confirmed"] is True and health["step"] == second, result.describe()
    assert health["evidence"]["deviation_steps"] == [first, second], result.describe()


def test_each_integrity_check_names_only_the_fault_it_can_see(replay_job):
    # Perturbed outputs change rank 2's local gradients, but DDP averages them: its state stays equal to
    # the others', so the state check names only rank 1's corrupted `positions`, and replay (inputs
    # broadcast from rank 0, `positions` in no replay layer) names only rank 2.
    result = replay_job

    assert [f["culprit_ranks"] for f in _state_findings(result)] == [[PCT100.rank]], result.describe()
    assert all(f["culprit_ranks"] == [PERTURB_RANK] for f in _replay_findings(result)), result.describe()
    assert len(result.findings) == 3, result.describe()  # state (rank 1), replay sdc + health (rank 2)
    assert _coordinator_exit(result)["replays_compared"] > 0, result.describe()


# ---- 5 and 7. healthy jobs: replay changes nothing, the checks run and stay silent -----------------

CLEAN_STEPS, CLEAN_CKPT_EVERY = 40, 10
# A certificate says what the coordinator knew when the checkpoint was saved; that knowledge reaches the
# ranks 1-3 s late (agent digest every second, the coordinator acting on it within 0.5 s, trust published at
# most once a second, then written by the agent for the ranks to read when they save).
# Every rank sleeps 300 ms per step (uniform slowness, not a straggler), so 10 steps between checkpoints
# take over 3 s of sleep plus compute even on a fast machine and the checkpoint after the first full
# rotation can be certified in time (at 100 ms, 1 in 3 runs certified it a checkpoint late).
PACE = ("--slow-ms", "300")


@pytest.fixture(scope="module")
def clean_pair(tmp_path_factory):
    """The same healthy job (same seed) twice, side by side (their steps are mostly the 300 ms sleep): replay
    every 2 steps, and replay off."""
    started, ckpts = {}, {}
    for label, replay_every in (("replay", REPLAY_EVERY), ("no-replay", 0)):
        tmp = tmp_path_factory.mktemp(label)
        ckpt = ckpts[label] = tmp / "checkpoints"
        started[label] = _demo_script_job(
            tmp,
            f"clean-{label}",
            env=_knobs(state_period=4, replay_every=replay_every),
            train_args=(
                "--steps",
                str(CLEAN_STEPS),
                "--seed",
                "3",
                "--log-every",
                "1",
                *PACE,
                "--checkpoint-every",
                str(CLEAN_CKPT_EVERY),
                "--checkpoint-dir",
                str(ckpt),
            ),
        )
    results = _finish(list(started.values()))
    return {label: (result, ckpts[label]) for label, result in zip(started, results)}


def test_clean_job_runs_both_checks_and_finds_nothing(clean_pair):
    result, _ = clean_pair["replay"]

    assert result.returncode == 0, result.describe()
    assert f"done: {CLEAN_STEPS} steps" in result.output, result.describe()
    assert result.findings == [], result.describe()
    assert result.raw_findings == [], result.describe()
    exit_event = _coordinator_exit(result)
    assert exit_event["findings"] == 0, result.describe()
    assert exit_event["state_ranges_compared"] > 0, result.describe()
    assert exit_event["replays_compared"] > 0, result.describe()


def test_replay_never_changes_training(clean_pair):
    (with_replay, ckpt_a), (without, ckpt_b) = clean_pair["replay"], clean_pair["no-replay"]

    for result in (with_replay, without):
        assert result.returncode == 0, result.describe()
        assert result.findings == [], result.describe()
    assert _coordinator_exit(with_replay)["replays_compared"] > 0, with_replay.describe()
    assert _coordinator_exit(without)["replays_compared"] == 0, without.describe()

    losses = _logged_losses(with_replay)
    assert len(losses) == CLEAN_STEPS, with_replay.describe()
    assert losses == _logged_losses(without)
    names = [f"step-{s:06d}.pt" for s in range(CLEAN_CKPT_EVERY, CLEAN_STEPS + 1, CLEAN_CKPT_EVERY)]
    assert sorted(p.name for p in ckpt_a.glob("*.pt")) == names
    assert sorted(p.name for p in ckpt_b.glob("*.pt")) == names
    for name in names:
        a = torch.load(ckpt_a / name, weights_only=True)
        b = torch.load(ckpt_b / name, weights_only=True)
        assert a["step"] == b["step"] == int(name[5:11])
        assert len(a["model"]) > 0 and len(a["optimizer"]["state"]) == len(a["model"])
        _assert_bitwise_equal(a["model"], b["model"], f"{name} model")
        _assert_bitwise_equal(a["optimizer"], b["optimizer"], f"{name} optimizer")


def test_clean_checkpoints_are_certified_once_rotations_completed(clean_pair):
    _, ckpt = clean_pair["replay"]

    listing = _list_checkpoints(ckpt)
    assert listing.returncode == 0, listing.text
    statuses = [status for _, _, status, _ in listing.rows]
    assert [step for _, step, _, _ in listing.rows] == list(
        range(CLEAN_CKPT_EVERY, CLEAN_STEPS + 1, CLEAN_CKPT_EVERY)
    ), listing.text
    assert statuses[0] in ("certified", "unverified"), listing.text  # saved before a full rotation
    assert statuses[1:] == ["certified"] * (len(statuses) - 1), listing.text
    assert listing.recover == str(ckpt / f"step-{CLEAN_STEPS:06d}.pt"), listing.text


# ---- 6. checkpoint certificates after a corruption -------------------------------------------------


def test_checkpoints_after_a_corruption_are_suspect_and_recovery_picks_one_before_it(tmp_path):
    ckpt = tmp_path / "checkpoints"
    fault_step = 30
    result = _run_demo_script(
        tmp_path,
        "ckpt-corrupt",
        env=_knobs(state_period=4, replay_every=REPLAY_EVERY),
        inject=f"corrupt:rank=2:step={fault_step}:how=scale",
        train_args=("--steps", "50", "--checkpoint-every", "10", "--checkpoint-dir", str(ckpt), *PACE),
    )

    assert result.returncode == 0, result.describe()
    assert f"trainscout-fault: rank 2: corrupt: scale in tokens.weight after step {fault_step}" in result.output
    # every finding is integrity evidence against rank 2 (state check, and replay seeing its parameters)
    assert result.findings and all(f["kind"] == "sdc" and f["culprit_ranks"] == [2] for f in result.findings), (
        result.describe()
    )
    state = _state_findings(result)
    assert len(state) == 1 and state[0]["evidence"]["tensor"] == "tokens.weight", result.describe()
    assert fault_step < state[0]["step"] <= fault_step + 4 + 2, result.describe()
    first_sdc = min(f["step"] for f in result.findings)
    assert first_sdc > fault_step, result.describe()

    listing = _list_checkpoints(ckpt)
    assert listing.returncode == 0, listing.text
    status = listing.status_by_step()
    assert sorted(status) == [10, 20, 30, 40, 50], listing.text
    for step, st in status.items():
        if step >= first_sdc:
            assert st == "suspect", listing.text
        else:
            assert st in ("certified", "unverified"), listing.text
    assert any(st == "certified" for step, st in status.items() if step < fault_step), listing.text
    first_suspect = min(step for step, st in status.items() if st == "suspect")
    newest_safe = max(step for step, st in status.items() if st == "certified" and step < first_suspect)
    assert newest_safe <= fault_step, listing.text
    assert listing.recover == str(ckpt / f"step-{newest_safe:06d}.pt"), listing.text

    certs = _certificates(ckpt)
    assert sorted(certs) == [10, 20, 30, 40, 50], sorted(certs)
    for step, cert in certs.items():
        assert {"schema", "step", "status", "trust"} <= set(cert), cert
        assert cert["schema"] == 1, cert
        assert cert["status"] in ("certified", "suspect", "unverified"), cert
        assert isinstance(cert["trust"], dict), cert
        # rank 0 saves to a temporary name and renames it into place: the certificate follows the rename
        assert Path(cert["checkpoint"]).name == f"step-{step:06d}.pt", cert
        assert cert["run_dir"] == str(result.run_path), cert
        if cert["status"] == "certified":
            assert cert["trust"]["suspect_since"] is None and cert["trust"]["verified_step"] >= 0, cert


# ---- 4b. replay on command ----------------------------------------------------------------------


def test_replay_on_command_names_the_rank_that_computes_the_requested_layer_wrong(tmp_path):
    """`trainscout replay RUN_DIR --layer L` while the job runs: no scheduled replay falls in this job
    (every 1000 steps), so the one finding can only come from the replay asked for."""
    run_id = unique_run_id("replay-cmd")
    launch = torchrun_cmd(
        "--nproc-per-node",
        "4",
        "--master-port",
        str(free_port()),
        "-m",
        "trainscout.demo.train",
        "--steps",
        "400",
        "--slow-ms",
        "20",
    )
    perturb = f"perturb:rank={PERTURB_RANK}:step={PERTURB_STEP}:layer={PERTURB_LAYER}"
    job = Job(
        trainscout_cmd(
            "run",
            "--run-dir",
            str(tmp_path),
            "--run-id",
            run_id,
            "--console",
            "plain",
            "--inject",
            perturb,
            "--",
            *launch,
        ),
        tmp_path,
        run_id,
        env=_knobs(state_period=STATE_PERIOD, replay_every=1000),
    )
    try:
        job.wait_for_launcher_text("step 20 loss", timeout=TIMEOUT_S)
        asked = subprocess.run(
            trainscout_cmd("replay", str(job.run_path), "--layer", PERTURB_LAYER),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert asked.returncode == 0, asked.stderr
        # 400 steps leave a loaded machine time to reach the replay; once it is named the job is stopped
        result = stop_once_found(job, lambda found: any(f.get("evidence", {}).get("check") == "replay" for f in found))
    finally:
        job.cleanup()
    assert result.returncode in (0, 3), result.describe()  # 3: stopped after naming the culprit
    requested = [e for e in result.events if e["kind"] == "replay_requested"]
    assert len(requested) == 1 and requested[0]["layer"] == PERTURB_LAYER, result.describe()
    replay = _replay_findings(result)
    assert [f["kind"] for f in replay] == ["sdc"], result.describe()
    f = replay[0]
    assert f["status"] == "attributed" and f["culprit_ranks"] == [PERTURB_RANK], result.describe()
    assert f["evidence"]["layer"] == PERTURB_LAYER and f["step"] == requested[0]["step"], result.describe()
    assert not _state_findings(result), result.describe()


def test_replay_request_outside_a_running_job_is_refused(tmp_path):
    asked = subprocess.run(trainscout_cmd("replay", str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert asked.returncode == 2 and "not the folder of a running trainscout job" in asked.stderr
