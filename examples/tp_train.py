"""Tensor parallel through DTensor (`parallelize_module`): an MLP stack split column/row-wise over the ranks.

Every rank sees the same batch (rank 0 broadcasts it); the layers' all-reduces are DTensor's functional
collectives, which no Python-level wrapper of torch.distributed sees. NCCL on GPUs when available, else
gloo on CPU. Unmodified by trainscout.

    torchrun --nproc-per-node 4 examples/tp_train.py --steps 20
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device_type = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
    device = torch.device(device_type, local_rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    width = 2 * args.hidden * world
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.hidden, width), nn.GELU(), nn.Linear(width, args.hidden))
                            for _ in range(args.blocks)]).to(device)
    plan = {}
    for i in range(args.blocks):
        plan[f"{i}.0"] = ColwiseParallel()
        plan[f"{i}.2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(0)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, args.hidden, device=device, generator=gen)
        dist.broadcast(x, src=0)  # one batch for the whole tensor-parallel group
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
