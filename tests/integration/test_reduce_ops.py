"""A reduce op given as a ReduceOp object is described by its kind, the same on every rank.

`dist.ReduceOp(dist.ReduceOp.SUM)` and the premul-sum ops FSDP2 builds for NCCL are objects, not enum
members; their text is their address, which differs between ranks. Described that way, every such
collective would carry a different signature on each rank, and the coordinator would call the identical
calls a desync. Two gloo ranks issue all-reduces with an op object and with an enum member under
`trainscout run`; each rank writes down how its channel described them.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import free_port, run_under_trainscout, torchrun_cmd

pytestmark = pytest.mark.slow

STEPS = 40

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist

    out_dir, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp(dist.ReduceOp.SUM))  # an op object
        opt.step()
        opt.zero_grad()
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MAX)  # an enum member

    import trainscout.probe.probe as probe_module
    from trainscout.channel.layout import channel_path
    from trainscout.channel.reader import ChannelReader

    probe_module._probe.publisher.poll_collectives(force=True)
    records = ChannelReader(channel_path(os.environ["TRAINSCOUT_RUN_ID"], rank)).new_records()
    descs = sorted({r["desc"].decode() for r in records if r["op"] == b"all_reduce"})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"descs": descs}, fh)
    dist.destroy_process_group()
    os._exit(0)  # results are written; skip torch's gloo teardown, which sometimes aborts
""")


def test_reduce_op_objects_are_described_alike_on_every_rank(tmp_path):
    script = tmp_path / "reduce_ops.py"
    script.write_text(SCRIPT)
    out = tmp_path / "descs"
    out.mkdir()
    launch = torchrun_cmd("--nproc-per-node", "2", "--master-port", str(free_port()), str(script), str(out), str(STEPS))
    result = run_under_trainscout(tmp_path, "reduce-ops", launch)

    assert result.returncode == 0, result.describe()
    assert result.findings == [], result.describe()
    descs = [json.loads((out / f"rank{rank}.json").read_text())["descs"] for rank in (0, 1)]
    assert (
        descs[0]
        == descs[1]
        == ["all_reduce Float[1, 4] op=SUM", "all_reduce Float[1] op=MAX", "all_reduce Float[1] op=SUM"]
    ), (descs, result.describe())
