"""The fingerprint's definition and its CPU implementations, a C kernel and numpy, which every path must equal.

Replicas are compared bit for bit by exchanging one 64-bit fingerprint per tensor (or per byte range of a
tensor, for the rotating checks of the numerical-integrity layer). The GPU kernel in `gpu.py` computes the
same integer function; this module is the reference it is tested against, and the path for CPU tensors.

The function (spec.md gives the reasoning and the guarantees): the bytes are read as little-endian uint32
words w_i (the tail zero-padded); word i goes through two lanes, each a bijection of w_i for fixed i that
also depends on i,

    a_i = fmix32_A(w_i + tA(i))      tA(i) = lo(i)*K_A + hi(i)*H_A
    b_i = fmix32_B(w_i + tB(i))      tB(i) = lo(i)*K_B + hi(i)*H_B + C_B      (all mod 2^32)

the lanes are summed mod 2^32, and the 64-bit result is a bijection of the two sums for a fixed length:

    F = fmix64((S_A | S_B << 32) XOR (L*K_L + C_L mod 2^64)).

Work per word is a handful of 32-bit integer operations, which is what lets the GPU kernel run at memory
bandwidth. On the CPU the lane sums come from the C extension `_native` (built by `pip install` when a
compiler is there; one auto-vectorised pass, SSE2/SSE4.1/AVX2 picked at import, GIL released) when it
imports and the words are a contiguous uint32 array; otherwise from numpy, in cache-sized chunks so memory
stays bounded. The numpy path is the reference the C kernel is tested against. `backend()` says which path
is in use, `use_native(False)` (or TRAINSCOUT_FINGERPRINT_NATIVE=0 in the environment) forces numpy.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import numpy as np
import torch

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF

# Position tweaks. K_* are odd, so lo(i) -> lo(i)*K is a bijection; H_A is odd and H_B even, which makes
# (tA(i), tB(i)) differ from (tA(j), tB(j)) for every i != j below 2^64 (spec.md, "Position").
K_A = 0x9E3779B1
H_A = 0x7FEB352D
K_B = 0x27D4EB2F
H_B = 0x846CA68A
C_B = 0x165667B1
# Lane A's mixer is murmur3's fmix32; lane B's is xxHash32's final avalanche (other shifts and multipliers),
# so the two lanes are different functions of the word, not one function at shifted points.
A_MUL1, A_MUL2 = 0x85EBCA6B, 0xC2B2AE35
A_SHIFTS = (16, 13, 16)
B_MUL1, B_MUL2 = 0x85EBCA77, 0xC2B2AE3D
B_SHIFTS = (15, 13, 16)
# Length term and murmur3's fmix64.
K_L = 0x9E3779B97F4A7C15
C_L = 0xD6E8FEB86659FD93
F_MUL1, F_MUL2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53

DEFAULT_CHUNK_WORDS = 1 << 18  # 1 MiB of words per numpy chunk: stays in L2/L3 across the ~20 passes

# The C extension's interface version this module speaks (TS_API_VERSION in _native.c).
NATIVE_API_VERSION = 1

Buffer = bytes | bytearray | memoryview | np.ndarray
_LE_U32 = np.dtype("<u4")


# ---------------------------------------------------------------- scalar pieces (host side of both paths)


def fmix32_a(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * A_MUL1) & M32
    x ^= x >> 13
    x = (x * A_MUL2) & M32
    return x ^ (x >> 16)


def fmix32_b(x: int) -> int:
    x &= M32
    x ^= x >> 15
    x = (x * B_MUL1) & M32
    x ^= x >> 13
    x = (x * B_MUL2) & M32
    return x ^ (x >> 16)


def fmix64(x: int) -> int:
    x &= M64
    x ^= x >> 33
    x = (x * F_MUL1) & M64
    x ^= x >> 33
    x = (x * F_MUL2) & M64
    return x ^ (x >> 33)


def tweak_a(i: int) -> int:
    """Lane A's position term for global word index i (any i >= 0)."""
    return ((i & M32) * K_A + (i >> 32) * H_A) & M32


def tweak_b(i: int) -> int:
    return ((i & M32) * K_B + (i >> 32) * H_B + C_B) & M32


def lane_a(word: int, i: int) -> int:
    return fmix32_a(word + tweak_a(i))


def lane_b(word: int, i: int) -> int:
    return fmix32_b(word + tweak_b(i))


def length_term(nbytes: int) -> int:
    return (nbytes * K_L + C_L) & M64


def finalize(sum_a: int, sum_b: int, nbytes: int) -> int:
    """The 64-bit fingerprint from the two lane sums (mod 2^32) and the byte length: a bijection of the
    pair (sum_a, sum_b) for a fixed length, so any change of either sum changes the result."""
    packed = (sum_a & M32) | ((sum_b & M32) << 32)
    return fmix64(packed ^ length_term(nbytes))


