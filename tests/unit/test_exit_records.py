"""How a rank's probe records its end (probe/exits.py), in a child process of its own (it patches sys.exit)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PRELUDE = """
import os, sys
from trainscout.probe import exits
class Writer:
    def record_exit(self, how, code, sig, text):
        print("RECORD", how, code, text, flush=True)
exits.install(Writer(), os.getpid())
def main():
    raise RuntimeError("boom")
"""


def _first_record(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", _PRELUDE + body], capture_output=True, text=True, timeout=60)
    return next(line for line in done.stdout.splitlines() if line.startswith("RECORD"))


@pytest.mark.parametrize(
    ("body", "record"),
    [
        # torch.multiprocessing.spawn's workers, and many scripts' main, end on an exception this way
        (
            "try:\n    main()\nexcept Exception:\n    sys.exit(1)\n",
            "RECORD exception 1 RuntimeError: boom at <string>:",
        ),
        ("main()\n", "RECORD exception 1 RuntimeError: boom at <string>:"),
        ("sys.exit(2)\n", "RECORD exit 2 sys.exit(2)"),
        ("try:\n    main()\nexcept Exception:\n    sys.exit(0)\n", "RECORD exit 0 sys.exit(0)"),  # handled: clean
    ],
)
def test_the_exception_behind_an_exit_is_the_recorded_cause(body, record):
    assert _first_record(body).startswith(record)
