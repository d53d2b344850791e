"""In-situ replay: replicas recompute one layer on the same input and compare fingerprints.

Every `every` steps (the same steps on every replica), each replica takes the next layer of the
rotation (embedding, blocks, head...), receives the input that layer saw in the source replica's last
training forward (broadcast over a side process group, never the job's own groups), and runs forward
and backward with the live parameters and a fixed output gradient. Outputs and gradients are
fingerprinted; a replica that computes differently from a strict majority computes wrong (SDC), and a
second deviation of the same layer confirms a faulty device.

Replay must not change training: it runs under a forked RNG, in eval mode, and takes gradients with
torch.autograd.grad, which leaves `.grad` untouched; parameters are only read. Buffers (BatchNorm's running
statistics) are each rank's own: every replica recomputes with the source's and gets its own back after.

On CUDA a replay step synchronises the host with the GPU: the side group is gloo, so the source copies
its captured input to host memory, the receivers copy it back, and the results are read on the host
(one read for all fingerprints of a replay). Only replay steps do this (and on command); between them
replay only keeps a reference to one layer's input, with no device work.

Schedule. With a `budget` (the default: TRAINSCOUT_REPLAY_BUDGET, 0.1 % of step time), replays are at
least `every` steps apart and further when a replay costs more than `budget` of the steps between
(a replay that waits for the GPU to drain costs ~14 ms on a 10 ms host-bound step: every 200 steps
would be 0.7 %). The source decides the next interval from its last replay's wall time and its step
time and sends it in the replay's header, so every replica replays at the same steps. Without a
budget (checks.replay.budget = 0, TRAINSCOUT_REPLAY_BUDGET=0) replays are at exactly the multiples of `every`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from trainscout.probe.compiled import compile_wrapper, compiled_in_place, eager_hook, forced_eager

REPLAY_PG_INDEX = -3
_NOT_CALLED = -2  # header: the layer's hook did not run on the source (-1: its input cannot be sent)
UNCALLED_TO_WHOLE = 2  # scheduled replays in a row whose layer's hook never ran: replay the whole model
WHOLE_MODEL = "model"  # the layer name of a model replayed whole
MAX_STRETCH = 50  # a budgeted interval is at most this many times `every`
_HEADER = 13  # ndim, dtype, up to 10 dims, the next interval
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")


class Replay:
    name = "replay"  # its figures' key in the rank's cost report

    def __init__(self, append, every: int, rank: int, budget: float = 0.0) -> None:
        self.append = append
        self.every = max(1, every)
        self.budget = max(0.0, budget)  # 0: replay at the multiples of `every`
        self.interval = self.every  # steps to the next scheduled replay (budgeted mode), agreed at each replay
        self._next_due = self.every
        self._rotation = 0  # scheduled replays so far (budgeted mode): the next layer of the rotation
        self._last_s = 0.0  # this rank's last replay, seconds
        self.rank = rank
        self.group = None  # side process group over the replicas
        self.source = 0  # global rank whose captured input is broadcast
        self.layers: list[tuple[str, Any]] = []  # (name, torch.nn.Module)
        self._captured: dict[str, Any] = {}  # layer name -> its input (a tensor)
        self._called: set[str] = set()  # armed layers whose hook ran (in eager code) since they were armed
        self._uncalled = 0  # replays in a row whose layer's hook never ran
        self._root: Any = None
        self._handles: list = []
        self.count = 0
        self.spent_s = 0.0
        self._broadcast: Callable | None = None
        self._next_index = 0

    def costs(self) -> dict:
        return {"seconds": self.spent_s, "count": self.count, "every": self.every, "interval": self.interval}

    def attach(self, module, group, source: int, broadcast) -> None:
        """module: the replicated model; group: side group of its replicas; broadcast: unwrapped dist.broadcast."""
        import torch.nn as nn

        self.group, self.source, self._broadcast = group, source, broadcast
        self._root = module
        layers: list[tuple[str, Any]] = []
        if compile_wrapper(module):
            # the hooks of the modules inside a compiled model are traced into its graph: arming one for a replay
            # would recompile it. The whole model is one layer (its own hooks run in eager code), named as
            # torch.compile's wrapper names its parameters
            layers.append(("_orig_mod", module))
        elif compiled_in_place(module):
            layers.append((WHOLE_MODEL, module))
        else:
            for name, child in module.named_children():
                if isinstance(child, (nn.ModuleList, nn.Sequential)):
                    # a block's activations (nn.ReLU in a Sequential) hold no weights: nothing of the replica's
                    # own to check, and no device to recompute on
                    layers.extend((f"{name}.{i}", c) for i, c in enumerate(child) if _has_parameters(c))
                elif _has_parameters(child):
                    layers.append((name, child))
        self.layers = layers
        self._next_index = 0

    def arm_if_due(self, next_step: int) -> None:
        """Called after each step: capture the next replay's input only in the step that replays."""
        if self.due(next_step):
            self._arm()

    def _arm(self, names: list[str] | None = None) -> None:
        # One pre-hook on one layer for one step: a hook on every layer, every step, cost each forward
        # a Python call per layer for an input kept once every `every` steps. A confirmation arms several.
        self._disarm()
        self._captured, self._called = {}, set()
        if not self.layers:
            return
        chosen = [self.layers[self._next_index]] if names is None else [(n, m) for n, m in self.layers if n in names]
        for name, layer in chosen:
            self._handles.append(layer.register_forward_pre_hook(eager_hook(self._capture_hook(name))))

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _capture_hook(self, name: str):
        # Registered only on the layer of the next replay (see _arm): one activation held, not one per layer.
        def hook(module, args):
            self._called.add(name)
            if len(args) == 1 and hasattr(args[0], "detach") and module.training:
                self._captured[name] = args[0].detach()

        return hook

    def due(self, step: int) -> bool:
        if not self.layers or self.group is None:
            return False
        return step >= self._next_due if self.budget else step % self.every == 0

    def _proposed_interval(self, step_s: float) -> int:
        """The source's pick: at least `every`, and long enough that its last replay's time stays within
        `budget` of the steps in between."""
        if not self.budget or step_s <= 0 or self._last_s <= 0:
            return self.interval
        wanted = math.ceil(self._last_s / (self.budget * step_s))
        return min(max(self.every, wanted), self.every * MAX_STRETCH)

    def prepare(self, layer: str) -> None:
        """An on-command replay of `layer` ("" = the next of the rotation) is coming: capture its input."""
        for i, (name, _) in enumerate(self.layers):
            if name == layer:
                self._next_index = i
        self._arm()

    def prepare_layers(self, names: list[str]) -> None:
        """A confirmation will replay these layers at the next step: capture each one's input."""
        self._arm([n for n in names if any(n == name for name, _ in self.layers)])

    def run_layers(self, step: int, names: list[str]) -> None:
        """Replay each of these layers now (the same list, in the rotation's order, on every replica); the
        schedule's rotation and interval are left as they were."""
        t0 = time.perf_counter()
        self._disarm()
        for name, layer in self.layers:
            if name not in names:
                continue
            x, _ = self._exchange_input(name, self.interval)
            if x is None:
                continue
            out_hash, grad_hash, param_hash = self._recompute(layer, x, step, self._exchange_buffers(layer))
            self.count += 1
            self.append(
                REPLAY_PG_INDEX, step, out_hash, grad_hash, time.time_ns(), step, "replay", f"{name}|{param_hash:016x}"
            )
        self._captured = {}
        self.spent_s += time.perf_counter() - t0

    def run(self, step: int, on_command: bool = False, step_s: float = 0.0) -> None:
        """Replay at this step (scheduled, or on command); step_s: this rank's recent step time (budget)."""
        import torch

        t0 = time.perf_counter()
        n = len(self.layers)
        if on_command:  # the layer prepare() chose; then back to the schedule's rotation
            index = self._next_index
            self._next_index = self._rotation % n if self.budget else (step // self.every) % n
        elif self.budget:
            index = self._rotation % n
            self._rotation += 1
            self._next_index = self._rotation % n
        else:
            index = (step // self.every - 1) % n
            self._next_index = (index + 1) % n
        name, layer = self.layers[index]
        self._disarm()
        x, interval = self._exchange_input(name, self._proposed_interval(step_s))
        self._captured = {}
        if self.budget and interval > 0:
            self.interval = interval
            if not on_command or self._next_due <= step:
                self._next_due = step + interval
        if x is None:
            if self._uncalled >= UNCALLED_TO_WHOLE and len(self.layers) > 1:
                self._replay_whole()
            self._last_s = time.perf_counter() - t0
            return
        out_hash, grad_hash, param_hash = self._recompute(layer, x, step, self._exchange_buffers(layer))
        self.count += 1
        # the parameters' fingerprint tells a wrong computation from corrupted weights
        self.append(
            REPLAY_PG_INDEX, step, out_hash, grad_hash, time.time_ns(), step, "replay", f"{name}|{param_hash:016x}"
        )
        self._last_s = time.perf_counter() - t0
        self.spent_s += self._last_s
        del torch

    def _replay_whole(self) -> None:
        """The layers' hooks do not run where the source can see them: the model's forward is traced by
        torch.compile (`torch.compile(DistributedDataParallel(model))` compiles the inner model's forward,
        whose submodules' hooks then run inside its graph). The whole model is one layer from now on, hooked
        where nn.Module calls it in eager code. Every replica sees the same headers, so all switch together."""
        self.layers = [(WHOLE_MODEL, self._root)]
        self._next_index = self._rotation = self._uncalled = 0

    def _exchange_input(self, name: str, interval: int):
        """(the source's captured input or None, the source's next interval) on every replica."""
        import torch

        broadcast = self._broadcast
        assert broadcast is not None  # attach() set it with the layers, and only a rank with layers replays
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[_HEADER - 1] = interval
        x = self._captured.get(name)
        if self.rank == self.source:
            if name not in self._called:
                header[0] = _NOT_CALLED
            elif x is None or str(x.dtype).replace("torch.", "") not in _DTYPES or x.dim() > 10:
                header[0] = -1
            else:
                header[0] = x.dim()
                header[1] = _DTYPES.index(str(x.dtype).replace("torch.", ""))
                header[2 : 2 + x.dim()] = torch.tensor(x.shape)
        broadcast(header, src=self.source, group=self.group)
        interval = int(header[_HEADER - 1])
        self._uncalled = self._uncalled + 1 if int(header[0]) == _NOT_CALLED else 0
        if int(header[0]) < 0:
            return None, interval
        shape = [int(v) for v in header[2 : 2 + int(header[0])]]
        dtype = getattr(torch, _DTYPES[int(header[1])])
        # the side group is gloo: the input travels through host memory, then goes where the layer is
        if self.rank == self.source:
            assert x is not None  # without an input the source sent -1 and returned above
            buf = x.detach().to("cpu", copy=True).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype)
        broadcast(buf, src=self.source, group=self.group)
        return buf, interval

    def _exchange_buffers(self, layer) -> list | None:
        """The source's floating-point buffers of `layer` (BatchNorm's running statistics), on every replica.
        They are each rank's own: DDP copies rank 0's into the others at each forward, then every rank updates
        them from its own batch, so after a step they differ between healthy replicas, and a layer recomputed
        in eval mode with its own would differ on every one. Recomputed with the source's, the replicas
        compare what is replicated: the parameters and the device's arithmetic. None: no such buffer."""
        import torch

        buffers = _floating_buffers(layer)
        if not buffers:
            return None
        assert self._broadcast is not None  # set by attach() with the layers
        if self.rank == self.source:  # float64 holds every narrower float exactly
            flat = torch.cat([b.detach().to("cpu", torch.float64).reshape(-1) for b in buffers])
        else:
            flat = torch.empty(sum(b.numel() for b in buffers), dtype=torch.float64)
        self._broadcast(flat, src=self.source, group=self.group)
        return list(flat.split([b.numel() for b in buffers]))

    def _recompute(self, layer, x, step: int, source_buffers: list | None = None) -> tuple[int, int, int]:
        import torch

        params = [p for p in layer.parameters() if p.requires_grad]
        device = next(iter(layer.parameters())).device
        x = x.to(device)
        was_training = layer.training
        # eval mode draws no random numbers; forking the RNG is a guard for layers that still do
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), forced_eager():
            layer.eval()
            own = _swap_buffers(layer, source_buffers) if source_buffers is not None else None
            try:
                with torch.enable_grad():
                    inp = x.requires_grad_(True) if x.is_floating_point() else x
                    out = layer(inp)
                    g = torch.Generator().manual_seed(step)
                    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float32).to(device, out.dtype)
                    wrt = ([inp] if inp.requires_grad else []) + params
                    grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
            finally:
                if own is not None:
                    _swap_buffers(layer, own)
                layer.train(was_training)
        tensors = [out.detach()] + [g for g in grads if g is not None] + [p.detach() for p in params]
        digests = _fingerprints(tensors)
        n_grads = sum(g is not None for g in grads)
        return digests[0], _combine(digests[1 : 1 + n_grads]), _combine(digests[1 + n_grads :])


