"""A group's membership travels once per agent: packing, the coordinator's record, the agent's side, end to end."""

from __future__ import annotations

import json
import os
import secrets
import uuid

import pytest

from trainscout.coordinator.memberships import Memberships
from trainscout.wire.membership import pack_members, unpack_members
from trainscout.wire.messages import GroupInfo, NodeDigest, PgState, RankState


@pytest.mark.parametrize(
    "members",
    [
        [],
        [5],
        list(range(100_352)),
        list(range(3, 100_352, 128)),
        [0, 1, 2, 3, 8, 9, 10, 11, 40],
        [7, 3, 3, 1],
    ],
)
def test_members_round_trip_exactly(members):
    assert unpack_members(pack_members(members)) == sorted(set(members))


def test_layouts_groups_pack_to_one_run_whatever_their_size():
    assert pack_members(range(100_352)) == [(0, 1, 100_352)]
    assert pack_members(range(5, 100_352, 128)) == [(5, 128, 784)]


def test_malformed_runs_are_skipped_not_expanded():
    assert unpack_members([(0, 0, 5), (0, 1, 1 << 40), (3, 1, 2)]) == [3, 4]


def _pg(name: str, seq: int, members: list[int] | None = None) -> PgState:
    return PgState(
        name=name, desc="d", members=members or [], seq=seq, rolling_hash=0, anchors=[], recent=[], seq_age_s=0.0
    )


def _rank(rank: int, pgs: list[PgState]) -> RankState:
    return RankState(
        rank=rank,
        local_rank=rank,
        world_size=4,
        pid=1,
        alive=True,
        step=1,
        heartbeat_age_s=0.0,
        progress_age_s=0.0,
        collectives=0,
        pgs=pgs,
    )


def _digest(ranks: list[RankState], groups: list[GroupInfo] | None = None) -> NodeDigest:
    return NodeDigest(node_id="n", host="h", number=1, ranks=ranks, groups=groups or [])


def test_memberships_learnt_once_are_filled_into_later_digests():
    book = Memberships()
    first = _digest([_rank(0, [_pg("0", 1)])], [GroupInfo("0", pack_members([0, 1, 2, 3]))])
    book.absorb(first)
    assert first.ranks[0].pgs[0].members == [0, 1, 2, 3] and not book.missing(first)
    version = book.version
    later = [_digest([_rank(r, [_pg("0", 2)])]) for r in (0, 1)]
    for d in later:
        book.absorb(d)
        assert not book.missing(d)
    # one list for the group, however many ranks report it; nothing changed, so no new version
    assert later[0].ranks[0].pgs[0].members is later[1].ranks[0].pgs[0].members is book.members["0"]
    assert book.version == version + 1  # rank 1 reported its groups for the first time


def test_an_unknown_group_is_asked_for_at_most_every_few_seconds():
    book = Memberships()
    d = _digest([_rank(0, [_pg("7", 1)])])
    book.absorb(d)
    assert book.missing(d) and d.ranks[0].pgs[0].members == []
    assert book.should_ask("n", 10.0) and not book.should_ask("n", 12.0) and book.should_ask("n", 15.5)


def test_members_sent_in_every_digest_are_still_understood_and_a_change_is_seen():
    book = Memberships()
    book.absorb(_digest([_rank(0, [_pg("0", 1, [0, 1])])]))
    v = book.version
    book.absorb(_digest([_rank(0, [_pg("0", 2, [0, 1])])]))
    assert book.version == v and book.members["0"] == [0, 1]
    book.absorb(_digest([_rank(0, [_pg("0", 3, [0, 1, 2])])]))
    assert book.version > v and book.members["0"] == [0, 1, 2]


# ---- the real agent and the real coordinator -----------------------------------------------------------


