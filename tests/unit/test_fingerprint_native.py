"""The C lane sums (trainscout.fingerprint._native) against the numpy reference path of cpu.py.

Both paths must give the same bits on every input: lengths around the vector widths and their tails, any
alignment, word bases whose range crosses a 2^32 boundary of the global index, every kernel variant the
CPU supports, and the public functions on tensors. Most tests skip where the module is not built; one
fails instead when a C compiler is on PATH, so a build that broke silently (the extension is optional)
shows up in CI.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading

import numpy as np
import pytest
import torch

from trainscout.fingerprint import cpu, fingerprint_range

M32 = (1 << 32) - 1
KAT_1000 = hashlib.shake_128(b"trainscout fingerprint").digest(1000)
BOUNDARY = 1 << 32


@pytest.fixture
def native():
    """The extension module; the numpy path stays reachable through cpu._numpy_lane_sums."""
    if not cpu.native_available():
        pytest.skip(f"trainscout.fingerprint._native is not available: {cpu.NATIVE_UNAVAILABLE}")
    previous = cpu.use_native(True)
    try:
        yield cpu._native
    finally:
        cpu.use_native(previous)
        cpu._native.set_variant(None)


def numpy_sums(words: np.ndarray, word_base: int) -> tuple[int, int]:
    return cpu._numpy_lane_sums(words, word_base, cpu.DEFAULT_CHUNK_WORDS, 1)


def fingerprint_numpy(data, word_base: int = 0) -> int:
    previous = cpu.use_native(False)
    try:
        return cpu.fingerprint_bytes(data, word_base=word_base)
    finally:
        cpu.use_native(previous)


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# ---------------------------------------------------------------- the build


def test_native_module_is_built_where_a_compiler_exists():
    """`pip install -e .` builds the extension when a C compiler exists; the build is optional, so a broken
    one would otherwise only show up as a slow CPU path. TRAINSCOUT_NATIVE_OPTIONAL=1 waives this check."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc or cc) on PATH: the numpy path is expected")
    if os.environ.get("TRAINSCOUT_NATIVE_OPTIONAL", "") not in ("", "0"):
        pytest.skip("TRAINSCOUT_NATIVE_OPTIONAL is set")
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    assert cpu.native_available(), (
        f"{compiler} exists but {cpu.NATIVE_UNAVAILABLE}. Reinstall with `pip install -e .` and read its "
        f"warnings (Python.h {'found' if os.path.exists(headers) else 'MISSING'} at {headers}); set "
        "TRAINSCOUT_NATIVE_OPTIONAL=1 to accept the numpy path"
    )
    expected = "numpy" if os.environ.get("TRAINSCOUT_FINGERPRINT_NATIVE", "1").strip() == "0" else "native-"
    assert cpu.backend().startswith(expected)


def test_backend_switch(native):
    assert cpu.backend() == f"native-{native.variant()}"
    assert native.variant() in native.variants() and "default" in native.variants()
    assert cpu.use_native(False) is True
    assert cpu.backend() == "numpy"
    assert "switched off" in cpu.backend_detail()
    cpu.use_native(True)
    assert cpu.backend_detail().startswith("native C kernel")


def test_a_module_of_another_interface_version_is_refused(native, monkeypatch):
    monkeypatch.setattr(cpu, "NATIVE_API_VERSION", native.API_VERSION + 1)
    module, why = cpu._load_native()
    assert module is None and "stale build" in why


