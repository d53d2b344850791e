"""The non-finite check's CUDA kernel: one launch per dtype counts the NaN/Inf elements of the loss and of every
local gradient and sums their squares, with no host sync and little host work per step.

`NonFiniteCheck` runs at the end of every backward pass. On a small model the step is short and host-bound,
so what matters is the Python on the training thread: one `torch._foreach_norm` over 54 gradients, the stack
of its 54 outputs and the copy cost ~0.2 ms of host time there, ~2 % of a 10 ms step. Here the gradients'
shapes and dtypes are fixed once (`Layout`), cut into items of at most `CHUNK` elements; per step the host
only reads each gradient's address, writes the addresses (as offsets from a reference pointer) into a small
pinned table, copies it to the device and launches one Triton program per item, per dtype. Each program
reads its elements once, as integers: it tests their exponent bits (all ones: Inf or NaN; integer work, which
no fast-math flag can fold away) and, from a bitcast of the same load, adds up their squares (float32; float64
for float64 tensors). The same pass thus gives the per-step numerical evidence (probe/local_evidence.py: the
local loss and each layer's gradient norm) and the non-finite origin.

The result vector (`Layout.n_values` float32 values):

    out[0 : n_out]            non-finite elements of item j (exact: an item holds at most CHUNK < 2**24)
    out[n_out : 2 * n_out]    sum of squares of item j's elements (NaN/Inf propagate into it)
    out[2 * n_out]            the value of tensor 0, the loss, sign included (only when it has one element)

`Layout.owner[j]` is the tensor item j belongs to (0: the loss); the host adds items up per tensor.

A finite item's sum of squares overflows float32 only if its elements' root mean square exceeds ~3.6e16 (or
one element exceeds ~1.8e19): then it reads Inf, which no count confirms, so nothing is reported non-finite, and
the evidence takes the float32 limit as the item's sum of squares (a lower bound: the gradient is huge, as an
exponent bit flipped in one element makes it).

The reads are 16 bytes wide when every address is 16-byte aligned (caching-allocator blocks are): the
table then holds offsets in 16-byte units, so the compiler can prove the alignment from the arithmetic.

A launch may read a sample instead (`enqueue`'s `sample`, a power of two): each item of SAMPLE_MIN elements or
more is read one 32-byte group in `sample`, the groups whose index is `phase` modulo the rate; the counts and
sums of squares then cover those elements (`Layout.read_share`), and smaller items are read whole. At 1 in 64
the read of a large model's gradients takes 1/16 of the time (fewer, scattered sectors; measured on an H100).

Importing this module needs neither CUDA nor Triton; `usable()` says whether the kernel can run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

BLOCK = 4096  # elements per loop step of a program
# elements per item (one program): 1 MiB of fp32. Items of one size spread a large model's 2.4 GB of
# gradients evenly over the SMs (~2400 programs); each program keeps 4 16-byte loads per thread in flight.
CHUNK = 64 * BLOCK
NUM_WARPS = 8
ALIGN = 16  # bytes
SECTOR = 32  # bytes: the unit a sampled read takes or skips (a GPU memory sector), GROUP elements of a dtype
# Items of at least this many elements are read in a sample when the check runs at a sample rate above 1
# (`enqueue`'s `sample`); smaller ones, whose read costs little beside a launch, are always read whole.
SAMPLE_MIN = CHUNK // 4

# dtype -> (the integer dtype of the same width, the exponent mask: all exponent bits set = Inf or NaN,
# how the kernel turns the integer into the float value: KIND below)
_BITS = {
    torch.float32: (torch.int32, 0x7F800000, 0),
    torch.float16: (torch.int16, 0x7C00, 1),
    torch.bfloat16: (torch.int16, 0x7F80, 2),
    torch.float64: (torch.int64, 0x7FF0000000000000, 3),
}

_ESIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}

if HAVE_TRITON:

    @triton.jit
    def _as_float(x, KIND: tl.constexpr):
        """The float value of elements loaded as integers (a bitcast of the same registers, no second read),
        in the accumulator's type: float32, float64 for float64 tensors. bfloat16 is the top half of a float32."""
        if KIND == 0:
            return x.to(tl.float32, bitcast=True)
        elif KIND == 1:
            return x.to(tl.float16, bitcast=True).to(tl.float32)
        elif KIND == 2:
            return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float64, bitcast=True)

    @triton.jit(
        do_not_specialize=["sample", "phase"],  # one compiled kernel serves every sample rate
        do_not_specialize_on_alignment=["toff_ptr", "item_ptr", "count_ptr", "sumsq_ptr", "value_ptr"],
    )
    def _check_kernel(
        ref_ptr,  # intN: the reference address (16-byte aligned); tensors are read at ref + offset
        toff_ptr,  # int64 [tensors]: each tensor's offset from ref, in UNIT-element steps
        item_ptr,  # int64 [items, 3]: (tensor, first block, elements)
        count_ptr,  # float32 [items]: non-finite elements found
        sumsq_ptr,  # float32 [items]: sum of the elements' squares
        value_ptr,  # float32 [1]: the value of item 0 (a one-element loss), written when WITH_VALUE
        sample,  # int32, a power of two: items of SAMPLE_MIN elements or more read 1 group in `sample`
        phase,  # int32: which group of each `sample` (phase mod sample)
        EXP: tl.constexpr,
        KIND: tl.constexpr,
        UNIT: tl.constexpr,
        BLOCK: tl.constexpr,
        GROUP: tl.constexpr,  # elements of one group: 32 bytes, one memory sector
        SAMPLE_MIN: tl.constexpr,
        WITH_VALUE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(item_ptr + 3 * pid)
        first = tl.load(item_ptr + 3 * pid + 1)
        n = tl.load(item_ptr + 3 * pid + 2).to(tl.int32)
        # UNIT * x + BLOCK * y: the compiler sees a multiple of UNIT elements (16 bytes when aligned)
        p = ref_ptr + (tl.load(toff_ptr + t) * UNIT + first * BLOCK)
        k = 1 + (sample - 1) * (n >= SAMPLE_MIN).to(tl.int32)  # small items are read whole
        ph = phase & (k - 1)
        ROWS: tl.constexpr = BLOCK // GROUP
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, GROUP)
        bad = tl.zeros([ROWS, GROUP], dtype=tl.int32)
        if KIND == 3:
            sq = tl.zeros([ROWS, GROUP], dtype=tl.float64)
        else:
            sq = tl.zeros([ROWS, GROUP], dtype=tl.float32)
        whole = n // GROUP  # whole groups; group g (g = ph mod k) starts at element g * GROUP
        taken = (whole - ph + k - 1) // k  # whole groups read
        tiles = taken // ROWS
        for i in range(tiles):  # tiles of ROWS groups, unmasked: 16-byte loads
            e = ((i * ROWS + rows) * k + ph)[:, None] * GROUP + cols[None, :]
            x = tl.load(p + e, eviction_policy="evict_first")
            bad += ((x & EXP) == EXP).to(tl.int32)
            f = _as_float(x, KIND)
            sq += f * f
        g = tiles * ROWS + rows  # the last, partial tile: masked by whole group (masked lanes read 0)
        e = (g * k + ph)[:, None] * GROUP + cols[None, :]
        x = tl.load(p + e, mask=(g < taken)[:, None], other=0, eviction_policy="evict_first")
        bad += ((x & EXP) == EXP).to(tl.int32)
        f = _as_float(x, KIND)
        sq += f * f
        e1 = whole * GROUP + cols  # the ragged tail, when its group is one of those read
        end = n * (whole % k == ph).to(tl.int32)
        y = tl.load(p + e1, mask=e1 < end, other=0)
        f1 = _as_float(y, KIND)
        n_bad = tl.sum(tl.sum(bad, axis=1), axis=0) + tl.sum(((y & EXP) == EXP).to(tl.int32), axis=0)
        total = tl.sum(tl.sum(sq, axis=1), axis=0) + tl.sum(f1 * f1, axis=0)
        tl.store(count_ptr + pid, n_bad.to(tl.float32))
        tl.store(sumsq_ptr + pid, total.to(tl.float32))
        if WITH_VALUE:
            if pid == 0:  # the loss: one element, item 0's first
                tl.store(value_ptr, _as_float(tl.load(p), KIND).to(tl.float32))