def tail_word(tail: bytes) -> int:
    """The last 1-3 bytes of a buffer whose length is not a multiple of 4, zero-padded to one word."""
    return int.from_bytes(bytes(tail) + b"\0" * (4 - len(tail)), "little")


def as_signed64(value: int) -> int:
    """A fingerprint as the int64 a device buffer holds (two's complement)."""
    value &= M64
    return value - (1 << 64) if value >> 63 else value


def as_unsigned64(value: int) -> int:
    """The inverse of `as_signed64`: what `fingerprint_tensor_cuda_async` wrote, as the fingerprint."""
    return int(value) & M64


# ---------------------------------------------------------------- numpy lanes


@functools.lru_cache(maxsize=8)
def _ramps(n: int) -> tuple[np.ndarray, np.ndarray]:
    """j*K_A and j*K_B mod 2^32 for j < n: the per-position part of the tweaks, shared by every chunk."""
    j = np.arange(n, dtype=np.uint32)
    ramp_a = j * np.uint32(K_A)
    ramp_b = j * np.uint32(K_B)
    ramp_a.flags.writeable = False
    ramp_b.flags.writeable = False
    return ramp_a, ramp_b


def _mix_inplace(x: np.ndarray, tmp: np.ndarray, shifts: tuple[int, int, int], m1: int, m2: int) -> None:
    s1, s2, s3 = shifts
    np.right_shift(x, np.uint32(s1), out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, np.uint32(m1), out=x)
    np.right_shift(x, np.uint32(s2), out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, np.uint32(m2), out=x)
    np.right_shift(x, np.uint32(s3), out=tmp)
    np.bitwise_xor(x, tmp, out=x)


def _pieces(n_words: int, word_base: int, chunk_words: int) -> Iterator[tuple[int, int]]:
    """(local start, length) pieces of at most chunk_words that never cross a 2^32 boundary of the global
    index, so hi(i) is constant in each piece and lo(i) = lo(start) + j without wrapping."""
    pos = 0
    while pos < n_words:
        g = word_base + pos
        to_boundary = (1 << 32) - (g & M32)
        m = min(chunk_words, n_words - pos, to_boundary)
        yield pos, m
        pos += m


def _sum_pieces(words: np.ndarray, word_base: int, pieces: list[tuple[int, int]], size: int) -> tuple[int, int]:
    ramp_a, ramp_b = _ramps(size)
    x = np.empty(size, dtype=np.uint32)
    tmp = np.empty(size, dtype=np.uint32)
    sum_a = 0
    sum_b = 0
    for start, m in pieces:
        w = words[start : start + m]
        g = word_base + start
        xv, tv = x[:m], tmp[:m]
        # tA(g + j) = tA(g) + j*K_A mod 2^32 because the piece does not cross a 2^32 boundary of the index.
        np.add(w, ramp_a[:m], out=xv)
        np.add(xv, np.uint32(tweak_a(g)), out=xv)
        _mix_inplace(xv, tv, A_SHIFTS, A_MUL1, A_MUL2)
        sum_a += int(np.add.reduce(xv, dtype=np.uint64))
        np.add(w, ramp_b[:m], out=xv)
        np.add(xv, np.uint32(tweak_b(g)), out=xv)
        _mix_inplace(xv, tv, B_SHIFTS, B_MUL1, B_MUL2)
        sum_b += int(np.add.reduce(xv, dtype=np.uint64))
    return sum_a & M32, sum_b & M32


@functools.lru_cache(maxsize=1)
def default_threads() -> int:
    # Inside a training process every core is the job's: one thread unless asked (fingerprint.threads).
    return max(1, min(os.cpu_count() or 1, _settings().threads))


# ---------------------------------------------------------------- native lanes (C extension)


def _load_native() -> tuple[ModuleType | None, str]:
    """The C extension if it imports and speaks this module's interface, else None and why not. Importing
    it only loads a shared library built at install time: nothing is ever compiled here."""
    try:
        from trainscout.fingerprint import _native  # type: ignore[attr-defined]  # C extension, no stub
    except ImportError as exc:
        return None, f"native module not built ({exc})"
    except Exception as exc:  # noqa: BLE001 - a broken build must cost speed only, never the job
        return None, f"native module failed to load ({exc!r})"
    version = getattr(_native, "API_VERSION", None)
    if version != NATIVE_API_VERSION:
        return None, (
            f"native module {_native.__file__} has interface {version}, this code wants "
            f"{NATIVE_API_VERSION}: stale build, reinstall the package"
        )
    return _native, ""


_native, NATIVE_UNAVAILABLE = _load_native()


