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

Meeting. The replicas meet at a replay's first broadcast; every broadcast waits for them a few seconds at
most (side_group.py), then this rank's replay turns itself off and training goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainscout.probe.compiled import compile_wrapper, compiled_in_place, eager_hook, forced_eager
from trainscout.probe.side_group import JOIN_S, SIDE_BYTES_S, wait_within

REPLAY_PG_INDEX = -3
_NOT_CALLED = -2  # header: the layer's hook did not run on the source (-1: its input cannot be sent)
UNCALLED_TO_WHOLE = 2  # scheduled replays in a row whose layer's hook never ran: replay the whole model
WHOLE_MODEL = "model"  # the layer name of a model replayed whole
MAX_STRETCH = 50  # a budgeted interval is at most this many times `every`
_PACKED = -4  # header: the input is a whole call (positional and keyword arguments), sent as bytes
_HEADER = 13  # ndim, dtype, up to 10 dims, the next interval
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")


def bounded(broadcast: Callable, slack_s: Callable[[], float] = lambda: 0.0) -> Callable:
    """`broadcast` that waits at most JOIN_S (+ slack_s(), + the transfer time of the tensor) for every replica,
    then raises PeerAbsent (side_group.py)."""

    def call(tensor, src: int, group) -> None:
        work = broadcast(tensor, src=src, group=group, async_op=True)
        if work is not None:
            limit = JOIN_S + slack_s() + tensor.numel() * tensor.element_size() / SIDE_BYTES_S
            wait_within(work, limit, "the replay")

    return call


@dataclass
class _Call:
    """A layer's input that is more than one tensor: its positional and keyword arguments (a transformer block
    called with its hidden states, an attention mask and rotary embeddings)."""

    args: tuple
    kwargs: dict


