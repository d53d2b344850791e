"""Run a callback right after a module finishes executing, before anyone else can bind its names.

torch.distributed re-exports distributed_c10d's functions (`from .distributed_c10d import *`), and
frameworks cache collective functions at import; patching after the fact misses those copies. A
meta-path finder that wraps the module's loader patches at the only moment every later reader sees.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Callable


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callbacks: list[Callable]) -> None:
        self._inner = inner
        self._callbacks = callbacks

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        for callback in self._callbacks:  # in registration order: later patches wrap earlier ones
            callback(module)


class PostImportHooks(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callable]] = {}
        self._resolving: set[str] = set()

    def on_import(self, name: str, callback: Callable) -> None:
        """Call callback(module) once the module is imported (at once when it already is). Several
        callbacks for one module all run, in the order they were registered."""
        if name in sys.modules and getattr(sys.modules[name], "__spec__", None) is not None:
            callback(sys.modules[name])
            return
        self._callbacks.setdefault(name, []).append(callback)

    def find_spec(self, fullname, path, target=None):
        callbacks = self._callbacks.get(fullname)
        if callbacks is None or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            self._resolving.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        del self._callbacks[fullname]
        spec.loader = _PatchingLoader(spec.loader, callbacks)
        return spec


_hooks: PostImportHooks | None = None


def hooks() -> PostImportHooks:
    global _hooks
    if _hooks is None:
        _hooks = PostImportHooks()
        sys.meta_path.insert(0, _hooks)
    return _hooks
