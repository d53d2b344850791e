"""Crashes and early exits: which rank's exit started the failure, and which exits followed from it.

Exits are ordered by when the agents saw them. The root is the first exit that is abnormal for a
reason of its own (an exception that is not a lost peer connection, a fatal signal, a process that
vanished without a record), or a clean exit while peers still had work: they later issued a
collective it never issued, passed its step, or failed. Exits after the root are collateral (peers
losing their connection, the launcher's SIGTERM) and are listed as evidence, not blamed. A SIGTERM, SIGINT or
SIGHUP is how launchers and schedulers stop ranks, so it blames nobody, unless it came first and was aimed at one
rank from outside: the job was not told to stop and the launcher did not send it.
"""

from __future__ import annotations

import signal as _signal
from typing import TYPE_CHECKING

from trainscout.config import RUN
from trainscout.detectors.interface import DetectorBase, JobView, Judgement, findings_only
from trainscout.detectors.observations import RankObs, rank_list, who
from trainscout.findings import CRASH, EARLY_EXIT, Finding

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import RankExit

HANG_TIMEOUT_S = RUN.hang_timeout
_TEARDOWN = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP)  # how launchers and schedulers stop ranks
_COLLATERAL_TEXT = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "processgroup",
    "nccl",
    "socket",
    "gloo",
)


def _signame(sig: int | None) -> str:
    if not sig:
        return ""
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _exit(o: RankObs) -> RankExit:
    """The exit record of a rank that has exited (the only ranks this module asks it of)."""
    e = o.state.exit
    assert e is not None
    return e


def _exited_at(o: RankObs) -> float:
    """When a rank that has exited was seen exiting (the only ranks this module asks it of)."""
    at = o.exited_at()
    assert at is not None
    return at


def is_abnormal(o: RankObs, launcher_codes: dict[int, int]) -> bool:
    e = _exit(o)
    code = launcher_codes.get(o.rank)
    if code is not None and code != 0:
        return True
    if code == 0 and e.how == "vanished":
        return False  # no record of its own (os._exit), but the launcher saw it succeed
    return e.how in ("exception", "signal", "vanished") or (e.code not in (0, None))


def is_collateral(o: RankObs, launcher_codes: dict[int, int]) -> bool:
    e = _exit(o)
    if e.how == "signal" and e.signal in _TEARDOWN:
        return True  # the launcher tears the survivors down this way
    if launcher_codes.get(o.rank) in (-_signal.SIGTERM, -_signal.SIGINT):
        return e.how != "vanished"
    return (
        e.how == "exception" and _raised_by_torch(e.message) and any(t in e.message.lower() for t in _COLLATERAL_TEXT)
    )


def _raised_by_torch(message: str) -> bool:
    """The exception is of a type torch.distributed raises when a peer is lost (RuntimeError, its Dist*Error
    family) and not the DataLoader's: a TimeoutError or ConnectionResetError the script's own data service
    raised, or a DataLoader timing out, is the rank's own failure, whatever its text says."""
    name = message.split(":", 1)[0].strip()
    if "torch/utils/data/" in message:
        return False  # the DataLoader's own RuntimeErrors ("DataLoader timed out after 60 seconds")
    return name == "RuntimeError" or name.startswith("Dist")


