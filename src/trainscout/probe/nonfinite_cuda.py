"""The non-finite check's CUDA kernel: one launch counts the NaN/Inf elements of the loss and of every local
gradient, with no host sync and little host work per step.

`NonFiniteCheck` runs at the end of every backward pass. On a small model the step is short and host-bound,
so what matters is the Python on the training thread: one `torch._foreach_norm` over 54 gradients, the stack
of its 54 outputs and the copy cost ~0.2 ms of host time there, ~2 % of a 10 ms step. Here the gradients'
shapes and dtypes are fixed once (`Layout`), cut into items of at most `CHUNK` elements; per step the host
only reads each gradient's address, writes the addresses (as offsets from a reference pointer) into a small
pinned table, copies it to the device and launches one Triton program per item, per dtype. Each program
tests the exponent bits of its elements (all ones: Inf or NaN; integer work, which no fast-math flag can
fold away) and writes how many it found into `out[item]`. The host later maps nonzero items back to the
loss (tensor 0) or a gradient.

The reads are 16 bytes wide when every address is 16-byte aligned (caching-allocator blocks are): the
table then holds offsets in 16-byte units, so the compiler can prove the alignment from the arithmetic.

Importing this module needs neither CUDA nor Triton; `usable()` says whether the kernel can run.
"""

from __future__ import annotations

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

# dtype -> (the integer dtype of the same width, the exponent mask: all exponent bits set = Inf or NaN)
_BITS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}

_ESIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}

if HAVE_TRITON:

    @triton.jit(do_not_specialize_on_alignment=["toff_ptr", "item_ptr", "out_ptr"])
    def _count_nonfinite_kernel(
        ref_ptr,  # intN: the reference address (16-byte aligned); tensors are read at ref + offset
        toff_ptr,  # int64 [tensors]: each tensor's offset from ref, in UNIT-element steps
        item_ptr,  # int64 [items, 3]: (tensor, first block, elements)
        out_ptr,  # float32 [items]: non-finite elements found
        EXP: tl.constexpr,
        UNIT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        t = tl.load(item_ptr + 3 * pid)
        first = tl.load(item_ptr + 3 * pid + 1)
        n = tl.load(item_ptr + 3 * pid + 2)
        # UNIT * x + BLOCK * y: the compiler sees a multiple of UNIT elements (16 bytes when aligned)
        p = ref_ptr + (tl.load(toff_ptr + t) * UNIT + first * BLOCK)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        n_full = n // BLOCK
        for i in range(n_full):
            x = tl.load(p + i * BLOCK + offs, eviction_policy="evict_first")
            acc += ((x & EXP) == EXP).to(tl.int32)
        m = offs < n - n_full * BLOCK
        x = tl.load(p + n_full * BLOCK + offs, mask=m, other=0)
        acc += ((x & EXP) == EXP).to(tl.int32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0).to(tl.float32))


def usable(tensors) -> bool:
    """True when the kernel can check these tensors: Triton is there, all on one CUDA device, each of a
    supported float dtype and dense (contiguous)."""
    if not HAVE_TRITON or not tensors:
        return False
    device = tensors[0].device
    return device.type == "cuda" and all(
        t.device == device and t.dtype in _BITS and t.is_contiguous() for t in tensors)


class Layout:
    """The fixed part of the check for one list of tensors (loss first, then the gradients): their dtypes
    and sizes, cut into items; the item tables live on the device, uploaded once without a sync."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.device = tensors[0].device
        self.n = len(tensors)
        self.dtypes = [t.dtype for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.nbytes = [t.numel() * t.element_size() for t in tensors]  # checked per step: no read past a tensor
        self.grad_nbytes = self.nbytes[1:]  # the gradients' part, compared as one list per step
        self.groups = []  # (dtype, tensor indices, items table on the device, first output, items)
        owners: list[int] = []
        table_pos = 0
        host_tables = []
        for dtype in dict.fromkeys(self.dtypes):
            idx = [i for i, d in enumerate(self.dtypes) if d == dtype]
            items = []
            for local, i in enumerate(idx):
                for first in range(0, self.numels[i], CHUNK):
                    items.append((local, first // BLOCK, min(CHUNK, self.numels[i] - first)))
                    owners.append(i)
            if not items:
                continue
            host = torch.tensor(items, dtype=torch.int64).reshape(-1)
            if self.device.type == "cuda":
                host = host.pin_memory()
            host_tables.append(host)  # kept until the copy below has surely run (see `ready`)
            device_table = host.to(self.device, non_blocking=True)
            self.groups.append((dtype, np.asarray(idx, dtype=np.int64), device_table, len(owners) - len(items),
                                len(items), table_pos))
            table_pos += len(idx)
        self._host_tables = host_tables
        self.table_len = table_pos  # entries of the per-slot offset table
        self.n_out = len(owners)
        self.owner = np.asarray(owners, dtype=np.int64)  # output position -> tensor index (0: the loss)

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

_compiled: dict[tuple, object] = {}
_direct_ok = [True]


def _interpreting() -> bool:
    return not isinstance(_count_nonfinite_kernel, triton.runtime.jit.JITFunction)


def enqueue(layout: Layout, ptrs: list[int], out: torch.Tensor, slot) -> None:
    """Count the non-finite elements of the tensors at addresses `ptrs` (the layout's tensors, in order)
    into out[:layout.n_out], on the current stream. `slot` (a DeviceResults slot) holds this slot's
    offset table in its `aux`."""
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
            table.host_np[pos:pos + len(idx)] = toff
            units.append(unit)
        table.device.copy_(table.host, non_blocking=True)
        table.ptrs, table.units = ptrs, units
    stream = None
    for (dtype, _, items, out_first, n_items, pos), unit in zip(layout.groups, table.units):
        int_dtype, exp = _BITS[dtype]
        key = (layout.device.index, dtype, unit)
        kernel = _compiled.get(key) if _direct_ok[0] else None
        if kernel is not None:
            if stream is None:  # the raw handle of torch's current stream, as Triton's own launch path reads it
                stream = triton.runtime.driver.active.get_current_stream(layout.device.index)
            try:
                kernel[(n_items, 1, 1)](table.ref, table.ref + 8 * pos, items.data_ptr(),
                                        out.data_ptr() + 4 * out_first, exp, unit, BLOCK, stream=stream)
                continue
            except Exception:  # Triton's internals moved: the generic launch from now on
                _direct_ok[0] = False
        compiled = _count_nonfinite_kernel[(n_items,)](
            table.device.view(int_dtype), table.device[pos:], items, out[out_first:],
            EXP=exp, UNIT=unit, BLOCK=BLOCK, num_warps=NUM_WARPS)
        if not _interpreting():
            _compiled[key] = compiled

