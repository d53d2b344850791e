"""DeepSpeed ZeRO (stage 1, 2 or 3) on a small MLP stack. Unmodified by trainscout.

NCCL on GPUs when available, else DeepSpeed's CPU accelerator over gloo. Launched by torchrun (or the
DeepSpeed launcher), as any DeepSpeed job:

    torchrun --nproc-per-node 4 examples/deepspeed_train.py --zero-stage 3 --steps 20
"""

import argparse
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.GELU())
                            for _ in range(args.layers)], nn.Linear(args.hidden, 8))
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.zero_stage == 3:
        # small buckets: the layers are tiny, and every layer's parameters are gathered on its own
        config["zero_optimization"].update({"stage3_param_persistence_threshold": 0,
                                            "stage3_prefetch_bucket_size": 0})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    device = engine.device
    gen = torch.Generator(device=device).manual_seed(rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, args.hidden, device=device, generator=gen)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {logged.item() / dist.get_world_size():.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print("done", os.getpid())


if __name__ == "__main__":
    main()
