"""Hang detection from collective sequence numbers: who never entered the collective the others wait in.

When no live rank has made progress for `hang_timeout_s`, each process group's members are compared by
the sequence number of the last collective they issued. The members behind a strict majority never
entered the collective the majority waits in: they are the culprits (C3 exact vote). Where no majority waits in
one collective, the vote is on the furthest collective a strict majority has entered (a broadcast's receivers
move on while its root waits). A rank behind in
one group but ahead in another waits in a different group than its peers: a process-group desync.
A job-wide pause (checkpoint save) leaves every member at the same sequence number: no finding, unless
it lasts `stall_timeout_s`, and then the finding blames nobody. Before any rank finished its first step the job
is starting (loading a model or a dataset, building indexes, every rank alike): a quiet start is a stall only
after STARTUP_STALL_FACTOR times as long (a 4-rank job under heavy load spent 12 s between init_process_group
and DDP's constructor, past a 10 s stall timeout). A job whose processes are stopped whole (most
ranks' probe threads silent too: SIGSTOP of the job, a suspended job, a paused VM) is not voted on: the stop
catches ranks wherever they were, and those caught in their compute would look like the culprits.

Ranks behind because they do work of their own (rank 0 saving a checkpoint or evaluating alone while the others
wait in a barrier, a rank compiling a new graph: markers.BUSY_*; rank 0 preparing the data alone: any code) are
not hung: the vote waits while every rank behind is inside a save or compilation, up to `stall_timeout_s`, ran a
forward pass more recently than `hang_timeout_s` ago, or had its training thread seen working that recently (I/O,
or a changing stack while computing; up to `stall_timeout_s` without a collective); a rank stuck anywhere, inside
a forward included, is named as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainscout.config import RUN
from trainscout.consensus import vote_exact
from trainscout.detectors.interface import DetectorBase, DumpStacks, JobView, Judgement
from trainscout.detectors.observations import RankObs, group_label, rank_list, who
from trainscout.findings import DESYNC, HANG, STALL, Finding
from trainscout.markers import BUSY_ACTIVE, BUSY_WHAT, PROBE_GROUP_ROLE

HANG_TIMEOUT_S, STALL_TIMEOUT_S = RUN.hang_timeout, RUN.stall_timeout
# a rank whose training thread keeps working between collectives (probe/activity.py: look)
OWN_CODE = "running code of its own"
STARTUP_STALL_FACTOR = 3.0  # before the first step: the stall timeout, this many times over


@dataclass
class Suspect:
    """A finding waiting for evidence the coordinator must fetch (stacks) before it is emitted."""

    finding: Finding
    stack_ranks: list[int] = field(default_factory=list)


class HangDetector(DetectorBase):
    name = "hang"

    def __init__(
        self,
        hang_timeout_s: float = HANG_TIMEOUT_S,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        starved_after_s: float = 2.0,
    ) -> None:
        self.hang_timeout_s = hang_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.starved_after_s = starved_after_s
        self._reported_this_quiet = False
        self.waiting_on_work: dict[int, str] = {}  # ranks the vote waits for now, and what each of them does
        self._told: set[int] = set()  # ... already in an event this quiet period

    def judge(self, view: JobView) -> Judgement:
        """A hang's finding waits for the stacks of the ranks it names (taken from outside them)."""
        suspects = self.update(view.now, dict(view.seen))
        new = {r: what for r, what in self.waiting_on_work.items() if r not in self._told}
        self._told.update(new)
        events = [("hang_vote_waits", {"ranks": sorted(new), "doing": sorted(set(new.values()))})] if new else []
        return Judgement(asks=[DumpStacks(s.finding, s.stack_ranks) for s in suspects], events=events)

    def own_work(self, o: RankObs, now: float) -> str | None:
        """What a rank behind its peers is doing of its own, if it is still doing it (None: nothing known)."""
        limit = self.hang_timeout_s if o.state.busy == BUSY_ACTIVE else self.stall_timeout_s
        if o.state.busy in BUSY_WHAT and o.busy_age(now) < limit:
            return BUSY_WHAT[o.state.busy]
        if o.moving_age(now) < self.hang_timeout_s and o.progress_age(now) < self.stall_timeout_s:
            return OWN_CODE
        return None

    def _waits_on_work(self, now: float, live: dict[int, RankObs], ranks) -> bool:
        """True (and noted) when every one of `ranks` is busy with work of its own: the vote waits."""
        doing = {r: self.own_work(live[r], now) for r in ranks}
        if not doing or any(what is None for what in doing.values()):
            return False
        self.waiting_on_work = {r: str(what) for r, what in doing.items()}
        self._reported_this_quiet = False
        return True

    def update(self, now: float, ranks: dict[int, RankObs]) -> list[Suspect]:
        live = {r: o for r, o in ranks.items() if o.state.alive}
        if len(live) < 1:
            return []
        quiet = min(o.progress_age(now) for o in live.values())
        if quiet < self.hang_timeout_s:
            self._reported_this_quiet = False
            self.waiting_on_work, self._told = {}, set()
            return []
        if self._reported_this_quiet:
            return []
        if 2 * sum(1 for o in live.values() if o.heartbeat_age(now) >= self.starved_after_s) > len(live):
            # most ranks' probe threads do not run either: their processes are stopped whole (a suspended job,
            # a paused VM), caught wherever they were, some in their compute, some in a collective. No rank hangs.
            return []
        behind: dict[int, list[tuple[str, int]]] = {}  # rank -> [(pg, majority seq it never entered)]
        ahead: dict[int, list[tuple[str, int]]] = {}
        unattributed: list[tuple[str, dict[int, int]]] = []
        waiting: set[int] = set()  # ranks inside a collective some member of its group has not entered
        on_exited: set[int] = set()  # ... that a member which has exited never entered
        for name, _members, seqs, exited_seq in _groups(ranks, live):
            if exited_seq is not None:
                on_exited.update(r for r, s in seqs.items() if s > exited_seq)
            lowest = min(seqs.values())
            if max(seqs.values()) == lowest:
                continue
            waiting.update(r for r, s in seqs.items() if s > lowest)
            verdict = vote_exact(seqs)
            if verdict.status != "attributed":
                entered = _entered_by_majority(seqs)
                if entered is None:
                    unattributed.append((name, seqs))
                    continue
                for r, s in seqs.items():
                    if s < entered:
                        behind.setdefault(r, []).append((name, entered))
                continue
            majority = verdict.majority_value
            for r in verdict.outliers:
                if seqs[r] < majority:
                    behind.setdefault(r, []).append((name, majority))
                else:
                    ahead.setdefault(r, []).append((name, seqs[r]))
        if not behind and not unattributed and not ahead:
            stuck_gpu = self._gpu_behind(now, live)
            if stuck_gpu:
                self._reported_this_quiet = True
                return [Suspect(self._gpu_blame(now, live, stuck_gpu, quiet), stuck_gpu)]
            started = any(o.state.step > 0 for o in live.values())
            if quiet >= self.stall_timeout_s * (1.0 if started else STARTUP_STALL_FACTOR):
                if self._outlived(ranks, live):  # most ranks ended: those left are stuck or still finishing
                    left = self._left_behind(now, live)
                    self._reported_this_quiet = bool(left)
                    return [Suspect(self._did_not_end(now, ranks, left, quiet), left)] if left else []
                self._reported_this_quiet = True
                return [Suspect(self._stall(now, live, quiet))]
            return []
        self._reported_this_quiet = True
        # A rank behind in one group because it waits in another (a tensor-parallel peer of the culprit never
        # reaches the data-parallel all-reduce) is not a cause: the causes are the ranks behind that wait in
        # nothing. If every rank behind also waits somewhere (a cycle, or a rank in the wrong group), all stay.
        roots = {r: v for r, v in behind.items() if r not in waiting and r not in on_exited}
        if roots:
            behind = roots
        elif on_exited and all(r in waiting or r in on_exited for r in behind) and not unattributed:
            # Every rank behind waits, in the end, for a rank that has exited (peers blocked in a collective a
            # crashed rank never joins): the exit is the cause, and the exit detector names it.
            return []
        if behind:
            if not (set(behind) & set(ahead)) and self._waits_on_work(now, live, behind):
                return []
            return [Suspect(self._blame(now, live, behind, ahead, quiet), sorted(behind))]
        # no rank to blame: the ranks behind the furthest (a majority behind a rank ahead of it included)
        groups = unattributed or [
            (g, {k: _seq(o, g) for k, o in live.items() if o.pg(g) is not None})
            for g in {v[0][0] for v in ahead.values()}
        ]
        lagging = {r for _, seqs in groups for r, s in seqs.items() if s < max(seqs.values())}
        if self._waits_on_work(now, live, lagging):
            return []
        return [Suspect(self._inconclusive(now, live, unattributed, ahead, quiet), sorted(live))]

    def _blame(self, now, live, behind, ahead, quiet) -> Finding:
        culprits = sorted(behind)
        cross = {r for r in culprits if r in ahead}
        pg_name, seq = behind[culprits[0]][0]
        waiting = [r for r, o in live.items() if r not in behind and _seq(o, pg_name) >= seq]
        op, desc, pg_desc = _collective_at(live, waiting, pg_name, seq)
        first = live[culprits[0]]
        evidence = {
            "quiet_s": round(quiet, 2),
            "waiting_ranks": waiting,
            "positions": {str(r): {n: _seq(live[r], n) for n, _ in behind[r]} for r in culprits},
        }
        starved = [r for r in culprits if live[r].heartbeat_age(now) >= self.starved_after_s]
        if starved:
            evidence["starved_ranks"] = starved
            evidence["starved_note"] = (
                "the probe's own thread stopped running in these ranks: the "
                "process holds the GIL (busy Python loop) or is frozen"
            )
            evidence["cpu_percent"] = {str(r): live[r].state.cpu_percent for r in starved}
        inside = {  # a save or compilation that outlasted the stall timeout is named, with what it was
            str(r): f"{BUSY_WHAT[live[r].state.busy]} for {live[r].busy_age(now):.0f} s"
            for r in culprits
            if live[r].state.busy in BUSY_WHAT and live[r].state.busy != BUSY_ACTIVE
        }
        for r in culprits:  # ... and work of its own in any other code, likewise
            if str(r) not in inside and live[r].moving_age(now) < self.hang_timeout_s:
                inside[str(r)] = f"{OWN_CODE} for {live[r].progress_age(now):.0f} s"
        if inside:
            evidence["inside"] = inside
        if cross:
            other_pg, other_seq = ahead[min(cross)][0]
            kind = DESYNC
            summary = (
                f"{rank_list(culprits)} issued collective #{other_seq} on pg {other_pg} while "
                f"{len(waiting)}/{len(live)} ranks wait in {op or 'a collective'} #{seq} of "
                f"{group_label(pg_name, pg_desc)}: different process group"
            )
            evidence["desync"] = "process group"
            evidence["culprit_group"] = {"pg": other_pg, "seq": other_seq}
        else:
            kind = HANG
            where = f"{op} #{seq}" if op else f"collective #{seq}"
            lead = who(first) if len(culprits) == 1 else rank_list(culprits)
            summary = (
                f"{lead} never entered {where} of {group_label(pg_name, pg_desc)}; "
                f"{len(waiting)}/{len(live)} ranks wait there"
            )
            if starved:
                summary += " (culprit holds the GIL or is frozen)"
        return Finding(
            kind=kind,
            summary=summary,
            culprit_ranks=culprits,
            step=first.state.step,
            hosts=sorted({live[r].host for r in culprits}),
            pids=[live[r].state.pid for r in culprits],
            pg=pg_name,
            collective_seq=seq,
            collective=op or None,
            evidence=evidence,
            confidence=1.0,
            first_seen=0.0,
        )

    def _inconclusive(self, now, live, unattributed, ahead, quiet) -> Finding:
        if unattributed:
            name, seqs = unattributed[0]
        else:
            r = min(ahead)
            name = ahead[r][0][0]
            seqs = {k: _seq(o, name) for k, o in live.items()}
        top = max(seqs.values())
        lagging = sorted(r for r, s in seqs.items() if s < top)
        return Finding(
            kind=HANG,
            status="inconclusive",
            culprit_ranks=[],
            summary=(
                f"job hung on pg {name}: {rank_list(lagging)} never entered collective #{top} but no "
                f"strict majority waits there, so no rank can be blamed"
            ),
            pg=name,
            collective_seq=top,
            confidence=0.3,
            evidence={
                "quiet_s": round(quiet, 2),
                "seq_by_rank": {str(k): v for k, v in seqs.items()},
                "lagging_ranks": lagging,
            },
        )

    def _gpu_behind(self, now: float, live: dict[int, RankObs]) -> list[int]:
        """With every rank at the same collective: those whose GPU has not finished its queued work for the hang
        timeout while a strict majority's has (a kernel that never ends; its peers wait on the host for its data).
        Exact C3 on "drained"; on NCCL the waiting peers' streams hold the collective's kernel too, and then no
        majority drained and nobody is named."""
        pending = {r: o.gpu_pending(now) for r, o in live.items()}
        stuck = sorted(r for r, age in pending.items() if age >= self.hang_timeout_s)
        drained = sum(1 for age in pending.values() if age == 0.0)
        return stuck if stuck and 2 * drained > len(live) else []

    def _gpu_blame(self, now, live, culprits, quiet) -> Finding:
        first = live[culprits[0]]
        lead = who(first) if len(culprits) == 1 else rank_list(culprits)
        waiting = sorted(r for r in live if r not in culprits)
        pending = {str(r): round(live[r].gpu_pending(now), 1) for r in culprits}
        summary = (
            f"{lead}'s GPU has not finished its queued work for {max(pending.values()):.0f} s (a kernel that "
            f"does not end); {rank_list(waiting)}, their GPUs idle, wait for it at step {first.state.step}"
        )
        return _hang(
            live, culprits, summary, {"quiet_s": round(quiet, 2), "gpu_pending_s": pending, "waiting_ranks": waiting}
        )

    @staticmethod
    def _outlived(ranks: dict[int, RankObs], live: dict[int, RankObs]) -> bool:
        """A strict majority of the job ended cleanly and some ranks are still alive."""
        return bool(live) and 2 * sum(1 for o in ranks.values() if o.ended_cleanly()) > len(ranks)

    def _left_behind(self, now: float, live: dict[int, RankObs]) -> list[int]:
        """The ranks still alive after most of the job ended cleanly, when each of them is stuck (not working of
        its own): a rank hung after its last step (a thread it joins, a lock, a teardown that never returns) keeps
        the job from ending. Judged at the stall timeout, as a pause of the whole job is: ranks finish uploads,
        evaluations and their loggers' last flush after the others left; one still working is never named."""
        if any(o.moving_age(now) < self.hang_timeout_s or self.own_work(o, now) for o in live.values()):
            return []
        return sorted(live)

    def _did_not_end(self, now, ranks, left, quiet) -> Finding:
        ended = sorted(r for r in ranks if r not in left)
        first = ranks[left[0]]
        lead = who(first) if len(left) == 1 else rank_list(left)
        last_exit = max((ranks[r].exited_at() or now) for r in ended)
        summary = (
            f"{lead} did not end: {rank_list(ended)} ended cleanly {now - last_exit:.0f} s ago, and it has "
            f"made no progress for {quiet:.0f} s since its step {first.state.step} (stuck after its work)"
        )
        return _hang(ranks, left, summary, {"quiet_s": round(quiet, 1), "ended_ranks": ended, "left_ranks": list(left)})

    def _stall(self, now, live, quiet) -> Finding:
        return Finding(
            kind=STALL,
            status="inconclusive",
            culprit_ranks=[],
            summary=f"no rank made progress for {quiet:.0f} s and all wait at the same point",
            step=max(o.state.step for o in live.values()),
            confidence=0.3,
            evidence={"quiet_s": round(quiet, 1), "ranks": sorted(live)},
        )


