"""The restart policy of dead monitoring tools: bounded, backing off, and every gap recorded."""

from __future__ import annotations

from trainscout.runner.restarts import RestartPolicy


def test_quick_failures_back_off_and_the_limit_stops_restarts():
    policy = RestartPolicy(limit=3, base_s=0.5, cap_s=1.5, healthy_s=60)
    delays = []
    t = 1000.0
    for _ in range(4):
        delay = policy.died("agent", -9, ran_s=2.0, now=t)
        delays.append(delay)
        if delay is not None:
            policy.restarted("agent", now=t + delay)
        t += 10
    assert delays == [0.5, 1.0, 1.5, None]
    assert policy.restarts == {"agent": 3}
    lines = policy.gap_lines()
    assert len(lines) == 4
    assert all("the agent was down from" in line and "restarted" in line for line in lines[:3])
    assert "was not restarted" in lines[3]


def test_a_process_that_ran_long_starts_the_backoff_over_and_components_count_apart():
    policy = RestartPolicy(limit=5, base_s=0.5, cap_s=8, healthy_s=60)
    assert policy.died("coordinator", -9, ran_s=1, now=0) == 0.5
    policy.restarted("coordinator", now=1)
    assert policy.died("coordinator", -9, ran_s=1, now=2) == 1.0
    policy.restarted("coordinator", now=3)
    assert policy.died("coordinator", -9, ran_s=300, now=400) == 0.5  # healthy for a while: quick again
    assert policy.died("agent", -9, ran_s=1, now=401) == 0.5
    assert policy.gaps[0].until == 1 and policy.gaps[-1].until is None


def test_no_restarts_when_the_limit_is_zero():
    policy = RestartPolicy(limit=0)
    assert policy.died("agent", 1, ran_s=5, now=0) is None
    assert "was not restarted" in policy.gap_lines()[0]


def test_a_restart_that_did_not_come_up_extends_the_same_gap():
    policy = RestartPolicy(limit=3, base_s=0.5, cap_s=8, healthy_s=60)
    assert policy.died("coordinator", -9, ran_s=5, now=10) == 0.5
    policy.failed_restart("coordinator")
    assert policy.died("coordinator", 1, ran_s=0.2, now=11) == 1.0
    policy.restarted("coordinator", now=13)
    assert len(policy.gaps) == 1 and (policy.gaps[0].since, policy.gaps[0].until) == (10, 13)
