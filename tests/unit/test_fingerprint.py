"""Tests for trainscout.fingerprint on the CPU: its paths against an independent plain-Python reference.

The reference below is written from spec.md with its own copy of the constants, so an accidental edit of
a constant or a shift in cpu.py fails here. Most tests run whichever CPU path is active (the C kernel where
it is built); the known answers, chunking and random inputs run the numpy path and the C kernel explicitly
(test_fingerprint_native.py compares the two in depth). The Triton kernel is checked on the CPU too,
through Triton's interpreter, when Triton is installed (tests/gpu checks it on a real GPU).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainscout.fingerprint import cpu, fingerprint, fingerprint_bytes, fingerprint_range

M32 = (1 << 32) - 1
M64 = (1 << 64) - 1
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- independent reference (slow, small inputs)


def _fmix32(x: int, s1: int, m1: int, s2: int, m2: int, s3: int) -> int:
    x ^= x >> s1
    x = (x * m1) & M32
    x ^= x >> s2
    x = (x * m2) & M32
    return x ^ (x >> s3)


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def reference(data: bytes, word_base: int = 0) -> int:
    padded = data + b"\0" * (-len(data) % 4)
    s_a = s_b = 0
    for k in range(len(padded) // 4):
        w = int.from_bytes(padded[4 * k : 4 * k + 4], "little")
        i = word_base + k
        lo, hi = i & M32, i >> 32
        t_a = (lo * 0x9E3779B1 + hi * 0x7FEB352D) & M32
        t_b = (lo * 0x27D4EB2F + hi * 0x846CA68A + 0x165667B1) & M32
        s_a += _fmix32((w + t_a) & M32, 16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)
        s_b += _fmix32((w + t_b) & M32, 15, 0x85EBCA77, 13, 0xC2B2AE3D, 16)
    packed = (s_a & M32) | ((s_b & M32) << 32)
    length = (len(data) * 0x9E3779B97F4A7C15 + 0xD6E8FEB86659FD93) & M64
    return _fmix64(packed ^ length)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


KAT_1000 = hashlib.shake_128(b"trainscout fingerprint").digest(1000)


@pytest.fixture(params=["numpy", "native"])
def cpu_path(request):
    """Runs a test once on the numpy path and once on the C kernel (skipped where it is not built)."""
    if request.param == "native" and not cpu.native_available():
        pytest.skip(f"C kernel not available: {cpu.NATIVE_UNAVAILABLE}")
    previous = cpu.use_native(request.param == "native")
    try:
        yield request.param
    finally:
        cpu.use_native(previous)


# ---------------------------------------------------------------- known answers


@pytest.mark.parametrize(
    "data,word_base,expected",
    [
        (b"", 0, 0xE514FD3BA51117AD),
        (b"a", 0, 0x6844D4B39EA5F42E),
        (b"abc", 0, 0x6BF1F2BDE6FD358E),
        (b"abcd", 0, 0x622C47503F5FA709),
        (KAT_1000, 0, 0x62DE473BC0C8F892),
        (KAT_1000, (1 << 32) - 7, 0xC8CE884AB43643BD),  # crosses the 2^32 index boundary
        (KAT_1000[:999], 1 << 40, 0x6E32A626594B7B68),
    ],
)
def test_known_answers(cpu_path, data, word_base, expected):
    assert reference(data, word_base) == expected
    assert cpu.fingerprint_bytes(data, word_base=word_base) == expected
    assert cpu.fingerprint_bytes(data, word_base=word_base, chunk_words=3) == expected


# ---------------------------------------------------------------- properties


def test_order_sensitive_swapping_two_words_changes_it():
    rng = np.random.default_rng(1)
    words = rng.integers(0, 1 << 32, 64, dtype=np.uint32)
    base = fingerprint_bytes(words)
    for i, j in [(0, 1), (0, 63), (10, 11), (5, 40)]:
        swapped = words.copy()
        swapped[[i, j]] = swapped[[j, i]]
        assert fingerprint_bytes(swapped) != base
    # rotating the whole buffer by one word (same multiset of words) changes it too
    assert fingerprint_bytes(np.roll(words, 1)) != base


def test_every_single_bit_flip_in_256_bytes_changes_it():
    data = bytearray(hashlib.shake_128(b"flips").digest(256))
    seen = {cpu.fingerprint_bytes(bytes(data))}
    for bit in range(256 * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        seen.add(cpu.fingerprint_bytes(bytes(data)))
        data[bit // 8] ^= 1 << (bit % 8)
    assert len(seen) == 1 + 256 * 8  # every flip changes it, and no two flips collide


def test_single_word_changes_are_always_detected_in_both_lanes():
    # The guarantee behind the spec: for a fixed position each lane is a bijection of the word, so any
    # change of one word changes both lane sums mod 2^32 (hence the 64-bit value).
    rng = np.random.default_rng(2)
    words = rng.integers(0, 1 << 32, 32, dtype=np.uint32)
    sums = cpu.lane_sums(words)
    for pos in range(32):
        for new in rng.integers(0, 1 << 32, 8, dtype=np.uint32):
            if new == words[pos]:
                continue
            changed = words.copy()
            changed[pos] = new
            s = cpu.lane_sums(changed)
            assert s[0] != sums[0] and s[1] != sums[1]


def test_length_is_part_of_the_value():
    assert fingerprint_bytes(b"\x01") != fingerprint_bytes(b"\x01\x00")
    assert fingerprint_bytes(b"\x01\x00\x00") != fingerprint_bytes(b"\x01\x00\x00\x00")
    assert fingerprint_bytes(b"") != fingerprint_bytes(b"\x00")


def test_value_is_a_64_bit_unsigned_int_and_round_trips_through_int64():
    for data in (b"", b"x", KAT_1000):
        v = fingerprint_bytes(data)
        assert 0 <= v < 1 << 64
        assert cpu.as_unsigned64(cpu.as_signed64(v)) == v
        assert -(1 << 63) <= cpu.as_signed64(v) < 1 << 63


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.int8]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_coverage(dtype):
    g = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        t = torch.rand(7, 9, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = torch.randn(7, 9, generator=g).to(dtype)
    else:
        t = torch.randint(-1000, 1000, (7, 9), generator=g).to(dtype)
    expected = reference(tensor_bytes(t))
    assert cpu.fingerprint_tensor(t) == expected
    assert fingerprint(t) == expected
    assert fingerprint(t.clone()) == expected


def test_same_bytes_same_value_across_dtypes_and_shapes():
    t = torch.randn(6, 10).to(torch.bfloat16)
    assert fingerprint(t) == fingerprint(t.view(torch.int16).reshape(60)) == fingerprint(t.view(torch.uint8))


def test_non_contiguous_tensor_uses_logical_order():
    t = torch.randn(33, 17)
    view = t.t()
    assert not view.is_contiguous()
    assert fingerprint(view) == reference(tensor_bytes(view.contiguous()))
    assert fingerprint(view) != fingerprint(t)


@pytest.mark.parametrize("start,end", [(0, 0), (0, 1), (4, 4), (4, 13), (12, 400), (396, 400), (0, 400), (100, 399)])
def test_range_is_the_reference_over_the_slice_with_offset_indices(start, end):
    t = torch.randn(100)  # 400 bytes
    raw = tensor_bytes(t)
    expected = reference(raw[start:end], word_base=start // 4)
    assert cpu.fingerprint_range(t, start, end) == expected
    assert fingerprint_range(t, start, end) == expected


def test_range_validates_its_bounds():
    t = torch.zeros(10)
    with pytest.raises(ValueError):
        fingerprint_range(t, 2, 8)  # start not a multiple of 4
    with pytest.raises(ValueError):
        fingerprint_range(t, 0, 41)
    with pytest.raises(ValueError):
        fingerprint_range(t, 8, 4)


@pytest.mark.parametrize("chunk_words", [1, 2, 3, 7, 64, 1000, 1 << 18])
@pytest.mark.parametrize("threads", [1, 3])
def test_chunk_size_and_threads_do_not_change_the_value(cpu_path, chunk_words, threads):
    data = hashlib.shake_128(b"chunks").digest(4 * 2500 + 3)
    expected = reference(data)
    assert cpu.fingerprint_bytes(data, chunk_words=chunk_words, threads=threads) == expected
    base = (1 << 32) - 1234
    assert cpu.fingerprint_bytes(data, word_base=base, chunk_words=chunk_words, threads=threads) == reference(
        data, base
    )


def test_accepts_bytes_memoryview_and_arrays():
    data = KAT_1000
    expected = reference(data)
    arr = np.frombuffer(data, dtype=np.uint8)
    assert fingerprint_bytes(memoryview(data)) == expected
    assert fingerprint_bytes(bytearray(data)) == expected
    assert fingerprint_bytes(arr) == expected
    assert fingerprint_bytes(arr[:1000].view(np.uint32).reshape(10, 25)) == expected
    strided = np.frombuffer(data * 2, dtype=np.uint8)[::2]
    assert fingerprint_bytes(strided) == reference(bytes(strided))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.binary(max_size=96),
    word_base=st.one_of(st.just(0), st.integers(0, 1 << 40), st.integers((1 << 32) - 30, (1 << 32) + 5)),
    chunk_words=st.integers(1, 9),
)
def test_reference_equals_numpy_on_random_bytes(cpu_path, data, word_base, chunk_words):
    assert cpu.fingerprint_bytes(data, word_base=word_base, chunk_words=chunk_words) == reference(data, word_base)


def test_importing_the_package_does_not_import_triton():
    code = "import sys, trainscout.fingerprint as f; f.fingerprint_bytes(b'x'); print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- the Triton kernel on the CPU (interpreter)

INTERPRETER_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    import triton.runtime.interpreter as interp

    # Triton 3.6's interpreter turns scalar kernel arguments into 1-element arrays and calls int() on them
    # for loop bounds, which numpy >= 2.4 refuses; read the element instead (test-only shim).
    _orig = interp._patch_lang_tensor
    def _patched(tensor, scope):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    interp._patch_lang_tensor = _patched

    from trainscout.fingerprint import cpu, gpu
    assert gpu.HAVE_TRITON
    rng = np.random.default_rng(5)
    cases = [
        # nbytes, word_base, launch params, words per launch
        (0, 0, dict(), None),
        (3, 0, dict(), None),
        (4, 0, dict(rows=1, num_warps=1), None),
        (4 * 4096 * 2 + 7, 0, dict(), None),  # two full default tiles and a ragged tail
        (4 * 128 * 7 + 5, 0, dict(rows=1, num_warps=1, programs_per_sm=2, mulhi=1), None),
        (4 * 256 * 3 + 2, (1 << 32) - 300, dict(rows=2, num_warps=1, mulhi=2), 200),  # several launches
    ]
    for nbytes, base, kw, per_launch in cases:
        if per_launch:
            gpu.MAX_WORDS_PER_LAUNCH = per_launch
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out = torch.full((3,), 7, dtype=torch.int64)
        gpu._enqueue(torch.from_numpy(data.copy()), 0, nbytes, base, out, 1, gpu.LaunchConfig(**kw), sm_count=3)
        got, want = cpu.as_unsigned64(int(out[1])), cpu.fingerprint_bytes(data, word_base=base)
        assert got == want, (nbytes, base, kw, hex(got), hex(want))
        assert int(out[0]) == 7 and int(out[2]) == 7
    print("INTERPRETER OK")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_under_the_interpreter_equals_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    out = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "INTERPRETER OK" in out.stdout


@pytest.mark.parametrize(
    "dtype,n", [(torch.float32, 1), (torch.float32, 1000), (torch.bfloat16, 16385), (torch.bool, 7), (torch.int8, 4099)]
)
def test_prepared_range_hasher_gives_fingerprint_range_values(dtype, n):
    from trainscout.fingerprint.cpu import RangeHasher

    t = (torch.randn(n) * 100).to(dtype)
    nbytes = t.numel() * t.element_size()
    for start, end in ((0, nbytes), (4 if nbytes >= 4 else 0, nbytes), (0, nbytes // 8 * 4)):
        hasher = RangeHasher(t, start, end)
        assert hasher() == fingerprint_range(t, start, end)
    hasher = RangeHasher(t, 0, nbytes)
    before = hasher()
    t.view(torch.uint8)[-1] ^= 1  # it reads the live memory, not a copy made when it was prepared
    assert hasher() == fingerprint_range(t, 0, nbytes) != before


def test_prepared_range_hasher_never_reads_memory_its_tensor_gave_up():
    from trainscout.fingerprint.cpu import RangeHasher

    t = torch.randn(1000)
    hasher = RangeHasher(t, 0, 4000)
    t.untyped_storage().resize_(0)  # how FSDP frees a gathered parameter
    assert hasher() is None
    with pytest.raises(ValueError):
        RangeHasher(torch.randn(4, 4).t(), 0, 64)  # not contiguous: the caller keeps the copying path