def _has_parameters(module) -> bool:
    return any(True for _ in module.parameters())


def _floating_buffers(layer) -> list:
    return [b for b in layer.buffers() if b.is_floating_point()]


def _swap_buffers(layer, values: list) -> list:
    """Puts `values` (flat, in the order of _floating_buffers) into the layer's floating buffers in place;
    returns what they held, in the same form."""
    import torch

    buffers = _floating_buffers(layer)
    held = [b.detach().reshape(-1).clone() for b in buffers]
    with torch.no_grad():
        for b, v in zip(buffers, values):
            b.copy_(v.reshape(b.shape).to(b.device, b.dtype))
    return held


def _fingerprints(tensors: list) -> list[int]:
    """Fingerprints of several tensors; CUDA ones are enqueued together and read with one host sync."""
    from trainscout.fingerprint import fingerprint

    if tensors and all(t.is_cuda for t in tensors) and len({t.device for t in tensors}) == 1:
        import torch

        from trainscout.fingerprint import cpu, gpu

        if not gpu.HAVE_TRITON:
            return [fingerprint(t) for t in tensors]
        out = torch.empty(len(tensors), dtype=torch.int64, device=tensors[0].device)
        for i, t in enumerate(tensors):
            gpu.fingerprint_tensor_cuda_async(t, out, i)
        return [cpu.as_unsigned64(v) for v in out.tolist()]
    return [fingerprint(t) for t in tensors]


def _combine(digests) -> int:
    """Order-sensitive combination of several 64-bit fingerprints."""
    h = 0
    for d in digests:
        h = (h * 0x100000001B3 + d) % (1 << 64)
    return h
