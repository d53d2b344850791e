"""Detectors and consensus are pure logic: importing any of them loads neither torch, nor the wire, nor the
probe (they are tested with plain data and run in the coordinator, which never imports torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PURE = sorted(
    f"trainscout.{p.parent.name}.{p.stem}"
    for folder in ("detectors", "consensus")
    for p in (SRC / "trainscout" / folder).glob("*.py")
    if p.stem != "__init__"
)
FORBIDDEN = ("torch", "trainscout.wire", "trainscout.probe")


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_torch_wire_or_probe(module):
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        f"print([m for m in {FORBIDDEN!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(SRC)}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"
