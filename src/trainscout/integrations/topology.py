"""The job's topology as trainscout sees it: which process groups exist and which ranks are replicas.

The coordinator builds it from what every rank's probe published (each group's name, description and
members, and the role a framework integration declared for it: `replicate`, `shard`, `tensor`,
`pipeline`, or `trainscout` for the probe's own side group). Ranks in one `replicate` group hold the
same parameters: they are the equivalence classes the replicated-state and replay checks compare.
Pure functions over plain data; no torch, no I/O.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from trainscout.markers import DRILL_GROUP_ROLE, PROBE_GROUP_ROLE

ROLE_ORDER = ("replicate", "shard", "tensor", "pipeline", "context", "expert")
MAX_OTHER_GROUPS = 6  # the line names this many undeclared groups, then counts the rest


def rank_span(ranks: Iterable[int]) -> str:
    """`[0-3]` for a contiguous run, `[0,2]` otherwise."""
    rs = sorted(set(ranks))
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"[{rs[0]}-{rs[-1]}]"
    return "[" + ",".join(str(r) for r in rs) + "]"


def build(groups_by_rank: Mapping[int, Iterable[Mapping]]) -> dict:
    """groups_by_rank: rank -> its groups as dicts with name, desc, members, role, framework.

    Returns {"ranks", "groups", "replicas", "line"}; a group's role is the one its members declared
    (the first non-empty one seen, in rank order), trainscout's own side groups are left out.
    """
    groups: dict[str, dict] = {}
    for rank in sorted(groups_by_rank):
        for g in groups_by_rank[rank]:
            name = str(g["name"])
            entry = groups.get(name)
            if entry is None:  # each group once: its members are sorted once, not once per member rank
                entry = groups[name] = {
                    "name": name,
                    "desc": str(g.get("desc") or ""),
                    "members": sorted(int(r) for r in g.get("members") or []),
                    "role": "",
                    "framework": "",
                }
            if not entry["members"] and g.get("members"):
                entry["members"] = sorted(int(r) for r in g["members"])
            if not entry["role"] and g.get("role"):
                entry["role"], entry["framework"] = str(g["role"]), str(g.get("framework") or "")
    shown = [g for g in groups.values() if g["role"] not in (PROBE_GROUP_ROLE, DRILL_GROUP_ROLE)]
    shown.sort(key=lambda g: (int(g["name"]) if g["name"].isdigit() else 1 << 62, g["name"]))
    replicas = sorted({tuple(g["members"]) for g in shown if g["role"] == "replicate" and len(g["members"]) > 1})
    doc = {"ranks": sorted(groups_by_rank), "groups": shown, "replicas": [list(r) for r in replicas]}
    doc["line"] = describe(doc)
    return doc


def describe(doc: Mapping) -> str:
    """One line for the console and the report (groups of one rank, which never wait for anyone, left out)."""
    parts = [f"{len(doc['ranks'])} ranks"]
    by_role: dict[tuple[str, str], list[dict]] = {}
    for g in doc["groups"]:
        if g["role"] and len(g["members"]) > 1:
            by_role.setdefault((g["framework"], g["role"]), []).append(g)

    def order(key):
        fw, role = key
        return (fw, ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)

    per_framework: dict[str, list[str]] = {}
    for fw, role in sorted(by_role, key=order):
        spans = " ".join(rank_span(g["members"]) for g in by_role[(fw, role)])
        per_framework.setdefault(fw or "framework", []).append(f"{role} {spans}")
    parts += [f"{fw}: {', '.join(items)}" for fw, items in per_framework.items()]
    replicas = doc["replicas"]
    if replicas:
        parts.append("replicas " + " ".join(rank_span(r) for r in replicas))
    elif by_role:
        parts.append("no replicas (no group holds the same parameters twice)")
    else:
        parts.append("roles unknown (no framework integration saw how the groups are used)")
    others = [g for g in doc["groups"] if not g["role"] and len(g["members"]) > 1]
    if others:
        shown = " ".join(f"{g['name']}{rank_span(g['members'])}" for g in others[:MAX_OTHER_GROUPS])
        more = len(others) - MAX_OTHER_GROUPS
        parts.append("other groups " + shown + (f" and {more} more" if more > 0 else ""))
    return "topology: " + "; ".join(parts)


class TopologyTracker:
    """Follows the topology while the job sets itself up; says when it changed and when to show it.

    Groups and roles appear one by one at start-up, so the line is shown once every rank has finished a
    step (the set-up is over by then), and again only if it changes later.
    """

    def __init__(self) -> None:
        self.doc: dict | None = None
        self.shown = ""

    def update(
        self, groups_by_rank: Mapping[int, Iterable[Mapping]], steps: Mapping[int, int]
    ) -> tuple[dict | None, str | None]:
        """(the new document if anything changed, the line to show now if any)."""
        doc = build(groups_by_rank)
        changed = None
        if self.doc is None or {k: v for k, v in doc.items() if k != "line"} != {
            k: v for k, v in self.doc.items() if k != "line"
        }:
            self.doc = changed = doc
        show = None
        if steps and min(steps.values()) >= 1 and doc["line"] != self.shown:
            self.shown = show = doc["line"]
        return changed, show
