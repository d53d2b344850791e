"""The fingerprint on CUDA tensors: one Triton kernel that reads each byte once and never syncs the host.

Same integer function as `cpu.py` (the reference; spec.md has the definition), computed where the tensor
lives so that a replica check costs one pass over device memory and no copy to the host.

`_fingerprint_kernel` runs a persistent grid (a few programs per SM). Each program walks tiles of
ROWS x COLS uint32 words (16 KiB by default; each thread issues ROWS 16-byte loads per tile), computes both
lanes with 32-bit integer work only, keeps per-column uint32 sums in registers, and writes its (S_A, S_B)
pair to a per-stream scratch buffer. The ragged last tile is done, masked, by program 0, so the loop over
full tiles has no masks. Each program then takes a ticket from a counter (atomic add, acq_rel); the program
that takes the last ticket adds all pairs, adds the zero-padded tail word (read from the tensor's last 1-3
bytes), applies fmix64, writes the fingerprint as int64 bits into out[slot], and resets the counter to 0
for the next call on that stream. Sums are mod 2^32, so neither the grid nor the order of additions can
change the result.

One launch per tensor, because on the GPU machine the host cost of a launch (not the kernel) dominated at
64 MiB: two launches through Triton's generic path cost ~130 us of Python per tensor against ~22 us of GPU
time. After the first call per configuration, the compiled kernel is launched directly with raw addresses
(the path Triton's launcher accepts for pointer arguments), skipping argument binding and specialisation;
any failure there falls back to the ordinary `kernel[grid](...)` path for good.

Scratch and counter are per (device, stream): launches on one stream run in order, so calls on the same
stream can share them, and calls on different streams never do. Do not replay two CUDA graphs that captured
fingerprints on the same stream concurrently on different streams (they would share one counter).

Importing this module needs neither CUDA nor Triton; `HAVE_TRITON` says whether the kernels exist.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from trainscout.fingerprint import cpu

try:  # Triton is optional: CPU-only installs use cpu.py and never import this module's kernels.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

MAX_WORDS_PER_LAUNCH = 1 << 30  # 4 GiB: keeps in-kernel offsets in int32 and lo(i) from wrapping
NUM_WARPS = 8
ROWS = 4  # 16-byte loads in flight per thread per tile
COLS = 4 * 32 * NUM_WARPS  # one 16-byte vector per thread per row
PROGRAMS_PER_SM = 8  # 4 are resident (64 registers, 256 threads); 8 balanced the tail best on H200
MULHI = 0  # 0: shifts on the ALU pipe; 1: lane A's shifts as mulhi; 2: both lanes' (same bits)
SCRATCH_HEAD = 16  # int32s before the partial sums: the ticket counter, then padding to 64 bytes


def _i32(v: int) -> int:
    """A uint32 as the int32 Triton receives (kernel arguments are typed by value; >= 2^31 would be i64)."""
    v &= cpu.M32
    return v - (1 << 32) if v >> 31 else v


if HAVE_TRITON:
    # The constants live in cpu.py (the reference); the kernel sees them as compile-time constants.
    _K_A = tl.constexpr(cpu.K_A)
    _K_B = tl.constexpr(cpu.K_B)
    _A_S1, _A_S2, _A_S3 = (tl.constexpr(v) for v in cpu.A_SHIFTS)
    _B_S1, _B_S2, _B_S3 = (tl.constexpr(v) for v in cpu.B_SHIFTS)
    _A_M1, _A_M2 = tl.constexpr(cpu.A_MUL1), tl.constexpr(cpu.A_MUL2)
    _B_M1, _B_M2 = tl.constexpr(cpu.B_MUL1), tl.constexpr(cpu.B_MUL2)
    _F_M1, _F_M2 = tl.constexpr(cpu.F_MUL1), tl.constexpr(cpu.F_MUL2)

    @triton.jit
    def _shr(x, s: tl.constexpr, MULHI: tl.constexpr):
        # x >> s for uint32. The mulhi form runs on the multiply pipe instead of the integer ALU pipe
        # (same bits; on H200 it measured slower, so it is off by default).
        if MULHI:
            return tl.umulhi(x, tl.full(x.shape, 1, tl.uint32) << (32 - s))  # 2^(32-s), folded
        else:
            return x >> s

    @triton.jit
    def _xorshift_mul(
        x, S1: tl.constexpr, M1: tl.constexpr, S2: tl.constexpr, M2: tl.constexpr, S3: tl.constexpr, MULHI: tl.constexpr
    ):
        x = x ^ _shr(x, S1, MULHI)
        x = x * tl.full(x.shape, M1, tl.uint32)
        x = x ^ _shr(x, S2, MULHI)
        x = x * tl.full(x.shape, M2, tl.uint32)
        return x ^ _shr(x, S3, MULHI)

    @triton.jit
    def _mix_a(x, MULHI: tl.constexpr):
        # murmur3's fmix32
        return _xorshift_mul(x, _A_S1, _A_M1, _A_S2, _A_M2, _A_S3, MULHI)

    @triton.jit
    def _mix_b(x, MULHI: tl.constexpr):
        # xxHash32's final avalanche
        return _xorshift_mul(x, _B_S1, _B_M1, _B_S2, _B_M2, _B_S3, MULHI)

    @triton.jit
    def _fmix64(x):
        x = x ^ (x >> 33)
        x = x * tl.full(x.shape, _F_M1, tl.uint64)
        x = x ^ (x >> 33)
        x = x * tl.full(x.shape, _F_M2, tl.uint64)
        x = x ^ (x >> 33)
        return x

    @triton.jit(
        do_not_specialize=[
            "part_off",
            "part_stride",
            "n_parts",
            "slot",
            "n_words",
            "seed_a",
            "seed_b",
            "tail_bytes",
            "tail_seed_a",
            "tail_seed_b",
            "len_lo",
            "len_hi",
        ],
        do_not_specialize_on_alignment=["tail_ptr", "part_ptr", "counter_ptr", "out_ptr"],
    )
    def _fingerprint_kernel(
        w_ptr,  # int32: this launch's words (16-byte alignment is specialised on: vector loads)
        tail_ptr,  # uint8: the 1-3 bytes after the last full word (read only if HAS_TAIL)
        part_ptr,  # int32 [2, part_stride]: lane A partial sums, then lane B's
        counter_ptr,  # int32 [1]: tickets taken so far; 0 between calls
        out_ptr,  # int64 [k]
        part_off,  # this launch's first column in part_ptr (tensors over 4 GiB take several launches)
        part_stride,
        n_parts,  # programs over all launches of this fingerprint
        slot,
        n_words,  # words in this launch (< 2^31)
        seed_a,  # tA / tB of this launch's first global word index, as int32 bits
        seed_b,
        tail_bytes,
        tail_seed_a,
        tail_seed_b,
        len_lo,  # the length term's low and high 32 bits, as int32 bits
        len_hi,
        ROWS: tl.constexpr,
        COLS: tl.constexpr,
        MULHI: tl.constexpr,
        HAS_TAIL: tl.constexpr,
    ):
        TILE: tl.constexpr = ROWS * COLS
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        # j*K mod 2^32 for the tile-local index j: loop invariant; per word the tweak is one add.
        ramp_a = offs.to(tl.uint32) * _K_A
        ramp_b = offs.to(tl.uint32) * _K_B
        sa = seed_a.to(tl.uint32, bitcast=True)
        sb = seed_b.to(tl.uint32, bitcast=True)
        acc_a = tl.zeros([COLS], dtype=tl.uint32)
        acc_b = tl.zeros([COLS], dtype=tl.uint32)
        n_full = n_words // TILE
        for tile in tl.range(pid, n_full, nprog):
            start = tile * TILE
            w = tl.load(w_ptr + start + offs, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
            su = start.to(tl.uint32)
            ta = sa + su * _K_A
            tb = sb + su * _K_B
            acc_a += tl.sum(_mix_a(w + ramp_a + ta, MULHI >= 1), axis=0, dtype=tl.uint32)
            acc_b += tl.sum(_mix_b(w + ramp_b + tb, MULHI >= 2), axis=0, dtype=tl.uint32)
        if pid == 0:
            start = n_full * TILE
            mask = offs < n_words - start
            w = tl.load(w_ptr + start + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
            su = start.to(tl.uint32)
            ta = sa + su * _K_A
            tb = sb + su * _K_B
            zero = tl.zeros([ROWS, COLS], dtype=tl.uint32)
            acc_a += tl.sum(tl.where(mask, _mix_a(w + ramp_a + ta, MULHI >= 1), zero), axis=0, dtype=tl.uint32)
            acc_b += tl.sum(tl.where(mask, _mix_b(w + ramp_b + tb, MULHI >= 2), zero), axis=0, dtype=tl.uint32)
        tot_a = tl.sum(acc_a, axis=0, dtype=tl.uint32)
        tot_b = tl.sum(acc_b, axis=0, dtype=tl.uint32)
        tl.store(part_ptr + part_off + pid, tot_a.to(tl.int32, bitcast=True))
        tl.store(part_ptr + part_stride + part_off + pid, tot_b.to(tl.int32, bitcast=True))
        # All of this program's stores before its ticket; acq_rel orders them before the counter update
        # and makes every earlier program's stores visible to whoever takes the last ticket.
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == n_parts - 1:
            cols = tl.arange(0, COLS)
            fin_a = tl.zeros([COLS], dtype=tl.uint32)
            fin_b = tl.zeros([COLS], dtype=tl.uint32)
            for first in tl.range(0, n_parts, COLS):
                m = first + cols < n_parts
                pa = tl.load(part_ptr + first + cols, mask=m, other=0, volatile=True)
                pb = tl.load(part_ptr + part_stride + first + cols, mask=m, other=0, volatile=True)
                fin_a += pa.to(tl.uint32, bitcast=True)
                fin_b += pb.to(tl.uint32, bitcast=True)
            if HAS_TAIL:
                k = tl.arange(0, 4)
                byte = tl.load(tail_ptr + k, mask=k < tail_bytes, other=0).to(tl.uint32)
                tw = tl.sum(byte << (k.to(tl.uint32) * 8), axis=0, dtype=tl.uint32)  # little-endian, zero-padded
                tw4 = tl.zeros([4], dtype=tl.uint32) + tw
                z4 = tl.zeros([4], dtype=tl.uint32)
                la = tl.where(k == 0, _mix_a(tw4 + tail_seed_a.to(tl.uint32, bitcast=True), False), z4)
                lb = tl.where(k == 0, _mix_b(tw4 + tail_seed_b.to(tl.uint32, bitcast=True), False), z4)
                sum_a = tl.sum(fin_a, axis=0, dtype=tl.uint32) + tl.sum(la, axis=0, dtype=tl.uint32)
                sum_b = tl.sum(fin_b, axis=0, dtype=tl.uint32) + tl.sum(lb, axis=0, dtype=tl.uint32)
            else:
                sum_a = tl.sum(fin_a, axis=0, dtype=tl.uint32)
                sum_b = tl.sum(fin_b, axis=0, dtype=tl.uint32)
            packed = sum_a.to(tl.uint64) | (sum_b.to(tl.uint64) << 32)
            len_term = len_lo.to(tl.uint32, bitcast=True).to(tl.uint64) | (
                len_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32
            )
            fp = _fmix64(packed ^ len_term)
            tl.store(out_ptr + slot, fp.to(tl.int64, bitcast=True))
            tl.store(counter_ptr, 0)


@dataclass(frozen=True)
class LaunchConfig:
    """How the kernel is launched: speed only, never the value (tests check several)."""

    rows: int = ROWS
    num_warps: int = NUM_WARPS
    programs_per_sm: int = PROGRAMS_PER_SM
    mulhi: int = MULHI

    @property
    def cols(self) -> int:
        return 4 * 32 * self.num_warps

    @property
    def tile(self) -> int:
        return self.rows * self.cols


DEFAULT_CONFIG = LaunchConfig()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launches(n_words: int, word_base: int) -> list[tuple[int, int]]:
    """(local start, words) per launch: at most MAX_WORDS_PER_LAUNCH, never across a 2^32 boundary of
    the global index (hi(i) is a per-launch constant folded into the seed). Always at least one launch:
    the kernel also finalises, even for fewer than 4 bytes."""
    out = []
    pos = 0
    while pos < n_words:
        g = word_base + pos
        m = min(MAX_WORDS_PER_LAUNCH, n_words - pos, (1 << 32) - (g & cpu.M32))
        out.append((pos, m))
        pos += m
    return out or [(0, 0)]


_scratch: dict[tuple[str, int, int], torch.Tensor] = {}
_compiled: dict[tuple, Any] = {}  # compiled Triton kernels


def kernels_compiled() -> int:
    """Kernel variants compiled so far (a caller that compiled one does not charge it as a step's cost)."""
    return len(_compiled)


_direct_ok = [True]


def _stream_handle(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # the interpreter (CPU tensors): no streams
    # What Triton's own launch path asks for (torch's current raw stream), without building a Stream object.
    return triton.runtime.driver.active.get_current_stream(device.index)


def _scratch_for(device: torch.device, stream: int, n_parts: int) -> torch.Tensor:
    """The (device, stream)'s scratch: the ticket counter (zero between calls) and room for n_parts pairs."""
    key = (device.type, device.index or 0, stream)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < SCRATCH_HEAD + 2 * n_parts:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Inside a capture the zero fill would only run at replay, leaving the counter undefined for
            # uncaptured calls on this stream: the scratch must exist before capturing.
            raise RuntimeError(
                "fingerprint the same (or a larger) tensor once on this stream before capturing a CUDA graph"
            )
        # Zeroed on this stream; an older buffer freed here is reused by the allocator only in stream order.
        cap = max(n_parts, 4096)
        buf = torch.zeros(SCRATCH_HEAD + 2 * cap, dtype=torch.int32, device=device)
        _scratch[key] = buf
    return buf


def _interpreting() -> bool:
    return not isinstance(_fingerprint_kernel, triton.runtime.jit.JITFunction)


def _enqueue(
    src: torch.Tensor,
    byte_start: int,
    nbytes: int,
    word_base: int,
    out: torch.Tensor,
    slot: int,
    config: LaunchConfig = DEFAULT_CONFIG,
    sm_count: int | None = None,
) -> None:
    """Enqueue on the current stream the fingerprint of bytes [byte_start, byte_start + nbytes) of the
    contiguous tensor `src` (flat, C order), with global word indices from word_base, into out[slot]."""
    if not HAVE_TRITON:
        raise RuntimeError("the CUDA fingerprint needs Triton; install triton or use the CPU path")
    n_words = nbytes // 4
    tail_bytes = nbytes - 4 * n_words
    addr = src.data_ptr() + byte_start
    if n_words and addr % 4:
        # A view starting at an odd byte offset cannot be read as uint32 words: copy it (rare: slices of
        # 1- and 2-byte dtypes at unaligned element offsets).
        src = src.reshape(-1).view(torch.uint8)[byte_start : byte_start + nbytes].clone()
        byte_start = 0
        addr = src.data_ptr()
    device = src.device
    if sm_count is None:
        sm_count = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    launches = _launches(n_words, word_base)
    grids = [max(1, min(-(-m // config.tile), sm_count * config.programs_per_sm)) for _, m in launches]
    n_parts = sum(grids)
    stream = _stream_handle(device)
    scratch = _scratch_for(device, stream, n_parts)
    cap = (scratch.numel() - SCRATCH_HEAD) // 2
    length = cpu.length_term(nbytes)
    i_tail = word_base + n_words
    tail_args = (
        tail_bytes,
        _i32(cpu.tweak_a(i_tail)),
        _i32(cpu.tweak_b(i_tail)),
        _i32(length),
        _i32(length >> 32),
    )
    constexprs = (config.rows, config.cols, config.mulhi, tail_bytes > 0)
    off = 0
    for (start, m), grid in zip(launches, grids, strict=True):
        g = word_base + start
        w_addr = addr + 4 * start if m else scratch.data_ptr()
        ints = (off, cap, n_parts, slot, m, _i32(cpu.tweak_a(g)), _i32(cpu.tweak_b(g)), *tail_args)
        key = (device.type, device.index, w_addr % 16 == 0, constexprs, config.num_warps)
        kernel = _compiled.get(key) if _direct_ok[0] else None
        if kernel is not None:
            try:
                kernel[(grid, 1, 1)](
                    w_addr,
                    addr + 4 * n_words if tail_bytes else scratch.data_ptr(),
                    scratch.data_ptr() + 4 * SCRATCH_HEAD,
                    scratch.data_ptr(),
                    out.data_ptr(),
                    *ints,
                    *constexprs,
                    stream=stream,
                )
                off += grid
                continue
            except Exception:  # Triton's internals moved: use the generic path from now on
                _direct_ok[0] = False
        flat = src.reshape(-1).view(torch.uint8)[byte_start : byte_start + nbytes]
        words = flat[4 * start : 4 * (start + m)].view(torch.int32) if m else scratch
        compiled = _fingerprint_kernel[(grid,)](
            words,
            flat[4 * n_words :] if tail_bytes else scratch.view(torch.uint8),
            scratch[SCRATCH_HEAD:],
            scratch,
            out,
            *ints,
            ROWS=config.rows,
            COLS=config.cols,
            MULHI=config.mulhi,
            HAS_TAIL=tail_bytes > 0,
            num_warps=config.num_warps,
        )
        if not _interpreting() and words.data_ptr() == w_addr:
            _compiled[key] = compiled
        off += grid


class PreparedRanges:
    """Byte ranges of CUDA tensors hashed again and again (the replicated-state slots, the gathered
    parameters of an FSDP unit), with their launch arguments worked out once: `enqueue(out)` then costs
    one raw kernel launch per range.

    out[i] receives the fingerprint of range i, as `fingerprint_range_cuda_async` would write it. By
    default the tensors given here are hashed and kept referenced, so their raw addresses stay valid (a
    tensor replaced in the model is then still the old storage: re-prepare when the state's layout
    changes). `enqueue(out, tensors)` hashes the same ranges of other tensors of the same sizes instead,
    reading their addresses at that call: for storage that is freed and allocated again between calls
    (FSDP's unsharded parameters). All ranges must be on one device. Ranges this fast path cannot take
    (strided or unaligned views, over 4 GiB, a variant not compiled yet, or after the raw launch path
    failed once) go through `_enqueue`, with the same value.
    """

    def __init__(self, items: list[tuple[torch.Tensor, int, int]], config: LaunchConfig = DEFAULT_CONFIG) -> None:
        if not HAVE_TRITON:
            raise RuntimeError("the CUDA fingerprint needs Triton")
        devices = {t.device for t, _, _ in items}
        if len(devices) > 1 or any(d.type != "cuda" for d in devices):
            raise ValueError(f"PreparedRanges takes ranges of one CUDA device, got {sorted(map(str, devices))}")
        self.device = next(iter(devices)) if devices else None
        self.config = config
        self.items = [(t, start, end) for t, start, end in items]
        self.nbytes = sum(end - start for _, start, end in items)
        self._sizes = [t.numel() * t.element_size() for t, _, _ in self.items]
        self._plans: list[tuple | None] = []
        self.max_parts = 1
        sm = _sm_count(self.device.index) if self.device is not None else 1
        for (t, start, end), size in zip(self.items, self._sizes):
            cpu.check_range(size, start, end)
            self._plans.append(self._plan(t, start, end, sm))

    def _plan(self, t: torch.Tensor, start: int, end: int, sm: int) -> tuple | None:
        """Launch arguments that do not depend on the tensor's address: (start, words, grid, ints, constexprs)."""
        nbytes = end - start
        n_words = nbytes // 4
        tail_bytes = nbytes - 4 * n_words
        word_base = start // 4
        if not t.is_contiguous() or n_words > MAX_WORDS_PER_LAUNCH:
            return None
        if (word_base & cpu.M32) + n_words > (1 << 32) or word_base >> 32:
            return None  # more than one launch: the general path
        cfg = self.config
        grid = max(1, min(-(-n_words // cfg.tile), sm * cfg.programs_per_sm))
        self.max_parts = max(self.max_parts, grid)
        length = cpu.length_term(nbytes)
        i_tail = word_base + n_words
        ints = (
            n_words,
            _i32(cpu.tweak_a(word_base)),
            _i32(cpu.tweak_b(word_base)),
            tail_bytes,
            _i32(cpu.tweak_a(i_tail)),
            _i32(cpu.tweak_b(i_tail)),
            _i32(length),
            _i32(length >> 32),
        )
        constexprs = (cfg.rows, cfg.cols, cfg.mulhi, tail_bytes > 0)
        return (start, n_words, grid, ints, constexprs)

    def compile(self) -> None:
        """Compile (or load from Triton's cache) every kernel variant these ranges need, with one throwaway
        launch each, so the first real `enqueue` does not pay for it (~0.1-1 s once per process)."""
        if self.device is None:
            return
        scratch_out = torch.empty(1, dtype=torch.int64, device=self.device)
        seen = set()
        with torch.cuda.device(self.device):
            for (t, start, end), plan in zip(self.items, self._plans):
                key = self._key(t.data_ptr(), plan) if plan is not None else None
                if key is not None and (key in _compiled or key in seen):
                    continue
                seen.add(key)
                _enqueue(_contiguous(t), start, end - start, start // 4, scratch_out, 0, self.config)

    def _key(self, base: int, plan: tuple) -> tuple | None:
        """The compiled-kernel key of a planned range of a tensor at address `base`; None when the words
        cannot be read in place (not 4-byte aligned)."""
        start, n_words, _, _, constexprs = plan
        w_addr = base + start
        if n_words and w_addr % 4:
            return None
        assert self.device is not None  # compile() and enqueue() return first when there is no range
        return (
            self.device.type,
            self.device.index,
            (not n_words) or w_addr % 16 == 0,
            constexprs,
            self.config.num_warps,
        )

    def enqueue(self, out: torch.Tensor, tensors: list[torch.Tensor] | None = None) -> None:
        """Enqueue every range's fingerprint into out[0..len-1] on the current stream; no host sync.
        tensors: hash these (contiguous, each the byte size of the prepared one) instead of the prepared."""
        if self.device is None:
            return
        if out.dtype != torch.int64 or out.device != self.device or out.numel() < len(self.items):
            raise ValueError("out must be an int64 tensor on the ranges' device with a slot per range")
        if tensors is not None and len(tensors) != len(self.items):
            raise ValueError(f"{len(tensors)} tensors for {len(self.items)} prepared ranges")
        if self.device.index != torch.cuda.current_device():
            with torch.cuda.device(self.device):
                self.enqueue(out, tensors)
            return
        stream = _stream_handle(self.device)
        scratch = _scratch_for(self.device, stream, self.max_parts)
        sp = scratch.data_ptr()
        cap = (scratch.numel() - SCRATCH_HEAD) // 2
        part = sp + 4 * SCRATCH_HEAD
        optr = out.data_ptr()
        for i, plan in enumerate(self._plans):
            t = self.items[i][0] if tensors is None else tensors[i]
            if tensors is not None and (t.device != self.device or t.numel() * t.element_size() != self._sizes[i]):
                raise ValueError(f"tensor {i} does not match the prepared range's device and size")
            kernel = None
            if plan is not None and _direct_ok[0] and (tensors is None or t.is_contiguous()):
                base = t.data_ptr()
                key = self._key(base, plan)
                kernel = _compiled.get(key) if key is not None else None
            if kernel is not None:
                assert plan is not None  # kernels are looked up for planned ranges only
                start, n_words, grid, ints, constexprs = plan
                w_addr = base + start
                try:
                    kernel[(grid, 1, 1)](
                        w_addr if n_words else sp,
                        w_addr + 4 * n_words if constexprs[3] else sp,
                        part,
                        sp,
                        optr,
                        0,
                        cap,
                        grid,
                        i,
                        *ints,
                        *constexprs,
                        stream=stream,
                    )
                    continue
                except Exception:  # Triton's internals moved: the general path from now on
                    _direct_ok[0] = False
            _, start, end = self.items[i]
            _enqueue(_contiguous(t), start, end - start, start // 4, out, i, self.config)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself if contiguous, else a contiguous copy (one device copy; the fingerprint is over the
    logical C order, so a strided view and its contiguous copy agree)."""
    return t if t.is_contiguous() else t.detach().contiguous()


def _check_out(t: torch.Tensor, out: torch.Tensor, slot: int) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"expected a CUDA tensor, got {t.device}")
    if out.dtype != torch.int64 or out.device != t.device or not out.is_contiguous():
        raise ValueError("out must be a contiguous int64 tensor on the tensor's device")
    if not 0 <= slot < out.numel():
        raise IndexError(f"slot {slot} outside out[{out.numel()}]")


def fingerprint_tensor_cuda_async(
    t: torch.Tensor, out: torch.Tensor, slot: int, stream: torch.cuda.Stream | None = None
) -> None:
    """Write t's fingerprint (as int64 bits; `cpu.as_unsigned64` turns it back) into out[slot], enqueued
    on `stream` (default: the current stream) without any host synchronisation.

    With an explicit stream, that stream first waits for the current one (so pending writes to t are
    visible) and t is recorded on it (so its memory is not reused before the read). `out` must be an int64
    CUDA tensor on t's device; it is written by a kernel, so read it after the stream's work completes.
    """
    _check_out(t, out, slot)
    if t.device.index != torch.cuda.current_device():  # Triton launches on the current device
        with torch.cuda.device(t.device):
            fingerprint_tensor_cuda_async(t, out, slot, stream)
        return
    if stream is None:
        src = _contiguous(t)
        _enqueue(src, 0, src.numel() * src.element_size(), 0, out, slot)
        return
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        t.record_stream(stream)
        out.record_stream(stream)
        src = _contiguous(t)
        _enqueue(src, 0, src.numel() * src.element_size(), 0, out, slot)


def fingerprint_range_cuda_async(t: torch.Tensor, start_byte: int, end_byte: int, out: torch.Tensor, slot: int) -> None:
    """`fingerprint_tensor_cuda_async` for bytes [start_byte, end_byte) of t, on the current stream (same
    definition as `cpu.fingerprint_range`: word indices offset by start_byte/4, L = end_byte - start_byte).
    Ranges starting at a multiple of 16 bytes (of a 16-byte aligned tensor) get 16-byte loads."""
    _check_out(t, out, slot)
    src = _contiguous(t)
    cpu.check_range(src.numel() * src.element_size(), start_byte, end_byte)
    with torch.cuda.device(t.device):
        _enqueue(src, start_byte, end_byte - start_byte, start_byte // 4, out, slot)


def fingerprint_tensor_cuda(t: torch.Tensor) -> int:
    """t's fingerprint as an unsigned 64-bit int (syncs the host once, to read the result)."""
    out = torch.empty(1, dtype=torch.int64, device=t.device)
    fingerprint_tensor_cuda_async(t, out, 0)
    return cpu.as_unsigned64(int(out.item()))


def fingerprint_range_cuda(t: torch.Tensor, start_byte: int, end_byte: int) -> int:
    out = torch.empty(1, dtype=torch.int64, device=t.device)
    fingerprint_range_cuda_async(t, start_byte, end_byte, out, 0)
    return cpu.as_unsigned64(int(out.item()))
