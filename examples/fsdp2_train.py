"""FSDP2 (fully_shard) on a 1-D mesh: a small MLP stack trained with AdamW. Unmodified by trainscout.

    torchrun --nproc-per-node 4 examples/fsdp2_train.py --steps 40
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.GELU()) for _ in range(4)],
                          nn.Linear(args.hidden, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, args.hidden, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print("done", os.getpid())


if __name__ == "__main__":
    main()
