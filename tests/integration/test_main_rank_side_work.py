"""Rank 0 evaluating and logging between steps is the script's choice; rank 0 slowed inside its step is a fault.

Four gloo DDP ranks train under `trainscout run`, unmodified. In "eval" mode rank 0 alone evaluates every 10
steps after the optimizer step (an evaluation DataLoader and forwards with autograd off and the model in eval
mode, then a blocking log write), as scripts do: its peers wait for it in the next gradient sync. Nothing is
wrong with it, and naming it would blame a healthy rank. In "forward" mode rank 0 is held up as long, as
often, inside the training forward (a pre-hook on one layer): that is a straggler, named on rank 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import free_port, of_kind, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

STEPS = 120

JOB = Path(__file__).resolve().parent / "slow_rank_job.py"


def _run(tmp_path, mode: str):
    launch = torchrun_cmd(
        "--nproc-per-node",
        "4",
        "--master-port",
        str(free_port()),
        str(JOB),
        mode,
        str(STEPS),
        str(tmp_path / "eval.log"),
    )
    return run_under_trainscout(tmp_path, f"side-work-{mode}", launch)


def test_rank_0_evaluating_between_steps_names_nobody(tmp_path):
    result = _run(tmp_path, "eval")

    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    observed = [e for e in result.events if e.get("kind") == "main_rank_side_work"]
    assert observed and all(e["rank"] == 0 for e in observed), result.describe()
    assert "observation, not a fault: rank 0 spends" in (result.run_path / "summary.md").read_text()


def test_rank_0_held_up_inside_its_forward_is_named(tmp_path):
    result = _run(tmp_path, "forward")

    assert result.returncode == 0, result.describe()
    stragglers = of_kind(result.findings, "straggler")
    assert stragglers and all(f["culprit_ranks"] == [0] for f in stragglers), result.describe()
    assert len(stragglers) == len(result.findings), result.describe()
    assert not [e for e in result.events if e.get("kind") == "main_rank_side_work"], result.describe()


def test_every_rank_held_up_in_turn_names_nobody(tmp_path):
    # each rank 30 ms every 4th step at its own phase: each is a regular progression of spikes, beyond chance
    # against its peers' spike rates (all began at once), but every rank keeps the same rhythm: no minority
    result = _run(tmp_path, "round-robin")

    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()


# Rank 0 alone for 6 s (3 hang timeouts) while its peers wait in a barrier: its own work, not a hang.
LONG_OPTIONS = ("--hang-timeout", "2", "--stall-timeout", "15")


@pytest.mark.parametrize(
    ("mode", "doing"),
    [
        ("long-save", "writing a checkpoint"),
        ("long-eval", "running forward"),
        ("long-compile", "compiling"),
        ("long-prep", "running code of its own"),
    ],
)
def test_rank_0_working_alone_past_the_hang_timeout_is_no_hang(tmp_path, mode, doing):
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), str(JOB), mode, "40", str(tmp_path / "job")
    )
    result = run_under_trainscout(tmp_path, f"side-work-{mode}", launch, options=LONG_OPTIONS)

    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    waits = [e for e in result.events if e.get("kind") == "hang_vote_waits"]
    assert waits and all(e["ranks"] == [0] for e in waits), result.describe()
    assert any(d.startswith(doing) for e in waits for d in e["doing"]), result.describe()


def test_a_save_that_never_ends_is_a_hang_after_the_stall_timeout(tmp_path):
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), str(JOB), "stuck-save", "40", str(tmp_path / "job")
    )
    options = (*LONG_OPTIONS, "--abort-on", "hang")
    result = run_under_trainscout(tmp_path, "side-work-stuck-save", launch, options=options)

    hangs = of_kind(result.findings, "hang")
    assert [f["culprit_ranks"] for f in hangs] == [[0]], result.describe()
    assert len(result.findings) == 1, result.describe()
    inside = hangs[0]["evidence"]["inside"]["0"]  # "writing a checkpoint for 16 s"
    assert inside.startswith("writing a checkpoint for "), result.describe()
    assert 15 <= int(inside.split()[-2]) < 35, result.describe()  # after the stall timeout, not the hang timeout


def test_a_rank_asleep_while_its_peers_wait_in_a_buffer_broadcast_or_past_it_is_named(tmp_path):
    # rank 0 waits in DDP's buffer broadcast (its root), ranks 1 and 3 wait one collective on: no strict majority
    # waits in one collective, but 3 of 4 entered the broadcast and rank 2 did not
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), str(JOB), "buffer-hang", "40", str(tmp_path / "j")
    )
    options = ("--hang-timeout", "3", "--abort-on", "hang")
    result = run_under_trainscout(tmp_path, "buffer-hang", launch, options=options)

    assert [(f["kind"], f["culprit_ranks"]) for f in result.findings] == [("hang", [2])], result.describe()
    assert result.findings[0]["collective"] == "broadcast", result.describe()


@pytest.mark.parametrize(("mode", "culprits"), [("tail-hang", [[2]]), ("tail-work", [])])
def test_a_rank_stuck_after_the_others_ended_is_named_at_the_stall_timeout(tmp_path, mode, culprits):
    # the job never ends while rank 2 is stuck; rank 0 writing its final files for 14 s is its own work
    launch = torchrun_cmd(
        "--nproc-per-node", "4", "--master-port", str(free_port()), str(JOB), mode, "30", str(tmp_path / "job")
    )
    options = ("--hang-timeout", "2", "--stall-timeout", "10", "--abort-on", "hang")
    result = run_under_trainscout(tmp_path, f"side-work-{mode}", launch, options=options)

    assert [f["culprit_ranks"] for f in result.findings] == culprits, result.describe()
    if culprits:
        (hang,) = result.findings
        assert hang["kind"] == "hang" and "did not end" in hang["summary"], result.describe()
        assert "slow_rank_job.py" in hang["stacks"]["2"], result.describe()  # where it is stuck
