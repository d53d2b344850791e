"""Step commands (link probes, replays) go out only over sound links, and again to an agent that comes back."""

from __future__ import annotations

from trainscout.coordinator.step_commands import StepCommands
from trainscout.wire.messages import Command


def _node(last: float, lost: bool = False, gone: bool = False, agent: bool = True) -> dict:
    return {"last": last, "lost": lost, "gone": gone, "agent": agent, "name": "n"}


def test_links_are_sound_only_while_every_agent_reports():
    sc = StepCommands(quiet_s=2.0)
    assert not sc.links_sound({}, 10.0)  # nobody to send to
    assert sc.links_sound({b"a": _node(9.0), b"b": _node(8.5)}, 10.0)
    assert not sc.links_sound({b"a": _node(9.0), b"b": _node(7.5)}, 10.0)  # b quiet 2.5 s: maybe cut off
    assert not sc.links_sound({b"a": _node(9.0), b"b": _node(9.9, lost=True)}, 10.0)
    # an agent that said goodbye and the supervisor's launcher report (no agent) do not count
    assert sc.links_sound({b"a": _node(9.0), b"b": _node(1.0, gone=True), b"s": _node(1.0, agent=False)}, 10.0)


def test_only_commands_for_steps_still_ahead_are_sent_again():
    sc = StepCommands()
    early, late = Command(kind="linkprobe", request_id=1), Command(kind="replay", request_id=2)
    sc.sent(100, early)
    sc.sent(120, late)
    assert sc.to_resend(90) == [early, late]
    assert sc.to_resend(100) == [late]  # the ranks are at step 100: too late for it
    assert sc.to_resend(130) == []
    assert sc.to_resend(0) == []  # forgotten for good