def _settings():
    from trainscout.config import from_environ

    return from_environ()[0].fingerprint


_use_native = _native is not None and _settings().native


def native_available() -> bool:
    """Whether the C extension is built and loadable (whether or not it is in use)."""
    return _native is not None


def use_native(enabled: bool) -> bool:
    """Use the C kernel (True) or force the numpy path (False) from now on, process-wide; returns the
    previous setting. For tests and benchmarks; TRAINSCOUT_FINGERPRINT_NATIVE=0 sets False at import."""
    global _use_native
    if enabled and _native is None:
        raise RuntimeError(f"trainscout fingerprint: {NATIVE_UNAVAILABLE}")
    previous, _use_native = _use_native, bool(enabled)
    return previous


def backend() -> str:
    """The path contiguous buffers take now, for logs and the run's summary: "native-avx2" (or
    "native-sse4.1", "native-default") or "numpy". Non-contiguous arrays always take numpy."""
    if _use_native and _native is not None:
        return f"native-{_native.variant()}"
    return "numpy"


def backend_detail() -> str:
    """`backend()` with the reason when it is numpy."""
    if _use_native and _native is not None:
        return f"native C kernel, {_native.variant()} variant (supported here: {', '.join(_native.variants())})"
    if _native is not None:
        return "numpy (native C kernel built but switched off: use_native(False) or TRAINSCOUT_FINGERPRINT_NATIVE=0)"
    return f"numpy ({NATIVE_UNAVAILABLE})"


def _native_lane_sums(words: np.ndarray, word_base: int, chunk_words: int, threads: int | None) -> tuple[int, int]:
    """Lane sums by the C kernel: one call over the whole buffer (it splits at 2^32 index boundaries
    itself), or contiguous slices on several threads (it releases the GIL). As with numpy, threads are
    used only when the buffer has at least that many chunks of chunk_words."""
    assert _native is not None
    n = int(words.shape[0])
    n_threads = min(threads or default_threads(), -(-n // chunk_words))
    if n_threads <= 1:
        return _native.lane_sums(words, word_base)
    bounds = [n * k // n_threads for k in range(n_threads + 1)]

    def part(k: int) -> tuple[int, int]:
        return _native.lane_sums(words[bounds[k] : bounds[k + 1]], word_base + bounds[k])

    with ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="trainscout-fp") as pool:
        parts = list(pool.map(part, range(n_threads)))
    return sum(p[0] for p in parts) & M32, sum(p[1] for p in parts) & M32


# ---------------------------------------------------------------- dispatch


def lane_sums(
    words: np.ndarray,
    word_base: int = 0,
    chunk_words: int = DEFAULT_CHUNK_WORDS,
    threads: int | None = None,
) -> tuple[int, int]:
    """(S_A, S_B) mod 2^32 over uint32 `words` whose first word has global index `word_base`.

    A contiguous 1-D array goes to the C kernel when it is available and enabled (`backend()`); anything
    else to numpy. Sums mod 2^32 do not depend on the order they are added in, so chunks may run on several
    threads (both paths release the GIL); numpy's memory stays at two chunk buffers per thread.
    """
    if words.dtype != _LE_U32:
        raise TypeError(f"words must be little-endian uint32, got {words.dtype}")
    if chunk_words <= 0:
        raise ValueError("chunk_words must be positive")
    n = int(words.shape[0])
    if n == 0:
        return 0, 0
    if _use_native and words.ndim == 1 and words.flags.c_contiguous and 0 <= word_base and word_base + n <= 1 << 64:
        return _native_lane_sums(words, word_base, chunk_words, threads)
    return _numpy_lane_sums(words, word_base, chunk_words, threads)


def _numpy_lane_sums(words: np.ndarray, word_base: int, chunk_words: int, threads: int | None) -> tuple[int, int]:
    """The reference: ~20 vectorised numpy passes per chunk of chunk_words, chunks on up to `threads`."""
    n = int(words.shape[0])
    size = min(chunk_words, n)
    pieces = list(_pieces(n, word_base, chunk_words))
    n_threads = min(threads or default_threads(), len(pieces))
    if n_threads <= 1:
        return _sum_pieces(words, word_base, pieces, size)
    groups = [pieces[k::n_threads] for k in range(n_threads)]
    with ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="trainscout-fp") as pool:
        parts = list(pool.map(lambda g: _sum_pieces(words, word_base, g, size), groups))
    return sum(p[0] for p in parts) & M32, sum(p[1] for p in parts) & M32


def _as_bytes_array(buf: Buffer) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            buf = np.ascontiguousarray(buf)  # a copy: the fingerprint is over the logical (C-order) bytes
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def fingerprint_bytes(
    buf: Buffer, *, word_base: int = 0, chunk_words: int = DEFAULT_CHUNK_WORDS, threads: int | None = None
) -> int:
    """The 64-bit fingerprint of `buf`'s bytes; word_base offsets the global word index (ranges use it)."""
    data = _as_bytes_array(buf)
    nbytes = int(data.shape[0])
    n_full = nbytes // 4
    words = data[: n_full * 4].view("<u4")
    sum_a, sum_b = lane_sums(words, word_base, chunk_words, threads)
    rem = nbytes - n_full * 4
    if rem:
        w = tail_word(data[n_full * 4 :].tobytes())
        sum_a += lane_a(w, word_base + n_full)
        sum_b += lane_b(w, word_base + n_full)
    return finalize(sum_a, sum_b, nbytes)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `t`'s bytes in C order (a copy only if `t` is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _numpy_view(data: torch.Tensor) -> np.ndarray:
    """A numpy view of a flat uint8 CPU tensor that, unlike Tensor.numpy(), leaves its storage resizable
    (FSDP frees gathered parameters by resizing their storage). Valid while `data` is alive."""
    n = int(data.numel())
    if n == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(data.data_ptr()))