def _hang(ranks: dict[int, RankObs], culprits: list[int], summary: str, evidence: dict) -> Finding:
    """A hang the sequence numbers alone could not place, attributed to `culprits` (their stacks are fetched)."""
    first = ranks[culprits[0]]
    return Finding(
        kind=HANG,
        summary=summary,
        culprit_ranks=list(culprits),
        step=first.state.step,
        hosts=sorted({ranks[r].host for r in culprits}),
        pids=[ranks[r].state.pid for r in culprits],
        evidence=evidence,
        confidence=1.0,
        first_seen=0.0,
    )


def _groups(ranks: dict[int, RankObs], live: dict[int, RankObs]):
    """(pg name, members, {live member: seq}, the lowest seq of a member that has exited or None) for every group
    with at least two live reporting members, or one and a member that has exited. trainscout's own groups are
    left out: their exchanges are bounded and end by themselves, and a rank that missed one (its node never got
    the command) is no culprit."""
    names: dict[str, list[int]] = {}
    for o in live.values():
        for pg in o.state.pgs:
            if pg.members and pg.name not in names and pg.role != PROBE_GROUP_ROLE:
                names[pg.name] = pg.members
    everyone_live = len(live) == len(ranks)
    for name, members in names.items():
        seqs = {r: _seq(live[r], name) for r in members if r in live}
        exited = None
        if not everyone_live and seqs:  # (a group whose only live member waits on the exited one counts too)
            exited = min(
                (_seq(ranks[r], name) for r in members if r not in live and r in ranks and ranks[r].state.exit),
                default=None,
            )
        if len(seqs) >= 2 or exited is not None:
            yield name, members, seqs, exited


def _entered_by_majority(seqs: dict[int, int]) -> int | None:
    """The furthest collective a strict majority of the members has entered, when some members never entered it.

    The majority need not wait in one collective: a broadcast's receivers leave it once their copy arrived while
    its root still waits for a member that never joined (DDP's buffer broadcast before each forward: root at #k,
    receivers on at #k+1, the hung rank at #k-1). The vote is on "entered #k", exact C3 all the same."""
    ordered = sorted(seqs.values(), reverse=True)
    entered = ordered[len(ordered) // 2]  # at least len // 2 + 1 members hold this or more
    return entered if ordered[-1] < entered else None


def _seq(o: RankObs, name: str) -> int:
    pg = o.pg(name)
    return pg.seq if pg is not None else 0


def _collective_at(live, waiting, pg_name, seq) -> tuple[str, str, str]:
    for r in waiting:
        pg = live[r].pg(pg_name)
        if pg is None:
            continue
        for rec in reversed(pg.recent):
            if rec.seq == seq:
                return rec.op, rec.desc, pg.desc
        return "", "", pg.desc
    return "", "", ""
