"""Framework integrations: learn from the frameworks' own set-up calls what each process group is for.

The probe sees every collective and every group, but a group's members say nothing of its purpose:
whether its members hold the same parameters (data-parallel replicas), shards of them, or slices of a
tensor-parallel layer. Each integration wraps one framework's set-up call at import (DDP's constructor,
FSDP2's `fully_shard`, DTensor's `parallelize_module`, `deepspeed.initialize`, Megatron-Core's
`initialize_model_parallel`) and, once it returned, declares the roles of the groups it used. Nothing
in the training script changes and no collective is added; a failure disables that integration only.
The roles travel with the probe's group table to the coordinator, which derives the job's topology
(`topology.py`). Where a framework keeps replicas the probe does not learn from DDP (HSDP's replicate
groups, ZeRO-1/2's data-parallel group), the integration also hands the module to the replicated-state
check, so those replicas are fingerprinted and compared like DDP's.
"""

from __future__ import annotations

from typing import Callable

from trainscout.markers import DRILL_GROUP_ROLE, PROBE_GROUP_ROLE

Declare = Callable[..., None]  # (process group, role, framework, module=None, params_only=False)


def install(hooks, declare: Declare, on_error: Callable[[str], None]) -> None:
    """Register every integration's post-import hook (hooks: the probe's PostImportHooks)."""
    from trainscout.integrations import deepspeed_zero, megatron, torch_parallel

    def guarded(fn, what: str):
        def run(module) -> None:
            try:
                fn(module, declare, on_error)
            except Exception as exc:  # fail open: the job runs as if the integration were absent
                on_error(f"{what} integration disabled: {exc!r}")

        return run

    hooks.on_import("torch.nn.parallel", guarded(torch_parallel.wrap_ddp, "DDP"))
    hooks.on_import("torch.distributed.fsdp._fully_shard", guarded(torch_parallel.wrap_fully_shard, "FSDP2"))
    hooks.on_import("torch.distributed.tensor.parallel", guarded(torch_parallel.wrap_parallelize, "DTensor TP"))
    hooks.on_import("deepspeed", guarded(deepspeed_zero.wrap_initialize, "DeepSpeed"))
    hooks.on_import("megatron.core.parallel_state", guarded(megatron.wrap_initialize, "Megatron-Core"))


def install_in_probe(probe) -> None:
    """Install the integrations for a started probe: roles go into its group table, errors into its header."""
    from trainscout.probe.import_hooks import hooks

    publisher = probe.publisher

    def declare(group, role: str, framework: str, module=None, params_only: bool = False) -> None:
        """module: the replicated model, when role is `replicate` and the probe should compare its state;
        params_only: only its parameters are replicated (the optimizer's state is sharded)."""
        _mark_side_groups(probe)  # the probe's own groups are no part of the job's topology
        publisher.set_role(group, role, framework)
        if role == "replicate" and module is not None:
            probe.param_names.update({id(p): n for n, p in module.named_parameters()})
            if probe.state_check is not None:
                probe.state_check.learn_model(module, str(group.group_name), params_only=params_only)

    install(hooks(), declare, probe.report_error)
    earlier = publisher.on_tick

    def on_tick() -> None:  # jobs no integration sees still get the side groups marked
        if earlier is not None:
            earlier()
        _mark_side_groups(probe)

    publisher.on_tick = on_tick


def _mark_side_groups(probe) -> None:
    """Groups the probe created beside the job's own (replay, link probes), and the fault injector's (pg desync)."""
    drill = getattr(getattr(probe, "injector", None), "_side_group", None)
    own = [getattr(probe, "_side_group", None), *getattr(probe, "_replica_groups", {}).values()]
    for group, role in [*((g, PROBE_GROUP_ROLE) for g in own), (drill, DRILL_GROUP_ROLE)]:
        if group is not None and hasattr(group, "group_name"):
            probe.publisher.set_role(group, role, "trainscout")


def after(real: Callable, learn: Callable, on_error: Callable[[str], None], what: str) -> Callable:
    """`real` wrapped so that learn(result, args, kwargs) runs after it; learn never raises into the caller."""
    import functools

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        try:
            learn(result, args, kwargs)
        except Exception as exc:
            on_error(f"{what} topology not learned: {exc!r}")
        return result

    wrapper.__trainscout_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper
