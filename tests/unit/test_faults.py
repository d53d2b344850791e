"""Fault specs parse strictly, and injected faults fire exactly where and when asked, once.

The demo, integration tests and benchmarks all rely on these faults: a fault that fires at the wrong step or
on the wrong rank would look like a detector bug. Rewrites are checked with real tensors but no process
group; step faults that end the process are checked in real subprocesses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainscout.faults import ENV_VAR, FaultInjector, FaultSpec, format_faults, parse_faults

SRC = str(Path(__file__).resolve().parents[2] / "src")


def injector(text: str, rank: int = 0) -> FaultInjector:
    inj = FaultInjector.from_env(rank, {ENV_VAR: text})
    assert inj is not None
    return inj


# ---- parsing -------------------------------------------------------------------------------------------


def test_parse_one_spec_with_defaults() -> None:
    assert parse_faults("hang:rank=2:step=20") == [FaultSpec("hang", (2,), 20, {})]
    assert parse_faults("crash:rank=1") == [FaultSpec("crash", (1,), 10, {"how": "kill"})]
    assert parse_faults("desync") == [FaultSpec("desync", None, 10, {"what": "shape"})]


def test_parse_several_specs_and_params() -> None:
    specs = parse_faults(
        " slow:rank=all:ms=80 ; exit:rank=3:code=3:step=0;pause:seconds=2.5;"
        "desync:rank=1:what=pg;crash:how=segv;gil:rank=0;"
    )
    assert specs == [
        FaultSpec("slow", None, 10, {"ms": 80.0}),
        FaultSpec("exit", (3,), 0, {"code": 3}),
        FaultSpec("pause", None, 10, {"seconds": 2.5}),
        FaultSpec("desync", (1,), 10, {"what": "pg"}),
        FaultSpec("crash", None, 10, {"how": "segv"}),
        FaultSpec("gil", (0,), 10, {}),
    ]
    assert parse_faults(format_faults(specs)) == specs  # the text form round-trips
    assert parse_faults("") == [] and parse_faults(" ; ") == []


def test_spec_rank_matching() -> None:
    only_two, every = parse_faults("hang:rank=2;slow:rank=all")
    assert only_two.applies_to(2) and not only_two.applies_to(0)
    assert every.applies_to(0) and every.applies_to(7)


@pytest.mark.parametrize(
    "token, message",
    [
        ("boom:rank=1", "unknown kind 'boom'"),
        ("hang:rank=x", "rank='x'"),
        ("hang:rank=1,2", "rank='1,2'"),
        ("hang:rank=-1", "rank=-1"),
        ("hang:step=-1", "step=-1"),
        ("hang:step=soon", "step='soon'"),
        ("hang:rank", "'rank' is not key=value"),
        ("hang:rank=", "'rank=' is not key=value"),
        ("hang:ms=5", "unknown key 'ms'"),
        ("hang:step=1:step=2", "given twice"),
        ("crash:how=explode", "how='explode'"),
        ("exit:code=abc", "code='abc'"),
        ("exit:code=256", "code=256"),
        ("desync:what=colour", "what='colour'"),
        ("slow:ms=-5", "ms='-5'"),
        ("slow:ms=nan", "ms='nan'"),
        ("pause:seconds=long", "seconds='long'"),
    ],
)
def test_parse_errors_name_the_token(token: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_faults(f"slow:rank=all;{token}")
    assert repr(token) in str(err.value)
    assert message in str(err.value)


def test_parse_errors_list_the_valid_choices() -> None:
    with pytest.raises(ValueError, match="valid kinds: hang, gil, crash, exit, desync, slow, pause"):
        parse_faults("boom")
    with pytest.raises(ValueError, match="valid keys for desync: rank, step, attempt, what"):
        parse_faults("desync:how=kill")
    with pytest.raises(ValueError, match="shape, dtype, op, reduce, pg"):
        parse_faults("desync:what=x")


# ---- from_env ------------------------------------------------------------------------------------------


def test_from_env_only_for_ranks_with_work() -> None:
    env = {ENV_VAR: "hang:rank=2:step=3"}
    assert FaultInjector.from_env(0, env) is None
    assert FaultInjector.from_env(2, env) is not None
    assert FaultInjector.from_env(0, {}) is None
    assert FaultInjector.from_env(0, {ENV_VAR: "  "}) is None


def test_from_env_bad_text_is_logged_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    assert FaultInjector.from_env(0, {ENV_VAR: "hang:rank=zero"}) is None
    assert "trainscout-fault:" in capsys.readouterr().err


def test_pg_desync_gives_every_rank_an_injector() -> None:
    env = {ENV_VAR: "desync:rank=1:what=pg"}
    bystander = FaultInjector.from_env(0, env)
    culprit = FaultInjector.from_env(1, env)
    assert bystander is not None and bystander.needs_side_group and bystander.specs == ()
    assert culprit is not None and culprit.needs_side_group and len(culprit.specs) == 1
    assert "side group" in bystander.describe()
    assert "desync(what=pg)@step10" in culprit.describe()


# ---- collective rewrites -------------------------------------------------------------------------------


def test_shape_desync_adds_one_element_once(capsys: pytest.CaptureFixture[str]) -> None:
    inj = injector("desync:rank=0:step=5:what=shape")
    loss = torch.tensor(2.5)
    name, args, kwargs = inj.rewrite_collective("all_reduce", (loss,), {"op": dist.ReduceOp.SUM}, step=5)
    assert name == "all_reduce" and kwargs == {"op": dist.ReduceOp.SUM} and len(args) == 1
    assert args[0].shape == (2,) and args[0].dtype == torch.float32
    assert args[0].tolist() == [2.5, 0.0]
    assert "trainscout-fault:" in capsys.readouterr().err
    again = inj.rewrite_collective("all_reduce", (loss,), {"op": dist.ReduceOp.SUM}, step=6)
    assert again[1][0] is loss  # fired once only


def test_shape_desync_rewrites_the_input_of_gather_ops() -> None:
    inj = injector("desync:rank=0:step=0:what=shape")
    out, inp = torch.zeros(8), torch.ones(2, 2)
    name, args, kwargs = inj.rewrite_collective("all_gather_into_tensor", (out, inp), {}, step=0)
    assert name == "all_gather_into_tensor" and args[0] is out and args[1].shape == (5,) and kwargs == {}


def test_dtype_desync_swaps_float_width() -> None:
    inj = injector("desync:rank=0:step=1:what=dtype")
    t32 = torch.ones(3)
    name, args, kwargs = inj.rewrite_collective("broadcast", (), {"tensor": t32, "src": 0}, step=1)
    assert name == "broadcast" and args == ()
    assert kwargs["src"] == 0 and kwargs["tensor"].dtype == torch.float64 and kwargs["tensor"].shape == (3,)

    inj = injector("desync:rank=0:step=1:what=dtype")
    _, args, _ = inj.rewrite_collective("all_reduce", (torch.ones(3, dtype=torch.float64),), {}, step=1)
    assert args[0].dtype == torch.float32 and args[0].shape == (3,)


def test_op_desync_turns_all_reduce_into_broadcast() -> None:
    inj = injector("desync:rank=0:step=2:what=op")
    t = torch.ones(4)
    name, args, kwargs = inj.rewrite_collective("all_reduce", (t,), {"op": dist.ReduceOp.SUM}, step=2)
    assert name == "broadcast" and args == (t,) and kwargs == {"src": 0, "group": None}
    assert inj.rewrite_collective("all_reduce", (t,), {}, step=3) == ("all_reduce", (t,), {})


def test_op_desync_turns_other_ops_into_all_reduce() -> None:
    inj = injector("desync:rank=0:step=0:what=op")
    t = torch.ones(4)
    name, args, kwargs = inj.rewrite_collective("broadcast", (t, 0), {"async_op": True}, step=0)
    assert name == "all_reduce" and args == (t,) and kwargs == {"group": None, "async_op": True}

    inj = injector("desync:rank=0:step=0:what=op")
    name, args, kwargs = inj.rewrite_collective("barrier", (), {}, step=0)
    assert name == "all_reduce" and args[0].shape == (1,) and kwargs == {"group": None}


def test_reduce_desync_flips_the_reduce_op() -> None:
    inj = injector("desync:rank=0:step=0:what=reduce")
    t = torch.ones(2)
    name, args, kwargs = inj.rewrite_collective("all_reduce", (t,), {"op": dist.ReduceOp.SUM}, step=0)
    assert (name, args, kwargs) == ("all_reduce", (t,), {"op": dist.ReduceOp.MAX})

    inj = injector("desync:rank=0:step=0:what=reduce")
    name, args, kwargs = inj.rewrite_collective("all_reduce", (t,), {}, step=0)  # default op is SUM
    assert kwargs == {"op": dist.ReduceOp.MAX}

    inj = injector("desync:rank=0:step=0:what=reduce")
    name, args, kwargs = inj.rewrite_collective("all_reduce", (t, dist.ReduceOp.AVG), {}, step=0)
    assert args == (t, dist.ReduceOp.SUM) and kwargs == {}


def test_reduce_desync_waits_for_a_reducing_collective() -> None:
    inj = injector("desync:rank=0:step=0:what=reduce")
    t = torch.ones(2)
    assert inj.rewrite_collective("broadcast", (t, 0), {}, step=0) == ("broadcast", (t, 0), {})
    _, _, kwargs = inj.rewrite_collective("all_reduce", (t,), {}, step=0)
    assert kwargs == {"op": dist.ReduceOp.MAX}


def test_pg_desync_without_side_group_fails_open(capsys: pytest.CaptureFixture[str]) -> None:
    inj = injector("desync:rank=0:step=0:what=pg")
    t = torch.ones(2)
    assert inj.rewrite_collective("all_reduce", (t,), {}, step=0) == ("all_reduce", (t,), {})
    assert "disabled" in capsys.readouterr().err


def test_no_rewrite_on_other_ranks_or_before_the_step() -> None:
    t = torch.ones(2)
    call = ("all_reduce", (t,), {"op": dist.ReduceOp.SUM})
    assert FaultInjector.from_env(1, {ENV_VAR: "desync:rank=0:step=3"}) is None
    bystander = FaultInjector(parse_faults("desync:rank=0:step=3"), rank=1)
    assert bystander.rewrite_collective(*call, step=3) == call

    inj = injector("desync:rank=0:step=3")
    assert inj.rewrite_collective(*call, step=0) == call
    assert inj.rewrite_collective(*call, step=2) == call
    assert inj.rewrite_collective(*call, step=3)[1][0].shape == (3,)


def test_rewrite_never_mutates_the_callers_kwargs() -> None:
    inj = injector("desync:rank=0:step=0:what=reduce")
    kwargs = {"tensor": torch.ones(1), "op": dist.ReduceOp.SUM}
    inj.rewrite_collective("all_reduce", (), kwargs, step=0)
    assert kwargs["op"] == dist.ReduceOp.SUM


# ---- step faults ---------------------------------------------------------------------------------------


def test_slow_sleeps_every_step_from_its_step() -> None:
    inj = injector("slow:rank=0:step=2:ms=50")
    started = time.perf_counter()
    inj.on_step_end(1)
    assert time.perf_counter() - started < 0.04
    for step in (2, 3):
        started = time.perf_counter()
        inj.on_step_end(step)
        assert time.perf_counter() - started >= 0.04


def test_pause_sleeps_once() -> None:
    inj = injector("pause:step=1:seconds=0.05")
    started = time.perf_counter()
    inj.on_step_end(1)
    assert time.perf_counter() - started >= 0.04
    started = time.perf_counter()
    inj.on_step_end(2)
    assert time.perf_counter() - started < 0.04


STEP_LOOP = textwrap.dedent(
    """
    import sys
    from trainscout.faults import FaultInjector
    inj = FaultInjector.from_env(int(sys.argv[1]))
    for step in range(1, 8):
        print(step, flush=True)
        if inj is not None:
            inj.on_step_end(step)
    print("finished", flush=True)
    """
)


def run_steps(spec: str, rank: int = 0, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, ENV_VAR: spec, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-c", STEP_LOOP, str(rank)], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_crash_exception_fires_at_its_step() -> None:
    proc = run_steps("crash:rank=0:step=3:how=exception")
    assert proc.returncode == 1
    assert proc.stdout.split() == ["1", "2", "3"]
    assert "RuntimeError: trainscout injected crash" in proc.stderr
    assert "trainscout-fault: rank 0: crash: how=exception at step 3" in proc.stderr


def test_crash_kill_dies_by_sigkill() -> None:
    proc = run_steps("crash:rank=0:step=2")
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["1", "2"]


def test_exit_code_fires_at_its_step() -> None:
    proc = run_steps("exit:rank=0:step=4:code=3")
    assert proc.returncode == 3
    assert proc.stdout.split() == ["1", "2", "3", "4"]
    assert "exit: code=3" in proc.stderr


def test_faults_for_another_rank_do_nothing() -> None:
    proc = run_steps("exit:rank=1:step=4:code=3", rank=0)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "finished"


def test_hang_stops_the_rank() -> None:
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_steps("hang:rank=0:step=2", timeout=3.0)
    out = err.value.stdout or b""
    assert (out.decode() if isinstance(out, bytes) else out).split() == ["1", "2"]


def test_faults_package_does_not_import_torch() -> None:
    code = "import sys, trainscout.faults; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=20
    )
    assert proc.returncode == 0, proc.stderr
