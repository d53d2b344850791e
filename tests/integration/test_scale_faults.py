"""The scale harness at a tiny scale: every fault class it simulates is named exactly by the real coordinator.

benchmarks/scale.py feeds the real coordinator (ZeroMQ with CURVE, signed msgspec frames) with simulated node
agents; its faults (benchmarks/scale_faults.py) show only what real ranks send. Were the simulation to drift from
the wire or the detectors (a field renamed, a rule changed), the big runs would silently measure nothing: here
each fault strikes a seeded random rank of 64 (pure DP and TP 8 x PP 2 x DP 4) and the exact culprit and kind
are asserted, and a clean run must give no finding. The runs go side by side to keep CI's time (~25 s
alone; each run's clock starts once its simulators are connected, so a loaded machine only delays it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# (layout, fault, seed): both layouts, every fault, a clean run of each layout
CASES = [
    ("dp:64", "hang", 1),
    ("8x2x4", "crash", 2),  # TP x PP x DP: the crashed rank's peers wait on it, no hang is blamed on them
    ("dp:64", "desync", 3),
    ("8x2x4", "straggler", 4),
    ("dp:64", "sdc", 5),
    ("8x2x4", "desync", 6),
    ("8x2x4", "none", 7),
    ("dp:64", "none", 8),
]
STEP_S = 0.2  # 5 steps a second: the straggler rules' 20-step warm-up passes in 4 s
ONSET_S = 5.0
SECONDS = 15.0  # a hang is named ~6 s after onset (5 s timeout); an SDC once the 16-step state rotation
# reaches the corrupted slot (<= 3.2 s); a 2x straggler within ~15 of its steps


def _start(layout: str, fault: str, seed: int, tmp_path: Path) -> subprocess.Popen:
    cmd = [
        *(sys.executable, "-m", "benchmarks", "scale", "coordinator", "--layout", layout, "--fault", fault),
        *("--seed", str(seed), "--step-s", str(STEP_S), "--onset-s", str(ONSET_S), "--seconds", str(SECONDS)),
        *("--warmup-s", "2", "--procs", "1", "--runs-under", str(tmp_path)),
    ]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, str], dict]:
    tmp = tmp_path_factory.mktemp("scale")
    procs = {(layout, fault): _start(layout, fault, seed, tmp) for layout, fault, seed in CASES}
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{key}: harness failed\n{stderr[-3000:]}"
        out[key] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize(("layout", "fault", "seed"), CASES)
def test_fault_is_named_exactly_at_its_random_rank(results, layout: str, fault: str, seed: int) -> None:
    got = results[layout, fault]
    kinds = [(kind, ranks) for kind, ranks, _n, _after in got["findings"]]
    if fault == "none":
        assert got["culprit"] == -1 and kinds == []
    else:
        assert 0 <= got["culprit"] < 64
        assert kinds == [(fault, [got["culprit"]])], got["findings"]
        assert got["exact"] and got["named_after_s"] is not None
