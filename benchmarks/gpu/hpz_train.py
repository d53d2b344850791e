"""A small GPT under DeepSpeed ZeRO-3, with or without ZeRO++ hpZ: the workload of `python -m benchmarks gpu hpz`.

One rank of `torchrun --nproc-per-node N benchmarks/gpu/hpz_train.py ...`. An ordinary training script
(pre-norm blocks, causal attention written out, bf16, AdamW, fixed random tokens per rank and step) plus what the
hpZ benchmark needs from inside the job:

- `--fix event|off|unsafe`: the secondary-partition mode (probe/hpz_fix.py). Without `trainscout run`
  the script installs the fix itself before DeepSpeed is imported; under `trainscout run` the probe
  does (TRAINSCOUT_HPZ_FIX) and the script only reads it.
- `--delay-ms`: a compute-stream sleep (`torch.cuda._sleep`) before every secondary copy, which makes the
  race deterministic: the host enqueues the backward all-gather while the copy still waits on the GPU.
- `--truth`: ground truth, independent of trainscout. Before each forward release the gathered weights
  are cloned; after each backward fetch from the secondary partitions they are compared on the GPU
  (no host sync inside the step); the count of corrupted parameter gathers is read after each step.
- `--bench-rounds R --bench-steps K`: throughput, with the modes unsafe / host stall / event-ordered
  interleaved in blocks of K steps, R rounds, one process (same model, data and allocator state);
  blocks are timed with CUDA events after a device sync at block boundaries.

Writes one JSON per rank 0 to `--out`: per-step losses, corrupted-gather counts, throughput blocks.
Runs on CPU too (`--device cpu`, DeepSpeed's CPU accelerator over gloo) to try the flow without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--hpz", type=int, default=2, help="zero_hpz_partition_size (1 = plain ZeRO-3)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--fix", choices=["event", "off", "unsafe"], default="event")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--truth", action="store_true")
    ap.add_argument("--reuse-distance", type=float, default=0)
    ap.add_argument("--max-live", type=float, default=1e6)
    ap.add_argument("--persistence-threshold", type=float, default=1e5, help="DeepSpeed's default")
    ap.add_argument("--bench-rounds", type=int, default=0)
    ap.add_argument("--bench-steps", type=int, default=10)
    ap.add_argument("--bench-modes", default="unsafe,off,event")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        # explicit attention: its backward is plain matmuls (the fused kernels' backward is not bitwise
        # reproducible, and the comparison with ZeRO-3 without hpZ is bit for bit)
        att = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        a = att.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def install_fix(mode: str):
    """The hpZ fix of this process: the probe's under `trainscout run`, else installed here."""
    from trainscout.probe import hpz_fix
    from trainscout.probe.import_hooks import hooks

    if os.environ.get("TRAINSCOUT_RUN_ID"):
        return hpz_fix.current()  # the probe installed it from TRAINSCOUT_HPZ_FIX
    return hpz_fix.install(hooks(), "event" if mode == "off" else mode)  # "off" is switched at run time


class Truth:
    """Counts parameter gathers whose backward weights differ from forward's, on the GPU, read per step."""

    def __init__(self, device) -> None:
        self.saved: dict[int, torch.Tensor] = {}
        self.bad = torch.zeros((), dtype=torch.int64, device=device)
        self.compared = torch.zeros((), dtype=torch.int64, device=device)

    def wrap(self) -> None:
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

        truth = self
        real_fwd = DeepSpeedZeRoOffload.post_sub_module_forward_function
        real_bwd = DeepSpeedZeRoOffload.pre_sub_module_backward_function

        def post_forward(offload, sub_module):
            if sub_module.training:
                for p in sub_module.parameters(recurse=False):
                    if not getattr(p, "ds_persist", True) and p.numel() == p.ds_numel:
                        truth.saved[id(p)] = p.data.detach().clone()
            return real_fwd(offload, sub_module)

        def pre_backward(offload, sub_module):
            result = real_bwd(offload, sub_module)
            for p in sub_module.parameters(recurse=False):
                ref = truth.saved.pop(id(p), None)
                if ref is not None and getattr(p, "ds_secondary_tensor", None) is not None:
                    truth.bad += (p.data != ref).any().to(torch.int64)
                    truth.compared += 1
            return result

        DeepSpeedZeRoOffload.post_sub_module_forward_function = post_forward
        DeepSpeedZeRoOffload.pre_sub_module_backward_function = pre_backward

    def take(self) -> tuple[int, int]:
        bad, compared = int(self.bad.item()), int(self.compared.item())
        self.bad.zero_()
        self.compared.zero_()
        self.saved.clear()
        return bad, compared


