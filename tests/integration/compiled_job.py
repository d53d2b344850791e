"""A DDP job whose model is compiled: `model.compile(fullgraph=True)` ("whole"), each block compiled in place
("blocks"), `torch.compile(model, fullgraph=True)` ("wrap") or `torch.compile(DistributedDataParallel(model))`
("ddp"). It evaluates every 5 steps (eval mode, autograd off). Once its first training step and evaluation have
compiled its graphs, any recompilation fails the job (`error_on_recompile`): it is caused by whoever hooks into
the model's modules. The eager backend keeps compiling fast; guards and recompilations are dynamo's, as with
inductor.

    python compiled_job.py MODE STEPS
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

MODE, STEPS = sys.argv[1], int(sys.argv[2])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model: nn.Module = Model()
    if MODE == "whole":
        model.compile(fullgraph=True, backend="eager")
    elif MODE == "blocks":
        for block in model.blocks:
            block.compile(fullgraph=True, backend="eager")
    elif MODE == "wrap":
        model = torch.compile(model, fullgraph=True, backend="eager")
    ddp = DistributedDataParallel(model)
    if MODE == "ddp":  # the DDP wrapper compiled (DDP's graph is split at its buckets: no fullgraph)
        ddp = torch.compile(ddp, backend="eager")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(dist.get_rank())
    for step in range(STEPS):
        x, y = torch.randn(16, 16, generator=data), torch.randint(0, 8, (16,), generator=data)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0:
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        torch._dynamo.config.error_on_recompile = True  # both graphs are compiled now
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
