"""Protocol desync: members of a process group issued different collectives at the same sequence number.

Every member publishes, per group, a rolling hash chained over its collectives' signatures. At the
highest sequence number every member has passed, the rolling hashes must agree (C3 exact vote). When
they do not, the first deviating collective is found from per-collective hashes: from the records in
the digests when they cover it, otherwise from records pulled from the agents (`FetchRequest`).
A collective issued outside Python (native: DDP's reducer, functional collectives) is chained by its
place alone, since each rank describes it when its Flight Recorder is read; the descriptions are then
compared among the members that have one.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscout.consensus import vote_exact
from trainscout.detectors.interface import DetectorBase, FetchRecords, JobView, Judgement
from trainscout.detectors.observations import RankObs, group_label, rank_list
from trainscout.findings import DESYNC, Finding
from trainscout.markers import NATIVE_HASH
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import CollectiveRecord, PgState

ANCHOR_EVERY = 16  # as trainscout.wire.messages.ANCHOR_EVERY (the agent keeps rolling hashes at these seqs)


@dataclass
class FetchRequest:
    pg: str
    seq_from: int
    seq_to: int
    ranks: list[int]


MAX_FETCHES = 3  # pulls per group that may come back without the deviation before the group is given up


VISITS_PER_PASS = 100_000  # members' group states one pass examines; beyond it the next pass resumes there
REFRESH_GROUPS_EVERY = 10  # passes between re-reading which groups exist (they change at start-up, rarely after)


class DesyncDetector(DetectorBase):
    """Groups are checked in turn, resuming where the previous pass stopped once `visits_per_pass` members'
    states were examined: a job of 100k ranks (400k group memberships) is covered every four passes
    instead of one pass taking seconds; below that every group is checked every pass."""

    name = "desync"

    def __init__(self, visits_per_pass: int = VISITS_PER_PASS) -> None:
        self._agreed: dict[str, int] = {}  # pg -> highest seq known to agree
        self._done: set[str] = set()  # groups already reported (hashes differ forever after)
        self._pending: dict[str, FetchRequest] = {}
        self._fetches: dict[str, int] = {}  # pg -> pulls made
        self.visits_per_pass = visits_per_pass
        self._groups: dict[str, list[int]] = {}
        self._order: list[str] = []
        self._cursor = 0
        self._passes = 0
        self._ranks_seen = 0
        self._groups_known: int | None = None
        self._checked_ended: dict[str, int] = {}  # pg -> the newest records last checked directly after an exit

    def judge(self, view: JobView) -> Judgement:
        """A deviation the digests' records show is named at once; else the records are pulled from the agents."""
        findings, fetches = self.update(dict(view.seen), groups_known=len(view.members))
        return Judgement(findings=findings, asks=[FetchRecords(req, self.resolve) for req in fetches])

    def update(
        self, ranks: dict[int, RankObs], groups_known: int | None = None
    ) -> tuple[list[Finding], list[FetchRequest]]:
        """groups_known: how many groups' members the coordinator knows; a change re-reads the groups at once
        (a group learnt between two refreshes went unchecked for up to ten passes: a desync in the job's first
        seconds was then named only after the exits it caused)."""
        findings: list[Finding] = []
        fetches: list[FetchRequest] = []
        if (
            self._passes % REFRESH_GROUPS_EVERY == 0
            or len(ranks) != self._ranks_seen
            or (groups_known is not None and groups_known != self._groups_known)
        ):
            self._groups = _group_members(ranks)
            self._order = list(self._groups)
            self._ranks_seen = len(ranks)
            self._groups_known = groups_known
        self._passes += 1
        visits = 0
        n = len(self._order)
        for i in range(n):
            if visits >= self.visits_per_pass:
                self._cursor = (self._cursor + i) % n
                break
            name = self._order[(self._cursor + i) % n]
            if name in self._done or name in self._pending:
                continue
            members = self._groups[name]
            visits += len(members)
            states = _member_states(ranks, name, members)
            if states is None:
                continue
            self._check(name, states, findings, fetches, ended=any(not ranks[r].state.alive for r in states))
        return findings, fetches

    def _check(
        self,
        name: str,
        states: dict[int, PgState],
        findings: list[Finding],
        fetches: list[FetchRequest],
        ended: bool = False,
    ) -> None:
        low = self._agreed.get(name, 0) + 1
        # Every member's rolling hash at the highest seq they all chained is equal: every collective up to there
        # agrees, unless native ones were described differently (their descriptions are not chained), which
        # only the records can show. (A record every member holds beyond that seq is one still waiting for an
        # earlier one on some member: the rolling hash covers it once the gap fills or is given up; but once a
        # member has exited its gaps may never fill, and the mismatch that killed it is in those records: a
        # collective of another size or dtype aborts a gloo peer at once, and the exit must not be named first.)
        agreed = _agreed_fast(states)
        if ended:  # once per change of the members' newest records: an exited member's stay as they are
            newest = hash(tuple(pg.recent[-1].seq if pg.recent else 0 for pg in states.values()))
            ended = self._checked_ended.get(name) != newest
            self._checked_ended[name] = newest
        if agreed is not None and not ended and not _described_native(states, low):
            if agreed >= low:
                self._agreed[name] = agreed
            return
        records = {r: list(pg.recent) for r, pg in states.items()}
        # Direct check: the newest records every member has (chained or not) must have equal hashes.
        if any(pg.recent and pg.recent[-1].seq >= low for pg in states.values()):
            finding = first_deviation(name, _desc(states), records, low, 1 << 62, complete_only=True)
            if finding is not None:
                self._done.add(name)
                findings.append(finding)
                return
        if agreed is not None:
            if agreed >= low:
                self._agreed[name] = agreed
            return
        known = {r: _history(pg) for r, pg in states.items()}
        comparable = {r: h for r, h in known.items() if h is not None}
        if len(comparable) < 2:
            return
        common = set.intersection(*(set(k) for k in comparable.values()))
        if not common:
            return
        top = max(common)
        verdict = vote_exact({r: comparable[r][top] for r in comparable})
        if verdict.status == "agree":
            self._agreed[name] = max(self._agreed.get(name, 0), top)
            return
        covered = all(recs and recs[0].seq <= low for recs in records.values())
        finding = first_deviation(name, _desc(states), records, low, top) if covered else None
        if finding is not None:
            self._done.add(name)
            findings.append(finding)
        else:
            req = FetchRequest(pg=name, seq_from=low, seq_to=top, ranks=sorted(known))
            self._pending[name] = req
            self._fetches[name] = self._fetches.get(name, 0) + 1
            fetches.append(req)

    def resolve(self, request: FetchRequest, records: dict[int, list[CollectiveRecord]]) -> Finding | None:
        """Called with the records the agents returned for a FetchRequest. A pull that came back without the
        deviation (an agent answered late or not at all, a record was not in yet) leaves the group open: the
        next comparison pulls again, up to MAX_FETCHES times, rather than never checking the group again."""
        self._pending.pop(request.pg, None)
        finding = first_deviation(request.pg, "", records, request.seq_from, request.seq_to, pulled=True)
        if finding is not None or self._fetches.get(request.pg, 0) >= MAX_FETCHES:
            self._done.add(request.pg)
        return finding


