"""DeepSpeed: the data-parallel group's role depends on the ZeRO stage.

Stages 0-2 keep a full copy of the parameters on every data-parallel rank (stage 1 shards the optimizer
state, stage 2 the gradients too): its members are `replicate` peers for the parameters. Stage 3 shards
the parameters themselves: no member holds another's shard (`shard`). For stages 0-2 the module goes to
the replicated-state check, parameters only (the optimizer's fp32 partitions differ by rank); the check
runs at the optimizer step hook, before DeepSpeed all-gathers the new values, so it compares the copies
each replica used in that step's forward and backward. Read from the engine
`deepspeed.initialize` returns; the comm layer itself needs nothing here (its collectives are the
wrapped torch.distributed ones, patched before DeepSpeed imports them).
"""

from __future__ import annotations


def wrap_initialize(module, declare, on_error) -> None:
    from trainscout.integrations import after

    real = getattr(module, "initialize", None)
    if real is None or getattr(real, "__trainscout_wrapped__", False):
        return

    def learn(result, _args, _kwargs) -> None:
        engine = result[0] if isinstance(result, tuple) else result
        stage = int(engine.zero_optimization_stage())
        group = getattr(engine, "data_parallel_group", None)
        if group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        if stage == 3:
            declare(group, "shard", f"DeepSpeed ZeRO-{stage}")
        else:  # parameters replicated, optimizer state (and gradients) sharded: compare parameters only
            declare(group, "replicate", f"DeepSpeed ZeRO-{stage}", module=engine.module, params_only=True)
        mp = getattr(engine, "mp_world_size", 1) or 1
        if mp > 1 and getattr(engine, "mpu", None) is not None:
            declare(engine.mpu.get_model_parallel_group(), "tensor", "DeepSpeed (mpu)")

    module.initialize = after(real, learn, on_error, "DeepSpeed")
