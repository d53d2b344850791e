"""FSDP2 on a 2-D device mesh (HSDP): parameters sharded within a group, replicated across groups.

`--replicate R` splits the world into R replicas of world/R shards each (R=1 is plain FSDP2 on a 1-D
mesh). NCCL on GPUs when available, else gloo on CPU. Unmodified by trainscout.

    torchrun --nproc-per-node 4 examples/hsdp_train.py --replicate 2 --steps 20
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicate", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device_type = "cuda" if cuda else "cpu"
    if args.replicate > 1:
        mesh = init_device_mesh(device_type, (args.replicate, world // args.replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    device = torch.device(device_type, local_rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.GELU()) for _ in range(4)],
                          nn.Linear(args.hidden, 8)).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, args.hidden, device=device, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {logged.item() / world:.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print("done", os.getpid())


if __name__ == "__main__":
    main()
