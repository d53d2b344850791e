"""Job shapes a user may bring, for false-blame and coverage checks by hand: a small causal transformer LM,
4 CPU ranks over gloo, started unmodified under trainscout. Each option turns on one shape; `--x-sleep` and
`--x-flip` are faults the job makes itself, outside trainscout (where `--inject` layer faults need a DDP model).

    trainscout run --console plain -- torchrun --nproc-per-node 4 benchmarks/false_positives/shapes_job.py OPTIONS

Shapes of benchmarks/RESULTS.md ("Job shapes nobody here had run", Dec 6) and their options:
  ZeroRedundancyOptimizer            --zero   (with PowerSGD: --zero --hook powersgd; SGD: --sgd)
  DDP comm hooks                     --hook powersgd | --hook fp16 --static-graph --bucket-view
  distributed checkpoints            --dcp-every 25 --hook fp16 --zero
  per-rank data domains              --domains   (also with --fsdp)
  activation checkpointing           --ckpt reentrant | --ckpt nonreentrant --teacher   (distillation)
  intra-op threads                   --threads 2
  tiny steps                         --tiny --steps 1500
  stochastic depth                   --layerdrop 0.3
  FSDP2, 1-D mesh                    --fsdp   (faults: --x-flip 1:60, --x-sleep 2:60:30)
  HSDP, 3 replicas x 2 shards        --fsdp --hsdp 3   (6 ranks)
  gradient accumulation (no_sync)    --accum 4
  torch.compile, bf16 autocast       --compile, --bf16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer around the optimizer")
    p.add_argument("--hook", default="none", choices=["none", "fp16", "bf16", "powersgd"], help="DDP comm hook")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view")
    p.add_argument("--dcp-every", type=int, default=0, help="torch.distributed.checkpoint.save every N steps")
    p.add_argument("--domains", action="store_true", help="each rank reads its own data domain")
    p.add_argument("--sgd", action="store_true", help="SGD with momentum instead of AdamW")
    p.add_argument("--ckpt", default="", choices=["", "reentrant", "nonreentrant"], help="activation checkpointing")
    p.add_argument("--teacher", action="store_true", help="distillation from a no_grad teacher")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard per block and root, no DDP")
    p.add_argument("--hsdp", type=int, default=0, help="with --fsdp: a 2-D mesh of this many replicas of the shards")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads on every rank")
    p.add_argument("--tiny", action="store_true", help="a tiny model: steps of a few ms of compute")
    p.add_argument("--layerdrop", type=float, default=0.0, help="each rank skips each block with this chance")
    p.add_argument("--accum", type=int, default=1, help="micro-batches a step, all but the last under no_sync()")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast around the forward")
    p.add_argument("--x-sleep", default="", help="RANK:STEP:MS: the job sleeps in blocks.1's forward there")
    p.add_argument("--x-flip", default="", help="RANK:STEP: the job negates blocks.1's output there")
    return p.parse_args()


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, args: argparse.Namespace, rank: int) -> None:
        super().__init__()
        self.args = args
        self.drop = torch.Generator().manual_seed(555 + rank)  # stochastic depth differs by rank
        self.emb = nn.Embedding(vocab, dim)
        layer = dict(dim_feedforward=4 * dim, dropout=0.1, batch_first=True)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, **layer) for _ in range(3))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for block in self.blocks:
            if self.args.layerdrop and self.training:
                if float(torch.rand(1, generator=self.drop)) < self.args.layerdrop:
                    continue
            if self.args.ckpt and self.training:
                from torch.utils.checkpoint import checkpoint

                h = checkpoint(block, h, mask, None, True, use_reentrant=self.args.ckpt == "reentrant")
            else:
                h = block(h, src_mask=mask, is_causal=True)
        return self.head(h)


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    if args.threads:
        torch.set_num_threads(args.threads)
    rank = dist.get_rank()
    torch.manual_seed(0)
    vocab, dim, seq = (64, 16, 8) if args.tiny else (256, 64, 48)
    lm = LM(vocab, dim, args, rank)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if args.hsdp:
            from torch.distributed.device_mesh import init_device_mesh

            world = dist.get_world_size()
            mesh = init_device_mesh("cpu", (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard"))
        for block in lm.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(lm, mesh=mesh)
        model: nn.Module = lm
    else:
        model = DistributedDataParallel(
            lm,
            static_graph=args.static_graph,
            gradient_as_bucket_view=args.bucket_view,
            find_unused_parameters=bool(args.layerdrop),
        )
        if args.hook in ("fp16", "bf16"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.fp16_compress_hook if args.hook == "fp16" else default_hooks.bf16_compress_hook
            model.register_comm_hook(None, hook)
        elif args.hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    if args.compile:
        model = torch.compile(model)
    teacher = LM(vocab, dim, args, rank).eval() if args.teacher else None
    now = [0]
    if args.x_sleep and rank == int(args.x_sleep.split(":")[0]):
        _, start, ms = args.x_sleep.split(":")

        def sleep(module, inputs) -> None:
            if now[0] >= int(start) and module.training:
                time.sleep(float(ms) / 1000)

        lm.blocks[1].register_forward_pre_hook(sleep)
    if args.x_flip and rank == int(args.x_flip.split(":")[0]):
        flip_from = int(args.x_flip.split(":")[1])
        lm.blocks[1].register_forward_hook(lambda module, inputs, out: -out if now[0] >= flip_from else out)
    opt_cls, kwargs = (torch.optim.SGD, dict(lr=0.05, momentum=0.9)) if args.sgd else (torch.optim.AdamW, dict(lr=2e-3))
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=opt_cls, **kwargs)
    else:
        opt = opt_cls(model.parameters(), **kwargs)
    data = torch.Generator().manual_seed(1000 + rank)

    def batch() -> torch.Tensor:
        start = torch.randint(0, vocab, (8, 1), generator=data)
        stride = torch.tensor(rank + 1) if args.domains else torch.randint(1, 5, (8, 1), generator=data)
        noisy = torch.rand(8, seq, generator=data) < (0.05 * (rank + 1) if args.domains else 0.1)
        return (
            start + stride * torch.arange(seq) + noisy.long() * torch.randint(0, vocab, (8, seq), generator=data)
        ) % vocab

    ckpt_dir = tempfile.mkdtemp(prefix="shapes_dcp_") if args.dcp_every else ""
    for step in range(1, args.steps + 1):
        now[0] = step
        for micro in range(args.accum):
            x = batch()
            sync = contextlib.nullcontext() if args.fsdp or micro == args.accum - 1 else model.no_sync()
            with sync:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                    logits = model(x[:, :-1])
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
                    if teacher is not None:
                        with torch.no_grad():
                            target = F.softmax(teacher(x[:, :-1]).float(), -1)
                        loss = loss + 0.5 * F.kl_div(F.log_softmax(logits.float(), -1), target, reduction="batchmean")
                (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.dcp_every and step % args.dcp_every == 0:
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": lm.state_dict()}, checkpoint_id=os.path.join(ckpt_dir, f"step{step}"))
        if step % 50 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
