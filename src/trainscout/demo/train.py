"""The demo training script: what `trainscout demo` launches under torchrun and then breaks on purpose.

It is deliberately an ordinary DDP script (torchrun env vars, gloo, DistributedSampler, AdamW) with no
trainscout import, so the demo proves trainscout attaches to unmodified code. Besides DDP's own gradient
all-reduces (issued from C++), every step issues one Python-level all-reduce of the loss for logging, as real
scripts do; that is the collective a desync fault rewrites. --pause-at and --slow-ms create legitimate
job-wide pauses and slowness, which the detectors must NOT report as a faulty rank. --timing-file gives
benchmarks/overhead.py per-step wall times measured inside the job, free of start-up and shutdown costs.

    torchrun --nproc-per-node 4 -m trainscout.demo.train --steps 100
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainscout.demo.model import GPTConfig, TinyGPT


class ArithmeticTokens(Dataset):
    """Token sequences start, start+stride, start+2*stride, ... (mod vocab).

    Each sample depends only on (seed, index), so every rank sees the same dataset without any file, and the
    task is learnable (the stride is visible after two tokens), so the logged loss falls as in real training.
    """

    def __init__(self, size: int, seq: int, vocab: int, seed: int) -> None:
        self.size, self.seq, self.vocab, self.seed = size, seq, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        tokens = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        return tokens[:-1], tokens[1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Tiny GPT trained with DDP on gloo (the trainscout demo job).")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch size")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--pause-at",
        type=int,
        default=None,
        metavar="STEP",
        help="after this step every rank saves a checkpoint and sleeps --pause-seconds",
    )
    parser.add_argument("--pause-seconds", type=float, default=5.0)
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR")
    parser.add_argument("--slow-ms", type=float, default=0.0, help="every rank sleeps this long each step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: each rank computes on GPU LOCAL_RANK modulo the GPUs present, still over gloo, "
        "so several ranks may share one GPU (NCCL refuses that): 3+ replicas on one GPU",
    )
    parser.add_argument(
        "--stop-file",
        default=None,
        metavar="PATH",
        help="end training (every rank, at the same step) once this file exists; looked for every 10 steps",
    )
    parser.add_argument(
        "--timing-file",
        default=None,
        metavar="PATH",
        help="rank 0 writes each step's wall seconds and its end time (monotonic clock, seconds) "
        "here, one step per line, after training",
    )
    return parser.parse_args(argv)


def batches(loader: DataLoader, sampler: DistributedSampler) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches, reshuffled each epoch the way DistributedSampler expects."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def save_checkpoint(
    directory: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> str | None:
    """Rank 0 writes DIR/step-NNNNNN.pt atomically (DDP state is replicated, so one copy is the checkpoint);
    other ranks serialise into memory, so every rank spends a save's time as in a sharded checkpoint."""
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if rank != 0:
        torch.save(state, io.BytesIO())
        return None
    path = os.path.join(directory, f"step-{step:06d}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a reader never sees a half-written checkpoint
    return path


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # several ranks share few cores; intra-op threads would only fight
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts them)

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    cfg = GPTConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq)
    model = DistributedDataParallel(
        TinyGPT(cfg).to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    dataset = ArithmeticTokens(size=4096, seq=args.seq, vocab=args.vocab, seed=args.seed)
    sampler: DistributedSampler[tuple[torch.Tensor, torch.Tensor]] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=0, drop_last=True)

    with contextlib.ExitStack() as stack:
        ckpt_dir = args.checkpoint_dir
        if ckpt_dir:
            os.makedirs(ckpt_dir, exist_ok=True)
        elif args.pause_at is not None:
            ckpt_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="trainscout-demo-ckpt-"))

        # Step times are kept in memory and written after the loop: file I/O per step would itself show up
        # in the overhead benchmark that reads them. Each spans the whole iteration, data loading included.
        step_seconds: list[float] = []
        step_ends: list[float] = []  # perf_counter is CLOCK_MONOTONIC: comparable with other processes' clocks
        started = step_started = time.perf_counter()
        for step, (inputs, targets) in enumerate(batches(loader, sampler), start=1):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            # The logged loss is the mean over ranks: a Python-level collective, as real scripts issue.
            logged = loss.detach().clone()
            dist.all_reduce(logged, op=dist.ReduceOp.SUM)
            logged /= world

            if args.slow_ms > 0:
                time.sleep(args.slow_ms / 1000.0)
            if args.checkpoint_every and step % args.checkpoint_every == 0 and args.checkpoint_dir:
                save_checkpoint(args.checkpoint_dir, step, model.module, optimizer, rank)
            if step == args.pause_at:
                save_checkpoint(ckpt_dir, step, model.module, optimizer, rank)
                time.sleep(args.pause_seconds)
            if rank == 0 and args.log_every and step % args.log_every == 0:
                print(f"step {step} loss {logged.item():.3f}", flush=True)
            now = time.perf_counter()
            step_seconds.append(now - step_started)
            step_ends.append(now)
            step_started = now
            if step >= args.steps:
                break
            if args.stop_file and step % 10 == 0 and _stop_requested(args.stop_file, rank):
                break
        elapsed = time.perf_counter() - started

    if rank == 0 and args.timing_file:
        with open(args.timing_file, "w") as fh:
            fh.writelines(f"{s:.9f} {e:.6f}\n" for s, e in zip(step_seconds, step_ends))

    if rank == 0:
        print(
            f"done: {args.steps} steps in {elapsed:.2f} s ({1000 * elapsed / max(args.steps, 1):.1f} ms/step)",
            flush=True,
        )
    dist.destroy_process_group()


def _stop_requested(path: str, rank: int) -> bool:
    """Rank 0 looks for the file and tells the others (they must leave the loop at the same step)."""
    flag = torch.tensor([1 if rank == 0 and os.path.exists(path) else 0])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