FALLBACK_CHECK = textwrap.dedent(
    """
    import importlib, sys
    from trainscout.fingerprint import cpu
    assert cpu.backend() == "numpy", cpu.backend()          # TRAINSCOUT_FINGERPRINT_NATIVE=0
    assert cpu.fingerprint_bytes(b"abcd") == 0x622C47503F5FA709

    class NoNative:                                          # as on a machine without a compiler
        def find_spec(self, name, path=None, target=None):
            if name == "trainscout.fingerprint._native":
                raise ImportError("blocked for the test")
    sys.meta_path.insert(0, NoNative())
    sys.modules.pop("trainscout.fingerprint._native", None)
    vars(sys.modules["trainscout.fingerprint"]).pop("_native", None)
    importlib.reload(cpu)
    assert not cpu.native_available() and cpu.backend() == "numpy"
    assert "not built" in cpu.backend_detail(), cpu.backend_detail()
    try:
        cpu.use_native(True)
        raise SystemExit("use_native(True) should refuse")
    except RuntimeError:
        pass
    import torch
    assert cpu.fingerprint_bytes(b"") == 0xE514FD3BA51117AD
    assert cpu.fingerprint_range(torch.arange(100, dtype=torch.int32), 8, 397) == cpu.fingerprint_bytes(
        torch.arange(100, dtype=torch.int32).numpy().tobytes()[8:397], word_base=2)
    print("FALLBACK OK")
    """
)


def test_environment_switch_and_missing_module_fall_back_to_numpy():
    env = dict(os.environ, TRAINSCOUT_FINGERPRINT_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", FALLBACK_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "FALLBACK OK" in out.stdout


# ---------------------------------------------------------------- known answers (spec.md, test_fingerprint.py)


@pytest.mark.parametrize(
    "data,word_base,expected",
    [
        (b"", 0, 0xE514FD3BA51117AD),
        (b"a", 0, 0x6844D4B39EA5F42E),
        (b"abc", 0, 0x6BF1F2BDE6FD358E),
        (b"abcd", 0, 0x622C47503F5FA709),
        (KAT_1000, 0, 0x62DE473BC0C8F892),
        (KAT_1000, (1 << 32) - 7, 0xC8CE884AB43643BD),
        (KAT_1000[:999], 1 << 40, 0x6E32A626594B7B68),
    ],
)
def test_known_answers_on_every_variant(native, data, word_base, expected):
    for variant in native.variants():
        native.set_variant(variant)
        assert cpu.fingerprint_bytes(data, word_base=word_base) == expected, variant


# ---------------------------------------------------------------- native == numpy


BASES = [0, 12345, (1 << 40) + 3, BOUNDARY - 2000, 5 * BOUNDARY - 1]


def test_every_length_up_to_4099_words_with_offsets_and_bases(native):
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, 4 * 4099 + 16, dtype=np.uint8)
    for n in range(4100):
        off = 4 * (n % 3) + (n % 4 == 3)  # aligned and unaligned starts
        words = raw[off : off + 4 * n].view("<u4")
        base = BASES[n % len(BASES)]
        assert native.lane_sums(words, base) == numpy_sums(words, base), (n, off, base)


@pytest.mark.parametrize("base", [0, BOUNDARY - 37, 3 * BOUNDARY - 1, (1 << 40) + 1])
def test_every_variant_on_short_and_long_buffers(native, base):
    rng = np.random.default_rng(12)
    big = rng.integers(0, 1 << 32, 70_000, dtype=np.uint32)
    lengths = [*range(0, 80), 255, 256, 257, 1023, 1025, 70_000]
    for n in lengths:
        want = numpy_sums(big[:n], base)
        for variant in native.variants():
            assert native.lane_sums(big[:n], base, variant) == want, (n, variant)


