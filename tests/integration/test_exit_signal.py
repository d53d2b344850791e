"""A rank killed by SIGSEGV is named with its signal every time, not as "vanished, unknown status"; one ended by a
SIGTERM or SIGINT sent to it alone from outside the job is named, where those signals from a launcher are not.

The rank leaves no exit record of its own; only torchrun, its parent, learns the signal. The supervisor
passes torchrun's report on as soon as it is printed and the crash finding waits for it. The race it closes
was lost only sometimes: one live run here; the repeats that catch a lost race now and then are
`python -m benchmarks latency faults --faults crash-segv --runs 10` (every run must name SIGSEGV).
"""

from __future__ import annotations

import pytest

from conftest import of_kind, run_demo

pytestmark = pytest.mark.slow


def test_segfaulted_rank_is_named_with_sigsegv(tmp_path):
    result = run_demo(tmp_path, "segv", fault="crash", rank=1, step=15, steps=60, params=("how=segv",))
    crashes = of_kind(result.findings, "crash")
    assert len(crashes) == 1, result.describe()
    (crash,) = crashes
    assert crash["culprit_ranks"] == [1], result.describe()
    assert crash["evidence"]["signal"] == "SIGSEGV", result.describe()
    assert "SIGSEGV" in crash["summary"] and "unknown status" not in crash["summary"], result.describe()
    assert result.returncode == 0, result.describe()  # the demo's verdict: the injected fault was named


@pytest.mark.parametrize("how,signame", [("term", "SIGTERM"), ("int", "SIGINT")])
def test_a_rank_sent_a_stop_signal_from_outside_is_named(tmp_path, how, signame):
    # torchrun then tears the others down with SIGTERM of its own: those are collateral, not co-culprits
    result = run_demo(tmp_path, how, fault="crash", rank=2, step=15, steps=60, params=(f"how={how}",))
    crashes = of_kind(result.findings, "crash")
    assert [c["culprit_ranks"] for c in crashes] == [[2]], result.describe()
    assert crashes[0]["evidence"]["signal"] == signame, result.describe()
    assert "from outside the job" in crashes[0]["summary"], result.describe()
    assert len(result.findings) == 1, result.describe()
