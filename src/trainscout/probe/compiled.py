"""The probe's hooks on the user's modules, kept out of torch.compile.

nn.Module runs a module's own hooks in eager code, also for a module compiled in place (`model.compile()`) or
wrapped (`torch.compile(model)`), and dynamo then compiles each hook it meets as a frame of its own. Ours read
state that changes (is a save in progress, which layer is armed) and inputs whose shapes vary: dynamo recompiled
them again and again (10 recompiles of the replay capture hook in 120 steps), and under `fullgraph=True` the job
died at the recompile limit (`FailOnRecompileLimitHit` at step 8, caused by the activity hook). The hooks of the
modules *inside* a compiled module are traced into the user's graph instead: dynamo guards on them.

So each hook's code is marked for dynamo to skip, with all it calls (it runs as plain Python), and the hook
returns at once while dynamo traces it (`torch.compiler.is_compiling()` is a constant there: no guard, no graph
break, nothing of ours in the graph); marks it would make inside a compiled region are lost. Hooks added and
removed during training (replay's) go only on modules whose hooks are not traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_SKIPPED: set = set()  # the code objects of every hook made by eager_hook
_dynamo_seen = False


def eager_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as a module hook that runs in eager code only (returns None while torch.compile traces it)."""
    import torch

    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if is_compiling():
            return None
        return fn(*args, **kwargs)

    _skip(hook.__code__)  # type: ignore[attr-defined]  # functools.wraps hides the function type
    return hook


def _skip(code) -> None:
    if code in _SKIPPED:
        return
    _SKIPPED.add(code)
    if _dynamo_seen:
        _skip_in_dynamo(code)


def on_dynamo_import(_dynamo=None) -> None:
    """torch._dynamo was imported: from now on it skips every hook's code as a frame of its own."""
    global _dynamo_seen
    _dynamo_seen = True
    for code in list(_SKIPPED):
        _skip_in_dynamo(code)


def _skip_in_dynamo(code) -> None:
    # skipped with everything it calls (our code, and a hook's callee would otherwise be compiled as a frame)
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # another torch: dynamo may compile the hook as a frame, which is slower, not wrong
        return
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def compile_wrapper(module) -> bool:
    """`module` is torch.compile's module wrapper (OptimizedModule), told without importing torch._dynamo: its
    own hooks run in eager code, those of the module it wraps may be traced."""
    return hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule"


def compiled_in_place(module) -> bool:
    """`module.compile()` was called: the hooks of the modules inside it are traced into its graph, so adding or
    removing one changes the graph's guards (a recompilation each time)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def forced_eager():
    """A context in which compiled modules run their eager code (replay's recomputation: its eval mode and
    fresh inputs would otherwise compile new graphs, counting towards the job's recompile limit)."""
    import contextlib
    import sys

    import torch

    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return set_stance("force_eager")
