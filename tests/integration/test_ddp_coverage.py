"""DDP's gradient all-reduces, issued from C++, are counted like the collectives a script issues in Python.

Patching `torch.distributed.all_reduce` sees none of DDP's bucket all-reduces; the probe must take them
from the Flight Recorder. A small DDP script runs under `trainscout run`; at the end each rank reads
its own shared-memory channel (what the agent reads) and writes down what was recorded there. The script
counts its own Python all_reduce calls through a wrapper of its own, so the test can tell the two paths
apart: the Python ones (the logged loss, a scalar) and the C++ ones (DDP's bucket, all parameters).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import free_port, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

STEPS = 10

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    out_dir, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    python_all_reduces = 0
    _real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        global python_all_reduces
        python_all_reduces += 1
        return _real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce  # every all_reduce this script issues from Python

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n_params = sum(p.numel() for p in model.parameters())
    for step in range(steps):
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        loss.backward()                      # DDP all-reduces the gradient bucket from C++
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)              # the logged loss: a Python-level scalar all_reduce

    import trainscout.probe.probe as probe_module
    from trainscout.channel.layout import channel_path, pg_table_path
    from trainscout.channel.reader import ChannelReader

    probe = probe_module._probe
    probe.publisher.poll_collectives(force=True)   # publish what the Flight Recorder has now
    run_id = os.environ["TRAINSCOUT_RUN_ID"]
    with open(pg_table_path(run_id, rank)) as fh:
        pg_index = json.load(fh)["index"]["0"]      # the default group
    records = ChannelReader(channel_path(run_id, rank)).new_records()
    mine = [r for r in records if int(r["pg_index"]) == pg_index and r["op"] == b"all_reduce"]
    bucket_desc = f"all_reduce Float[{n_params}]"
    result = {
        "rank": rank,
        "n_params": n_params,
        "python_all_reduces": python_all_reduces,
        "ddp_all_reduces": sum(1 for r in mine if r["desc"].decode() == bucket_desc),
        "loss_all_reduces": sum(1 for r in mine if r["desc"].decode().startswith("all_reduce Float[] ")),
        "all_reduce_descs": sorted({r["desc"].decode() for r in mine}),
        "seqs": sorted(int(r["seq"]) for r in mine),
        "probe_dropped": int(probe.writer.header["dropped"]),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()
""")


def test_ddp_bucket_all_reduces_from_cpp_are_recorded(tmp_path):
    script = tmp_path / "ddp_probe_count.py"
    script.write_text(SCRIPT)
    out = tmp_path / "counts"
    out.mkdir()
    launch = torchrun_cmd("--nproc-per-node", "2", "--master-port", str(free_port()), str(script), str(out), str(STEPS))
    result = run_under_trainscout(tmp_path, "ddp", launch)

    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), result.describe()
        counts = json.loads(path.read_text())
        # the script's own Python all_reduces: only the logged loss, once per step (DDP's are not Python)
        assert counts["python_all_reduces"] == STEPS, counts
        assert counts["loss_all_reduces"] == STEPS, counts
        # one bucket (all 68 parameters) all-reduced from C++ per backward, every one recorded
        assert counts["n_params"] == 68, counts
        assert counts["ddp_all_reduces"] >= STEPS, counts
        assert counts["ddp_all_reduces"] == STEPS, counts  # one bucket: exactly one per step
        assert len(counts["seqs"]) == len(set(counts["seqs"])), counts  # each collective recorded once
        assert counts["all_reduce_descs"] == sorted(
            [f"all_reduce Float[{counts['n_params']}]", "all_reduce Float[] op=SUM"]
        ), counts
