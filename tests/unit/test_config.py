"""The one declaration of settings (trainscout/config.py): precedence, strict parsing, the generated reference,
and that no module reads a setting from the environment behind its back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainscout import config

ROOT = Path(__file__).resolve().parents[2]


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(tmp_path):
    toml = tmp_path / "t.toml"
    toml.write_text("[run]\nhang_timeout = 9\nstall_timeout = 100\n[checks.state]\nbudget = 0.002\n")
    env = {"TRAINSCOUT_HANG_TIMEOUT": "8", "TRAINSCOUT_STALL_TIMEOUT": "200"}
    cfg, src = config.load({"run.hang_timeout": 7}, env, str(toml))
    assert (cfg.run.hang_timeout, src["run.hang_timeout"]) == (7.0, "flag")
    assert (cfg.run.stall_timeout, src["run.stall_timeout"]) == (200.0, "env")
    assert (cfg.checks.state.budget, src["checks.state.budget"]) == (0.002, "toml")
    assert (cfg.checks.replay.every, src["checks.replay.every"]) == (200, "default")


@pytest.mark.parametrize(
    "text,value",
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("NO", False),
        ("off", False),
    ],
)
def test_switches_read_every_usual_spelling(text, value):
    cfg, _ = config.load(environ={"TRAINSCOUT_STATE_CHECK": text}, toml_path=None)
    assert cfg.checks.state.enabled is value


@pytest.mark.parametrize(
    "env,named",
    [
        ({"TRAINSCOUT_STATE_CHECK": "maybe"}, "checks.state.enabled"),
        ({"TRAINSCOUT_STATE_BUDGET": "abc"}, "checks.state.budget"),
        ({"TRAINSCOUT_STATE_BUDGET": "2"}, "checks.state.budget"),
        ({"TRAINSCOUT_HANG_TIMEOUT": "0"}, "run.hang_timeout"),
        ({"TRAINSCOUT_HANG_TIMEOUT": "nan"}, "run.hang_timeout"),
        ({"TRAINSCOUT_REPLAY_EVERY": "1.5"}, "checks.replay.every"),
        ({"TRAINSCOUT_MONITOR_NICE": "20"}, "run.monitor_nice"),
        ({"TRAINSCOUT_HPZ_FIX": "fast"}, "checks.hpz.fix"),
    ],
)
def test_a_bad_value_is_refused_with_the_setting_and_what_it_accepts(env, named):
    with pytest.raises(config.ConfigError, match=re.escape(named) + ".*expected"):
        config.load(environ=env, toml_path=None)


def test_the_file_is_checked_too(tmp_path):
    bad = tmp_path / "t.toml"
    bad.write_text("[checks.sate]\nbudget = 1\n")
    with pytest.raises(config.ConfigError, match="unknown setting 'checks.sate.budget'"):
        config.load(environ={}, toml_path=str(bad))
    bad.write_text("[checks\n")
    with pytest.raises(config.ConfigError, match="not valid TOML"):
        config.load(environ={}, toml_path=str(bad))


def test_inside_a_rank_a_bad_hand_set_value_keeps_its_default_and_says_so():
    cfg, problems = config.from_environ({"TRAINSCOUT_STATE_BUDGET": "abc", "TRAINSCOUT_LINK_PROBE": "off"})
    assert cfg.checks.state.budget == 0.005 and cfg.checks.link_probe is False
    assert len(problems) == 1 and "checks.state.budget" in problems[0]


def test_what_trainscout_run_exports_reads_back_the_same():
    cfg, _ = config.load({"run.hang_timeout": 3.5}, {"TRAINSCOUT_EVIDENCE": "off"}, None)
    again, problems = config.from_environ(config.to_environ(cfg))
    assert again == cfg and problems == []


def test_the_settings_reference_is_generated_from_the_declaration():
    assert (ROOT / "docs" / "configuration.md").read_text() == config.markdown()


def test_no_module_reads_a_setting_from_the_environment_itself():
    """Settings reach modules as arguments (or config.from_environ): a raw read is how `!= "0"` switches and
    silently defaulted numbers came about."""
    names = "|".join(re.escape(s.env) for s in config.SETTINGS.values())
    raw = re.compile(r"environ(\.get)?\s*[\[(]\s*[\"'](" + names + r")[\"']")
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "src").rglob("*.py")
        if p.name != "config.py" and raw.search(p.read_text())
    ]
    assert offenders == []
