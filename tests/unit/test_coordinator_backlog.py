"""A coordinator behind its queue must not take its own backlog for silent agents."""

from __future__ import annotations

import os
import secrets
import time

from trainscout.agent.main import Agent
from trainscout.coordinator.main import Coordinator
from trainscout.sinks import ConsoleSink
from trainscout.wire.endpoints import CoordinatorEndpoint
from trainscout.wire.messages import Hello


def test_silence_counts_only_up_to_when_the_queue_was_last_empty(tmp_path):
    secret = secrets.token_bytes(32)
    endpoint = CoordinatorEndpoint("tcp://127.0.0.1:0", secret)
    agent = Agent("backlog-test", endpoint.address, secret, "node-a")
    try:
        coordinator = Coordinator(endpoint, str(tmp_path), ConsoleSink(open(os.devnull, "w"), rich=False))
        assert not endpoint.backlog()
        agent.send(Hello(node_id="node-a", host="h", agent_pid=1))
        got = endpoint.recv(5000)
        assert got is not None
        coordinator.handle(got[0], got[1], 100.0)
        agent.send(Hello(node_id="node-a", host="h", agent_pid=1))  # waits in the queue, not handled yet
        for _ in range(50):
            if endpoint.backlog():
                break
            time.sleep(0.1)
        assert endpoint.backlog()
        node = coordinator.nodes[got[0]]
        coordinator._caught_up = 101.0  # last empty queue 1 s after the agent's frame: 1 s of known silence
        coordinator._watch_agents(110.0)
        assert not node["lost"]
        coordinator._caught_up = 104.0  # caught up 4 s after it, and nothing from the agent meanwhile
        coordinator._watch_agents(110.0)
        assert node["lost"]
    finally:
        agent.endpoint.close()
        endpoint.close()
