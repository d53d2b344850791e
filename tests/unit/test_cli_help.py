"""`trainscout --help` explains every finding a user can get, and the demo's help every fault it takes."""

from __future__ import annotations

import pytest

from trainscout import cli
from trainscout.faults.spec import KINDS as FAULT_KINDS
from trainscout.findings import KINDS, MONITORING


def test_the_help_explains_every_finding_kind():
    listed = {line.split()[0] for line in cli.FINDING_HELP.splitlines()[1:] if line[:2] == "  " and line[2] != " "}
    assert listed == set(KINDS) - {MONITORING}  # monitoring gaps are told in summary.md, not as findings


def test_demo_help_lists_every_fault_and_its_verdict(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(kind in text for kind in FAULT_KINDS)
    assert "Exits 0 when trainscout named the injected fault" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["demo", "--rank", "7"], "rank 7 is not in a 4-rank demo"),
        (["demo", "--step", "500"], "hang at step 500 would never fire: the demo trains 100 steps"),
        (["demo", "--fault", "corrupt", "--step", "450"], "the demo trains 400 steps"),
        (["demo", "--fault", "bogus"], "unknown kind 'bogus'"),
    ],
)
def test_a_demo_fault_that_cannot_fire_is_refused_before_anything_starts(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
