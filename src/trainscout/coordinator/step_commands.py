"""Commands every member must act on at one step (link probes, replays): sent only over sound links, and again
to an agent that comes back before that step.

Each such command makes the ranks that received it meet their peers on the side group at the named step; a rank
whose node never got it does not come, and the others wait for it up to the side group's timeout, stalling
training. A command is lost when the node's agent is dead, stopped or cut off while it is sent (zmq drops what a
dead peer or a reset connection held). So the coordinator sends one only while every agent is reporting, and
sends it again to an agent that says Hello (a restarted one) or reports again after a silence, as long as its
step is ahead. Agents and probes take a request id once, so a second copy costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscout.wire.messages import Command

# an agent whose last message is older than this (about two digest intervals) may be cut off right now
QUIET_S = 2.0


@dataclass
class _Pending:
    step: int
    command: Command


class StepCommands:
    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self.quiet_s = quiet_s
        self._pending: list[_Pending] = []

    def links_sound(self, nodes: dict[bytes, dict], now: float) -> bool:
        """Whether every agent still in the job reported lately (none lost, none quiet past `quiet_s`)."""
        agents = [n for n in nodes.values() if n.get("agent") and not n["gone"]]
        return bool(agents) and all(not n["lost"] and now - n["last"] <= self.quiet_s for n in agents)

    def sent(self, step: int, command: Command) -> None:
        self._pending.append(_Pending(step, command))

    def to_resend(self, top_step: int) -> list[Command]:
        """The commands whose step is still ahead of the furthest rank (the others are forgotten)."""
        self._pending = [p for p in self._pending if p.step > top_step]
        return [p.command for p in self._pending]