def _channel(run_id: str, rank: int, groups: dict[str, list[int]]):
    from trainscout.channel.layout import pg_table_path
    from trainscout.channel.writer import ChannelWriter

    writer = ChannelWriter(run_id, rank, rank, 4)
    writer.set("pid", os.getpid())
    doc = {
        "index": {name: i for i, name in enumerate(groups)},
        "groups": {name: {"desc": name, "members": m} for name, m in groups.items()},
        "roles": {},
        "device": "",
    }
    with open(pg_table_path(run_id, rank), "w") as fh:
        json.dump(doc, fh)
    writer.set("pg_table_version", 1)
    return writer


def _receive(coord_endpoint, coordinator, kind):
    import time

    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        got = coord_endpoint.recv(200)
        if got is not None:
            coordinator.handle(got[0], got[1], time.monotonic())
            if isinstance(got[1], kind):
                return got[1]
    raise AssertionError(f"no {kind.__name__} arrived")


def test_agent_sends_each_membership_once_and_again_when_the_coordinator_asks(tmp_path):
    from trainscout.agent.main import Agent
    from trainscout.channel.layout import pg_table_path
    from trainscout.coordinator.main import Coordinator
    from trainscout.sinks import ConsoleSink
    from trainscout.wire.endpoints import CoordinatorEndpoint

    run_id = f"memb-{uuid.uuid4().hex[:8]}"
    secret = secrets.token_bytes(32)
    groups = {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3]}
    writers = [_channel(run_id, r, {"0": groups["0"], str(1 + r // 2): groups[str(1 + r // 2)]}) for r in range(4)]
    endpoint = CoordinatorEndpoint("tcp://127.0.0.1:0", secret)
    agent = Agent(run_id, endpoint.address, secret, "node-a")
    try:
        coordinator = Coordinator(endpoint, str(tmp_path), ConsoleSink(open(os.devnull, "w"), rich=False))
        agent.discover()
        for view in agent.views.values():
            view.refresh()
        agent.send_digest()
        first = _receive(endpoint, coordinator, NodeDigest)
        assert sorted((g.name, tuple(unpack_members(g.runs))) for g in first.groups) == sorted(
            (n, tuple(m)) for n, m in groups.items()
        )
        assert all(pg.members == groups[pg.name] for st in first.ranks for pg in st.pgs)  # filled in on arrival
        agent.send_digest()
        second = _receive(endpoint, coordinator, NodeDigest)
        assert second.groups == []
        got = {st.rank: {pg.name: pg.members for pg in st.pgs} for st in second.ranks}
        assert got == {r: {"0": groups["0"], str(1 + r // 2): groups[str(1 + r // 2)]} for r in range(4)}
        assert coordinator.ranks[3].pg("2").members == [2, 3]

        # a coordinator that never got them (restarted): it asks, the agent sends them all again
        fresh = Coordinator(endpoint, str(tmp_path), ConsoleSink(open(os.devnull, "w"), rich=False))
        agent.send_digest()
        _receive(endpoint, fresh, NodeDigest)
        assert fresh.ranks[0].pg("0").members == []
        cmd = agent.endpoint.recv_command(5000)
        assert cmd is not None and cmd.kind == "send_groups"
        agent.handle(cmd)
        agent.send_digest()
        again = _receive(endpoint, fresh, NodeDigest)
        assert {g.name for g in again.groups} == set(groups)
        assert fresh.ranks[0].pg("0").members == [0, 1, 2, 3] and fresh.ranks[2].pg("2").members == [2, 3]

        # a membership that changes travels again (the probe rewrote its table)
        with open(pg_table_path(run_id, 0)) as fh:
            doc = json.load(fh)
        doc["groups"]["1"]["members"] = [0, 1, 2]
        with open(pg_table_path(run_id, 0), "w") as fh:
            json.dump(doc, fh)
        writers[0].set("pg_table_version", 2)
        agent.views[0].refresh()
        agent.send_digest()
        changed = _receive(endpoint, fresh, NodeDigest)
        assert [(g.name, unpack_members(g.runs)) for g in changed.groups] == [("1", [0, 1, 2])]
    finally:
        agent.endpoint.close()
        endpoint.close()
        for rank, w in enumerate(writers):
            w.close()
            os.unlink(w.path)
            os.unlink(pg_table_path(run_id, rank))