class Replay:
    name = "replay"  # its figures' key in the rank's cost report

    def __init__(self, append, every: int, rank: int, budget: float = 0.0, report=None) -> None:
        self.append = append
        self.report = report  # a warning for the user (a layer left out of replay), or None
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
        self._ever_called = False  # an armed layer's hook ever ran here: a layer not called is routing, not compile
        self._uncalled = 0  # replays in a row whose layer's hook never ran
        self._root: Any = None
        self._handles: list = []
        self.count = 0
        self.spent_s = 0.0
        self._broadcast: Callable | None = None
        self.slack_s = 0.0  # this step's extra time to meet the replicas (a whole-state check before the replay)
        self._next_index = 0
        self._failed: set[str] = set()  # layers whose recomputation raised: left out, on every replica alike
        # around each recomputation: where the replicas are a subset of the job (a pipeline stage's), the
        # probe's collective tap refuses the job's collectives there, so a layer that calls one raises on
        # every replica alike and is left out instead of waiting for ranks that are not replaying
        self.guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def costs(self) -> dict:
        return {
            "seconds": self.spent_s,
            "count": self.count,
            "every": self.every,
            "interval": self.interval,
            "layers": len(self.layers),
            "layer_names": [name for name, _ in self.layers],  # what the rotation covers, for the user
            "left_out": sorted(self._failed),
        }

    def attach(self, module, group, source: int, broadcast) -> None:
        """module: the replicated model; group: side group of its replicas; broadcast: unwrapped dist.broadcast."""
        import torch.nn as nn

        self.group, self.source = group, source
        self._broadcast = bounded(broadcast, lambda: self.slack_s)
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
            layers = _rotation_layers(module, nn)
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
            hook = eager_hook(self._capture_hook(name))
            self._handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _capture_hook(self, name: str):
        # Registered only on the layer of the next replay (see _arm): one activation held, not one per layer.
        def hook(module, args, kwargs):
            self._called.add(name)
            self._ever_called = True
            if not module.training:
                return
            if len(args) == 1 and not kwargs and hasattr(args[0], "detach"):
                self._captured[name] = args[0].detach()
            else:  # references only, as for one tensor: packed for sending at the replay
                self._captured[name] = _Call(_map_tensors(args, _detach), _map_tensors(kwargs, _detach))

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
        self._settle()
        for name, layer in self.layers:
            if name not in names:
                continue
            x, _ = self._exchange_input(name, self.interval)
            if x is None:
                # the source's header says so to every replica alike, so the confirmation waiting for this layer
                # need not wait out its deadline (an expert the source's batch never routed a token to). A
                # recomputation that raises on one replica says nothing of the others: no record, as before
                self._record(step, name, 0, 0, "")
                continue
            hashes = self._recompute_or_leave_out(name, layer, x, step)
            if hashes is None:
                continue
            out_hash, grad_hash, param_hash = hashes
            self.count += 1
            self._record(step, name, out_hash, grad_hash, f"{param_hash:016x}")
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
        self._settle()
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
        hashes = self._recompute_or_leave_out(name, layer, x, step)
        if hashes is not None:
            out_hash, grad_hash, param_hash = hashes
            self.count += 1
            # the parameters' fingerprint tells a wrong computation from corrupted weights
            self._record(step, name, out_hash, grad_hash, f"{param_hash:016x}")
        self._last_s = time.perf_counter() - t0
        self.spent_s += self._last_s
        del torch

    def _settle(self) -> None:
        """On CUDA, wait for this rank's queued GPU work before meeting the replicas: the source's input is copied to
        the host after it, and a host running a step or two ahead of a slow GPU would otherwise arrive at the
        bounded meeting (JOIN_S) seconds after its peers. A replay synchronises with the GPU anyway."""
        import torch

        param = next(self._root.parameters(), None) if self._root is not None else None
        if param is not None and param.is_cuda:
            torch.cuda.current_stream(param.device).synchronize()

    def _record(self, step: int, name: str, out_hash: int, grad_hash: int, params: str) -> None:
        """A replay's record: its fingerprints, and in its text the layer, the parameters' fingerprint ("": no
        input was replayed) and the source rank, which names the group of replicas it is compared within."""
        self.append(
            REPLAY_PG_INDEX, step, out_hash, grad_hash, time.time_ns(), step, "replay", f"{name}|{params}|{self.source}"
        )

    def _recompute_or_leave_out(self, name: str, layer, x, step: int) -> tuple[int, int, int] | None:
        """The layer's fingerprints, or None where recomputing it raised: a layer whose call cannot be redone
        from its captured arguments (an argument holding state, a hook of the job's that needs more) is left
        out of replay, the others go on. The source then sends no input for it, so every replica skips it."""
        buffers = self._exchange_buffers(layer)
        try:
            with self.guard():
                return self._recompute(layer, x, step, buffers)
        except Exception as exc:
            self._failed.add(name)
            if self.report is not None:
                self.report(f"replay leaves layer {name} out: recomputing it raised {exc!r}")
            return None

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
        packed = None
        if self.rank == self.source:
            if isinstance(x, _Call):
                packed = None if name in self._failed else _pack(x)
            if name not in self._called:
                header[0] = _NOT_CALLED
                header[2] = int(self._ever_called)
            elif packed is not None:
                header[0], header[1] = _PACKED, packed.numel()
            elif (
                x is None
                or isinstance(x, _Call)
                or name in self._failed
                or str(x.dtype).replace("torch.", "") not in _DTYPES
                or x.dim() > 10
            ):
                header[0] = -1
            else:
                header[0] = x.dim()
                header[1] = _DTYPES.index(str(x.dtype).replace("torch.", ""))
                header[2 : 2 + x.dim()] = torch.tensor(x.shape)
        broadcast(header, src=self.source, group=self.group)
        interval = int(header[_HEADER - 1])
        # a layer the source's forward did not call where others' hooks did run (an expert no token was routed
        # to) is skipped; only hooks that never run anywhere on the source mean a compiled forward hides them
        self._uncalled = self._uncalled + 1 if int(header[0]) == _NOT_CALLED and not int(header[2]) else 0
        if int(header[0]) == _PACKED:
            if packed is None:
                packed = torch.empty(int(header[1]), dtype=torch.uint8)
            broadcast(packed, src=self.source, group=self.group)
            return _unpack(packed), interval  # the source too recomputes from the bytes: one call on every replica
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
        call = x if isinstance(x, _Call) else _Call((x,), {})
        inputs: list = []  # the call's floating-point tensors, on the layer's device: gradients are taken of them

        def to_device(t):
            t = t.to(device)
            if t.is_floating_point():
                inputs.append(t.requires_grad_(True))
            return t

        was_training = layer.training
        # eval mode draws no random numbers; forking the RNG is a guard for layers that still do
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            forced_eager(),
            _deterministic_kernels(torch),
        ):
            layer.eval()
            own = _swap_buffers(layer, source_buffers) if source_buffers is not None else None
            try:
                with torch.enable_grad():
                    args, kwargs = _map_tensors(call.args, to_device), _map_tensors(call.kwargs, to_device)
                    # a layer may answer with several tensors (a tuple, a dict, a model-output record)
                    outs = [t for t in _tensors_in(layer(*args, **kwargs)) if t.is_floating_point()]
                    g = torch.Generator().manual_seed(step)
                    grad_outs = [
                        torch.randn(o.shape, generator=g, dtype=torch.float32).to(device, o.dtype) for o in outs
                    ]
                    taken = [(o, go) for o, go in zip(outs, grad_outs) if o.requires_grad]
                    wrt = inputs + params
                    grads = (
                        torch.autograd.grad([o for o, _ in taken], wrt, [go for _, go in taken], allow_unused=True)
                        if taken and wrt
                        else []
                    )
            finally:
                if own is not None:
                    _swap_buffers(layer, own)
                layer.train(was_training)
        if not outs:
            raise ValueError("the layer returned no floating-point tensor")
        kept = [g for g in grads if g is not None]
        digests = _fingerprints([o.detach() for o in outs] + kept + [p.detach() for p in params])
        n_out, n_grads = len(outs), len(kept)
        out_hash = digests[0] if n_out == 1 else _combine(digests[:n_out])
        return out_hash, _combine(digests[n_out : n_out + n_grads]), _combine(digests[n_out + n_grads :])


