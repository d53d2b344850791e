"""DDP with uneven inputs: the last rank runs out of batches `short` steps early; the Join context manager
shadows its peers' collectives until they finish too (torch.distributed.algorithms.join)."""

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

steps, short = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.Generator().manual_seed(rank)
with Join([model]):
    for _step in range(steps - (short if rank == world - 1 else 0)):
        model(torch.randn(16, 32, generator=data)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
dist.barrier()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
