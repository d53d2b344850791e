"""Tensor- and pipeline-parallel job shapes, for false-blame and coverage checks by hand: a small causal
transformer LM (hand-written blocks: nn.Linear q/k/v/o and a two-layer MLP), CPU ranks over gloo, started
unmodified under trainscout. `--x-sleep` and `--x-flip` are faults the job makes itself, outside trainscout.

    trainscout run --console plain -- torchrun --nproc-per-node 6 benchmarks/false_positives/parallel_job.py OPTIONS

Shapes (`--shape`), each on a 2-D DeviceMesh ("dp", X) with X of size `--tp` or `--pp` (default 2) and
dp = world // X; a world of 6 gives data-parallel groups of 3 (a strict majority), 4 gives groups of 2:
  tp       tensor parallel in every block (parallelize_module on mesh["tp"]: Colwise q/k/v and MLP up,
           Rowwise o and MLP down), then FSDP2 fully_shard(block, mesh=mesh["dp"]) per block and the root
           (the torchtitan pattern)                                  --shape tp --tp 2
  tp-ddp   the same tensor parallel, data parallel by DDP over the dp group
           (torch.distributed.tensor.parallel.ddp._pre_dp_module_transform)   --shape tp-ddp
  pp       pipeline parallel (torch.distributed.pipelining: a PipelineStage a rank built by hand from a
           split of the blocks, ScheduleGPipe or Schedule1F1B, `--micro 4` micro-batches, the loss on the
           last stage), data parallel by DDP (or `--pp-dp fsdp`: FSDP2) over each stage's dp group
                                                                     --shape pp --pp 2 --schedule 1f1b
Ranks of one data-parallel replica (the same dp coordinate) read the same batches (seeded by the dp
coordinate, not the rank). Faults, on global ranks:
  --x-sleep RANK:STEP:MS  that rank sleeps MS ms a step from STEP on, in a forward pre-hook of one block it
                          holds (pp: split across the micro-batches, so MS a step in all)
  --x-flip RANK:STEP      that rank negates one block's output from STEP on (tp: blocks.1; pp: the first
                          block of its stage)
Examples:  --shape tp --steps 300 --x-sleep 2:60:40     --shape pp --steps 300 --x-flip 2:60
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="tp", choices=["tp", "tp-ddp", "pp"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (tp, tp-ddp)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (pp)")
    p.add_argument("--micro", type=int, default=4, help="micro-batches a step (pp)")
    p.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"], help="pipeline schedule (pp)")
    p.add_argument("--pp-dp", default="ddp", choices=["ddp", "fsdp"], help="data parallel of each stage (pp)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--x-sleep", default="", help="RANK:STEP:MS: that rank sleeps in one block's forward")
    p.add_argument("--x-flip", default="", help="RANK:STEP: that rank negates one block's output")
    return p.parse_args()


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP. Head count is read from the (possibly TP-sharded) q output."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        x = self.ln1(h)
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class Stage(nn.Module):
    """One pipeline stage: the embedding on the first, a slice of the blocks, the norm and head on the last."""

    def __init__(self, lm: LM, index: int, stages: int) -> None:
        super().__init__()
        n = len(lm.blocks)
        lo, hi = index * n // stages, (index + 1) * n // stages
        self.first, self.last = index == 0, index == stages - 1
        self.emb = lm.emb if self.first else None
        self.blocks = nn.ModuleList(lm.blocks[lo:hi])
        self.norm = lm.norm if self.last else None
        self.head = lm.head if self.last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            h = self.emb(h)
        for block in self.blocks:
            h = block(h)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def tensor_parallel(lm: LM, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    plan |= {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in lm.blocks:
        parallelize_module(block, tp_mesh, plan)


def clip(params: list[torch.Tensor], max_norm: float) -> None:
    """clip_grad_norm_ for gradients that are DTensors on different meshes (2-D TP x FSDP: block weights on
    (dp, tp), the rest on dp), which torch's clip_grad_norm_ cannot stack: one total a mesh, then combined."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in groups.values():
        for g in grads:
            g.mul_(coef)


