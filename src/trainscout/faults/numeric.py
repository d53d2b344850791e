"""Numerical faults: corrupt one rank's replicated state, or make its values non-finite, on cue.

They model silent data corruption (a bit flip in a parameter or in optimizer state, a scaled or
overwritten slice) and the birth of a NaN on one rank, so the replicated-state and non-finite-origin
checks can be shown and tested on unmodified scripts. Applied from the optimizer post-step hook, with
the optimizer at hand; tensors are chosen by name (`tensor=`) or else the largest parameter, and within a
tensor one element (element 0) or a seeded random fraction (`frac=`) of its elements.
"""

from __future__ import annotations


def _pick(optimizer, names: dict[int, str], wanted: str, target: str, key: str = ""):
    """(label, tensor) to corrupt: a parameter, or its optimizer-state tensor `key` (default: the first key,
    sorted, holding more than one element: exp_avg for Adam)."""
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
    if key:
        v = state.get(key)
        if not hasattr(v, "numel") or v.numel() == 0:
            raise ValueError(
                f"parameter {name!r} has no optimizer state tensor {key!r} "
                f"(have: {', '.join(sorted(map(str, state))) or 'none yet'})"
            )
        return f"{name}:{key}", v.to_local() if hasattr(v, "to_local") else v
    for key in sorted(state):
        v = state[key]
        if hasattr(v, "numel") and v.numel() > 1:
            return f"{name}:{key}", v.to_local() if hasattr(v, "to_local") else v
    raise ValueError(f"parameter {name!r} has no optimizer state tensor yet")


# The highest exponent bit per float width: flipping it scales a small value by 2**(2**(exponent bits - 1)),
# the classic silent-data-corruption bit.
_TOP_EXPONENT_BIT = {
    "float32": ("int32", 30),
    "float16": ("int16", 14),
    "bfloat16": ("int16", 14),
    "float64": ("int64", 62),
}


def _chosen_elements(flat, frac: float):
    """Indexes to corrupt: element 0 alone (frac=0), else round(frac * numel) (at least one) elements drawn by a
    seeded randperm, so a rerun corrupts the same ones."""
    import torch

    if not frac:
        return torch.zeros(1, dtype=torch.long, device=flat.device)
    count = max(1, round(frac * flat.numel()))
    perm = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:count]
    return perm.to(flat.device)


def _flip_bits(flat, idx, bit: int, int_name: str) -> None:
    import torch

    as_int = flat.view(getattr(torch, int_name))
    as_int[idx] ^= 1 << bit


def _flip_top_exponent_bit(flat, idx, label: str) -> None:
    width = _TOP_EXPONENT_BIT.get(str(flat.dtype).removeprefix("torch."))
    if width is None:
        raise ValueError(f"expflip supports float64/32/16 and bfloat16 tensors, {label} is {flat.dtype}")
    _flip_bits(flat, idx, width[1], width[0])


def exponent_flipped(tensor):
    """A copy of `tensor` whose largest element has the top bit of its exponent flipped: a value under 2 in
    magnitude becomes ~2**128 times larger (float32: up to ~3e38, finite), the one-element SDC of a gradient."""
    out = tensor.detach().clone()
    flat = out.view(-1)
    _flip_top_exponent_bit(flat, flat.abs().argmax().reshape(1), "the gradient")
    return out


def corrupt(optimizer, names: dict[int, str], params: dict) -> str:
    import torch

    target = params.get("target", "param")
    label, t = _pick(optimizer, names, params.get("tensor", ""), target, params.get("key", ""))
    flat = t.view(-1)
    how = params.get("how", "bitflip")
    frac = float(params.get("frac", 0.0))
    with torch.no_grad():
        if how in ("pct1", "pct100"):
            count = flat.numel() if how == "pct100" else max(1, flat.numel() // 100)
            idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:count]
            flat[idx] = flat[idx] * 2.0 + 1.0
            return f"{how} in {label}"
        idx = _chosen_elements(flat, frac)
        if how == "bitflip":
            if flat.dtype != torch.float32:
                raise ValueError(f"bitflip supports float32 tensors, {label} is {flat.dtype}")
            _flip_bits(flat, idx, 20, "int32")  # one mantissa bit
        elif how == "expflip":
            _flip_top_exponent_bit(flat, idx, label)
        elif how == "signflip":
            flat[idx] = -flat[idx]
        elif how == "sign":
            values = flat[idx]
            flat[idx] = torch.where(values != 0, -values, torch.ones_like(values))
        elif how == "scale":
            flat[idx] = flat[idx] * float(params.get("factor", 1e3))
        else:
            raise ValueError(f"unknown how={how!r}")
    # Without frac the line stays what it always was: tests and benchmarks match it.
    return f"{how} in {label} ({len(idx)} of {flat.numel()} elements)" if frac else f"{how} in {label}"


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
