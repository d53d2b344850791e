"""The probe's cost on the training thread, inside one process: the same training steps with its hooks on and off.

Everything the probe adds to a step on the training thread goes through functions it patched and hooks it
registered (the collective wrappers, the backward and DataLoader wrappers, the optimizer-step hooks and the
checks they run). This script starts the probe as the bootstrap does, trains the demo model as a 1-rank gloo
DDP job (the demo's own step: forward, backward, AdamW, a logged-loss all-reduce), and alternates blocks of
steps with the probe's patches in place and with the original functions put back, reading the training
thread's CPU time around each step. Both sides share one process, its memory layout and the machine's
moment, so differences of a few microseconds a step show. Not measured here: the probe's own thread (Flight
Recorder reads) and the agent and coordinator; `overhead sliced` measures the whole job.

    .venv/bin/python -m benchmarks overhead probe --blocks 20 --block-steps 50
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import sys
import time
from pathlib import Path

from benchmarks._common import append_results, begin, command_line, fmt, free_port, markdown_table, median


def start_probe() -> object:
    """What the bootstrap does in a rank, before torch is imported (the patches are post-import hooks)."""
    run_id = f"probecost-{os.getpid()}"
    os.environ.update(
        TRAINSCOUT_RUN_ID=run_id,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")  # as `trainscout run` sets it
    from trainscout.probe import probe

    return probe.start()


def patches() -> tuple[list[tuple[object, str, object, object]], list]:
    """(owner, attribute, patched, original) of each function the probe replaced, and its global optimizer
    hook tables (emptied while the probe is off)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.utils.data.dataloader as dl
    from torch.optim import optimizer as optim_mod

    def original(fn):
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        return fn

    found = []
    for owner, name in ((torch.autograd, "backward"), (dl._BaseDataLoaderIter, "__next__")):
        fn = getattr(owner, name)
        if hasattr(fn, "__wrapped__"):
            found.append((owner, name, fn, original(fn)))
    for name, fn in list(vars(c10d).items()):
        if getattr(fn, "__trainscout_wrapped__", False):
            found.append((c10d, name, fn, original(fn)))
            if getattr(dist, name, None) is fn:
                found.append((dist, name, fn, original(fn)))
    hooks = [optim_mod._global_optimizer_pre_hooks, optim_mod._global_optimizer_post_hooks]
    return found, hooks


PARTS = ("collectives", "backward", "dataloader", "optimizer")


def part_of(owner, name: str) -> str:
    if name == "backward":
        return "backward"
    if name == "__next__":
        return "dataloader"
    return "collectives"


def set_probe(on: bool, found, hook_tables, saved: list, parts=PARTS) -> None:
    """Patches of `parts` in place (on) or all originals back (off); saved keeps the optimizer hooks."""
    for owner, name, patched, orig in found:
        setattr(owner, name, patched if on and part_of(owner, name) in parts else orig)
    if not saved:
        saved[:] = [list(t.items()) for t in hook_tables]
    for table, items in zip(hook_tables, saved):
        table.clear()
        if on and "optimizer" in parts:
            table.update(items)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--blocks",
        type=int,
        default=20,
        help="rounds; each runs a block with the probe off, on, and (--parts) each part alone, "
        "in random order (default 20)",
    )
    parser.add_argument("--block-steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument(
        "--parts", action="store_true", help="also each group of patches alone against none: " + ", ".join(PARTS)
    )
    parser.add_argument("--label", default="")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    out, info, up_before = begin("probe-cost", args.out_dir)
    probe = start_probe()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from trainscout.demo.model import GPTConfig, TinyGPT
    from trainscout.demo.train import ArithmeticTokens, batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = DistributedDataParallel(TinyGPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = ArithmeticTokens(size=4096, seq=cfg.seq, vocab=cfg.vocab, seed=0)
    loader = DataLoader(
        data, batch_size=8, sampler=DistributedSampler(data, 1, 0, shuffle=True, seed=0), num_workers=0, drop_last=True
    )
    it = batches(loader, loader.sampler)

    def step() -> float:
        c0 = time.thread_time()
        inputs, targets = next(it)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.SUM)
        return time.thread_time() - c0

    for _ in range(args.warmup):
        step()
    found, hook_tables = patches()
    saved: list = []
    rng = random.Random(0)

    configs = {"all": PARTS, **({part: (part,) for part in PARTS} if args.parts else {})}
    results = {name: ([], []) for name in configs}  # name -> (per round: on - off, off)
    for _ in range(args.blocks):  # a round: every configuration and all-off, in random order
        order = ["off", *configs]
        rng.shuffle(order)
        got = {}
        for name in order:
            set_probe(name != "off", found, hook_tables, saved, configs.get(name, ()))
            times = [step() for _ in range(args.block_steps)]
            got[name] = median(times[2:])
        for name in configs:
            results[name][0].append(got[name] - got["off"])
            results[name][1].append(got["off"])
    set_probe(True, found, hook_tables, saved)
    up_after = time.strftime("%H:%M:%S")
    costs = probe.costs()
    dist.destroy_process_group()
    for path in glob.glob(f"/dev/shm/trainscout-{os.environ['TRAINSCOUT_RUN_ID']}-*"):
        os.unlink(path)

    rows = [["patched functions", str(len(found)), "", ""]]
    for what, (pairs, offs) in results.items():
        diffs = sorted(1e6 * d for d in pairs)
        off_us = 1e6 * median(offs)
        boot = sorted(median(rng.choices(diffs, k=len(diffs))) for _ in range(4000))
        lo, hi = boot[100], boot[3899]
        label = "the probe's cost a step" if what == "all" else f"{what} patches alone"
        rows.append(
            [
                label + " (median over rounds of on - off)",
                fmt(median(diffs), 1),
                "us",
                f"{100 * median(diffs) / off_us:+.2f} % of {off_us:.0f} us (95 %: {lo:+.1f} to {hi:+.1f} us)",
            ]
        )
    for name, sec in (
        ("non-finite check", costs.get("nonfinite", {}).get("seconds")),
        ("state check", costs.get("state_check", {}).get("seconds")),
        ("replay", costs.get("replay", {}).get("seconds")),
    ):
        if sec is not None and costs.get("steps"):
            rows.append([f"of which {name} (probe's own accounting)", fmt(1e6 * sec / costs["steps"], 1), "us", ""])
    table = markdown_table(["what", "value", "unit", "note"], rows)
    print(table)
    if not args.no_record:
        body = (
            f"- 1 rank (gloo, world size 1), demo model, {args.blocks} rounds of {args.block_steps}-step blocks "
            f"per configuration in random order, first 2 steps of a block dropped; uptime before `{up_before}`, done "
            f"{up_after}\n\n{table}\n"
        )
        title = "Probe cost on the training thread, in-process A/B (python -m benchmarks overhead probe)" + (
            f": {args.label}" if args.label else ""
        )
        append_results(title, info, command_line().replace(str(out), "<out-dir>"), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