def first_deviation(
    pg: str,
    pg_desc: str,
    records: dict[int, list[CollectiveRecord]],
    low: int,
    high: int,
    pulled: bool = False,
    complete_only: bool = False,
) -> Finding | None:
    """The first seq in [low, high] where members' records differ, as a finding (None if none found).

    complete_only: only look at seqs every member has a record of (the digest's recent window), and
    give up at the first seq someone lacks rather than asking for a pull.
    """
    by_seq: dict[int, dict[int, CollectiveRecord]] = {}
    for rank, recs in records.items():
        for rec in recs:
            if low <= rec.seq <= high:
                by_seq.setdefault(rec.seq, {})[rank] = rec
    for seq in sorted(by_seq):
        at = by_seq[seq]
        if len(at) < len(records):
            if pulled or complete_only:
                continue
            return None  # not every member's record of this seq is at hand: pull them
        keys = {r: _chain_key(rec) for r, rec in at.items()}
        verdict = vote_exact(keys)
        if verdict.status == "agree":
            described = {r: rec for r, rec in at.items() if rec.native and rec.entry_hash}
            if len(described) < 2:
                continue
            at, keys = described, {r: rec.entry_hash for r, rec in described.items()}
            verdict = vote_exact(keys)
            if verdict.status == "agree":
                continue
        groups: dict[int, list[int]] = {}
        for r, key in keys.items():
            groups.setdefault(key, []).append(r)
        evidence = {"issued": {_text(at[rs[0]]): sorted(rs) for rs in groups.values()}, "pg": pg}
        if verdict.status == "attributed":
            culprits = list(verdict.outliers)
            majority_desc = next(_text(rec) for r, rec in at.items() if r not in culprits)
            odd = "; ".join(
                f"{rank_list(rs)} issued {_text(at[rs[0]])}" for h, rs in groups.items() if h != verdict.majority_value
            )
            majority = groups[verdict.majority_value]
            summary = (
                f"at collective #{seq} of {group_label(pg, pg_desc)}: {odd} while "
                f"{rank_list(majority)} issued {majority_desc}"
            )
            evidence["differs_in"] = _difference(at[culprits[0]], at[majority[0]])
            return Finding(
                kind=DESYNC,
                summary=summary,
                culprit_ranks=culprits,
                pg=pg,
                collective_seq=seq,
                collective=at[culprits[0]].op,
                step=at[culprits[0]].step,
                evidence=evidence,
            )
        summary = (
            f"at collective #{seq} of {group_label(pg, pg_desc)} members disagree ("
            + "; ".join(f"{rank_list(rs)}: {_text(at[rs[0]])}" for rs in groups.values())
            + "); no strict majority, so no rank can be blamed"
        )
        return Finding(
            kind=DESYNC,
            status="inconclusive",
            summary=summary,
            culprit_ranks=[],
            pg=pg,
            collective_seq=seq,
            step=min(rec.step for rec in at.values()),
            confidence=0.5,
            evidence=evidence,
        )
    return None


