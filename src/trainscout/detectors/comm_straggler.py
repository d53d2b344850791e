"""Communication stragglers: a slow transport on one rank, found by watching waits, then probing links.

In a ring or tree collective every member waits for the slowest transfer, so a slow link or host
network stack on one rank makes all members of its process groups wait longer, by the same amount,
while their compute stays the same. That pattern is the trigger: per process group, the per-step wait
of the least-waiting member (what the collective itself costs, arrival skew removed) is compared with
its own early baseline; at least double and 5 ms more, for a window of steps, with no compute straggler
flagged meanwhile, asks for a link probe (probe/link_probe.py): each rank exchanges a buffer with every
other probed rank, one partner at a time. Each rank's fastest exchange says what its own endpoint can
do: a rank slow with every partner is the communication straggler (statistical C3 over those minima);
a pair slow only with each other is a slow link. A compute straggler makes its peers wait, not itself,
so the least-waiting member's wait stays flat: it does not trigger this, nor does a uniformly slow job.
Pure logic: records in, requests and findings out.
"""

from __future__ import annotations

from collections.abc import Mapping

import statistics
from collections import deque
from dataclasses import dataclass, field

from trainscout.consensus import vote_statistical
from trainscout.findings import STRAGGLER, Finding
from trainscout.markers import ASYNC_WAIT, P2P_WAIT
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import LinkRecord, StepRecord

BASELINE_STEPS = 16
WINDOW = 8
RISE_FACTOR = 2.0
RISE_ABS_S = 0.005
RETRY_S = 60.0  # between link probes of one group
MAX_PROBES = 4  # a finding needs two in a row
RESULT_WAIT_S = 15.0  # after the probe step, for every member's result
LINK_REL, LINK_ABS_S = 1.0, 0.005  # a slow endpoint: >= 2x and >= 5 ms above the median of the minima
PAIR_FACTOR = 3.0  # a slow pair: >= 3x the median pair time
COMPUTE_QUIET_STEPS = 64  # no compute outlier for this many steps before a comm slowdown is probed


@dataclass
class _Group:
    baseline: list[float] = field(default_factory=list)
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    members: set[int] = field(default_factory=set)
    last_probe: float = -1e9
    probes: int = 0
    reported: bool = False
    # what the last probe found slow, (endpoint, ranks) -> finding: named only if the next probe finds it again
    candidates: dict[tuple, Finding] = field(default_factory=dict)


@dataclass
class _Probe:
    request_id: int
    pg: str
    members: list[int]
    step: int
    before_s: float
    now_s: float
    scheduled_at: float
    results: dict[int, dict[int, float]] = field(default_factory=dict)


