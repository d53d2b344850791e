"""A small DDP (or FSDP2) language-model job that counts host-device synchronisations in its steady state.

After `--warmup` steps it arms `torch.cuda.set_sync_debug_mode("warn")` and records every warning it
raises, with the Python file and line that made the synchronising call, over `--steps` more steps in
which the job itself never reads a device value. Before that it checks that the recording works at all:
one `.item()` on the training thread and one inside an autograd hook (which runs on the engine's thread)
must each be recorded. Each rank writes what it saw, and what the trainscout probe in it did meanwhile
(when one is attached), to `--out` with `{rank}` replaced.

    torchrun --nproc-per-node 2 tests/gpu/sync_job.py --out /tmp/sync-{rank}.json [--fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

VOCAB = 256


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, hidden: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _probe_stats() -> dict:
    mod = sys.modules.get("trainscout.probe.probe")
    probe = getattr(mod, "_probe", None)
    if probe is None:
        return {"attached": False}
    sc, nf, gc = probe.state_check, probe.nonfinite, probe.gather_check
    dev = getattr(sc, "_device", None) if sc is not None else None
    nf_results = getattr(nf, "_results", None) if nf is not None else None
    gc_results = getattr(gc, "_results", None) if gc is not None else None
    return {
        "attached": True,
        "step": probe.step,
        "state_check": sc is not None,
        "state_stride": getattr(sc, "stride", None),
        "state_published": dev.published if dev is not None else None,
        "state_submitted": dev.results.inflight.submitted if dev is not None else None,
        "state_dropped": dev.results.inflight.dropped if dev is not None else None,
        "nonfinite_device_checks": getattr(nf, "device_checks", None),
        "nonfinite_completed": nf_results.inflight.completed if nf_results is not None else None,
        "nonfinite_device_ok": getattr(nf, "_device_ok", None),
        "nonfinite_counts_error": getattr(nf, "counts_error", None),
        "gather_submitted": gc_results.inflight.submitted if gc_results is not None else None,
        "gather_dropped": gc_results.inflight.dropped if gc_results is not None else None,
        "gather_published": getattr(gc, "published", None),
        "gather_stride": getattr(gc, "stride", None),
        "gather_error": getattr(gc, "error", None),
        "replays": probe.replay.count if probe.replay is not None else None,
        "error_text": bytes(probe.writer.header["error_text"]).rstrip(b"\0").decode(errors="replace"),
    }


def _record(caught) -> list[str]:
    return [f"{os.path.basename(w.filename)}:{w.lineno}: {str(w.message)[:120]}" for w in caught]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard per block and the root) instead of DDP")
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        model = TinyLM().to(device)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    else:
        model = DistributedDataParallel(TinyLM().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, VOCAB, (8, 64), device=device, generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), tokens.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()

    with warnings.catch_warnings(record=True) as control:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.ones(1, device=device).item()  # training thread
        w = torch.ones(4, device=device, requires_grad=True)
        handle = w.register_hook(lambda g: g * float(g.sum().item() != 0))  # the engine's thread
        torch.autograd.grad((w * 2).sum(), w)
        handle.remove()
        torch.cuda.set_sync_debug_mode(0)

    before = _probe_stats()
    with warnings.catch_warnings(record=True) as steady:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for _ in range(args.steps):
            step()
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    after = _probe_stats()
    with open(args.out.replace("{rank}", str(rank)), "w") as fh:
        json.dump(
            {"rank": rank, "control": _record(control), "steady": _record(steady), "before": before, "after": after},
            fh,
            indent=1,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
