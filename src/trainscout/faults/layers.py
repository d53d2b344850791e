"""Which module a layer fault (delay, gradnoise, outflip) attaches to, by name or by default the first block.

The default has to find "the first transformer block" in models we have never seen: the first module named
`<container>.0` whose parent is a ModuleList or Sequential (blocks.0, layers.0, h.0, or 0 of a Sequential model);
a model with no such container gets the fault on the whole model.
"""

from __future__ import annotations

from typing import Any


def find_layer(model: Any, wanted: str) -> tuple[str, Any]:
    """(name, module) of layer `wanted` ("" = the first block) in `model`; ValueError says what exists."""
    if model is None:
        raise ValueError("no model seen (a layer fault needs the DistributedDataParallel model)")
    modules = dict(model.named_modules())
    if wanted:
        if wanted not in modules:
            have = ", ".join(name for name in list(modules)[1:9])
            raise ValueError(f"no layer named {wanted!r} (have: {have} ...)")
        return wanted, modules[wanted]
    return first_block(model)


def first_block(model: Any) -> tuple[str, Any]:
    from torch import nn

    modules = dict(model.named_modules())
    for name, module in modules.items():
        parent, _, leaf = name.rpartition(".")
        if leaf == "0" and isinstance(modules.get(parent), (nn.ModuleList, nn.Sequential)):
            return name, module
    return "", model


def describe_layer(name: str) -> str:
    return f"layer {name}" if name else "the whole model"