def usable(tensors) -> bool:
    """True when the kernel can check these tensors: Triton is there, all on one CUDA device, each of a
    supported float dtype and dense (contiguous)."""
    if not HAVE_TRITON or not tensors:
        return False
    device = tensors[0].device
    return device.type == "cuda" and all(t.device == device and t.dtype in _BITS and t.is_contiguous() for t in tensors)


class Layout:
    """The fixed part of the check for one list of tensors (loss first, then the gradients): their dtypes
    and sizes, cut into items; the item tables live on the device, uploaded once without a sync.

    n_out: items; owner[j]: the tensor item j belongs to; n_values: length of the result vector (see the
    module docstring), 2 * n_out, plus the loss's value when tensor 0 has one element (`has_value`)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.device = tensors[0].device
        self.n = len(tensors)
        self.dtypes = [t.dtype for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.nbytes = [t.numel() * t.element_size() for t in tensors]  # checked per step: no read past a tensor
        self.grad_nbytes = self.nbytes[1:]  # the gradients' part, compared as one list per step
        self.grad_bytes = sum(self.grad_nbytes)
        # tensor 0 (one element) is then the first item of the first group: its program writes the value too
        self.has_value = self.numels[0] == 1
        self.groups = []  # (dtype, tensor indices, items table on the device, first output, items, table position)
        owners: list[int] = []
        numels: list[int] = []
        group_sizes: list[int] = []
        table_pos = 0
        host_tables = []
        for dtype in dict.fromkeys(self.dtypes):
            idx = [i for i, d in enumerate(self.dtypes) if d == dtype]
            items = []
            for local, i in enumerate(idx):
                for first in range(0, self.numels[i], CHUNK):
                    items.append((local, first // BLOCK, min(CHUNK, self.numels[i] - first)))
                    owners.append(i)
                    numels.append(items[-1][2])
                    group_sizes.append(SECTOR // _ESIZE[dtype])
            if not items:
                continue
            host = torch.tensor(items, dtype=torch.int64).reshape(-1)
            if self.device.type == "cuda":
                host = host.pin_memory()
            host_tables.append(host)  # kept until the copy below has surely run (see `ready`)
            device_table = host.to(self.device, non_blocking=True)
            self.groups.append(
                (dtype, np.asarray(idx, dtype=np.int64), device_table, len(owners) - len(items), len(items), table_pos)
            )
            table_pos += len(idx)
        self._host_tables = host_tables
        self.table_len = table_pos  # entries of the per-slot offset table
        self.n_out = len(owners)
        self.n_values = 2 * self.n_out + (1 if self.has_value else 0)
        self.owner = np.asarray(owners, dtype=np.int64)  # output position -> tensor index (0: the loss)
        self.item_numel = np.asarray(numels, dtype=np.int64)  # elements of each item
        self.item_group = np.asarray(group_sizes, dtype=np.int64)  # elements of each of its 32-byte groups
        self._shares: dict[tuple[int, int], np.ndarray] = {}  # read_share's arrays, by (sample, phase)

    def read_share(self, sample: int, phase: int) -> np.ndarray:
        """Per item, the elements a check at this sample rate and phase reads over the item's elements (1.0
        for items read whole; as the kernel reads: whole groups with index = phase mod rate, and the ragged
        tail when its group is one of them). A sampled item's sum of squares over this share estimates the
        whole item's."""
        key = (sample, phase)
        share = self._shares.get(key)
        if share is None:
            if len(self._shares) >= 128:  # every phase of two rates: the rate settles, so this rarely clears
                self._shares.clear()
            share = self._shares[key] = self._read_share(sample, phase)
        return share

    def _read_share(self, sample: int, phase: int) -> np.ndarray:
        n, group = self.item_numel, self.item_group
        k = np.where(n >= SAMPLE_MIN, sample, 1)
        ph = phase & (k - 1)
        whole = n // group
        taken = (whole - ph + k - 1) // k
        tail = np.where(whole % k == ph, n - whole * group, 0)
        return (taken * group + tail) / np.maximum(n, 1)

    def matches(self, loss: torch.Tensor, n: int) -> bool:
        """Still the layout for this loss and n tensors in all (the gradients' sizes are checked per step)."""
        return n == self.n and loss.dtype == self.dtypes[0] and loss.device == self.device


