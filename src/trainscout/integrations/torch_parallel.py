"""PyTorch's own parallelisms: DDP (replicas), FSDP2 and HSDP (shards, replicas of shards), DTensor TP.

DDP: every member of its process group holds the whole model (`replicate`). FSDP2: the mesh dimension
it shards over is a `shard` group; with a 2-D mesh (HSDP) the other dimension holds identical shards
(`replicate`). Tensor parallel (`parallelize_module`): the mesh's group holds slices of each layer
(`tensor`). The roles are read from the objects the frameworks build, after their set-up call returns.
"""

from __future__ import annotations


def wrap_ddp(module, declare, on_error) -> None:
    from trainscout.integrations import after

    cls = module.DistributedDataParallel
    real_init = cls.__init__

    def learn(_result, args, _kwargs) -> None:
        ddp = args[0]
        declare(ddp.process_group, "replicate", "DDP")

    cls.__init__ = after(real_init, learn, on_error, "DDP")


def wrap_fully_shard(module, declare, on_error) -> None:
    from trainscout.integrations import after

    real = module.fully_shard
    seen: set[int] = set()  # parameters of the modules sharded so far
    replicas: list = []  # the HSDP replicate group, once one call showed it

    def learn(result, args, kwargs) -> None:
        target = args[0] if args else kwargs.get("module")
        mods = target if isinstance(target, (list, tuple)) else [result if result is not None else target]
        for m in mods:
            state = m._get_fsdp_state()
            group = getattr(state, "_fsdp_param_group", None)
            info = getattr(group, "mesh_info", None)
            if info is not None:
                mesh = info.mesh
                framework = "HSDP" if info.replicate_mesh_dim is not None else "FSDP2"
                declare(mesh.get_group(info.shard_mesh_dim), "shard", framework)
                if info.replicate_mesh_dim is not None and not replicas:
                    replicas.append(mesh.get_group(info.replicate_mesh_dim))
            ids = {id(p) for p in m.parameters()}
            outermost = seen <= ids  # holds every module sharded before it (the root, or the first one)
            seen.update(ids)
            if replicas and outermost:
                # replicas hold equal shards and optimizer state: the state check compares them; parameter
                # names come from the outermost module only (an inner module's names repeat across layers)
                declare(replicas[0], "replicate", "HSDP", module=m)

    module.fully_shard = after(real, learn, on_error, "FSDP2")


def wrap_parallelize(module, declare, on_error) -> None:
    from trainscout.integrations import after

    real = module.parallelize_module

    def learn(_result, args, kwargs) -> None:
        mesh = args[1] if len(args) > 1 else kwargs.get("device_mesh")
        if mesh is None:
            from torch.distributed.device_mesh import _mesh_resources

            mesh = _mesh_resources.get_current_mesh()
        if mesh.ndim == 1:
            declare(mesh.get_group(0), "tensor", "DTensor TP")

    module.parallelize_module = after(real, learn, on_error, "DTensor TP")
