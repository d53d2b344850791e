"""A pipeline of two stages replicated three times (6 ranks): torch.distributed.pipelining's GPipe schedule over
each pipeline's pair of ranks (isend / irecv, waited on their handles), DDP (or FSDP2, as torchtitan does) over
each stage's replicas. Rank r is stage r % 2 of pipeline replica r // 2. The job may slow one rank itself, or
make it compute wrong, outside trainscout:

    python pipeline_dp_job.py --steps N [--fsdp] [--slow RANK:FROM_STEP:MS]   (MS ms a step in its forward)
                                             [--flip RANK:FROM_STEP]      (its stage's first layer's output negated)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel

DIM, MICRO, BATCH = 96, 4, 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over each stage's replicas instead of DDP")
    p.add_argument("--slow", default="", help="RANK:FROM_STEP:MS")
    p.add_argument("--flip", default="", help="RANK:FROM_STEP")
    args = p.parse_args()
    slow = [int(x) for x in args.slow.split(":")] if args.slow else None
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "pp"))
    stage_index, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(stage_index)  # a stage's replicas start equal
    layers = [m for _ in range(3) for m in (nn.Linear(DIM, DIM), nn.GELU())]
    module = nn.Sequential(*layers)
    now = [0]
    if slow is not None and rank == slow[0]:

        def sleep(mod, inputs) -> None:
            if now[0] >= slow[1]:
                time.sleep(slow[2] / 1000 / MICRO)  # per micro-batch: MS a step in all

        module[0].register_forward_pre_hook(sleep)
    flip = [int(x) for x in args.flip.split(":")] if args.flip else None
    if flip is not None and rank == flip[0]:
        module[0].register_forward_hook(lambda mod, inputs, out: -out if now[0] >= flip[1] else out)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])
        model: nn.Module = fully_shard(module, mesh=mesh["dp"])
    else:
        # find_unused_parameters: DDP's bucket rebuild fails when the schedule runs micro-batch backwards under
        # no_sync
        model = DistributedDataParallel(module, process_group=mesh["dp"].get_group(), find_unused_parameters=True)
    stage = PipelineStage(model, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=lambda out, target: F.mse_loss(out, target))
    opt = torch.optim.SGD(module.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(replica)  # one batch stream per pipeline replica
    for step in range(1, args.steps + 1):
        now[0] = step
        x = torch.randn(BATCH, DIM, generator=data)
        opt.zero_grad()
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=torch.tanh(x))
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
