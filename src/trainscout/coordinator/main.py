"""Coordinator process: `python -m trainscout.coordinator` (started by `trainscout run` on node 0).

It receives node digests from agents, keeps the latest state of every rank, runs the detectors a few
times a second, gathers the evidence a finding needs (stacks taken from outside the culprit, records
of the first deviating collective) and emits each finding once to the console, findings.jsonl and
events.jsonl. Frames that fail authentication or decoding are dropped and counted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from trainscout import config, log
from trainscout.coordinator import confirmation
from trainscout.coordinator.attempts import AttemptTracker
from trainscout.coordinator.collection import Collection
from trainscout.coordinator.memberships import Memberships
from trainscout.coordinator.step_commands import StepCommands
from trainscout.detectors.devices import DeviceWatch
from trainscout.detectors.exits import ExitDetector, is_abnormal, is_collateral
from trainscout.detectors.interface import Ask, Confirm, DumpStacks, FetchRecords, JobView, LinkProbe, evidence_clock
from trainscout.detectors.observations import RankObs
from trainscout.detectors.registry import Registry, default_detectors
from trainscout.detectors.replay import ReplayDetector
from trainscout.detectors.state import ReplicaStateDetector, verified_window
from trainscout.detectors.where_time_goes import where_time_goes
from trainscout.findings import CRASH, DESYNC, EARLY_EXIT, HANG, HEALTH, HPZ_RACE, NONFINITE, SDC, STALL, STRAGGLER
from trainscout.findings import Finding, from_json
from trainscout.integrations.topology import TopologyTracker
from trainscout.process_priority import lower_priority
from trainscout.runner.handoff import Handoff
from trainscout.sinks import ConsoleSink, EventLog, JsonlSink
from trainscout.sinks.held_lines import FullFolderNotice
from trainscout.sinks import metrics as run_metrics
from trainscout.sinks.evidence_log import EvidenceLog
from trainscout.sinks.notify import Notifier, notify_urls
from trainscout.wire.endpoints import CoordinatorEndpoint
from trainscout.wire.messages import (
    Command,
    Goodbye,
    Hello,
    LauncherReport,
    NodeDigest,
    RankExit,
    RecordsReport,
    StackReport,
)

_log = log.get("coordinator")
# signals no launcher's teardown sends: a rank killed by one failed of its own accord
FAULT_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}
ROOT_KINDS = {HANG, DESYNC, CRASH, EARLY_EXIT, STALL}
# straggler types whose finding says where the time goes (a starved rank's is spread over whatever it runs)
PROFILED = {"blocked", "compute", "data_loading"}
INTEGRITY_KINDS = {SDC, NONFINITE, HEALTH, HPZ_RACE}


@dataclass
class PendingStacks:
    finding: Finding
    waiting: set[int]
    deadline: float


@dataclass
class PendingProfile:
    """A straggler finding held while the agents sample where its culprit's time goes (and its peers')."""

    finding: Finding
    culprit: int
    peers: list[int]
    waiting: set[int]
    deadline: float
    reports: dict[int, str] = field(default_factory=dict)


PROFILE_S = 2.0  # seconds of stack samples taken of a straggler and its peers
PROFILE_PEERS = 2


@dataclass
class PendingFetch:
    ask: FetchRecords
    waiting: set[int]
    deadline: float
    records: dict = field(default_factory=dict)


REPLAY_REQUEST = "replay-request"  # file in the run dir that `trainscout replay` writes
REPLAY_LEAD_S = 5.0  # how far ahead an on-command replay is scheduled, in seconds of training
REPLAY_LEAD_STEPS = 10
STALL_S = 5.0  # a gap this long between detection passes is a monitoring gap (the coordinator did not run)
COLLECTED_NOTE = 10_000  # a full collection that freed more objects than this is noted in events.jsonl (cycles pile up)


class Coordinator:
    def __init__(
        self,
        endpoint: CoordinatorEndpoint,
        run_dir: str,
        console: ConsoleSink,
        *,
        hang_timeout_s: float = config.RUN.hang_timeout,
        stall_timeout_s: float = config.RUN.stall_timeout,
        abort_on: set[str] | None = None,
        stack_timeout_s: float = 4.0,
        agent_silence_s: float = 3.0,
        gpu_stragglers: bool = True,
        detectors: Registry | None = None,
        metrics_port: int = 0,
        metrics_addr: str = "127.0.0.1",
        metrics_max_ranks: int = 512,
        notify: list[str] | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.console = console
        self.folder = FullFolderNotice(console.warn, console.info)
        self.findings_sink = JsonlSink(os.path.join(run_dir, "findings.jsonl"), self.folder)
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"), self.folder)
        self.evidence_log = EvidenceLog(os.path.join(run_dir, "evidence.jsonl"))
        self.handoff = handoff or Handoff(run_dir, os.path.basename(run_dir))  # verdict.json, --on-finding
        self.attempts = AttemptTracker()  # elastic restarts: each attempt's ranks are judged afresh
        self._given_detectors = detectors
        self._timeouts = (hang_timeout_s, stall_timeout_s, gpu_stragglers)
        self._fresh_detectors()
        self.topology = TopologyTracker()
        self.memberships = Memberships()  # every group's members, sent once by each agent
        self._topology_key = -1  # memberships.version last judged, once its line is shown (see _track_topology)
        self._topology_tried: tuple[int, bool] = (-1, False)
        self._topology_next = 0.0
        self.topology_file = os.path.join(run_dir, "topology.json")
        self.abort_on = abort_on or set()
        self.stack_timeout_s = stack_timeout_s
        self.agent_silence_s = agent_silence_s
        self.ranks: dict[int, RankObs] = {}
        self.replay_request_file = os.path.join(run_dir, REPLAY_REQUEST)
        self._step_history: deque = deque(maxlen=64)  # (monotonic s, highest step of any rank)
        self._top_step = 0
        self._step_walls: deque = deque(maxlen=64)  # recent steps' wall seconds, any rank (the current step rate)
        self.rank_node: dict[int, bytes] = {}
        self.nodes: dict[bytes, dict] = {}
        self.launcher_codes: dict[int, int] = {}
        self.launcher_done = False
        self.launcher_signalled: dict[bytes, set[int]] = {}  # node -> pids its launcher sent a closing signal
        self.job_interrupted = False  # a supervisor or launcher was told to stop the whole job
        self.emitted: set[tuple] = set()
        self.numerically_named: dict[int, int] = {}  # rank -> step it was first named at for sdc or nonfinite
        self._seen_errors: set[tuple[int, str]] = set()  # probe errors already shown (per coordinator)
        self.findings: list[Finding] = []
        self.pending_stacks: dict[int, PendingStacks] = {}
        self.pending_fetch: dict[int, PendingFetch] = {}
        self.pending_profiles: dict[int, PendingProfile] = {}
        self.step_commands = StepCommands()  # link probes and replays: sent over sound links, resent to returners
        self.request_ids = itertools.count(1)
        self.aborting = False
        self.aborted_at: float | None = None  # monotonic time of our own --abort-on stop
        self.root_found = False
        self._confirms_after: str | None = None  # the detector whose suspects wait for a confirmation
        self._next_trust = 0.0
        self._last_trust = ""
        self.stop = False
        self._caught_up: float | None = None  # when the run loop last found no frame waiting (None: not running)
        self._final = False  # finish(): the job ended and the agents' last reports are in
        # optional outputs: Prometheus metrics (--metrics-port) and findings posted to webhooks (--notify)
        self.metrics = (
            run_metrics.start(
                metrics_port,
                metrics_addr,
                console.info,
                console.warn,
                self.events,
                metrics_max_ranks,
                supervisor_events=os.path.join(run_dir, "events.supervisor.jsonl"),
            )
            if metrics_port
            else None
        )
        self.notifier = (
            Notifier(notify, self.events, console.warn, run_id=os.path.basename(run_dir)) if notify else None
        )

    def _fresh_detectors(self) -> None:
        """The detectors of one attempt of the job (all rank state they hold belongs to that attempt)."""
        hang_timeout_s, stall_timeout_s, gpu_stragglers = self._timeouts
        self.detectors = self._given_detectors or default_detectors(
            hang_timeout_s=hang_timeout_s, stall_timeout_s=stall_timeout_s, gpu_stragglers=gpu_stragglers
        )
        # what the coordinator itself reads of three detectors: the state and replay verdicts (confirmations,
        # checkpoint trust) and which GPU a rank runs on (a finding's identity); each may be left out
        self.state = _of(self.detectors, "state", ReplicaStateDetector)
        self.replay = _of(self.detectors, "replay", ReplayDetector)
        self.devices = _of(self.detectors, "devices", DeviceWatch)
        self.confirmations = confirmation.Confirmations()  # replay + whole-state checks before they are named

    def _decide_exits(self, now: float) -> bool:
        """Nothing more will come of these ranks (their attempt or the job ended): decide their exits now.
        False if no exit detector runs."""
        exits = self.detectors.get("exits")
        if not isinstance(exits, ExitDetector):
            return False
        stopped = self._signalled_by_launcher()
        for f in exits.update(now + 3600.0, self.ranks, self.launcher_codes, True, stopped, self._told_to_stop):
            self.emit(f, now)
        return True

    @property
    def _told_to_stop(self) -> bool:
        """The whole job was told to stop: a supervisor or launcher got a signal, or --abort-on fired."""
        return self.job_interrupted or self.aborting

    def _signalled_by_launcher(self) -> frozenset[int]:
        """Ranks their own node's launcher said it sent a closing signal (pids are per host). Every pass builds
        a view: no walk over the ranks until a launcher has sent one."""
        if not self.launcher_signalled:
            return frozenset()
        return frozenset(
            r
            for r, o in self.ranks.items()
            if o.state.pid in self.launcher_signalled.get(self.rank_node.get(r, b""), ())
        )

    def _next_attempt(self, attempt: int, now: float) -> None:
        """A rank of a newer attempt (elastic restart): decide what the old attempt left pending, then forget it."""
        if self.ranks and self._decide_exits(now):
            for p in self.pending_stacks.values():
                p.deadline = -math.inf
            for pf in self.pending_fetch.values():
                pf.deadline = -math.inf
            self.pending_profiles.clear()  # samples of a process that is gone
            self._flush_due(now)
        self.events.write("attempt_end", attempt=self.attempts.current, findings=len(self.findings))
        self.attempts.begin(attempt, time.time())
        self.events.write("attempt", attempt=attempt)
        self.console.info(f"attempt {attempt} of the job started (elastic restart): its ranks are judged afresh")
        self._fresh_detectors()
        self.ranks.clear()
        self._step_history.clear()
        self._top_step = 0
        self._step_walls.clear()
        self.numerically_named.clear()
        self.pending_stacks.clear()
        self.pending_fetch.clear()
        self.root_found = False

    # ---- messages -------------------------------------------------------------------------
    def handle(self, identity: bytes, msg, now: float) -> None:
        node = self.nodes.setdefault(
            identity, {"last": now, "name": identity.decode(errors="replace"), "lost": False, "gone": False}
        )
        # back only with fresh news of its ranks: a restarted agent's Hello comes first, and judging the ranks'
        # state from before the silence would blame one of them for the monitor's own blindness
        if node["lost"] and isinstance(msg, NodeDigest):
            node["lost"] = False
            self.console.info(f"agent {node['name']} is reporting again")
            self.events.write("agent_back", node=node["name"], silent_s=round(now - node["last"], 1))
            self._resend_step_commands(identity)
        node["last"] = now
        if isinstance(msg, (NodeDigest, Hello)):
            node["agent"] = True  # the supervisor's one-off launcher report is not an agent
        if isinstance(msg, NodeDigest):
            node["host"] = msg.host
            self.memberships.absorb(msg)
            if self.memberships.missing(msg) and self.memberships.should_ask(node["name"], now):
                self.endpoint.send(identity, Command(kind="send_groups", request_id=next(self.request_ids)))
            current = []
            for st in msg.ranks:
                if self.attempts.is_stale(st.attempt):
                    continue  # the last look at a rank of an attempt that has ended
                if self.attempts.is_newer(st.attempt):
                    self._next_attempt(st.attempt, now)
                self.ranks[st.rank] = RankObs(state=st, host=msg.host, seen_at=now)
                self.rank_node[st.rank] = identity
                current.append(st)
            if len(current) != len(msg.ranks):  # detectors see the current attempt's ranks only
                msg = msgspec.structs.replace(msg, ranks=current)
            for detector in self.detectors:
                detector.observe(msg, now)
            for st in msg.ranks:
                if st.steps:
                    self._step_walls.extend(r.wall_s for r in st.steps if r.wall_s > 0)
                if st.steps or st.numerics:
                    self.evidence_log.write(st.rank, st.steps, st.numerics, st.numeric_layers, len(self.ranks))
                for err in st.probe_errors:
                    self._probe_error(st.rank, err)
            # the furthest step, kept as digests arrive (a walk over every rank per digest was O(world^2) a second)
            top = self._top_step = max([self._top_step, *(st.step for st in msg.ranks)])
            if not self._step_history or self._step_history[-1][1] != top:
                self._step_history.append((now, top))  # when the furthest rank's step was known to move
        elif isinstance(msg, StackReport):
            self._on_stack(msg, now)
        elif isinstance(msg, RecordsReport):
            self._on_records(msg, now)
        elif isinstance(msg, LauncherReport):
            self.launcher_done = self.launcher_done or msg.final  # not final: exits seen while it runs
            self.launcher_signalled.setdefault(msg.node_id.encode(), set()).update(msg.signalled_pids)
            self.job_interrupted = self.job_interrupted or msg.interrupted
            for rank, code, _pid in msg.worker_exits:
                self.launcher_codes[rank] = code
                self._exit_from_launcher(rank, code, now)
            if msg.final and msg.exit_code == 0:
                # torchrun succeeds only when every worker did, and then names none: each of this node's ranks
                # exited 0, also one that left no record of its own (os._exit after its work)
                agent = msg.node_id.encode()  # an agent's identity on the wire is its node's name
                for rank, identity in self.rank_node.items():
                    if identity == agent:
                        self.launcher_codes.setdefault(rank, 0)
            self.events.write(
                "launcher_exit" if msg.final else "worker_exits", exit_code=msg.exit_code, workers=msg.worker_exits
            )
        elif isinstance(msg, Hello):
            self.events.write("agent_hello", node=msg.node_id, host=msg.host, pid=msg.agent_pid)
            self._resend_step_commands(identity)
        elif isinstance(msg, Goodbye):
            node["gone"] = True
            self.events.write("agent_goodbye", node=msg.node_id, reason=msg.reason)

    def _exit_from_launcher(self, rank: int, code: int, now: float) -> None:
        """A rank the launcher reports killed by a fault signal whose exit no agent has reported yet (a job torn
        down within a digest of a crash: the agent stopped before it saw the exits) exits now, as the launcher
        says; an agent's own record, richer, replaces it if one still comes."""
        obs = self.ranks.get(rank)
        if obs is None or obs.state.exit is not None or -code not in FAULT_SIGNALS:
            return  # an exit code, SIGKILL or SIGTERM may be the teardown's, and read at once would blame it
        obs.state.exit = RankExit(
            how="signal",
            code=None,
            signal=-code,
            message="exit reported by the launcher",
            step=obs.state.step,
            age_s=obs.seen_at - now,  # exited_at() = now: when the launcher's report came
        )
        obs.state.alive = False

    def resume(self) -> int:
        """A restarted coordinator takes over its predecessor's findings (findings.jsonl) so that none is
        emitted twice; the ranks' state comes back with the agents' next digests. Returns how many."""
        try:
            with open(self.findings_sink.path, "rb") as fh:
                earlier = [from_json(line) for line in fh if line.strip()]
        except (OSError, ValueError):
            return 0
        for f in earlier:
            self._remember(f)
            self.findings.append(f)
        if earlier:
            self.events.write("coordinator_resumed", findings=len(earlier))
        return len(earlier)

    def _probe_error(self, rank: int, err: str) -> None:
        if (rank, err) not in self._seen_errors:
            self._seen_errors.add((rank, err))
            self.console.warn(f"rank {rank}: {err}")
            self.events.write("probe_error", rank=rank, error=err)

    # ---- detection ------------------------------------------------------------------------
    def detect(self, now: float) -> None:
        if self.aborting:
            self._flush_due(now)
            return
        self._watch_agents(now)  # first: a silent agent's ranks must not be judged in this very pass
        self._replay_on_command(now)
        view = self._view(now)
        for detector in self.detectors:
            view.root_found = self.root_found
            judgement = detector.judge(view)
            for f in judgement.findings:
                self._take(f, view)
            for ask in judgement.asks:
                if isinstance(ask, Confirm):
                    self._confirms_after = detector.name
                self._ask(ask, view)
            for kind, fields in judgement.events:
                self.events.write(kind, **fields)
            # a confirmation resolves in the slot of the detector that asked for it, so what it names takes
            # that detector's place in the judging order (root causes before their consequences)
            if detector.name == self._confirms_after:
                for f in self._confirm(now):
                    self._emit_confirmed(f, now)
        self._flush_due(now)
        self._publish_trust(now)
        self._track_topology()
        if self.metrics:
            self.metrics.on_pass(self.ranks, view.live, self.nodes)

    def _view(self, now: float) -> JobView:
        # A lost agent's last report goes stale: judging it would blame ranks for our own blindness (a rank of
        # no known agent is judged).
        lost = {ident for ident, n in self.nodes.items() if n.get("lost")}
        seen = {r: o for r, o in self.ranks.items() if self.rank_node.get(r) not in lost} if lost else self.ranks
        live = {r for r, o in seen.items() if o.state.alive}
        classes: dict[str, list[int]] = {}
        for r in sorted(live):
            group = self.ranks[r].state.replica_group
            if group:
                classes.setdefault(group, []).append(r)
        return JobView(
            now=now,
            ranks=self.ranks,
            seen=seen,
            live=live,
            members=self.memberships.members,
            classes=classes,
            launcher_codes=self.launcher_codes,
            launcher_done=self.launcher_done,
            launcher_signalled=self._signalled_by_launcher(),
            job_interrupted=self._told_to_stop,
            root_found=self.root_found,
            caught_up=self._caught_up,
            final=self._final,
        )

    def _take(self, f: Finding, view: JobView) -> None:
        """A detector's finding: a straggler's waits for where its time goes; the rest go out now."""
        if f.kind == STRAGGLER:
            self._straggler(f, view.live, view.now)
        else:
            self.emit(f, view.now)

    def _ask(self, ask: Ask, view: JobView) -> None:
        now = view.now
        if isinstance(ask, DumpStacks):
            self._start_stacks(ask, now)
        elif isinstance(ask, FetchRecords):
            self._start_fetch(ask, now)
        elif isinstance(ask, Confirm):
            s = ask.suspect
            # what the probes can replay, as the rotation orders it: every class's (a pipeline's stages replay
            # their own layers; each rank replays those of the list it has)
            self.confirmations.replay_layers = list(
                dict.fromkeys(name for o in self.ranks.values() for name in o.state.replay_layers)
            )
            self.events.write(
                "numeric_suspect",
                rank=s.rank,
                step=s.step,
                statistic=s.statistic,
                pattern=s.pattern,
                layer=s.layer,
                ratio=round(s.ratio, 4),
                z=round(s.z, 2),
            )
            if s.confirmable:
                self.confirmations.add(s, confirmation.numeric_finding(s))
            else:
                self._emit_confirmed(confirmation.without_replicas(confirmation.numeric_finding(s)), now)
        elif isinstance(ask, LinkProbe):
            self._schedule_link_probe(now, ask)
        else:
            raise TypeError(f"unknown ask {ask!r}")

    def _track_topology(self) -> None:
        """Which groups exist and which ranks are replicas: topology.json, an event, a console line."""
        # Nothing to redo while the groups stand and their line is shown: groups and roles change at start-up,
        # rarely later (memberships.version says when; comparing them every pass cost O(world x group size)).
        key = self.memberships.version
        if key == self._topology_key or time.monotonic() < self._topology_next:
            return
        # before the line is shown it waits for every rank's first step: redo it then, or on a change
        stepped = not self.topology.shown and all(o.state.step >= 1 for o in self.ranks.values())
        if (key, stepped) == self._topology_tried:
            return
        self._topology_tried = (key, stepped)
        started = time.monotonic()
        groups = {
            r: [
                {"name": pg.name, "desc": pg.desc, "members": pg.members, "role": pg.role, "framework": pg.framework}
                for pg in o.state.pgs
            ]
            for r, o in self.ranks.items()
        }
        steps = {r: o.state.step for r, o in self.ranks.items()}
        changed, line = self.topology.update(groups, steps)
        if self.topology.shown:
            self._topology_key = key
        if changed is not None:
            try:
                with open(self.topology_file + ".tmp", "wb") as fh:
                    fh.write(msgspec.json.encode(changed))  # json.dump took seconds for 10k ranks' groups
                os.replace(self.topology_file + ".tmp", self.topology_file)
            except OSError:
                pass  # a full run folder: the report's topology stays as it was, detection goes on
            self.events.write("topology", groups=changed["groups"], replicas=changed["replicas"])
        if line is not None:
            self.console.info(line)
        # while ranks keep appearing (start-up of a large job), rebuild at most every 10x what a build costs
        self._topology_next = time.monotonic() + 10 * (time.monotonic() - started)

    def trust(self) -> dict:
        """What a checkpoint saved now can claim (see probe/checkpoints.py)."""
        live = [o.state for o in self.ranks.values()]
        period = max((s.state_period for s in live), default=0)
        slots = max((s.state_slots for s in live), default=0)
        layers = sorted({layer for s in live for layer in s.replay_layers})
        integrity = [f for f in self.findings if f.kind in INTEGRITY_KINDS]
        suspect_since = min((f.step or 0 for f in integrity), default=None)
        verified, first = verified_window(self.state.step_clean if self.state else {}, slots)
        if suspect_since is not None and first > suspect_since:
            suspect_since = None  # a whole clean rotation after the finding re-verified the state
        return {
            "verified_step": verified,
            "state_period": period,
            "suspect_since": suspect_since,
            "replay_layers": layers,
            "replay_rotation_clean": set(layers) <= (self.replay.clean_layers if self.replay else set()),
            "findings": [f.summary for f in integrity][-5:],
        }

    def _publish_trust(self, now: float) -> None:
        if now < self._next_trust:
            return
        self._next_trust = now + 1.0
        payload = json.dumps(self.trust(), sort_keys=True)
        if payload == self._last_trust:
            return
        self._last_trust = payload
        for ident in self.nodes:
            self.endpoint.send(ident, Command(kind="trust", request_id=next(self.request_ids), payload=payload))

    def _straggler(self, f: Finding, live: set[int], now: float) -> None:
        # a stall names where the training code waits: the call site the probe saw (slow loads, saves)
        where = {"data_loading": "data", "checkpoint_write": "ckpt"}.get(f.evidence.get("type", ""))
        if where:
            for r in f.culprit_ranks:
                site = self.ranks[r].state.io_sites.get(where) if r in self.ranks else None
                if site:
                    f.stacks[str(r)] = site
        if f.culprit_ranks and f.evidence.get("type") in PROFILED and self._start_profile(f, live, now):
            return  # emitted once the samples are in (_flush_due)
        self.emit(f, now)

    def _start_profile(self, finding: Finding, live: set[int], now: float) -> bool:
        """Sample the culprit's and some peers' stacks over the same seconds (agents, py-spy); the finding waits
        for them. False when no agent could be asked (then it is emitted as it is)."""
        culprit = finding.culprit_ranks[0]
        peers = [r for r in sorted(live) if r != culprit][:PROFILE_PEERS]
        rid = next(self.request_ids)
        by_node: dict[bytes, list[int]] = {}
        for r in [culprit, *peers]:
            if r in self.rank_node:
                by_node.setdefault(self.rank_node[r], []).append(r)
        sent: set[int] = set()
        for ident, ranks in by_node.items():
            if self.endpoint.send(ident, Command(kind="profile", request_id=rid, ranks=ranks, payload=str(PROFILE_S))):
                sent.update(ranks)
        if culprit not in sent:
            return False
        finding.first_seen = time.time()
        self.pending_profiles[rid] = PendingProfile(finding, culprit, peers, sent, now + PROFILE_S + 4.0)
        self.events.write("profile_requested", ranks=sorted(sent), culprit=culprit, request=rid)
        return True

    def _finish_profile(self, p: PendingProfile) -> Finding:
        """Say where the culprit's extra time goes, from its samples set against its peers'."""
        f = p.finding
        slow = p.reports.get(p.culprit, "")
        where = where_time_goes(slow, [p.reports[r] for r in p.peers if r in p.reports])
        if where is not None:
            f.evidence["where"] = where.frame
            f.evidence["where_share"] = round(where.share, 3)
            site = f.stacks.get(str(p.culprit))
            f.stacks[str(p.culprit)] = (
                "[sampled, against its peers]\n"
                + where.line()
                + (f"\n[call site of slow loads/saves] {site}" if site else "")
            )
            f.summary += f"; its time goes to {where.frame}"
        elif slow:  # sampled, but no function holds its excess alone (spread over its code, or the job ended)
            f.evidence["where"] = None
        return f

    def _confirm(self, now: float) -> list[Finding]:
        """Numerical suspects wait for a confirmation (replay of their layers and the whole replicated state,
        on every replica at one step ahead): schedule the next one; the completed findings once it is in."""
        if (
            self.confirmations.queued is not None
            and self.confirmations.current is None
            and self.step_commands.links_sound(self.nodes, now)
        ):
            step, rate = self._step_ahead(now, confirmation.LEAD_S, lead_steps=3)
            rid = next(self.request_ids)
            step_s = statistics.median(self._step_walls) if self._step_walls else 0.0
            payload = self.confirmations.next_request(step, rid, now, step_s)
            if payload is not None and step is not None:  # (no payload without a step)
                self._send_step_command(step, Command(kind="replay", request_id=rid, payload=payload))
                pending = self.confirmations.current
                assert pending is not None  # next_request started it
                self.console.info(
                    f"numerical outlier on rank(s) {', '.join(map(str, sorted(pending.ranks)))}: "
                    f"confirming at step {step} (replay of {', '.join(pending.layers) or 'nothing'}, "
                    "the whole replicated state)"
                )
                self.events.write(
                    "confirmation_requested",
                    step=step,
                    layers=pending.layers,
                    ranks=sorted(pending.ranks),
                    steps_per_s=round(rate, 2),
                )
        return self.confirmations.resolve(
            now,
            self.replay.outcomes if self.replay else {},
            self.state.step_clean if self.state else {},
            self.state.outliers_at if self.state else {},
        )

    def _emit_confirmed(self, f: Finding, now: float) -> None:
        """A numerical finding back from its confirmation: named, or only logged (confirmation.is_observation)."""
        if confirmation.is_observation(f):
            self.events.write(
                "numeric_deviation_not_reproduced", rank=f.culprit_ranks[0], step=f.step, summary=f.summary
            )
            return
        self.emit(f, now)

    def _schedule_link_probe(self, now: float, ask: LinkProbe) -> None:
        """Collectives of `pg` slowed on every member: have the members time exchanges with each other at a
        step far enough ahead that every probe has read the request (see probe/link_probe.py)."""
        # as far ahead as a confirmation's checks: a probe's request has the same path to travel, and a
        # communication straggler is named only after two probes agree
        step, rate = self._step_ahead(now, confirmation.LEAD_S, lead_steps=3)
        if step is None or not self.step_commands.links_sound(self.nodes, now):
            return  # (asked again while the slowdown lasts)
        rid = next(self.request_ids)
        payload = json.dumps({"id": rid, "step": step, "members": ask.members})
        self._send_step_command(step, Command(kind="linkprobe", request_id=rid, payload=payload))
        ask.scheduled(rid, step, now)
        self.console.info(
            f"collectives of pg {ask.pg} slowed on every member ({ask.before_s * 1e3:.1f} -> "
            f"{ask.now_s * 1e3:.1f} ms per step): link probe at step {step}"
        )
        self.events.write("link_probe_requested", pg=ask.pg, step=step, members=ask.members, steps_per_s=round(rate, 2))

    def _send_step_command(self, step: int, cmd: Command) -> None:
        for ident in self.nodes:
            self.endpoint.send(ident, cmd)
        self.step_commands.sent(step, cmd)

    def _resend_step_commands(self, identity: bytes) -> None:
        """An agent restarted or back from a silence may have missed a command for a step still ahead."""
        for cmd in self.step_commands.to_resend(self._top_step):
            self.endpoint.send(identity, cmd)
            self.events.write("step_command_resent", node=identity.decode(errors="replace"), command=cmd.kind)

    def _step_ahead(
        self, now: float, lead_s: float = REPLAY_LEAD_S, lead_steps: int = REPLAY_LEAD_STEPS
    ) -> tuple[int | None, float]:
        """A step a few seconds of training ahead of where the ranks are now, and the recent step rate.

        The furthest step known is a digest old (up to an agent interval, plus the coordinator's own
        tick), so the steps made since are added. The rate is the lower of the last few seconds' (start-up,
        when steps did not move, left out) and the one the recent steps' wall times give."""
        if not self._step_history:
            return None, 0.0
        t1, s1 = self._step_history[-1]
        t0, s0 = next((t, s) for t, s in self._step_history if t >= t1 - max(lead_s, REPLAY_LEAD_S))
        rate = (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else 0.0
        if self._step_walls:
            # The steps' own wall times follow a slowdown within a few steps, the window's rate lags it by
            # seconds: a link probe asked for just after a 3x slowdown was put 15 s of training ahead, not 5.
            walls_rate = 1.0 / max(1e-6, statistics.median(self._step_walls))
            rate = walls_rate if rate <= 0.0 else min(rate, walls_rate)
        ahead = rate * (max(0.0, now - t1) + lead_s)
        return s1 + max(lead_steps, int(ahead) + 1), rate

    def _replay_on_command(self, now: float) -> None:
        """`trainscout replay RUN_DIR` drops a request file; schedule the replay a few seconds of steps ahead.

        Every replica must replay at the same step (the input travels by a side-group broadcast), so the
        step is picked far enough ahead that every probe has read the request before reaching it.
        """
        if not os.path.exists(self.replay_request_file) or not self.step_commands.links_sound(self.nodes, now):
            return  # (a request waits for every agent to be reporting)
        try:
            with open(self.replay_request_file) as fh:
                request = json.load(fh)
            os.unlink(self.replay_request_file)
            if not isinstance(request, dict):  # `trainscout replay` writes an object; anything else is not ours
                raise ValueError(f"not a request object: {type(request).__name__}")
        except (OSError, ValueError) as exc:
            self.console.warn(f"replay request unreadable: {exc}")
            try:
                os.unlink(self.replay_request_file)
            except OSError:
                pass
            return
        layers = sorted({layer for o in self.ranks.values() for layer in o.state.replay_layers})
        layer = str(request.get("layer") or "")
        if not layers or not self._step_history:
            self.console.warn(
                "replay request ignored: no rank has replay enabled yet (DDP over 3+ replicas, "
                "TRAINSCOUT_REPLAY_EVERY > 0)"
            )
            self.events.write("replay_request_ignored", reason="no replay layers")
            return
        if layer and layer not in layers:
            self.console.warn(f"replay request ignored: unknown layer {layer!r} (layers: {', '.join(layers)})")
            self.events.write("replay_request_ignored", reason=f"unknown layer {layer}")
            return
        step, rate = self._step_ahead(now)
        assert step is not None  # there is a step history (checked above)
        payload = json.dumps({"id": next(self.request_ids), "step": step, "layer": layer})
        self._send_step_command(step, Command(kind="replay", request_id=next(self.request_ids), payload=payload))
        self.console.info(f"replay requested: {layer or 'next layer of the rotation'} at step {step}")
        self.events.write("replay_requested", step=step, layer=layer, steps_per_s=round(rate, 2))

    def _start_stacks(self, suspect: DumpStacks, now: float) -> None:
        suspect.finding.first_seen = time.time()
        self.root_found = self.root_found or suspect.finding.kind in ROOT_KINDS
        rid = next(self.request_ids)
        by_node: dict[bytes, list[int]] = {}
        for r in suspect.ranks:
            if r in self.rank_node:
                by_node.setdefault(self.rank_node[r], []).append(r)
        sent: set[int] = set()
        for ident, ranks in by_node.items():
            if self.endpoint.send(ident, Command(kind="dump_stacks", request_id=rid, ranks=ranks)):
                sent.update(ranks)
        self.pending_stacks[rid] = PendingStacks(suspect.finding, sent, now + self.stack_timeout_s)
        if sent:  # a wait of up to stack_timeout_s before the finding shows: say what is happening
            self.console.info(f"{suspect.finding.kind} suspected: collecting stacks from {len(sent)} rank(s)...")
        self.events.write(
            "suspect", finding_kind=suspect.finding.kind, ranks=suspect.finding.culprit_ranks, request=rid
        )

    def _on_stack(self, msg: StackReport, now: float) -> None:
        profile = self.pending_profiles.get(msg.request_id)
        if profile is not None:
            profile.reports[msg.rank] = msg.text
            profile.waiting.discard(msg.rank)
            return
        pending = self.pending_stacks.get(msg.request_id)
        if pending is None:
            return
        text = msg.text or "(no stack could be captured)"
        pending.finding.stacks[str(msg.rank)] = f"[{msg.method}]\n{text}"
        pending.waiting.discard(msg.rank)

    def _stale(self, finding: Finding) -> bool:
        """True if the evidence came (partly) from an agent that has gone silent since."""
        return any(n.get("lost") for n in self.nodes.values() if n.get("agent"))

    def _start_fetch(self, ask: FetchRecords, now: float) -> None:
        req = ask.request
        rid = next(self.request_ids)
        by_node: dict[bytes, list[int]] = {}
        for r in req.ranks:
            if r in self.rank_node:
                by_node.setdefault(self.rank_node[r], []).append(r)
        for ident, ranks in by_node.items():
            self.endpoint.send(
                ident,
                Command(
                    kind="fetch_records",
                    request_id=rid,
                    ranks=ranks,
                    pg=req.pg,
                    seq_from=req.seq_from,
                    seq_to=req.seq_to,
                ),
            )
        self.pending_fetch[rid] = PendingFetch(ask, set(req.ranks), now + self.stack_timeout_s)

    def _on_records(self, msg: RecordsReport, now: float) -> None:
        pending = self.pending_fetch.get(msg.request_id)
        if pending is None:
            return
        pending.records[msg.rank] = msg.records
        pending.waiting.discard(msg.rank)

    def _flush_due(self, now: float) -> None:
        """Emit what waited for answers (stacks, profiles, pulled records) once every answer is in or its deadline
        passed on the clock of evidence: behind a backlog the answers may be queued (JobView.waited_until)."""
        clock = evidence_clock(now, self._caught_up)
        for rid, p in list(self.pending_stacks.items()):
            if not p.waiting or clock >= p.deadline:
                del self.pending_stacks[rid]
                if self._stale(p.finding):
                    self.events.write("suspect_dropped", request=rid, reason="an agent went silent meanwhile")
                    continue
                self.emit(p.finding, now)
        for rid, pp in list(self.pending_profiles.items()):
            if not pp.waiting or clock >= pp.deadline:
                del self.pending_profiles[rid]
                self.emit(self._finish_profile(pp), now)
        for rid, pf in list(self.pending_fetch.items()):
            if not pf.waiting or clock >= pf.deadline:
                del self.pending_fetch[rid]
                f = pf.ask.resolve(pf.ask.request, pf.records)
                if f is not None:
                    self.emit(f, now)

    def emit(self, finding: Finding, now: float) -> None:
        finding.attempt = self.attempts.current
        earlier = self.attempts.earlier_blame(finding)
        if earlier is not None:  # the same culprit, the same kind of fault: named once, in its first attempt
            self.events.write(
                "repeat",
                finding_kind=finding.kind,
                culprits=finding.culprit_ranks,
                attempt=finding.attempt,
                first_attempt=earlier,
                summary=finding.summary,
            )
            return
        key = finding.key()
        if key in self.emitted:
            return
        if self._is_consequence(finding):
            self.events.write(
                "consequence", finding_kind=finding.kind, culprits=finding.culprit_ranks, summary=finding.summary
            )
            return
        self._remember(finding)
        wall = time.time()
        finding.first_seen = finding.first_seen or wall
        finding.confirmed = wall
        self._fill_identity(finding)
        self.findings.append(finding)
        self.findings_sink.finding(finding)
        self.events.write("finding", finding_kind=finding.kind, culprits=finding.culprit_ranks, summary=finding.summary)
        self.console.finding(finding)
        self.attempts.record(finding)
        self.handoff.on_finding(finding, self.findings)
        if self.metrics:
            self.metrics.on_finding(finding)
        if self.notifier:
            self.notifier.notify(finding)
        if finding.kind in self.abort_on and not self.aborting:
            self.abort(f"{finding.kind} found", now)

    def _remember(self, f: Finding) -> None:
        """What an emitted finding changes for later ones: emitted once, its numerically named culprits (later
        outliers of theirs are consequences), a root cause found (later exits follow from it)."""
        self.emitted.add(f.key())
        if f.kind in ("sdc", "nonfinite"):
            for r in f.culprit_ranks:
                self.numerically_named.setdefault(r, f.step or 0)
        if f.kind in ROOT_KINDS:
            self.root_found = True

    def _is_consequence(self, f: Finding) -> bool:
        """A statistical outlier (loss, gradient norms) that began after its rank was named for corrupted numbers
        is what that corruption does next, not a second fault: it goes to events.jsonl, not to the findings.
        One that began before (the outlier whose confirmation by replay was emitted first) is the earliest
        sign of that fault and stays."""
        check = str(f.evidence.get("check", ""))
        named = [self.numerically_named.get(r) for r in f.culprit_ranks]
        return (
            f.kind == "sdc"
            and check.startswith("numeric_")
            and bool(named)
            and all(n is not None and (f.step or 0) > n for n in named)
        )

    def _fill_identity(self, f: Finding) -> None:
        obs = [self.ranks[r] for r in f.culprit_ranks if r in self.ranks]
        if not f.hosts:
            f.hosts = sorted({o.host for o in obs})
        if not f.pids:
            f.pids = [o.state.pid for o in obs]
        gpu_of = self.devices.gpu_of if self.devices else (lambda r: None)
        if not f.devices:
            f.devices = [
                gpu_of(r) or f"local_rank {self.ranks[r].state.local_rank}" for r in f.culprit_ranks if r in self.ranks
            ]
        for r in f.culprit_ranks:  # what the culprit's GPU looked like when the finding was made
            gpu = gpu_of(r)
            text = self.devices.summary(gpu) if self.devices and gpu is not None else None
            if text:
                f.evidence.setdefault("device", {})[str(r)] = text

    def abort(self, reason: str, now: float) -> None:
        self.aborting = True
        self.aborted_at = now
        self.console.warn(f"stopping the training job ({reason}; --abort-on)")
        self.events.write("abort", reason=reason)
        self.handoff.mark_abort()  # before the ranks are stopped: their teardown output stays off the terminal
        for ident in self.nodes:
            self.endpoint.send(ident, Command(kind="abort", request_id=next(self.request_ids)))

    def _only_our_abort_stopped_ranks(self) -> bool:
        """After --abort-on stopped the job, the signals it sent are not crashes (a short job may end as they
        land, even on a rank already in its interpreter's exit): exits are judged only if a rank had failed of
        its own before the abort (as the exit detector tells its own failures from collateral ones)."""
        if self.aborted_at is None:
            return False
        codes = self.launcher_codes
        return not any(
            (t := o.exited_at()) is not None
            and t < self.aborted_at
            and is_abnormal(o, codes)
            and not is_collateral(o, codes)
            for o in self.ranks.values()
        )

    def _watch_agents(self, now: float) -> None:
        # Silence is known up to when this process last had nothing queued: behind a backlog (long passes of a
        # large job, a starved core) every agent would look silent, though its digests wait in our queue.
        upto = now if self._caught_up is None else min(now, self._caught_up)
        for node in self.nodes.values():
            if (
                node.get("agent")
                and not node["gone"]
                and not node["lost"]
                and upto - node["last"] > self.agent_silence_s
            ):
                node["lost"] = True
                self.console.warn(
                    f"lost contact with the agent of node {node['name']}: monitoring of its ranks is interrupted"
                )
                self.events.write("agent_lost", node=node["name"])

    # ---- main loop ------------------------------------------------------------------------
    def run(self, detect_every_s: float = 1.0, after_digest_s: float = 0.5) -> None:
        """Detect once a second, and soon after a digest arrives (but not more often than every
        `after_digest_s`): what a digest brings is acted on at once, whatever the phase of the two clocks."""
        with Collection() as collection:
            self._run(collection, detect_every_s, after_digest_s)
        self.finish()

    def _run(self, collection: Collection, detect_every_s: float, after_digest_s: float) -> None:
        next_detect = 0.0
        last_detect = 0.0
        last_pass_s = 0.0
        parent = os.getppid()
        while not self.stop:
            if os.getppid() != parent:
                break  # the supervisor is gone (killed hard): do not linger as an orphan
            # rounded up: waits truncated to 0-1 ms made this loop spin for the last millisecond before each
            # detection (~200 wake-ups a second, measured)
            got = self.endpoint.recv(max(1, math.ceil((next_detect - time.monotonic()) * 1000)))
            now = time.monotonic()
            if got is None or not self.endpoint.backlog():
                self._caught_up = now  # every frame sent before now is handled (see _watch_agents)
            if got is not None:
                self.handle(got[0], got[1], now)
                if isinstance(got[1], NodeDigest):
                    # a large job's digests arrive without pause: its passes keep to at most a third of the time
                    soonest = last_detect + max(after_digest_s, 2 * last_pass_s)
                    next_detect = min(next_detect, max(now + 0.02, soonest))
            if now >= next_detect:
                if last_detect and now - last_detect > STALL_S:
                    # this process did not run (stopped, or starved of CPU): nothing was judged meanwhile
                    self.events.write("coordinator_stalled", seconds=round(now - last_detect, 1))
                self.detect(now)
                last_pass_s = time.monotonic() - now
                took = collection.maybe_full(time.monotonic())  # between passes, rarely (see collection.py)
                if took > 1.0 or collection.found > COLLECTED_NOTE:
                    self.events.write("coordinator_collected", seconds=round(took, 2), freed=collection.found)
                # from the pass's end: a pass that takes long (a large job) must leave time for the digests,
                # or passes run back to back with one digest handled between them
                last_detect = time.monotonic()
                next_detect = last_detect + detect_every_s

    def finish(self) -> None:
        # Drain what agents send while they stop, then decide with everything known.
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            got = self.endpoint.recv(50)
            if got is not None:
                self.handle(got[0], got[1], time.monotonic())
            elif any(n.get("agent") for n in self.nodes.values()) and all(
                n["gone"] for n in self.nodes.values() if n.get("agent")
            ):
                break
        self.launcher_done = True
        self._caught_up = None  # drained: silence is judged up to now
        self._final = True  # and what waits for more evidence judges what it has
        now = time.monotonic()
        self.detect(now)  # a hang or desync named now is the root: the exits that followed are its consequences
        if self.ranks and not self.root_found and not self._only_our_abort_stopped_ranks():
            self._decide_exits(now)
        for p in list(self.pending_stacks.values()) + []:
            p.deadline = now
        for pp in self.pending_profiles.values():
            pp.deadline = now
        for pf in self.pending_fetch.values():
            pf.deadline = now
        self._flush_due(now)
        for f in self.confirmations.abandon():
            self._emit_confirmed(f, now)
        counters: dict = {}
        for detector in self.detectors:
            closing = detector.close()
            for f in closing.findings:
                self.emit(f, now)
            for kind, fields in closing.events:
                self.events.write(kind, **fields)
            counters.update(closing.counters)
        if self.notifier:
            self.notifier.close()  # a short, bounded drain of the posts still pending
        self.events.write(
            "coordinator_exit", findings=len(self.findings), rejected=dict(self.endpoint.rejected), **counters
        )
        self.evidence_log.close()
        self.events.close()
        self.findings_sink.close()  # what a full disk held back is written now, if there is space
        if self.findings_sink.held:
            self.console.warn(
                f"{self.findings_sink.held} finding(s) are missing from findings.jsonl: the run folder is still full "
                "(they were shown above)"
            )
        self.handoff.finish()
        self.endpoint.close()
        if self.metrics:
            self.metrics.close()


def _of(detectors: Registry, name: str, kind: type):
    """The registered detector of that name if it is of that kind, else None."""
    found = detectors.get(name)
    return found if isinstance(found, kind) else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainscout.coordinator", description=__doc__)
    p.add_argument("--bind", default="tcp://127.0.0.1:0")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--hang-timeout", type=float, default=config.RUN.hang_timeout)
    p.add_argument("--stall-timeout", type=float, default=config.RUN.stall_timeout)
    p.add_argument("--abort-on", default="")
    p.add_argument("--console", choices=["auto", "rich", "plain"], default="auto")
    p.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by this much")
    args = p.parse_args(argv)
    lower_priority(args.nice)
    settings, problems = config.from_environ()
    coord: Coordinator | None = None
    log.setup(
        "coordinator",
        args.run_dir,
        step=lambda: max((o.state.step for o in coord.ranks.values()), default=None) if coord else None,
        level=settings.run.log_level,
    )
    for problem in problems:
        _log.warning("setting ignored: %s", problem)
    secret = bytes.fromhex(os.environ["TRAINSCOUT_SECRET"])
    endpoint = CoordinatorEndpoint(args.bind, secret)
    rich = {"auto": None, "rich": True, "plain": False}[args.console]
    console = ConsoleSink(sys.stdout, rich=rich)
    coord = Coordinator(
        endpoint,
        args.run_dir,
        console,
        hang_timeout_s=args.hang_timeout,
        stall_timeout_s=args.stall_timeout,
        abort_on={k for k in args.abort_on.split(",") if k},
        gpu_stragglers=settings.stragglers.gpu,
        metrics_port=settings.run.metrics_port,
        metrics_addr=settings.run.metrics_addr,
        metrics_max_ranks=settings.run.metrics_max_ranks,
        notify=notify_urls(settings.run.notify, console.warn),
        handoff=Handoff(args.run_dir, os.path.basename(os.path.normpath(args.run_dir)), settings.run.on_finding),
    )
    coord.resume()  # after a restart: what was already emitted stays emitted once
    addr_file = os.path.join(args.run_dir, "coordinator.addr")
    with open(addr_file + ".tmp", "w") as fh:
        fh.write(endpoint.address)
    os.replace(addr_file + ".tmp", addr_file)

    def _stop(*_):
        coord.stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    coord.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