class ExitDetector(DetectorBase):
    name = "exits"

    def __init__(
        self,
        settle_s: float = 1.0,
        max_wait_s: float = 4.0,
        blocked_s: float = HANG_TIMEOUT_S,
        launcher_code_wait_s: float = 3.0,
    ) -> None:
        self.settle_s = settle_s
        # a rank that vanished without a record (SIGSEGV, SIGKILL) has its signal only in the launcher's
        # report, which trails its death: the finding waits that long for it rather than say "unknown status"
        self.launcher_code_wait_s = launcher_code_wait_s
        self.blocked_s = blocked_s
        self.max_wait_s = max_wait_s
        self.done = False
        # exited rank -> peer -> the peer's step in its first state seen after that exit: a peer that steps on
        # from there went on without the rank. Its step alone is no such sign: with uneven inputs (DDP's Join) a
        # rank out of data stops stepping but shadows its peers' collectives to the end, and leaves with them.
        self._steps_after_exit: dict[int, dict[int, int]] = {}

    def judge(self, view: JobView) -> Judgement:
        if view.root_found:
            self.done = True  # later exits follow from the fault already named
        return findings_only(
            self.update(
                view.waited_until,
                dict(view.ranks),
                dict(view.launcher_codes),
                view.launcher_done,
                view.launcher_signalled,
                view.job_interrupted,
            )
        )

    def update(
        self,
        now: float,
        ranks: dict[int, RankObs],
        launcher_codes: dict[int, int],
        launcher_done: bool,
        launcher_signalled: frozenset[int] = frozenset(),
        job_interrupted: bool = False,
    ) -> list[Finding]:
        if self.done:
            return []
        exited = sorted((o for o in ranks.values() if o.state.exit is not None), key=_exited_at)
        if not exited:
            return []
        alive = [o for o in ranks.values() if o.state.alive]
        abnormal = [o for o in exited if is_abnormal(o, launcher_codes)]
        own = [o for o in abnormal if not is_collateral(o, launcher_codes)]
        first_abnormal_at = abnormal[0].exited_at() if abnormal else None

        early = self._early_exits(now, exited, ranks, abnormal, first_abnormal_at)
        if early:
            self.done = True
            return [self._early_finding(early, ranks, exited)]
        if not abnormal:
            return []
        outside = None if own else _stopped_from_outside(abnormal, launcher_signalled, job_interrupted)
        if outside is not None and exited[0] is outside:  # it ended first, while its peers still ran
            # the launcher's word on the signals it sent can trail the exits: judged once it ended, or after a while
            if now - _exited_at(outside) < (self.settle_s if launcher_done else self.max_wait_s):
                return []
            self.done = True
            return [self._crash_finding([outside], exited, launcher_codes, from_outside=True)]
        if not own and all(_exit(o).how == "signal" for o in abnormal):
            return []  # only teardown signals (Ctrl-C, the launcher stopping survivors): nobody to blame
        root_candidates = own or abnormal
        root_at = _exited_at(root_candidates[0])
        waited = now - root_at
        settled = launcher_done or not alive
        if waited < (self.settle_s if settled else self.max_wait_s):
            return []
        if (
            waited < self.launcher_code_wait_s
            and not launcher_done
            and _cause_unknown(root_candidates[0], launcher_codes)
        ):
            return []
        roots = [o for o in root_candidates if _exited_at(o) - root_at <= 0.25 and not is_collateral(o, launcher_codes)]
        roots = roots or [root_candidates[0]]
        self.done = True
        finding = self._crash_finding(roots, exited, launcher_codes)
        if not own:  # the first to fail only lost a peer: whoever it lost is not in view
            finding.status, finding.culprit_ranks, finding.confidence = "inconclusive", [], 0.4
        return [finding]

    def _early_exits(self, now, exited, ranks, abnormal, first_abnormal_at) -> list[RankObs]:
        """Clean exits while peers still had work: they passed its step; or they issued collectives it
        never issued and then failed, or stayed blocked for `blocked_s` after it left."""
        clean = [
            o for o in exited if o.ended_cleanly() and (first_abnormal_at is None or o.exited_at() <= first_abnormal_at)
        ]
        early = []
        for o in clean:
            others = [
                p
                for p in ranks.values()
                if p.rank != o.rank and (p.state.exit is None or p.exited_at() > o.exited_at())
            ]
            if self._went_on_without(o, others):
                early.append(o)
                continue
            waiting = [p for p in others if _issued_more(p, o)]
            failed = any(p in abnormal for p in waiting)
            blocked = any(p.state.alive and now - o.exited_at() >= self.blocked_s for p in waiting)
            if failed or blocked:
                early.append(o)
        return early

    def _went_on_without(self, gone: RankObs, others: list[RankObs]) -> bool:
        """Some peer stepped past `gone`'s step after `gone` exited, as the peer's own states tell."""
        base = self._steps_after_exit.setdefault(gone.rank, {})
        went_on = False
        for p in others:
            if p.rank not in base:
                if p.seen_at >= _exited_at(gone):  # its first state from after the exit
                    base[p.rank] = p.state.step
                continue
            went_on = went_on or p.state.step > max(base[p.rank], gone.state.step)
        return went_on

    def _early_finding(self, early, ranks, exited) -> Finding:
        first = early[0]
        culprits = sorted(o.rank for o in early)
        others = sorted(r for r in ranks if r not in culprits)
        after = [o for o in exited if o.rank not in culprits]
        lead = who(first) if len(early) == 1 else rank_list(culprits)
        max_step = max(ranks[r].state.step for r in others) if others else first.state.step
        if max_step > first.state.step:
            went_on = f"went on to step {max_step}"
        else:
            went_on = "still had collectives to run"
        summary = (
            f"{lead} exited cleanly (code {first.state.exit.code or 0}) after step {first.state.step} "
            f"while {rank_list(others)} {went_on}"
        )
        if after:
            summary += f"; {len(after)} rank(s) then failed because of it"
        return Finding(
            kind=EARLY_EXIT,
            summary=summary,
            culprit_ranks=culprits,
            step=first.state.step,
            hosts=sorted({o.host for o in early}),
            pids=[o.state.pid for o in early],
            evidence={"exit": {str(o.rank): o.state.exit.message for o in early}, "collateral": _collateral(after)},
        )

    def _crash_finding(self, roots, exited, launcher_codes, from_outside: bool = False) -> Finding:
        first = roots[0]
        e = first.state.exit
        code = launcher_codes.get(first.rank, e.code)
        sig = e.signal or (-code if code is not None and code < 0 else None)
        how = _signame(sig) if sig else (f"exit code {code}" if code is not None else "unknown status")
        if e.how == "exception":
            cause = e.message
        elif e.how == "vanished" and not sig:
            cause = "it vanished without an exit record (killed, e.g. SIGKILL / OOM killer, or crashed hard)"
        elif e.how == "exit" and sig:
            # its own exit record says the script ended; the signal came later, in interpreter teardown (torch
            # 2.13's gloo teardown aborts rank 0 now and then, with or without trainscout)
            cause = (
                f"after its script ended ({e.message}), in interpreter teardown (exit handlers, library "
                "destructors), not in training"
            )
        elif from_outside:
            cause = (
                f"{e.message} from outside the job while its peers were training (neither the launcher nor "
                "trainscout sent it, and no other rank was sent one): an operator, a node daemon or an out-of-memory "
                "daemon stopped it"
            )
        else:
            cause = e.message
        culprits = sorted(o.rank for o in roots)
        after = [o for o in exited if o.rank not in culprits]
        lead = who(first) if len(roots) == 1 else rank_list(culprits)
        summary = f"{lead} died first ({how}) at step {e.step}: {cause}"
        if after and all(o.ended_cleanly() for o in after):
            summary += f"; the other {len(after)} rank(s) had ended too"
        elif after:
            summary += f"; {len(after)} rank(s) failed after it"
        return Finding(
            kind=CRASH,
            summary=summary,
            culprit_ranks=culprits,
            step=e.step,
            hosts=sorted({o.host for o in roots}),
            pids=[o.state.pid for o in roots],
            evidence={
                "exit_code": code,
                "signal": _signame(sig) or None,
                "how": e.how,
                "message": e.message,
                "collateral": _collateral(after),
            },
        )


