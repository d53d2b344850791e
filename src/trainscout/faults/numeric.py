"""Numerical faults: corrupt one rank's replicated state, or make its values non-finite, on cue.

They model silent data corruption (a bit flip in a parameter or in optimizer state, a scaled or
overwritten slice) and the birth of a NaN on one rank, so the replicated-state and non-finite-origin
checks can be shown and tested on unmodified scripts. Applied from the optimizer post-step hook, with
the optimizer at hand; tensors are chosen by name (`tensor=`) or else the largest parameter.
"""

from __future__ import annotations


def _pick(optimizer, names: dict[int, str], wanted: str, target: str):
    """(label, tensor) to corrupt: a parameter, or its first optimizer-state tensor."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    labelled = [(names.get(id(p), f"param_group0.{i}"), p) for i, p in enumerate(params)]
    if wanted:
        matches = [(n, p) for n, p in labelled if n == wanted]
        if not matches:
            raise ValueError(f"no parameter named {wanted!r} (have: {', '.join(n for n, _ in labelled[:8])} ...)")
        name, p = matches[0]
    else:
        name, p = max(labelled, key=lambda item: item[1].numel())
    if target == "param":
        data = p.data
        return name, data.to_local() if hasattr(data, "to_local") else data  # a DTensor: this rank's shard
    state = optimizer.state.get(p, {})
    for key in sorted(state):
        v = state[key]
        if hasattr(v, "numel") and v.numel() > 1:
            return f"{name}:{key}", v.to_local() if hasattr(v, "to_local") else v
    raise ValueError(f"parameter {name!r} has no optimizer state tensor yet")


def corrupt(optimizer, names: dict[int, str], params: dict) -> str:
    import torch

    label, t = _pick(optimizer, names, params.get("tensor", ""), params.get("target", "param"))
    flat = t.view(-1)
    how = params.get("how", "bitflip")
    with torch.no_grad():
        if how == "bitflip":
            as_int = flat[:1].view(torch.int32) if flat.dtype == torch.float32 else None
            if as_int is None:
                raise ValueError(f"bitflip supports float32 tensors, {label} is {flat.dtype}")
            as_int ^= 1 << 20  # one mantissa bit of element 0
        elif how == "sign":
            flat[0] = -flat[0] if flat[0] != 0 else 1.0
        elif how == "scale":
            flat[0] *= 1e3
        else:
            count = flat.numel() if how == "pct100" else max(1, flat.numel() // 100)
            idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:count]
            flat[idx] = flat[idx] * 2.0 + 1.0
    return f"{how} in {label}"


def make_nonfinite(optimizer, names: dict[int, str], params: dict) -> str:
    """where=param: one parameter element becomes NaN (the next loss is NaN on this rank only);
    where=grad: the next local gradient of one parameter becomes NaN before it is reduced."""
    import torch

    label, p = _pick_param(optimizer, names, params.get("tensor", ""))
    if params.get("where", "param") == "param":
        with torch.no_grad():
            p.data.view(-1)[0] = float("nan")
        return f"NaN in parameter {label}"
    handle = None

    def once(grad):
        # a gradient hook runs before accumulation, so the NaN is in the local gradient the probe checks
        handle.remove()
        poisoned = grad.clone()
        poisoned.view(-1)[0] = float("nan")
        return poisoned

    handle = p.register_hook(once)
    return f"NaN in the next gradient of {label}"


def _pick_param(optimizer, names, wanted):
    params = [p for g in optimizer.param_groups for p in g["params"]]
    labelled = [(names.get(id(p), f"param_group0.{i}"), p) for i, p in enumerate(params)]
    if wanted:
        for n, p in labelled:
            if n == wanted:
                return n, p
        raise ValueError(f"no parameter named {wanted!r}")
    return max(labelled, key=lambda item: item[1].numel())


def perturb(model, params: dict) -> str:
    """From now on, every forward of one layer adds eps to its output on this rank: a device that
    computes wrong, the recurring corruption that replay must catch."""
    if model is None:
        raise ValueError("no model seen (perturb needs a DistributedDataParallel model)")
    wanted = params.get("layer", "")
    modules = dict(model.named_modules())
    if not wanted:
        wanted = next((n for n in modules if n.startswith("blocks.") and n.count(".") == 1), "")
    layer = modules.get(wanted)
    if layer is None or not wanted:
        raise ValueError(f"no layer named {wanted!r}")
    eps = float(params.get("eps", 1e-3))
    layer.register_forward_hook(lambda module, args, out: out + eps)
    return f"layer {wanted} now adds {eps:g} to its output"
