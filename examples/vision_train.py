"""A small image classifier trained the way vision jobs are: DDP with BatchNorm (its running statistics broadcast
from rank 0 before every forward, DDP's default) or SyncBatchNorm (all-reduces in every forward), random-crop and
flip augmentation in DataLoader workers, SGD with Nesterov momentum and a one-cycle schedule, label smoothing,
metrics gathered as Python objects, an evaluation on rank 0 alone while the others wait in a barrier, and a rank-0
checkpoint. gloo on CPU or when ranks share GPUs, NCCL with a GPU per rank. Unmodified by trainscout.

    torchrun --nproc-per-node 4 examples/vision_train.py --steps 300 --workers 1 [--syncbn]
"""

import argparse
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

CLASSES = 10


class Shapes(Dataset):
    """Synthetic 3x32x32 images: a class-dependent pattern plus noise, randomly cropped and flipped on load."""

    def __init__(self, size: int, seed: int, augment: bool) -> None:
        self.size, self.seed, self.augment = size, seed, augment

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 7_919 + i)
        label = int(torch.randint(0, CLASSES, (1,), generator=g))
        grid = torch.linspace(0, 3.14159 * (label + 1), 40)
        image = torch.sin(grid[None, :, None] + grid[None, None, :] * (label % 3 + 1)).repeat(3, 1, 1)
        image = image + 0.3 * torch.randn(3, 40, 40, generator=g)
        if self.augment:
            top, left = torch.randint(0, 9, (2,), generator=g).tolist()
            image = image[:, top : top + 32, left : left + 32]
            if torch.rand(1, generator=g).item() < 0.5:
                image = image.flip(2)
        else:
            image = image[:, 4:36, 4:36]
        return image.contiguous(), label


def block(cin: int, cout: int, stride: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = block(3, width, 1)
        self.stage1 = block(width, 2 * width, 2)
        self.stage2 = block(2 * width, 4 * width, 2)
        self.head = nn.Linear(4 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.stage1(self.stem(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank")
    parser.add_argument("--syncbn", action="store_true", help="SyncBatchNorm: statistics all-reduced in every forward")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.syncbn and not cuda:
        parser.error("--syncbn needs GPUs (PyTorch's SyncBatchNorm runs on CUDA modules only)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = local_rank % torch.cuda.device_count() if cuda else 0
    if cuda:
        torch.cuda.set_device(gpu)
    own_gpu = cuda and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if own_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", gpu) if cuda else torch.device("cpu")
    torch.manual_seed(args.seed)
    net = Net(args.width)
    if args.syncbn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DistributedDataParallel(net.to(device), device_ids=[gpu] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=args.steps)
    data = Shapes(args.steps * args.batch * world + 512, args.seed, augment=True)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(
        data,
        args.batch,
        sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        pin_memory=cuda,
        drop_last=True,
    )
    held_out = Shapes(256, args.seed + 1, augment=False)
    ckpt_dir = tempfile.mkdtemp(prefix="vision_train_ckpt_") if rank == 0 else ""
    batches = iter(loader)
    seen = correct = 0
    began = time.perf_counter()
    for step in range(1, args.steps + 1):
        model.train()
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        seen += len(labels)
        correct += int((logits.argmax(1) == labels).sum())
        if step % 20 == 0:
            gathered = [None] * world
            dist.all_gather_object(gathered, {"loss": loss.item(), "seen": seen, "correct": correct})
            if rank == 0:
                accuracy = sum(g["correct"] for g in gathered) / max(1, sum(g["seen"] for g in gathered))
                mean_loss = sum(g["loss"] for g in gathered) / world
                print(f"step {step} loss {mean_loss:.4f} train acc {accuracy:.3f}", flush=True)
            seen = correct = 0
        if step % args.eval_every == 0:
            if rank == 0:  # rank 0 alone evaluates; the others wait for it in the barrier
                model.eval()
                with torch.no_grad():
                    hits = 0
                    for i in range(0, len(held_out), 64):
                        xs, ys = zip(*(held_out[j] for j in range(i, min(i + 64, len(held_out)))))
                        predicted = model.module(torch.stack(xs).to(device)).argmax(1).cpu()
                        hits += int((predicted == torch.tensor(ys)).sum())
                print(f"step {step} eval acc {hits / len(held_out):.3f}", flush=True)
            dist.barrier()
        if step % args.ckpt_every == 0:
            if rank == 0:
                torch.save(
                    {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                    os.path.join(ckpt_dir, "last.pt"),
                )
            dist.barrier()
    if rank == 0:
        elapsed = time.perf_counter() - began
        print(f"done: {args.steps} steps in {elapsed:.1f} s ({1000 * elapsed / args.steps:.0f} ms/step)", flush=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
