"""ZeRO++ hpZ on 2 GPUs (the GPU machine only; DeepSpeed must be importable, e.g. from carried wheels).

Runs `python -m benchmarks gpu hpz --side-by-side` for a few steps: ZeRO-3 without hpZ twice (a run-to-run
control), hpZ with DeepSpeed's stall removed (`unsafe`, under `trainscout run`) and hpZ with the
event-ordered fix (under `trainscout run`), all with a compute-stream sleep before every secondary copy.
Asserts what the 2x H200 run showed: the control and the event-ordered job are bitwise equal to the
reference with no corrupted gather and no finding; the unsafe job corrupts gathers, and trainscout names
an `hpz_race` no later than one step after the first corrupted gather.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"),
]


def test_race_named_and_event_order_bitwise(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "gpu",
            "hpz",
            "--out",
            str(tmp_path),
            "--side-by-side",
            "--steps",
            "12",
            "--phases",
            "ref,ref2,unsafe,event",
            "--budget-s",
            "240",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    res = json.loads((tmp_path / "hpz_results.json").read_text())
    assert res["ref2"]["summary"]["vs_ref"]["bitwise_equal"], res["ref2"]
    event = res["event"]["summary"]
    assert event["vs_ref"]["bitwise_equal"] and event["corrupted_gathers"] == 0 and event["findings"] == [], event
    unsafe = res["unsafe"]["summary"]
    first = unsafe["first_corrupted_step"]
    assert first is not None, unsafe
    races = [f for f in unsafe["findings"] if f[0] == "hpz_race"]
    assert races and races[0][1] <= first + 1, unsafe