def _chain_key(rec: CollectiveRecord) -> int:
    """What the rolling hash chains for this record (see trainscout.probe.protocol.NATIVE_HASH)."""
    return NATIVE_HASH if rec.native else rec.entry_hash


def _text(rec: CollectiveRecord) -> str:
    if rec.desc:
        return rec.desc
    return "a collective issued outside Python" if rec.native else rec.op


def _difference(odd_rec: CollectiveRecord, usual_rec: CollectiveRecord) -> str:
    if odd_rec.native != usual_rec.native:
        return "origin"  # one side issued it from Python, the other from C++ (e.g. DDP's reducer)
    odd, usual = odd_rec.desc, usual_rec.desc
    a, b = odd.split(), usual.split()
    if a[:1] != b[:1]:
        return "op"
    if any(x.startswith("op=") for x in a + b) and [x for x in a if x.startswith("op=")] != [
        x for x in b if x.startswith("op=")
    ]:
        return "reduce op"
    if [x.split("[")[0] for x in a[1:]] != [x.split("[")[0] for x in b[1:]]:
        return "dtype"
    return "shape" if a != b else "signature"


def _group_members(ranks: dict[int, RankObs]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for obs in ranks.values():
        for state in obs.state.pgs:
            if state.members and state.name not in groups:
                groups[state.name] = state.members
    return groups


def _member_states(ranks: dict[int, RankObs], name: str, members: list[int]) -> dict[int, PgState] | None:
    """{member: its PgState} when every reporting member issued on the group (at least two), else None."""
    states: dict[int, PgState] = {}
    reporting = 0
    for r in members:
        o = ranks.get(r)
        if o is None:
            continue
        reporting += 1
        pg = o.pg(name)
        if pg is not None and pg.seq != 0:
            states[r] = pg
    return states if len(states) >= 2 and len(states) == reporting else None


def _history(pg: PgState) -> dict[int, int] | None:
    """{seq: rolling hash} this member can show (anchors, chained recent records, its newest), None if its chain
    is broken."""
    if not pg.complete or pg.chained_seq == 0:
        return None
    hist = dict(pg.anchors)
    hist.update({rec.seq: rec.rolling_hash for rec in pg.recent if rec.rolling_hash})
    hist[pg.chained_seq] = pg.rolling_hash
    return hist


def _agreed_fast(states: dict[int, PgState]) -> int | None:
    """The highest seq every member chained, when every member shows the same rolling hash there; None when
    that cannot be told without their whole histories (a broken chain, a hash not at hand, a disagreement).

    The member that chained least holds nothing above its own chained seq, so that seq is the highest one all
    share whenever every member can show it: what the general comparison would find, without building each
    member's history (the per-pass cost at 100k ranks).
    """
    top = min(pg.chained_seq for pg in states.values())
    if top == 0:
        return None
    value = None
    for pg in states.values():
        if not pg.complete:
            return None
        if pg.chained_seq == top:
            h = pg.rolling_hash
        else:
            h = next((rec.rolling_hash for rec in pg.recent if rec.seq == top and rec.rolling_hash), 0)
            if not h and top % ANCHOR_EVERY == 0:
                h = next((a_hash for a_seq, a_hash in pg.anchors if a_seq == top), 0)
            if not h:
                return None
        if value is None:
            value = h
        elif h != value:
            return None
    return top


def _described_native(states: dict[int, PgState], low: int) -> bool:
    """Whether some member holds, from `low` on, a native collective its Flight Recorder has described."""
    return any(rec.native and rec.entry_hash and rec.seq >= low for pg in states.values() for rec in pg.recent)


def _desc(states: dict[int, PgState]) -> str:
    return next((pg.desc for pg in states.values() if pg.desc), "")