class _Table:
    """One result slot's offset table: pinned host memory and its device copy. Rewritten only when the
    slot is taken again, i.e. after the event behind its last copy completed."""

    __slots__ = ("host", "host_np", "device", "ref", "ptrs", "units")

    def __init__(self, n: int, device) -> None:
        self.host = torch.zeros(max(n, 1), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.host_np[:] = -1  # nothing valid uploaded yet
        self.device = torch.empty(max(n, 1), dtype=torch.int64, device=device)
        self.ref = self.device.data_ptr()
        self.ptrs: list[int] = []  # the addresses the table holds now (usually the same every step)
        self.units: list[int] = []  # per group: UNIT of its offsets


_compiled: dict[tuple, Any] = {}  # compiled Triton kernels
_direct_ok = [True]


def kernels_compiled() -> int:
    """How many kernel variants were compiled so far (a check that compiled one is not charged as a step's cost)."""
    return len(_compiled)


def _interpreting() -> bool:
    return not isinstance(_check_kernel, triton.runtime.jit.JITFunction)


def enqueue(layout: Layout, ptrs: list[int], out: torch.Tensor, slot, sample: int = 1, phase: int = 0) -> None:
    """Check the tensors at addresses `ptrs` (the layout's tensors, in order) into out[:layout.n_values]
    (counts, sums of squares, the loss's value: see the module docstring), on the current stream. `slot`
    (a DeviceResults slot) holds this slot's offset table in its `aux`. `sample` (a power of two, 1 = every
    element): items of SAMPLE_MIN elements or more are read one 32-byte group in `sample`, those with index =
    phase mod sample (`Layout.read_share`); their counts and sums then cover that share of their elements."""
    if sample < 1 or sample & (sample - 1):
        raise ValueError(f"sample must be a power of two, not {sample}")
    if out.numel() < layout.n_values or out.dtype != torch.float32:
        raise ValueError(f"the result vector needs {layout.n_values} float32 values (Layout.n_values)")
    table = slot.aux
    if not isinstance(table, _Table) or table.host_np.size < layout.table_len or table.device.device != layout.device:
        table = slot.aux = _Table(layout.table_len, layout.device)
    if ptrs != table.ptrs:  # the caching allocator mostly hands out the same addresses: then nothing to do
        rel = np.asarray(ptrs, dtype=np.int64) - table.ref
        units = []
        for dtype, idx, _, _, _, pos in layout.groups:
            esize = _ESIZE[dtype]
            r = rel[idx]
            if (r % ALIGN).any():
                if (r % esize).any():
                    raise ValueError("a tensor address is not a multiple of its element size")
                unit, toff = 1, r // esize
            else:
                unit, toff = ALIGN // esize, r // ALIGN
            table.host_np[pos : pos + len(idx)] = toff
            units.append(unit)
        table.device.copy_(table.host, non_blocking=True)
        table.ptrs, table.units = ptrs, units
    stream = None
    n_out, base = layout.n_out, out.data_ptr()
    value_at = base + 4 * 2 * n_out
    for g, ((dtype, _, items, out_first, n_items, pos), unit) in enumerate(zip(layout.groups, table.units)):
        int_dtype, exp, kind = _BITS[dtype]
        with_value = g == 0 and layout.has_value
        key = (layout.device.index, dtype, unit, with_value)
        kernel = _compiled.get(key) if _direct_ok[0] else None
        if kernel is not None:
            if stream is None:  # the raw handle of torch's current stream, as Triton's own launch path reads it
                stream = triton.runtime.driver.active.get_current_stream(layout.device.index)
            try:
                kernel[(n_items, 1, 1)](
                    table.ref,
                    table.ref + 8 * pos,
                    items.data_ptr(),
                    base + 4 * out_first,
                    base + 4 * (n_out + out_first),
                    value_at,
                    sample,
                    phase,
                    exp,
                    kind,
                    unit,
                    BLOCK,
                    SECTOR // _ESIZE[dtype],
                    SAMPLE_MIN,
                    with_value,
                    stream=stream,
                )
                continue
            except Exception:  # Triton's internals moved: the generic launch from now on
                _direct_ok[0] = False
        compiled = _check_kernel[(n_items,)](
            table.device.view(int_dtype),
            table.device[pos:],
            items,
            out[out_first:],
            out[n_out + out_first :],
            out[2 * n_out :],
            sample,
            phase,
            EXP=exp,
            KIND=kind,
            UNIT=unit,
            BLOCK=BLOCK,
            GROUP=SECTOR // _ESIZE[dtype],
            SAMPLE_MIN=SAMPLE_MIN,
            WITH_VALUE=with_value,
            num_warps=NUM_WARPS,
        )
        if not _interpreting():
            _compiled[key] = compiled
