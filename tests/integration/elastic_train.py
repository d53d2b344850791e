"""A small DDP job over gloo that survives torchrun's elastic restarts (`--max-restarts`), for the tests.

With the static rendezvous (`--master-port`), torchrun keeps one store across attempts, and torch 2.13's
default process group then reads the previous attempt's gloo addresses from it (a restarted gloo job fails to
connect). The job therefore builds its default group on a store prefixed by the attempt number, as a
training script that restarts elastically does.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", base), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(32, 64, generator=gen)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        time.sleep(0.05)
        if rank == 0 and step % 10 == 0:
            print(f"attempt {attempt} step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
