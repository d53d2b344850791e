"""The state check's CUDA path hashes tiny CPU ranges (AdamW's `step` counters) with plain integers instead
of the numpy path: the value must be the reference `cpu.fingerprint_range` of the same bytes."""

from __future__ import annotations

import pytest
import torch

from trainscout.fingerprint import cpu
from trainscout.probe.device_state import SMALL_HOST_BYTES, small_range_fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int16, torch.uint8, torch.bool])
def test_small_range_fingerprint_equals_the_reference_for_every_range(dtype):
    gen = torch.Generator().manual_seed(7)
    for n in (1, 2, 3, 5, 16, 33):
        t = (torch.randn(n, generator=gen) * 100).to(dtype)
        for tensor in [t, torch.tensor(2.5).to(dtype)] + ([t[::2]] if n >= 3 else []):
            nbytes = tensor.numel() * tensor.element_size()
            for start in range(0, nbytes + 1, 4):
                for end in range(start, min(nbytes, start + SMALL_HOST_BYTES) + 1):
                    assert small_range_fingerprint(tensor, start, end) == cpu.fingerprint_range(tensor, start, end)
