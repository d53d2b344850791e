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


@pytest.mark.parametrize("run_id", ["../../etc", "/tmp/x", "a/b", "..", "-x", ""])
def test_a_run_id_that_is_not_a_plain_name_is_refused_before_anything_starts(run_id, tmp_path, capsys):
    runs = tmp_path / "runs"
    assert cli.main(["run", "--run-dir", str(runs), f"--run-id={run_id}", "--", "true"]) == 2
    assert "is not a plain name" in capsys.readouterr().err
    assert not runs.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_run_dir_that_cannot_hold_files_is_refused_with_a_line_not_a_traceback(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["run", "--run-dir", str(blocker / "runs"), "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "cannot hold the run's files" in err and "Traceback" not in err
