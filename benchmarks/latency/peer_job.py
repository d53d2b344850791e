"""The job an independent fault tool attacks: the demo's tiny GPT in a 4-rank gloo DDP loop, with lm-resiliency's
fault campaign (the peer's injector) enabled in the script the way its users enable it, from one fault in env
PEER_FAULT (JSON: type, surface, module, params, at, every, life, rank; empty: no campaign). trainscout is not
imported here: it attaches from outside (`trainscout run`), as to any job.

    torchrun --nproc-per-node 4 benchmarks/latency/peer_job.py STEPS [cpu|cuda]

On `cuda` every rank computes on the one GPU (cuda:0) and the gradients are reduced over gloo: the CUDA code paths
with three or more replicas on a one-GPU machine.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trainscout.demo.model import GPTConfig, TinyGPT


def campaign_of(fault: dict, steps: int) -> dict:
    """One incident on one rank: from iteration `at`, for good (life 0), for `life` iterations, or until a
    named event ("recovery"); `every` N iterations from `at` for intermittent faults."""
    target = {"surface": fault["surface"], "rank": fault.get("rank", 2), "module_path": fault["module"]}
    every = fault.get("every", 0)
    trigger = {"range": {"start": fault["at"], "end": steps, "every": every}} if every else {"at": [fault["at"]]}
    life = fault.get("life", 0)
    if life == 0:
        lifetime: dict = {"until": "campaign_end"}
    else:
        lifetime = {"until": life} if isinstance(life, str) else {"iterations": life}
    incident = {
        "incident_id": "i",
        "trigger": trigger,
        "lifetime": lifetime,
        "retrigger": "once",
        "faults": [{"fault_id": "f", "type": fault["type"], "target": target, "parameters": fault.get("params", {})}],
    }
    if every:
        incident.update(retrigger="max_occurrences", max_occurrences=steps)
    return {"name": "benchmark", "incidents": [incident]}


def batch(step: int, rank: int, cfg: GPTConfig, size: int = 8) -> torch.Tensor:
    """Repeated motifs: a learnable language, different on every rank and step."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    period = int(torch.randint(2, 6, (1,), generator=g))
    motif = torch.randint(0, cfg.vocab, (size, period), generator=g)
    return motif.repeat(1, cfg.seq // period + 1)[:, : cfg.seq]


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    device = torch.device("cuda", 0) if len(sys.argv) > 2 and sys.argv[2] == "cuda" else torch.device("cpu")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig()
    net = TinyGPT(cfg).to(device)
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fault = json.loads(os.environ.get("PEER_FAULT") or "{}")
    session = None
    if fault:
        from lm_resiliency.fault_injection import FaultCampaign, enable_fault_injection

        session = enable_fault_injection(net, opt, campaign=FaultCampaign.from_dict(campaign_of(fault, steps)))
    t0, announced = time.time(), 0
    for step in range(1, steps + 1):
        ids = batch(step, rank, cfg).to(device)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f} {time.time() - t0:.1f}s", flush=True)
        if session is not None and len(session.records) > announced:  # the runs stop once named: say it at once
            for record in session.records[announced:]:
                print("peer injection:", json.dumps(record.to_dict(), default=str), flush=True)
            announced = len(session.records)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