def _deterministic_kernels(torch):
    """cuDNN's own picks for the recomputation: deterministic algorithms, no benchmarking. Its default
    convolution backward accumulates with atomics, so two healthy replicas (or one, twice) differ in the last
    bits: a clean CUDA vision job's replays of its convolution stages disagreed on every replica."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=cudnn.enabled, benchmark=False, deterministic=True, allow_tf32=cudnn.allow_tf32)


def _rotation_layers(module, nn, prefix: str = "") -> list[tuple[str, Any]]:
    """The layers replay takes in turn: the model's children, the blocks of its block lists one by one, and
    inside a module that holds a block list further down (a causal LM around its transformer, BERT's encoder
    inside its model) that module's parts."""
    layers: list[tuple[str, Any]] = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            # a block's activations (nn.ReLU in a Sequential) hold no weights: nothing of the replica's own to
            # check, and no device to recompute on
            layers.extend((f"{prefix}{name}.{i}", c) for i, c in enumerate(child) if _has_parameters(c))
        elif (
            not compile_wrapper(child)  # hooks inside a compiled module are traced: it stays one layer
            and not compiled_in_place(child)
            and any(isinstance(m, nn.ModuleList) for m in child.modules())  # blocks further down (encoder.layer)
        ):
            layers.extend(_rotation_layers(child, nn, f"{prefix}{name}."))
        elif _has_parameters(child):
            layers.append((f"{prefix}{name}", child))
    return layers


def _detach(t):
    return t.detach()


def _map_tensors(value, fn):
    """`value` with fn applied to every tensor inside its tuples, lists and dicts; anything else as it is."""
    if hasattr(value, "detach") and hasattr(value, "is_floating_point"):
        return fn(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if type(value) is dict:
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _tensors_in(value) -> list:
    """The tensors of a layer's output, in order: itself, or those in its tuples, lists, dicts (a model-output
    record is a dict), named tuples and dataclasses."""
    if hasattr(value, "detach") and hasattr(value, "is_floating_point"):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors_in(getattr(value, f.name))]
    return []


def _pack(call: _Call):
    """A call's arguments as bytes (a uint8 tensor), tensors in host memory; None if they cannot be saved."""
    import torch

    buf = io.BytesIO()
    try:
        torch.save((_map_tensors(call.args, _to_host), _map_tensors(call.kwargs, _to_host)), buf)
    except Exception:  # an argument that cannot be pickled: the layer is not replayed this time
        return None
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _to_host(t):
    return t.detach().to("cpu")


def _unpack(packed) -> _Call:
    import torch

    # the bytes come from the job's own source replica over its side group, as trusted as the job itself
    args, kwargs = torch.load(io.BytesIO(packed.numpy().tobytes()), map_location="cpu", weights_only=False)
    return _Call(tuple(args), dict(kwargs))


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