@pytest.mark.parametrize("tail", [0, 1, 2, 3])
def test_fingerprint_bytes_with_tails(native, tail):
    rng = np.random.default_rng(13)
    for n in [*range(0, 40), 63, 64, 65, 1000, 4097]:
        data = rng.integers(0, 256, 4 * n + tail, dtype=np.uint8).tobytes()
        for base in (0, BOUNDARY - n // 2 - 1, 1 << 40):
            assert cpu.fingerprint_bytes(data, word_base=base) == fingerprint_numpy(data, base), (n, tail, base)


@pytest.mark.parametrize(
    "base",
    [0, 1 << 40, BOUNDARY - 300_000, 2 * BOUNDARY - 1, 7 * BOUNDARY - 123_457],
    ids=["zero", "2^40", "crosses-2^32", "crosses-2^33-at-1", "crosses-7*2^32"],
)
def test_a_few_mib(native, base):
    data = random_bytes(3 * (1 << 20) + 3, seed=base & 0xFFFF)
    assert cpu.fingerprint_bytes(data, word_base=base) == fingerprint_numpy(data, base)
    words = np.frombuffer(data, dtype=np.uint8)[: 3 << 20].view("<u4")
    assert native.lane_sums(words, base) == numpy_sums(words, base)


def test_top_of_the_64_bit_index_range(native):
    words = np.arange(1, 12, dtype=np.uint32)
    top = (1 << 64) - 11
    assert cpu.lane_sums(words, top) == numpy_sums(words, top)  # last index 2^64 - 1: native
    assert cpu.lane_sums(words, top + 1) == numpy_sums(words, top + 1)  # beyond: numpy, no error
    with pytest.raises(OverflowError):
        native.lane_sums(words, top + 1)
    with pytest.raises(OverflowError):
        native.lane_sums(words, -1)
    with pytest.raises(ValueError):
        native.lane_sums(b"abcde", 0)
    with pytest.raises(ValueError):
        native.lane_sums(words, 0, "no-such-variant")


def test_non_contiguous_words_take_the_numpy_path(native):
    words = np.random.default_rng(14).integers(0, 1 << 32, 1000, dtype=np.uint32)
    strided = words[::2]
    assert cpu.lane_sums(strided, 5) == numpy_sums(np.ascontiguousarray(strided), 5)
    with pytest.raises((BufferError, ValueError)):  # numpy says ValueError: not C-contiguous
        native.lane_sums(strided, 5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("chunk_words", [3, 1000, cpu.DEFAULT_CHUNK_WORDS])
def test_threads_and_chunks_do_not_change_the_value(native, threads, chunk_words):
    words = np.frombuffer(random_bytes(4 * 700_001, seed=15), dtype="<u4")
    for base in (0, BOUNDARY - 350_000):
        want = numpy_sums(words, base)
        assert cpu.lane_sums(words, base, chunk_words=chunk_words, threads=threads) == want
        assert cpu.lane_sums(words[:2500], base, chunk_words=chunk_words, threads=threads) == numpy_sums(
            words[:2500], base
        )


def test_the_gil_is_released_while_summing(native):
    """With a 10 s switch interval the main thread only runs while the worker has let go of the GIL: it
    must get to run before the worker's calls are done."""
    words = np.frombuffer(random_bytes(16 << 20, seed=16), dtype="<u4")
    state = {"done": False}
    started = threading.Event()

    def work():
        started.set()
        for _ in range(20):
            native.lane_sums(words, 0)
        state["done"] = True

    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        ran_during_calls = not state["done"]
        worker.join()
    finally:
        sys.setswitchinterval(old)
    assert ran_during_calls


# ---------------------------------------------------------------- tensors through the public functions


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fingerprint_range_on_tensors(native, dtype):
    g = torch.Generator().manual_seed(17)
    if dtype == torch.bool:
        t = torch.rand(333, 37, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = torch.randn(333, 37, generator=g).to(dtype)
    else:
        t = torch.randint(-100, 100, (333, 37), generator=g).to(dtype)
    nbytes = t.numel() * t.element_size()
    ranges = [(0, nbytes), (0, 0), (4, 5), (8, nbytes - 1), (4 * 97, 4 * 2001 + 2), (nbytes // 8 * 4, nbytes)]
    for start, end in ranges:
        native_value = fingerprint_range(t, start, end)
        cpu.use_native(False)
        try:
            numpy_value = fingerprint_range(t, start, end)
        finally:
            cpu.use_native(True)
        assert native_value == numpy_value, (dtype, start, end)
    whole = cpu.fingerprint_tensor(t)
    cpu.use_native(False)
    try:
        assert cpu.fingerprint_tensor(t) == whole
        assert cpu.fingerprint_tensor(t.t()) == cpu.fingerprint_tensor(t.t().contiguous())
    finally:
        cpu.use_native(True)