def _stopped_from_outside(
    abnormal: list[RankObs], launcher_signalled: frozenset[int], job_interrupted: bool
) -> RankObs | None:
    """The first rank to fail, when a terminating signal (SIGTERM, SIGINT, SIGHUP) ended it that was aimed at
    it alone: the job was not told to stop (Ctrl-C, the scheduler, --abort-on), its launcher did not send it,
    and every other rank a terminating signal ended, the launcher did (tearing the job down after it). A signal
    the launcher did not send to two ranks is the job being stopped from outside (pkill, scancel): nobody."""
    if job_interrupted or not abnormal:
        return None

    def unexplained_signal(o: RankObs) -> bool:
        e = _exit(o)
        return e.how == "signal" and e.signal in _TEARDOWN and o.rank not in launcher_signalled

    first = abnormal[0]
    if not unexplained_signal(first) or any(unexplained_signal(o) for o in abnormal[1:]):
        return None
    return first


def _cause_unknown(o: RankObs, launcher_codes: dict[int, int]) -> bool:
    """A rank gone without an exit record of its own, whose exit status the launcher has not reported yet."""
    e = _exit(o)
    return e.how == "vanished" and not e.signal and o.rank not in launcher_codes


def _issued_more(peer: RankObs, gone: RankObs) -> bool:
    for pg in gone.state.pgs:
        mine = peer.pg(pg.name)
        if mine is not None and gone.rank in (mine.members or [gone.rank]) and mine.seq > pg.seq:
            return True
    return False


def _collateral(after: list[RankObs]) -> dict[str, str]:
    out = {}
    for o in after:
        e = _exit(o)
        label = (
            e.how + (f" {_signame(e.signal)}" if e.signal else "") + (f" code {e.code}" if e.code is not None else "")
        )
        out[str(o.rank)] = f"{label}: {e.message}"[:300]
    return out
