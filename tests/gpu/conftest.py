"""GPU tests run on the GPU machine only: without CUDA (or without Triton) they are reported as skipped.

The check happens at collection time without importing Triton, so `make test` on a CPU-only machine lists
these tests as skipped rather than failing to import them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (GPU tests run on the GPU machine)"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(marker)


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def gen(cuda: torch.device) -> torch.Generator:
    return torch.Generator(device=cuda).manual_seed(20240611)
