"""A pipeline of one stage per rank, hand-written with point-to-point calls (as GPipe schedules are): each
step sends NMB micro-batches forward and their gradients back, then a barrier. The first and last stages make
half as many P2P calls as the middle ones, and the last stage does `heavy` times more work by design.

    python pipeline_job.py STEPS HEAVY
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

H, MB, NMB = 128, 8, 4


def main() -> None:
    steps, heavy = int(sys.argv[1]), float(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    layers: list[nn.Module] = [nn.Linear(H, H), nn.Linear(H, H)]
    if rank == world - 1:  # the output projection: the last stage's extra work
        layers.append(nn.Linear(H, int(H * heavy)))
    stage = nn.Sequential(*layers)
    opt = torch.optim.SGD(stage.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        inputs, outputs = [], []
        for _ in range(NMB):
            if rank == 0:
                x = torch.randn(MB, H, generator=data)
            else:
                x = torch.empty(MB, H)
                dist.recv(x, rank - 1)
                x.requires_grad_(True)
            y = stage(x)
            if rank < world - 1:
                dist.send(y.detach(), rank + 1)
            inputs.append(x)
            outputs.append(y)
        for i in reversed(range(NMB)):
            if rank == world - 1:
                outputs[i].pow(2).mean().backward()
            else:
                grad = torch.empty(MB, H)
                dist.recv(grad, rank + 1)
                outputs[i].backward(grad)
            if rank > 0:
                dist.send(inputs[i].grad, rank - 1)
        opt.step()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
