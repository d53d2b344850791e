"""ZeRO++ hpZ on CPU: real DeepSpeed ZeRO-3 jobs with hierarchical partitioning under `trainscout run`.

DeepSpeed's CPU accelerator runs ZeRO-3 with `zero_hpz_partition_size: 2` over gloo: the forward gathers
each parameter from the primary partitions, the release after forward fills the secondary partition,
and the backward gathers from it. The CPU has no streams, so the copy/all-gather race itself cannot
happen here (the GPU reproduction is `python -m benchmarks gpu hpz`); what these jobs check is everything
around it on unmodified DeepSpeed: the probe's forward/backward fingerprints of the gathered weights,
their way through channel, agent and coordinator, and the verdict. A healthy job stays silent; a job
whose rank 1 corrupts its own secondary partition at one step (what an unfilled copy looks like to the
receivers) gets one `hpz_race` finding naming rank 1 at that step.

This file is also the training script (`torchrun ... test_hpz.py --train`), so the test and the job it
runs stay side by side. Skipped when DeepSpeed is not installed.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

CORRUPT_ENV = "HPZ_TEST_CORRUPT"  # "RANK:STEP": that rank adds 1.0 to its secondary partition at STEP


def train(steps: int) -> None:
    """A small model under DeepSpeed ZeRO-3 + hpZ on the CPU accelerator (gloo), fixed data, AdamW."""
    import torch
    import torch.nn as nn

    import deepspeed
    import deepspeed.ops

    # The CPU accelerator would compile a shared-memory all-reduce extension at init (minutes on a
    # small machine); it is an optimisation only, so this job goes without it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from deepspeed.runtime.zero.partition_parameters import Init

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.up = nn.Linear(dim, 2 * dim)
            self.down = nn.Linear(2 * dim, dim)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self, vocab: int = 64, dim: int = 32) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 1_000_000,
        "zero_optimization": {
            "stage": 3,
            "zero_hpz_partition_size": 2,
            "overlap_comm": True,
            # release after forward and gather again in backward (what happens at scale)
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 0,
            "stage3_param_persistence_threshold": 0,
        },
    }
    deepspeed.init_distributed(dist_backend="gloo")
    model = Net()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
    )
    rank = int(os.environ["RANK"])
    corrupt = os.environ.get(CORRUPT_ENV, "")
    if corrupt:
        bad_rank, bad_step = (int(v) for v in corrupt.split(":"))
        real = Init._partition_param_sec

        def _partition_param_sec(init, param, *args, **kwargs):
            copying = param.ds_status.name == "AVAILABLE"
            result = real(init, param, *args, **kwargs)
            sec = param.ds_secondary_tensor
            if copying and sec is not None and rank == bad_rank and engine.global_steps + 1 == bad_step:
                with torch.no_grad():
                    sec.narrow(0, 0, min(4, sec.numel())).add_(1.0)
            return result

        Init._partition_param_sec = _partition_param_sec

    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (4, 8), generator=gen) for _ in range(steps)]
    for tokens in data:
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
    from trainscout.probe import probe

    check = probe._probe.hpz_check if probe._probe is not None else None
    print(f"rank {rank}: HPZ_CHECKED={check.checked if check else -1} loss={loss.item():.6f}", flush=True)


if __name__ == "__main__" and "--train" in sys.argv:
    train(int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 10)
    sys.exit(0)


import pytest  # noqa: E402

from conftest import Job, free_port, torchrun_cmd, trainscout_cmd, unique_run_id  # noqa: E402

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the hpZ jobs run real DeepSpeed ZeRO-3)")

TIMEOUT_S = 240.0
STEPS = 10
CORRUPT_STEP = 6


def _start(jobs, tmp_path: Path, name: str, env: dict[str, str]) -> Job:
    run_id = unique_run_id(name)
    launch = torchrun_cmd(
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(Path(__file__).resolve()),
        "--train",
        "--steps",
        str(STEPS),
    )
    args = trainscout_cmd("run", "--run-dir", str(tmp_path), "--run-id", run_id, "--console", "plain", "--", *launch)
    # the check's default schedule: every step the two modules the previous forward released last (here
    # blocks.1.down and head), plus one module in TRAINSCOUT_HPZ_PERIOD (4) by DeepSpeed's module id
    # (the defaults, set so that an outer environment cannot leak in)
    knobs = {
        "DS_ACCELERATOR": "cpu",
        "TRAINSCOUT_REPLAY_EVERY": "0",
        "OMP_NUM_THREADS": "1",
        CORRUPT_ENV: "",
        "TRAINSCOUT_HPZ_PERIOD": "4",
        "TRAINSCOUT_HPZ_CHECK": "1",
        "TRAINSCOUT_HPZ_FIX": "event",
    }
    return jobs(args, tmp_path, run_id, env={**knobs, **env})


@pytest.fixture(scope="module")
def hpz_jobs(tmp_path_factory):
    """A healthy job and a job whose rank 1 corrupts its secondary partition, run side by side."""
    from conftest import _stop, kill_run_leftovers

    started = []

    def jobs(args, root, run_id, **kw):
        job = Job(args, root, run_id, **kw)
        started.append(job)
        return job

    root = tmp_path_factory.mktemp("hpz")
    clean = _start(jobs, root, "hpz-clean", {})
    corrupt = _start(jobs, root, "hpz-corrupt", {CORRUPT_ENV: f"1:{CORRUPT_STEP}"})
    try:
        yield {"clean": clean.wait(TIMEOUT_S), "corrupt": corrupt.wait(TIMEOUT_S)}
    finally:
        for job in started:
            if job.proc.poll() is None:
                _stop(job.proc)
            kill_run_leftovers(job.run_id)


def _checked(output: str) -> list[int]:
    """Each rank's count of checked parameters. Two ranks' prints can land on one line of the launcher's
    output (torchrun interleaves them), so match the pattern anywhere rather than line by line."""
    by_rank = {int(r): int(n) for r, n in re.findall(r"rank (\d+): HPZ_CHECKED=(-?\d+)", output)}
    return [by_rank[r] for r in sorted(by_rank)]


def test_healthy_hpz_job_is_silent(hpz_jobs):
    result = hpz_jobs["clean"]
    assert result.returncode == 0, result.describe()
    checked = _checked(result.output)
    assert len(checked) == 2 and min(checked) > 0, f"the hpZ check never ran\n{result.describe()}"
    assert result.findings == [], result.describe()


def test_corrupted_secondary_partition_names_its_rank(hpz_jobs):
    result = hpz_jobs["corrupt"]
    assert result.returncode == 0, result.describe()
    races = [f for f in result.findings if f["kind"] == "hpz_race"]
    assert len(races) == 1, result.describe()
    race = races[0]
    assert race["culprit_ranks"] == [1], result.describe()
    assert race["step"] == CORRUPT_STEP, result.describe()
    assert race["evidence"]["receivers"] == [0, 1]  # both members of the secondary group gathered it
    assert race["evidence"]["fix_mode"] == "none"  # CPU: no streams, so the partition itself was corrupted
    assert all(r["secondary_of"] == 1 for r in race["evidence"]["ranges"])
    assert {"head.weight", "blocks.1.down.weight"} <= set(race["evidence"]["params"])  # the schedule's tail
    assert [f for f in result.findings if f["kind"] != "hpz_race"] == [], result.describe()