class CommStragglerWatch:
    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        self.wanted: tuple[str, list[int], float, float] | None = None  # (pg, members, baseline s, now s)
        self.probes: dict[int, _Probe] = {}
        self._step = 0
        self._early_links: dict[int, dict[int, dict[int, float]]] = {}
        self._last_compute_flag = -(10**9)  # last step with a compute outlier
        self._reported: set[tuple] = set()

    # ---- trigger -------------------------------------------------------------------------------
    def observe(
        self,
        step: int,
        recs: dict[int, StepRecord],
        compute_flagged: bool,
        now: float,
        members: Mapping[str, list[int]] | None = None,
    ) -> None:
        """One step's records. `members` (group -> its ranks, as the coordinator knows them): a group is judged
        only at steps where every one of its members reported; None takes the reporting ranks as the group."""
        if compute_flagged:
            self._last_compute_flag = step
        self._step = step
        names = {name for rec in recs.values() for name in rec.pg_wait} - {P2P_WAIT, ASYNC_WAIT}
        for name in names:
            waits = {r: rec.pg_wait[name] for r, rec in recs.items() if name in rec.pg_wait}
            if len(waits) < 2:
                continue
            # "Slowed on every member" needs every member: with some unseen (an agent restarting, a node
            # cut off), the ones seen wait for them, and probing only those named two healthy ranks.
            if members is not None and not (name in members and set(members[name]) <= set(waits)):
                continue
            g = self.groups.setdefault(name, _Group())
            g.members |= set(waits)
            least = min(waits.values())
            if len(g.baseline) < BASELINE_STEPS:
                if step > 2:
                    g.baseline.append(least)
                continue
            g.recent.append(least)
            self._maybe_want(name, g, now)

    def _maybe_want(self, name: str, g: _Group, now: float) -> None:
        if len(g.recent) < WINDOW or g.reported or g.probes >= MAX_PROBES or now - g.last_probe < RETRY_S:
            return
        if any(p.pg == name for p in self.probes.values()) or self.wanted is not None:
            return
        before, current = statistics.median(g.baseline), statistics.median(g.recent)
        if current < RISE_FACTOR * before or current - before < RISE_ABS_S:
            return
        if self._step - self._last_compute_flag < COMPUTE_QUIET_STEPS:
            return  # a compute straggler explains the waits (and scheduling noise around it)
        self.wanted = (name, sorted(g.members), before, current)

    def take_request(self) -> tuple[str, list[int], float, float] | None:
        """The link probe the coordinator should schedule now, if any: (pg, members, baseline s, now s)."""
        wanted, self.wanted = self.wanted, None
        return wanted

    def scheduled(
        self, request_id: int, pg: str, members: list[int], step: int, before_s: float, now_s: float, now: float
    ) -> None:
        g = self.groups.setdefault(pg, _Group())
        g.last_probe, g.probes = now, g.probes + 1
        self.probes[request_id] = _Probe(request_id, pg, list(members), step, before_s, now_s, now)
        for rank, seconds in self._early_links.pop(request_id, {}).items():
            self.probes[request_id].results[rank] = seconds

    # ---- results --------------------------------------------------------------------------------
    def add_links(self, rank: int, links: list[LinkRecord], now: float) -> None:
        for rec in links:
            probe = self.probes.get(rec.request_id)
            target = probe.results if probe is not None else self._early_links.setdefault(rec.request_id, {})
            target.setdefault(rank, {}).update(rec.seconds)

    def judge(self, now: float) -> list[Finding]:
        out = []
        for rid, probe in list(self.probes.items()):
            complete = set(probe.members) <= set(probe.results)
            if not complete and now - probe.scheduled_at < RESULT_WAIT_S + 30.0:
                continue
            del self.probes[rid]
            out.extend(self._reproduced(probe.pg, self._judge_probe(probe)))
        return out

    def _reproduced(self, pg: str, found: list[Finding]) -> list[Finding]:
        """A slow endpoint or link is slow in every probe; a pair that was descheduled at the wrong moment on a
        crowded machine is not (two disjoint "slow links" among 6 healthy ranks on 2 cores, at load 17). So a
        probe's findings are named only if the group's next probe finds the same; a first sighting probes again
        at once."""
        g = self.groups.setdefault(pg, _Group())
        now_found = {(f.evidence.get("endpoint"), tuple(f.culprit_ranks)): f for f in found}
        before, g.candidates = g.candidates, now_found
        confirmed = [f for key, f in now_found.items() if key in before]
        if confirmed:
            g.reported, g.candidates = True, {}
            for f in confirmed:
                f.summary += "; slow in two link probes in a row"
                f.evidence["probes_agreeing"] = 2
            return confirmed
        if now_found:
            g.last_probe = -1e9  # probe again as soon as the slowdown still shows
        return []

    def _judge_probe(self, probe: _Probe) -> list[Finding]:
        minima = {r: min(s.values()) for r, s in probe.results.items() if s}
        if len(minima) < 2:
            return []
        pg_note = (
            f"collectives of pg {probe.pg} slowed on every member: the least-waiting rank waits "
            f"{probe.now_s * 1e3:.1f} ms per step, was {probe.before_s * 1e3:.1f} ms"
        )
        evidence_common = {
            "type": "communication",
            "pgs": [probe.pg],
            "probe_step": probe.step,
            "collective_wait_before_s": round(probe.before_s, 6),
            "collective_wait_now_s": round(probe.now_s, 6),
            "basis": "link probe over the side group: each rank's fastest exchange, statistical C3",
        }
        if len(minima) >= 3:
            verdict = vote_statistical(minima, rel_threshold=LINK_REL, abs_threshold=LINK_ABS_S)
            if verdict.status == "attributed":
                median = statistics.median(minima.values())
                findings = []
                for r in verdict.outliers:
                    ratio = minima[r] / median if median > 0 else float("inf")
                    findings.append(
                        Finding(
                            kind=STRAGGLER,
                            culprit_ranks=[r],
                            step=probe.step,
                            pg=probe.pg,
                            confidence=0.9,
                            summary=(
                                f"rank {r} is a communication straggler: every transfer to or from it is slow "
                                f"({minima[r] * 1e3:.1f} ms at best vs {median * 1e3:.1f} ms for its peers, "
                                f"link probe at step {probe.step}); {pg_note}"
                            ),
                            evidence={
                                **evidence_common,
                                "endpoint": f"rank {r}",
                                "ratio": round(ratio, 3),
                                "link_seconds": {str(p): round(s, 6) for p, s in probe.results[r].items()},
                                "peer_median_s": round(median, 6),
                            },
                        )
                    )
                return findings
        return self._slow_pairs(probe, evidence_common, pg_note)

    def _slow_pairs(self, probe: _Probe, evidence_common: dict, pg_note: str) -> list[Finding]:
        # Both ends time the same round trips, and scheduling noise only adds time, so the pair's time is the
        # lower of the two: a slow link is slow from both ends. (Taking the higher one named a healthy link on a
        # crowded machine: 8.2 ms against 1.8 ms for the other pairs, one end's reading.)
        pairs: dict[tuple[int, int], float] = {}
        for r, seconds in probe.results.items():
            for peer, s in seconds.items():
                key = (min(r, peer), max(r, peer))
                pairs[key] = min(pairs.get(key, s), s)
        if len(pairs) < 3:
            if len(pairs) == 1 and len(probe.members) == 2:  # two ranks: slow, but which end cannot be told
                (a, b), s = next(iter(pairs.items()))
                return [
                    Finding(
                        kind=STRAGGLER,
                        culprit_ranks=[a, b],
                        status="inconclusive",
                        step=probe.step,
                        pg=probe.pg,
                        confidence=0.3,
                        summary=(
                            f"communication slowdown between ranks {a} and {b} ({s * 1e3:.1f} ms per "
                            f"exchange); with 2 ranks the slow end cannot be told; {pg_note}"
                        ),
                        evidence={**evidence_common, "endpoint": f"ranks {a}-{b}"},
                    )
                ]
            return []
        median = statistics.median(pairs.values())
        slow = [(k, s) for k, s in pairs.items() if s > PAIR_FACTOR * median and s - median > LINK_ABS_S]
        if not slow or 2 * len(slow) >= len(pairs):
            return []
        return [
            Finding(
                kind=STRAGGLER,
                culprit_ranks=[a, b],
                step=probe.step,
                pg=probe.pg,
                confidence=0.7,
                summary=(
                    f"slow link between ranks {a} and {b}: {s * 1e3:.1f} ms per exchange vs "
                    f"{median * 1e3:.1f} ms between other pairs; {pg_note}"
                ),
                evidence={
                    **evidence_common,
                    "type": "communication",
                    "endpoint": f"link {a}-{b}",
                    "link_s": round(s, 6),
                    "pair_median_s": round(median, 6),
                },
            )
            for (a, b), s in slow
        ]