def check_range(nbytes: int, start_byte: int, end_byte: int) -> None:
    if start_byte % 4:
        raise ValueError(f"start_byte must be a multiple of 4, got {start_byte}")
    if not 0 <= start_byte <= end_byte <= nbytes:
        raise ValueError(f"byte range [{start_byte}, {end_byte}) is outside [0, {nbytes})")


def fingerprint_range(
    t: torch.Tensor,
    start_byte: int,
    end_byte: int,
    *,
    chunk_words: int = DEFAULT_CHUNK_WORDS,
    threads: int | None = None,
) -> int:
    """Fingerprint of bytes [start_byte, end_byte) of `t` (C order): the same function over that range,
    with word indices start_byte/4 + local index and L = end_byte - start_byte. Replicas compare the same
    range with each other; a range fingerprint is not combined into the whole tensor's."""
    data = tensor_bytes(t.cpu() if t.device.type != "cpu" else t)
    check_range(int(data.numel()), start_byte, end_byte)
    piece = data[start_byte:end_byte]
    return fingerprint_bytes(_numpy_view(piece), word_base=start_byte // 4, chunk_words=chunk_words, threads=threads)


def fingerprint_tensor(t: torch.Tensor, *, chunk_words: int = DEFAULT_CHUNK_WORDS, threads: int | None = None) -> int:
    """Fingerprint of a tensor's bytes in C order, any dtype (bf16, bool, ...). A CUDA tensor is copied to
    the host first; use `trainscout.fingerprint.fingerprint` to stay on the device."""
    data = tensor_bytes(t.cpu() if t.device.type != "cpu" else t)
    return fingerprint_bytes(_numpy_view(data), chunk_words=chunk_words, threads=threads)


class RangeHasher:
    """`fingerprint_range(t, start, end)` of one CPU tensor, prepared once and computed many times.

    A rotating check hashes the same ranges of the same tensors again and again; the torch and numpy views
    around each call cost ~20-50 us, more than hashing a 256 KiB range at memory speed. The views are made
    here once. Each call first checks that the tensor still owns the same memory (its data pointer and its
    storage's size: a storage freed or resized, e.g. by FSDP, must never be read), and returns None when it
    does not: the caller then plans again.
    """

    __slots__ = ("_tensor", "_ptr", "_storage_nbytes", "_words", "_tail", "_word_base", "_nbytes")

    def __init__(self, t: torch.Tensor, start_byte: int, end_byte: int) -> None:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("RangeHasher takes a contiguous CPU tensor")
        data = t.detach().reshape(-1).view(torch.uint8)
        check_range(int(data.numel()), start_byte, end_byte)
        self._tensor = t
        self._ptr = t.data_ptr()
        self._storage_nbytes = t.untyped_storage().nbytes()
        piece = _numpy_view(data[start_byte:end_byte])
        n_full = (end_byte - start_byte) // 4
        self._words = piece[: n_full * 4].view("<u4")
        self._tail = piece[n_full * 4 :]
        self._word_base = start_byte // 4
        self._nbytes = end_byte - start_byte

    def __call__(self) -> int | None:
        t = self._tensor
        if t.data_ptr() != self._ptr or t.untyped_storage().nbytes() != self._storage_nbytes:
            return None
        sum_a, sum_b = lane_sums(self._words, self._word_base, DEFAULT_CHUNK_WORDS, 1)
        if self._tail.shape[0]:
            w = tail_word(self._tail.tobytes())
            index = self._word_base + int(self._words.shape[0])
            sum_a += lane_a(w, index)
            sum_b += lane_b(w, index)
        return finalize(sum_a, sum_b, self._nbytes)
