"""The shape of PyTorch's DDP tutorial: one process spawns the ranks (torch.multiprocessing.spawn), and each
learns its rank only in its own init_process_group(rank=..., world_size=...) call: no RANK in any environment.

    python spawn_job.py STEPS PORT [cpu|cuda]

On cuda every rank computes on cuda:0 (gloo: ranks may share the GPU).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

WORLD = 4


def worker(rank: int, steps: int, port: int, device: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(device)
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(32, 64, device=device), torch.randint(0, 8, (32,), device=device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    assert "RANK" not in os.environ
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    mp.spawn(worker, args=(int(sys.argv[1]), int(sys.argv[2]), device), nprocs=WORLD, join=True)
