"""trainscout's own exchanges between ranks (a replay's broadcasts, a link probe's sends and receives) give up on a
rank that does not come within seconds, so training is held that long and not for the side group's minute.

Two real gloo ranks: rank 0 runs a link probe (or a replay) at a step rank 1 never reaches there (its step count
is off by one, or its node never got the command); rank 1 goes on with its own work for a while and then ends.
Rank 0's call must raise after a few seconds (the probe then turns that check off)."""

from __future__ import annotations

import json
import textwrap

import pytest

from conftest import run_torchrun_script

pytestmark = pytest.mark.slow

ABSENT_S = 20.0  # rank 1 stays away this long, as a peer in the job's next collective would
SCRIPT = textwrap.dedent("""
    import datetime, json, os, sys, time
    import torch
    import torch.distributed as dist
    from trainscout.probe.link_probe import LinkProbe
    from trainscout.probe.replay import Replay

    what, out, absent_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    result = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            if what == "link":
                probe = LinkProbe(lambda *r: None, 0, print)
                probe.request = {"id": 1, "step": 5, "members": [0, 1]}
                probe.run(5, side)
            else:
                model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
                replay = Replay(lambda *r: None, 1, 0)
                replay.attach(model, side, 0, dist.broadcast)
                replay.arm_if_due(1)
                model(torch.randn(2, 4))
                replay.run(1)
            result["raised"] = None
        except Exception as exc:
            result["raised"] = type(exc).__name__
        result["waited_s"] = time.monotonic() - t0
    else:
        time.sleep(absent_s)
    with open(out.format(rank=rank), "w") as fh:
        json.dump(result, fh)
    os._exit(0)  # the side group holds an unfinished call: no orderly teardown
""")


@pytest.mark.parametrize("what", ["link", "replay"])
def test_a_peer_that_never_comes_is_given_up_on_within_seconds(tmp_path, what):
    script = tmp_path / "side_job.py"
    script.write_text(SCRIPT)
    out = str(tmp_path / f"{what}-{{rank}}.json")
    run_torchrun_script(script, 2, what, out, str(ABSENT_S))
    got = json.loads(open(out.format(rank=0)).read())
    assert got["raised"] is not None, got  # it gave up ...
    assert got["waited_s"] < ABSENT_S / 2, got  # ... long before the peer came back
