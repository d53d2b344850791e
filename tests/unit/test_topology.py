"""The topology line and document built from what the probes published (pure data, no job)."""

from trainscout.integrations.topology import TopologyTracker, build, rank_span


def _g(name, members, role="", framework="", desc="undefined"):
    return {"name": name, "desc": desc, "members": members, "role": role, "framework": framework}


def test_hsdp_replicas_are_the_members_of_each_replicate_group():
    world = _g("0", [0, 1, 2, 3], desc="default_pg")
    side = _g("1", [0, 1, 2, 3], "trainscout", "trainscout")
    per_rank = {
        0: [world, side, _g("2", [0, 2], "replicate", "HSDP"), _g("4", [0, 1], "shard", "HSDP")],
        1: [world, side, _g("3", [1, 3], "replicate", "HSDP"), _g("4", [0, 1], "shard", "HSDP")],
        2: [world, side, _g("2", [0, 2], "replicate", "HSDP"), _g("5", [2, 3], "shard", "HSDP")],
        3: [world, side, _g("3", [1, 3], "replicate", "HSDP"), _g("5", [2, 3], "shard", "HSDP")],
    }
    doc = build(per_rank)
    assert doc["replicas"] == [[0, 2], [1, 3]]
    assert [g["name"] for g in doc["groups"]] == ["0", "2", "3", "4", "5"]  # the side group is not the job's
    assert doc["line"] == (
        "topology: 4 ranks; HSDP: replicate [0,2] [1,3], shard [0,1] [2,3]; replicas [0,2] [1,3]; other groups 0[0-3]"
    )


def test_sharded_job_has_no_replicas_and_unknown_roles_are_said_so():
    shard = {r: [_g("0", [0, 1, 2], "shard", "DeepSpeed ZeRO-3", "default_pg")] for r in range(3)}
    assert build(shard)["replicas"] == []
    assert "no replicas" in build(shard)["line"]
    plain = {r: [_g("0", [0, 1], desc="default_pg")] for r in range(2)}
    assert build(plain)["line"].endswith(
        "roles unknown (no framework integration saw how the groups are used); other groups 0[0,1]"
    )


def test_first_declared_role_wins_and_a_late_member_list_fills_in():
    per_rank = {0: [_g("7", [], "tensor", "DTensor TP")], 1: [_g("7", [0, 1], "replicate", "DDP")]}
    (g,) = build(per_rank)["groups"]
    assert (g["role"], g["framework"], g["members"]) == ("tensor", "DTensor TP", [0, 1])


def test_tracker_shows_the_line_once_every_rank_stepped_and_again_only_on_change():
    t = TopologyTracker()
    groups = {0: [_g("0", [0, 1], "replicate", "DDP")], 1: [_g("0", [0, 1], "replicate", "DDP")]}
    changed, show = t.update(groups, {0: 1, 1: 0})
    assert changed is not None and show is None  # rank 1 is still setting up
    changed, show = t.update(groups, {0: 2, 1: 1})
    assert changed is None and show.startswith("topology: 2 ranks; DDP: replicate [0,1]")
    assert t.update(groups, {0: 3, 1: 2}) == (None, None)


def test_rank_span():
    assert rank_span([3, 1, 2, 0]) == "[0-3]"
    assert rank_span([0, 2]) == "[0,2]"
    assert rank_span([0, 1]) == "[0,1]"


def test_groups_of_one_rank_are_left_out_of_the_line_and_many_others_are_counted():
    # Megatron-Core with TP=2 on 2 ranks: data/pipeline groups of one rank, many undeclared helper groups
    per_rank = {
        r: [_g("1", [0, 1], "tensor", "Megatron-Core"), _g(f"{2 + r}", [r], "replicate", "Megatron-Core")]
        + [_g(str(10 + i), [0, 1]) for i in range(9)]
        + [_g(str(30 + r), [r])]
        for r in range(2)
    }
    line = build(per_rank)["line"]
    assert line == (
        "topology: 2 ranks; Megatron-Core: tensor [0,1]; no replicas (no group holds the same "
        "parameters twice); other groups 10[0,1] 11[0,1] 12[0,1] 13[0,1] 14[0,1] 15[0,1] and 3 more"
    )
