"""Tensor fingerprints: the 64-bit values replicas exchange to prove they hold the same bytes.

The numerical-integrity checks (replicated parameters and optimizer state in rotating chunks, all-gather
receivers, replay outputs) reduce each tensor to one 64-bit fingerprint and let the C3 vote compare them
across ranks. The fingerprint is one pass over memory, depends on the order of the bytes, is the same
integer on CPU and GPU for the same bytes, and always changes when any single 32-bit word changes
(spec.md beside this file: definition, guarantees, collision bound, limits). It is not cryptographic.

`fingerprint(t)` / `fingerprint_range(t, start, end)` pick the path by device: for CPU tensors `cpu.py`,
which runs a C kernel (`_native.c`, built by `pip install` where a compiler exists; one pass at memory
speed) and falls back to numpy (the reference definition) where the extension is not built; `cpu_backend()`
says which one runs ("native-avx2", ..., or "numpy"). CUDA tensors go to a Triton kernel (`gpu.py`, imported
only when a CUDA tensor shows up, so CPU-only installs never import Triton). For a result that stays on the
device without a host sync, use `gpu.fingerprint_tensor_cuda_async`.
"""

from __future__ import annotations

import warnings

import torch

from trainscout.fingerprint.cpu import as_unsigned64, fingerprint_bytes
from trainscout.fingerprint.cpu import backend as cpu_backend

__all__ = ["as_unsigned64", "cpu_backend", "fingerprint", "fingerprint_bytes", "fingerprint_range"]

_warned_no_triton = False


def _cuda_path() -> object | None:
    """The gpu module if its kernels can run, else None (after one warning: the CPU path copies)."""
    global _warned_no_triton
    from trainscout.fingerprint import gpu

    if gpu.HAVE_TRITON:
        return gpu
    if not _warned_no_triton:
        _warned_no_triton = True
        warnings.warn(
            "trainscout.fingerprint: Triton is not importable; CUDA tensors are copied to the host and "
            "fingerprinted there (same value, much slower)",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def fingerprint(t: torch.Tensor) -> int:
    """64-bit fingerprint (unsigned int) of t's bytes in C order, on t's device."""
    if t.device.type == "cuda":
        gpu = _cuda_path()
        if gpu is not None:
            return gpu.fingerprint_tensor_cuda(t)  # type: ignore[attr-defined]
    from trainscout.fingerprint import cpu

    return cpu.fingerprint_tensor(t)


def fingerprint_range(t: torch.Tensor, start_byte: int, end_byte: int) -> int:
    """Fingerprint of bytes [start_byte, end_byte) of t (start a multiple of 4), for rotating checks."""
    if t.device.type == "cuda":
        gpu = _cuda_path()
        if gpu is not None:
            return gpu.fingerprint_range_cuda(t, start_byte, end_byte)  # type: ignore[attr-defined]
    from trainscout.fingerprint import cpu

    return cpu.fingerprint_range(t, start_byte, end_byte)
