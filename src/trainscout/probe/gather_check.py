"""All-gather receivers (FSDP2 / ZeRO-3 style sharding): every rank that gathers a parameter must hold
the same full tensor.

`fully_shard` is wrapped; each sharded module gets a forward pre-hook that runs after FSDP's own
(hooks run in registration order), when the module's parameters are the gathered full tensors. On a
rotation over modules (the same on every rank), the gathered parameters are fingerprinted and sent
like replicated-state fingerprints, with the default group as the class of receivers: with one or
two mesh dimensions every rank gathers the same full parameter. A receiver whose gathered copy
differs from a strict majority is named.
"""

from __future__ import annotations

import functools
import time

from trainscout.probe.state_check import STATE_PG_INDEX


class GatherCheck:
    def __init__(self, append, get_step, register_tensor, period: int = 4) -> None:
        self.append = append
        self.get_step = get_step
        self.register_tensor = register_tensor  # name -> tensor id in the shared tensor table
        self.period = max(1, period)
        self.modules = 0
        self.spent_s = 0.0
        self.before_check = None  # fault injection point: (module, step) -> None, between gather and check

    def wrap(self, module) -> None:
        real = module.fully_shard
        check = self

        def fully_shard(mod, *args, **kwargs):
            result = real(mod, *args, **kwargs)
            try:
                check.watch(result if result is not None else mod)
            except Exception:
                pass  # fail open: sharding itself must not be affected
            return result

        # fully_shard carries attributes its own code uses (fully_shard.state(module)): keep them all
        module.fully_shard = functools.wraps(real)(fully_shard)

    def watch(self, mod) -> None:
        index = self.modules
        self.modules += 1
        label = f"gathered[{index}]{type(mod).__name__}"

        def pre_forward(m, args):
            step = self.get_step() + 1  # the step being computed
            if step % self.period != index % self.period or not m.training:
                return
            if self.before_check is not None:
                self.before_check(m, step)
            t0 = time.perf_counter()
            from trainscout.fingerprint import fingerprint

            for pname, p in _own_parameters(m):
                if type(p).__name__ == "DTensor":
                    continue  # still sharded: not gathered here
                name = f"{label}.{pname}"
                size = p.numel() * p.element_size()
                self.append(STATE_PG_INDEX, self.register_tensor(name), fingerprint(p.detach()), 0,
                            time.time_ns(), step, "state", f"0:{size}")
            self.spent_s += time.perf_counter() - t0

        mod.register_forward_pre_hook(pre_forward)


def _own_parameters(module):
    """Parameters this FSDP unit gathers: its own and those of children that are not FSDP units."""
    for name, child in [("", module)] + [(n, c) for n, c in module.named_children()]:
        if child is not module and type(child).__name__.startswith("FSDP"):
            continue
        if child is module:
            yield from module.named_parameters(recurse=False)
        else:
            for pname, p in child.named_parameters():
                yield f"{name}.{pname}", p
