"""A causal language model trained on CUDA with DDP (or FSDP2): the workload of `python -m benchmarks gpu overhead`.

An ordinary training script: vocabulary 256, learned positions, pre-norm blocks (LayerNorm, multi-head
attention, LayerNorm, 4x MLP), bf16 autocast, AdamW, random tokens, the loss printed every 10 steps.
`--scout` enables the peer tool's detection (lm-resiliency SCOUT) through its public API, the way its users do.

Step times come from CUDA events recorded after each optimizer step (no extra synchronisation; the GPU
timeline includes any time the GPU waited for the host), read once at the end. Each rank writes its step
times, peak GPU memory (`torch.cuda.max_memory_allocated`) and host memory (VmRSS/VmHWM) to
`--timing-file` with `{rank}` replaced.

    torchrun --nproc-per-node 2 benchmarks/gpu/workload.py --hidden 512 --layers 4 --seq 128 --batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self._mask = None

    def forward(self, x):
        seq = x.shape[1]
        if self._mask is None or self._mask.shape[0] != seq or self._mask.device != x.device:
            self._mask = torch.triu(torch.full((seq, seq), float("-inf"), device=x.device), diagonal=1)
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=self._mask, is_causal=True, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class CausalLM(nn.Module):
    def __init__(self, hidden: int, layers: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Embedding(max_seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def loss_of(model, data):
    """The training loss of one batch of tokens: bf16 autocast forward, float32 cross-entropy."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(data[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), data[:, 1:].reshape(-1))


def _memory_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def _cpu_set(spec: str) -> set[int]:
    """'4-7,12' -> {4, 5, 6, 7, 12}."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _probe_stats() -> dict | None:
    """What trainscout's probe in this process did (when `trainscout run` attached one): proof that its
    checks ran during the timed steps, for the benchmark's raw rows."""
    probe = getattr(sys.modules.get("trainscout.probe.probe"), "_probe", None)
    if probe is None:
        return None
    out: dict = {"step": probe.step}
    try:
        out["error_text"] = bytes(probe.writer.header["error_text"]).rstrip(b"\0").decode(errors="replace")
    except Exception:
        pass
    nf, sc, gc = probe.nonfinite, probe.state_check, probe.gather_check
    if nf is not None:
        out["nonfinite"] = {
            "device_checks": nf.device_checks,
            "counts_error": getattr(nf, "counts_error", None),
            "spent_s": nf.spent_s,
        }
    if sc is not None:
        dev = getattr(sc, "_device", None)
        out["state"] = {
            "stride": sc.stride,
            "spent_s": sc.spent_s,
            "published": dev.published if dev is not None else None,
        }
    if gc is not None and gc.modules:
        results = getattr(gc, "_results", None)
        out["gather"] = {
            "modules": gc.modules,
            "stride": gc.stride,
            "spent_s": gc.spent_s,
            "submitted": results.inflight.submitted if results is not None else 0,
            "dropped": gc.dropped,
            "published": gc.published,
            "error": gc.error,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=0, help="default: hidden / 64")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard per block) instead of DDP")
    ap.add_argument("--scout", action="store_true", help="enable lm-resiliency SCOUT (the peer tool)")
    ap.add_argument("--timing-file", default="")
    ap.add_argument(
        "--pin-cpus",
        default="",
        help="CPU sets per local rank, ';'-separated (e.g. '4-7;8-11'): each rank keeps to its own "
        "cores, so runs of different sides see the same placement",
    )
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.pin_cpus:
        os.sched_setaffinity(0, _cpu_set(args.pin_cpus.split(";")[local_rank]))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    with device:
        model = CausalLM(args.hidden, args.layers, args.heads or max(1, args.hidden // 64), args.seq)
    if args.fsdp:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    handle = None
    if args.scout:
        from lm_resiliency import ReplayHarnessConfig, enable_resiliency

        # GEMINI in-memory checkpointing (enable_checkpoint, on by default) pairs ranks across nodes and
        # raises on one 2-GPU node (world size must be a multiple of 2 x GPUs per node): SCOUT only.
        handle = enable_resiliency(
            model,
            opt,
            interval=5,
            enable_detection=True,
            enable_checkpoint=False,
            replay=ReplayHarnessConfig(check_interval=5, rotate_layers=True),
        )

    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    total = args.warmup + args.steps
    events = [torch.cuda.Event(enable_timing=True) for _ in range(total + 1)]
    events[0].record()
    t_start = time.perf_counter()
    host_t = [t_start]  # host clock after each step's launches: a host-bound step shows here first
    for step in range(1, total + 1):
        data = torch.randint(0, VOCAB, (args.batch, args.seq + 1), device=device, generator=gen)
        loss = loss_of(model, data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        events[step].record()
        host_t.append(time.perf_counter())
        if step % 10 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - t_start
    step_ms = [events[i].elapsed_time(events[i + 1]) for i in range(args.warmup, total)]
    result = {
        "rank": rank,
        "args": vars(args),
        "step_ms": step_ms,
        "host_step_ms": [1000 * (host_t[i + 1] - host_t[i]) for i in range(args.warmup, total)],
        "cpus": sorted(os.sched_getaffinity(0)),
        "wall_s_all_steps": wall_s,
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
        "params": sum(p.numel() for p in model.parameters()),
        **_memory_kb(),
        "trainscout": _probe_stats(),
    }
    if args.timing_file:
        with open(args.timing_file.replace("{rank}", str(rank)), "w") as fh:
            json.dump(result, fh)
    del handle
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
