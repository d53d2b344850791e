"""The coordinator's record of every process group's members, learnt once per agent instead of every digest.

Agents send a group's members once (`NodeDigest.groups`) and leave `PgState.members` empty afterwards; this
keeps the memberships and fills them back into each rank's reported groups as a digest arrives, so detectors
read `pg.members` as before while a digest stays O(local ranks). The lists are shared, not copied: one list per
group however many ranks report it. A digest naming a group not known yet (its membership frame was lost, or
the coordinator restarted) makes the caller ask that agent to send its groups again.

`version` changes whenever a membership, or the groups (names, descriptions, roles) some rank reports, change:
what the topology is built from, so it is rebuilt only then instead of being compared every detection pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainscout.wire.membership import unpack_members

if TYPE_CHECKING:
    from trainscout.wire.messages import NodeDigest

ASK_AGAIN_S = 5.0  # an agent asked to resend its groups is asked again no sooner than this


class Memberships:
    def __init__(self) -> None:
        self.members: dict[str, list[int]] = {}  # group name -> sorted global ranks
        self._runs: dict[str, list[tuple[int, int, int]]] = {}
        self._signature: dict[int, tuple] = {}  # rank -> its groups as it last reported them (not members)
        self._asked: dict[str, float] = {}  # node -> when it was last asked to resend
        self.version = 0

    def absorb(self, msg: NodeDigest) -> None:
        """Learn the digest's memberships, then fill `members` into every group its ranks report."""
        for g in msg.groups:
            runs = [tuple(r) for r in g.runs]
            if self._runs.get(g.name) != runs:
                self._runs[g.name] = runs  # type: ignore[assignment]
                self.members[g.name] = unpack_members(runs)
                self.version += 1
        for st in msg.ranks:
            signature = tuple((pg.name, pg.desc, pg.role, pg.framework) for pg in st.pgs)
            if self._signature.get(st.rank) != signature:
                self._signature[st.rank] = signature
                self.version += 1
            for pg in st.pgs:
                if pg.members:  # an agent that sends members in every digest (older agents)
                    if self.members.get(pg.name) != pg.members:
                        self.members[pg.name] = sorted(pg.members)
                        self._runs.pop(pg.name, None)
                        self.version += 1
                    pg.members = self.members[pg.name]
                else:
                    pg.members = self.members.get(pg.name, pg.members)

    def missing(self, msg: NodeDigest) -> bool:
        """Whether the digest's ranks report a group whose members are not known."""
        return any(not pg.members for st in msg.ranks for pg in st.pgs)

    def should_ask(self, node: str, now: float) -> bool:
        """Whether to ask this node's agent to send its groups again now (not more often than ASK_AGAIN_S)."""
        if now - self._asked.get(node, -ASK_AGAIN_S) < ASK_AGAIN_S:
            return False
        self._asked[node] = now
        return True
