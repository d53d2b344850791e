"""Ranks started without RANK in their environment join the job in their own init_process_group call.

`torch.multiprocessing.spawn` (PyTorch's DDP tutorial), site scripts and notebooks start processes that learn
their rank only when they call `init_process_group(rank=..., world_size=...)`. The bootstrap cannot start the
probe at start-up in them, so it wraps init_process_group as torch.distributed is imported (before
torch.distributed binds its own copy of the name) and starts the probe there, with the rank and world size of the
call, before the group exists: the probe's own patches then see every collective, as in a rank started by
torchrun. Where the call does not say, RANK and WORLD_SIZE set by the script itself serve (env://); where nothing
says (a rank in the init_method's URL), the probe starts once the group exists, from the group's own rank and
size (without replay's side group). A process that never joins a group starts no probe.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable


def attach_at_init(start: Callable[..., Any]) -> None:
    """start(rank=, world_size=) runs once, in this process's first init_process_group call."""
    from trainscout.probe.import_hooks import hooks

    hooks().on_import("torch.distributed.distributed_c10d", lambda c10d: _wrap(c10d, start))


def _wrap(c10d, start: Callable[..., Any]) -> None:
    real = c10d.init_process_group
    started = [False]

    def init_process_group(*args, **kwargs):
        if started[0]:
            return real(*args, **kwargs)
        started[0] = True
        rank, world_size = _int_arg(args, kwargs, 4, "rank"), _int_arg(args, kwargs, 3, "world_size")
        if rank < 0 or world_size < 0:  # env:// with variables the script set itself, or known only once it exists
            rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        before = dict(vars(c10d))
        if rank < 0 or world_size < 0:
            result = real(*args, **kwargs)
            _start(start, c10d.get_rank(), c10d.get_world_size())
            _share_patches(c10d, before)
            return result
        _start(start, rank, world_size)
        _share_patches(c10d, before)
        patched = c10d.init_process_group  # the probe's own wrapper (its side group), around this one
        return (patched if patched is not init_process_group else real)(*args, **kwargs)

    init_process_group.__wrapped__ = real  # type: ignore[attr-defined]
    init_process_group.__doc__ = real.__doc__
    c10d.init_process_group = init_process_group


def _int_arg(args: tuple, kwargs: dict, position: int, name: str) -> int:
    """init_process_group(backend, init_method, timeout, world_size, rank, ...): -1 where not given."""
    value = kwargs.get(name, args[position] if len(args) > position else -1)
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, -1))
    except ValueError:
        return -1


def _start(start: Callable[..., Any], rank: int, world_size: int) -> None:
    try:
        start(rank=rank, world_size=world_size)
    except Exception as exc:  # a broken probe must not stop training
        print(f"trainscout: probe disabled in this rank: {exc!r}", file=sys.stderr)


def _share_patches(c10d, before: dict) -> None:
    """torch.distributed bound its copies of c10d's functions at its import: point those the probe patched in c10d
    just now (collectives, init, destroy) at the patched ones, as an import-time patch would have."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    for name, old in before.items():
        new = getattr(c10d, name, old)
        if new is not old and getattr(dist, name, None) is old:
            setattr(dist, name, new)