def add_faults(args: argparse.Namespace, rank: int, block: nn.Module, now: list[int], calls: int) -> None:
    if args.x_sleep and rank == int(args.x_sleep.split(":")[0]):
        _, start, ms = args.x_sleep.split(":")

        def sleep(module, inputs) -> None:
            if now[0] >= int(start) and module.training:
                time.sleep(float(ms) / 1000 / calls)

        block.register_forward_pre_hook(sleep)
    if args.x_flip and rank == int(args.x_flip.split(":")[0]):
        flip_from = int(args.x_flip.split(":")[1])
        block.register_forward_hook(lambda module, inputs, out: -out if now[0] >= flip_from else out)


def shard_blocks_and_root(module: nn.Module, mesh) -> nn.Module:
    """FSDP2 over the data-parallel mesh: each block, then the root (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    inner = args.pp if args.shape == "pp" else args.tp
    assert world % inner == 0, f"world {world} is not a multiple of {inner}"
    dp = world // inner
    name = "pp" if args.shape == "pp" else "tp"
    mesh = init_device_mesh("cpu", (dp, inner), mesh_dim_names=("dp", name))
    dp_rank, inner_rank = mesh["dp"].get_local_rank(), mesh[name].get_local_rank()
    torch.manual_seed(0)  # the same initial weights everywhere
    vocab, dim, heads, seq, bsz = 256, 64, 4, 48, 8
    lm = LM(vocab, dim, heads, args.layers)
    now = [0]
    schedule = None
    if args.shape in ("tp", "tp-ddp"):
        tensor_parallel(lm, mesh["tp"])
        add_faults(args, rank, lm.blocks[1], now, 1)
        if args.shape == "tp":
            model: nn.Module = shard_blocks_and_root(lm, mesh["dp"])
        else:
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

            _pre_dp_module_transform(lm)
            model = DistributedDataParallel(lm, process_group=mesh["dp"].get_group())
        params = list(model.parameters())
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage_mod = Stage(lm, inner_rank, inner)
        del lm
        add_faults(args, rank, stage_mod.blocks[0], now, args.micro)
        if args.pp_dp == "fsdp":
            wrapped: nn.Module = shard_blocks_and_root(stage_mod, mesh["dp"])
        else:
            # find_unused_parameters: DDP's bucket rebuild after the first step fails an internal assert when
            # pipelining runs the micro-batch backwards under no_sync (torch 2.13); this path never rebuilds
            wrapped = DistributedDataParallel(
                stage_mod, process_group=mesh["dp"].get_group(), find_unused_parameters=True
            )
        stage = PipelineStage(wrapped, inner_rank, inner, torch.device("cpu"), group=mesh["pp"].get_group())

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        schedule = cls(stage, n_microbatches=args.micro, loss_fn=loss_fn)
        model = wrapped
        params = list(stage_mod.parameters())
    opt = torch.optim.AdamW(params, lr=2e-3)
    data = torch.Generator().manual_seed(1000 + dp_rank)  # one stream per data-parallel replica

    def batch() -> torch.Tensor:
        start = torch.randint(0, vocab, (bsz, 1), generator=data)
        stride = torch.randint(1, 5, (bsz, 1), generator=data)
        noisy = torch.rand(bsz, seq, generator=data) < 0.1
        return (
            start + stride * torch.arange(seq) + noisy.long() * torch.randint(0, vocab, (bsz, seq), generator=data)
        ) % vocab

    printer = 0 if args.shape != "pp" else inner - 1  # the rank of dp replica 0 that holds the loss
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        now[0] = step
        x = batch()
        if schedule is None:
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
        else:
            losses: list[torch.Tensor] = []
            if inner_rank == 0:
                schedule.step(x[:, :-1])
            elif inner_rank == inner - 1:
                schedule.step(target=x[:, 1:], losses=losses)
            else:
                schedule.step()
            loss = torch.stack(losses).mean() if losses else torch.tensor(math.nan)
        clip(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 and rank == printer:
            ms = (time.perf_counter() - t0) * 1000 / 50
            print(f"step {step} loss {loss.item():.3f} ({ms:.0f} ms/step)", flush=True)
            t0 = time.perf_counter()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