def add_delay(ms: float) -> None:
    """A compute-stream sleep before every secondary copy (the copy runs late; the host does not wait)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 * ms / max(start.elapsed_time(end), 1e-3))
    real = Init._partition_param_sec

    def _partition_param_sec(init, param, *args, **kwargs):
        if param.ds_status.name == "AVAILABLE":
            torch.cuda._sleep(cycles)
        return real(init, param, *args, **kwargs)

    Init._partition_param_sec = _partition_param_sec


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    fix = install_fix(args.fix) if args.hpz > 1 else None
    import deepspeed

    if not cuda:  # the CPU accelerator would compile a shared-memory extension first (minutes)
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.delay_ms > 0 and cuda:
        add_delay(args.delay_ms)
    truth = Truth(device) if args.truth else None
    if truth is not None:
        truth.wrap()
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "stage3_max_reuse_distance": args.reuse_distance,
        "stage3_max_live_parameters": args.max_live,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": args.persistence_threshold,
    }
    if args.hpz > 1:
        zero["zero_hpz_partition_size"] = args.hpz
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "steps_per_print": 1_000_000,
        "zero_optimization": zero,
        "bf16": {"enabled": cuda},
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(1234)
    model = GPT(args.vocab, args.seq, args.hidden, args.heads, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if fix is not None and not os.environ.get("TRAINSCOUT_RUN_ID"):
        fix.mode = args.fix

    def batch_for(step: int):
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)

    def train_step(tokens):
        logits = engine(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, args.vocab).float(), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        return loss

    result = {
        "args": vars(args),
        "world": world,
        "losses": [],
        "corrupted": [],
        "compared": [],
        "blocks": [],
        "fix": fix.describe() if fix is not None else "no hpZ",
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
    }
    t0 = time.perf_counter()
    if args.bench_rounds <= 0:
        for step in range(1, args.steps + 1):
            loss = train_step(batch_for(step))
            result["losses"].append(float(loss.item()))  # a host sync after the step, not inside it
            if truth is not None:
                bad, compared = truth.take()
                result["corrupted"].append(bad)
                result["compared"].append(compared)
    else:
        # Same work in every mode: the unsafe mode's corrupted gathers give non-finite gradient norms, and
        # DeepSpeed then skips the optimizer update (18-34 % of unsafe steps in one run), which shortens
        # those steps for that reason alone. Benchmark blocks therefore always update (the weights may go
        # NaN in unsafe blocks; the arithmetic costs the same). DeepSpeed 0.19's ZeRO-3 layout.
        import deepspeed.runtime.zero.stage3 as stage3

        if hasattr(stage3, "is_invalid_grad_norm"):
            stage3.is_invalid_grad_norm = lambda *a, **k: False
            result["never_skip"] = True
        modes = args.bench_modes.split(",")
        step = 0
        for _ in range(args.warmup):
            step += 1
            train_step(batch_for(step))
        for rnd in range(args.bench_rounds):
            shift = rnd % len(modes)  # rotate the order so no mode always runs first in its round
            for mode in modes[shift:] + modes[:shift]:
                if fix is not None:
                    fix.mode = mode
                if cuda:
                    torch.cuda.synchronize()
                skipped = getattr(engine, "skipped_steps", 0)
                start = time.perf_counter()
                for _ in range(args.bench_steps):
                    step += 1
                    loss = train_step(batch_for(step))
                if cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                tokens = args.bench_steps * args.batch * args.seq * world
                # optimizer steps DeepSpeed skipped on non-finite gradients (corrupted gathers): shorter steps
                skipped = getattr(engine, "skipped_steps", 0) - skipped
                result["blocks"].append(
                    {
                        "round": rnd,
                        "mode": mode,
                        "seconds": seconds,
                        "tokens_per_s": tokens / seconds,
                        "skipped_steps": skipped,
                    }
                )
        if fix is not None:
            fix.mode = "event"
            result["fix"] = fix.describe()
    result["wall_s"] = time.perf_counter() - t0
    if fix is not None:
        result["fix"] = fix.describe()  # what it did over the run (counts)
    if rank == 0 and args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    if rank == 0:
        print(f"hpz_train: done {json.dumps({k: v for k, v in result.items() if k in ('fix', 'wall_s')})}", flush=True)


if __name__ == "__main__":
    main()
