"""A small causal LM trained the way real jobs are: DDP, DataLoader worker processes over a DistributedSampler,
variable-length padded batches, bf16 autocast, gradient accumulation (no_sync), clipping, a warm-up + cosine
learning rate, the loss all-reduced for logging, an evaluation on every rank and a rank-0 checkpoint between
barriers. NCCL with a GPU per rank; gloo on CPU, or when ranks share GPUs (NCCL refuses two ranks on one GPU).
Unmodified by trainscout.

    torchrun --nproc-per-node 4 examples/lm_train.py --steps 300 --workers 1
"""

import argparse
import math
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB = 512


class Tokens(Dataset):
    """Synthetic token sequences of varying length: a fixed recurrence per sample, so the LM can learn it."""

    def __init__(self, size: int, max_len: int, seed: int) -> None:
        self.size, self.max_len, self.seed = size, max_len, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = int(torch.randint(self.max_len // 2, self.max_len + 1, (1,), generator=g))
        start, stride = torch.randint(0, VOCAB, (2,), generator=g).tolist()
        return (start + stride * torch.arange(n) + torch.arange(n) ** 2) % VOCAB


def pad(batch: list[torch.Tensor]) -> torch.Tensor:
    out = torch.full((len(batch), max(len(b) for b in batch)), -1, dtype=torch.long)
    for i, b in enumerate(batch):
        out[i, : len(b)] = b
    return out


class LM(nn.Module):
    def __init__(self, dim: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        x = self.embed(tokens.clamp(min=0)) + self.pos[:n]
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def lm_loss(model: nn.Module, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    batch = batch.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), ignore_index=-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (recompiles as lengths vary)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = local_rank % torch.cuda.device_count() if cuda else 0
    if cuda:
        torch.cuda.set_device(gpu)
    own_gpu = cuda and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if own_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", gpu) if cuda else torch.device("cpu")
    torch.manual_seed(args.seed)
    lm = LM(args.dim, args.layers, args.max_len).to(device)
    model = DistributedDataParallel(torch.compile(lm) if args.compile else lm, device_ids=[gpu] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    data = Tokens(args.steps * args.accum * args.batch * world + 1024, args.max_len, args.seed)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(
        data,
        args.batch,
        sampler=sampler,
        num_workers=args.workers,
        collate_fn=pad,
        persistent_workers=args.workers > 0,
        pin_memory=cuda,
    )
    held_out = [pad([Tokens(64, args.max_len, args.seed + 1)[i] for i in range(j, j + 8)]) for j in range(0, 64, 8)]
    ckpt_dir = tempfile.mkdtemp(prefix="lm_train_ckpt_") if rank == 0 else ""
    batches = iter(loader)
    began = time.perf_counter()
    for step in range(1, args.steps + 1):
        model.train()
        for micro in range(args.accum):
            batch = next(batches)
            if micro < args.accum - 1:
                with model.no_sync():  # accumulate locally; the last micro-batch syncs the gradients
                    (lm_loss(model, batch, device) / args.accum).backward()
            else:
                loss = lm_loss(model, batch, device)
                (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            if rank == 0:
                print(f"step {step} loss {logged.item() / world:.4f} lr {schedule.get_last_lr()[0]:.2e}", flush=True)
        if step % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                total = torch.stack([lm_loss(model.module, b, device) for b in held_out]).mean()
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step} eval loss {total.item() / world:.4f}", flush=True)
        if step % args.ckpt_every == 0:
            if rank == 0:
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
                torch.save(state, os.path.join(ckpt_dir, "last.pt"))
            dist.barrier()
    if rank == 0:
        elapsed = time.perf_counter() - began
        print(f"done: {args.steps} steps in {elapsed:.1f} s ({1000 * elapsed / args.steps:.0f} ms/step)", flush=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
