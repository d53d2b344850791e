"""Experiment for a later design of the non-finite check: where its GPU time goes on a GPU-bound step.

One process, one GPU, 1-rank DDP of benchmarks/gpu/workload.py's model; interleaved blocks of 15 steps in three
modes: `none`; `end` = one counting kernel over all local gradients at the end of backward on the training
stream (what the probe does); `overlap` = gradients grouped in arrival order (post-accumulate-grad hooks) and
each group counted on a side stream while backward goes on, the training stream waiting for the side stream
at the end of backward (before DDP overwrites the gradients). Prints the median step time per mode and the
host time spent per step in the hooks and the end-of-backward callback.

    python3 -m benchmarks gpu overlap HIDDEN LAYERS SEQ BATCH GROUP_MIB
    python3 -m benchmarks gpu overlap 2048 12 1024 8 64
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks._common import free_port
from benchmarks.gpu import workload as gw

from trainscout.probe import nonfinite_cuda as nc
from trainscout.probe.device_results import DeviceResults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("hidden", "layers", "seq", "batch"):
        ap.add_argument(name, type=int, help="the model's size (gpu/workload.py)")
    ap.add_argument("group_mib", type=int, help="MiB of gradients counted together on the side stream")
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    hidden, layers, seq, batch = args.hidden, args.layers, args.seq, args.batch
    GROUP_BYTES = args.group_mib << 20
    torch.manual_seed(0)
    with dev:
        model = gw.CausalLM(hidden, layers, max(1, hidden // 64), seq)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    params = [p for p in model.parameters()]
    gen = torch.Generator(device=dev).manual_seed(0)
    results = DeviceResults(torch.float32, depth=64)
    side = torch.cuda.Stream()
    state = {"mode": "none", "order": [], "groups": None, "layouts": {}, "pending": [], "bytes": 0, "learn": True}
    train_stream = torch.cuda.current_stream()
    host_us = []

    def launch(tensors, key, stream):
        lay = state["layouts"].get(key)
        if lay is None:
            lay = state["layouts"][key] = nc.Layout(tensors)  # its tables are copied on the current stream
        if stream is side:  # after the layout's upload and the gradients' producers
            ev = torch.cuda.Event()
            ev.record(train_stream)
            side.wait_event(ev)
        slot = results.take(dev, getattr(lay, "n_values", lay.n_out))
        if slot is None:
            return
        with torch.cuda.stream(stream):
            nc.enqueue(lay, [t.data_ptr() for t in tensors], slot.device, slot)
            results.submit(slot, getattr(lay, "n_values", lay.n_out), key)

    def hook(p):
        if state["learn"]:
            state["order"].append(p)
            return
        if state["mode"] != "overlap":
            return
        t0 = time.perf_counter()
        state["pending"].append(p)
        state["bytes"] += p.grad.nbytes
        if state["bytes"] >= GROUP_BYTES:
            flush_group()
        host_us.append(time.perf_counter() - t0)

    def flush_group():
        ps = state["pending"]
        if not ps:
            return
        launch([q.grad for q in ps], tuple(id(q) for q in ps), side)
        state["pending"], state["bytes"] = [], 0

    def end_of_backward():
        t0 = time.perf_counter()
        if state["mode"] == "end":
            launch([q.grad for q in params], "all", train_stream)
        elif state["mode"] == "overlap":
            flush_group()
            train_stream.wait_stream(side)
        host_us.append(time.perf_counter() - t0)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def step():
        data = torch.randint(0, gw.VOCAB, (batch, seq + 1), device=dev, generator=gen)
        loss = gw.loss_of(ddp, data)
        loss.grad_fn.register_prehook(
            lambda g: torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        results.ready()

    for _ in range(3):
        step()
    state["learn"] = False
    for m in ("end", "overlap"):
        state["mode"] = m
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    times = {m: [] for m in ("none", "end", "overlap")}
    hosts = {m: [] for m in times}
    for b in range(6):
        for m in ("none", "end", "overlap") if b % 2 == 0 else ("overlap", "end", "none"):
            state["mode"] = m
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            host_us.clear()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(15):
                step()
            e.record()
            torch.cuda.synchronize()
            times[m].append(s.elapsed_time(e) / 15)
            hosts[m].append(sum(host_us) / 15 * 1e6)
    base = statistics.median(times["none"])
    gb = sum(p.numel() * 4 for p in params) / 1e9
    print(
        f"model {hidden}/{layers}/{seq}/{batch}: {gb:.2f} GB of fp32 gradients; group {GROUP_BYTES >> 20} MiB; groups per step ~{max(1, int(gb * 1e9 // GROUP_BYTES))}"
    )
    for m in times:
        med = statistics.median(times[m])
        print(
            f"{m:8s} step ms median {med:.3f} ({med / base - 1:+.2%}) blocks {[round(t, 2) for t in times[m]]} host us/step in hooks {statistics.median(hosts[m]):.0f}"
        )
    print("results submitted", results.inflight.submitted, "dropped", results.inflight.dropped)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
