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

import msgspec
from dataclasses import dataclass, field

from trainscout.detectors.desync import DesyncDetector, FetchRequest
from trainscout.detectors.device_health import DeviceHealthDetector, GpuSample
from trainscout.detectors.exits import ExitDetector
from trainscout.detectors.hpz import HpzRaceDetector, is_hpz_record
from trainscout import config
from trainscout.coordinator import confirmation
from trainscout.coordinator.memberships import Memberships
from trainscout.detectors.nonfinite import NonFiniteDetector
from trainscout.detectors.numerics import NumericDetector
from trainscout.detectors.state import ReplicaStateDetector, verified_window
from trainscout.detectors.observations import RankObs
from trainscout.detectors.progress import HangDetector, Suspect
from trainscout.detectors.replay import ReplayDetector
from trainscout.detectors.straggler import StragglerDetector
from trainscout.detectors.where_time_goes import where_time_goes
from trainscout.findings import HPZ_RACE
from trainscout.findings import CRASH, DESYNC, EARLY_EXIT, HANG, HEALTH, NONFINITE, SDC, STALL, Finding
from trainscout.integrations.topology import TopologyTracker
from trainscout.process_priority import lower_priority
from trainscout.sinks import ConsoleSink, EventLog, JsonlSink
from trainscout.sinks.evidence_log import EvidenceLog
from trainscout.wire.endpoints import CoordinatorEndpoint
from trainscout.wire.messages import (
    Command,
    Goodbye,
    Hello,
    LauncherReport,
    NodeDigest,
    RecordsReport,
    StackReport,
)

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
    request: FetchRequest
    waiting: set[int]
    deadline: float
    records: dict = field(default_factory=dict)


REPLAY_REQUEST = "replay-request"  # file in the run dir that `trainscout replay` writes
REPLAY_LEAD_S = 5.0  # how far ahead an on-command replay is scheduled, in seconds of training
REPLAY_LEAD_STEPS = 10
STALL_S = 5.0  # a gap this long between detection passes is a monitoring gap (the coordinator did not run)


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
    ) -> None:
        self.endpoint = endpoint
        self.console = console
        self.findings_sink = JsonlSink(os.path.join(run_dir, "findings.jsonl"))
        self.events = EventLog(os.path.join(run_dir, "events.jsonl"))
        self.evidence_log = EvidenceLog(os.path.join(run_dir, "evidence.jsonl"))
        self.hang = HangDetector(hang_timeout_s=hang_timeout_s, stall_timeout_s=stall_timeout_s)
        self.desync = DesyncDetector()
        self.exits = ExitDetector(blocked_s=hang_timeout_s)
        self.state = ReplicaStateDetector()
        self.hpz = HpzRaceDetector()
        self.nonfinite = NonFiniteDetector()
        self.replay = ReplayDetector()
        self.numerics = NumericDetector()  # loss and layer gradient norms against peers (statistical suspects)
        self.confirmations = confirmation.Confirmations()  # replay + whole-state checks before they are named
        # CUDA jobs: compute is judged on GPU-side spans, or (TRAINSCOUT_GPU_STRAGGLERS=0) not at all
        self.straggler = StragglerDetector(gpu_compute=gpu_stragglers)
        self.devices = DeviceHealthDetector()
        self.rank_gpu: dict[int, str] = {}  # rank -> "host:gpu index" of the GPU its process runs on (NVML)
        self._devices_new = False
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
        self._step_walls: deque = deque(maxlen=64)  # recent steps' wall seconds, any rank (the rate at start-up)
        self.rank_node: dict[int, bytes] = {}
        self.nodes: dict[bytes, dict] = {}
        self.launcher_codes: dict[int, int] = {}
        self.launcher_done = False
        self.emitted: set[tuple] = set()
        self.numerically_named: dict[int, int] = {}  # rank -> step it was first named at for sdc or nonfinite
        self._seen_errors: set[tuple[int, str]] = set()  # probe errors already shown (per coordinator)
        self.findings: list[Finding] = []
        self.pending_stacks: dict[int, PendingStacks] = {}
        self.pending_fetch: dict[int, PendingFetch] = {}
        self.pending_profiles: dict[int, PendingProfile] = {}
        self.request_ids = itertools.count(1)
        self.aborting = False
        self.root_found = False
        self._next_trust = 0.0
        self._last_trust = ""
        self.stop = False
        self._caught_up: float | None = None  # when the run loop last found no frame waiting (None: not running)

    # ---- messages -------------------------------------------------------------------------
    def handle(self, identity: bytes, msg, now: float) -> None:
        node = self.nodes.setdefault(
            identity, {"last": now, "name": identity.decode(errors="replace"), "lost": False, "gone": False}
        )
        if node["lost"]:
            node["lost"] = False
            self.console.info(f"agent {node['name']} is reporting again")
            self.events.write("agent_back", node=node["name"], silent_s=round(now - node["last"], 1))
        node["last"] = now
        if isinstance(msg, (NodeDigest, Hello)):
            node["agent"] = True  # the supervisor's one-off launcher report is not an agent
        if isinstance(msg, NodeDigest):
            node["host"] = msg.host
            self.memberships.absorb(msg)
            if self.memberships.missing(msg) and self.memberships.should_ask(node["name"], now):
                self.endpoint.send(identity, Command(kind="send_groups", request_id=next(self.request_ids)))
            self._take_devices(msg, now)
            for st in msg.ranks:
                self.ranks[st.rank] = RankObs(state=st, host=msg.host, seen_at=now)
                self.rank_node[st.rank] = identity
                if st.state:
                    hpz = [r for r in st.state if is_hpz_record(r)]  # forward/backward weights (hpZ check)
                    if hpz:
                        self.hpz.add(st.rank, hpz, now)
                    self.state.add(st.rank, st.replica_group, [r for r in st.state if not is_hpz_record(r)], now)
                if st.replays:
                    self.replay.add(st.rank, st.replays, now)
                if st.steps:
                    self.straggler.add(st.rank, st.steps, now)
                    self._step_walls.extend(r.wall_s for r in st.steps if r.wall_s > 0)
                if st.links:
                    self.straggler.add_links(st.rank, st.links, now)
                if st.steps or st.numerics:
                    self.evidence_log.write(st.rank, st.steps, st.numerics, st.numeric_layers, len(self.ranks))
                if st.numerics and st.replica_group:
                    self.numerics.add(
                        st.rank,
                        st.replica_group,
                        st.numeric_layers,
                        [(n.step, n.loss, n.norms) for n in st.numerics],
                        now,
                    )
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
            self.launcher_done = True
            for rank, code, _pid in msg.worker_exits:
                self.launcher_codes[rank] = code
            self.events.write("launcher_exit", exit_code=msg.exit_code, workers=msg.worker_exits)
        elif isinstance(msg, Hello):
            self.events.write("agent_hello", node=msg.node_id, host=msg.host, pid=msg.agent_pid)
        elif isinstance(msg, Goodbye):
            node["gone"] = True
            self.events.write("agent_goodbye", node=msg.node_id, reason=msg.reason)

    def _take_devices(self, msg: NodeDigest, now: float) -> None:
        """The node's GPU readings: to the device-health detector, and which rank's process runs on which GPU."""
        if not msg.devices:
            return
        pid_rank = {st.pid: st.rank for st in msg.ranks}
        for reading in msg.devices:
            key = f"{msg.host}:gpu{reading.index}"
            self.devices.add(GpuSample.from_reading(key, reading), now)
            for pid in reading.pids:
                if pid in pid_rank:
                    self.rank_gpu[pid_rank[pid]] = key
        self._devices_new = True

    def _device_findings(self, now: float, live: set[int]) -> list[Finding]:
        """GPUs that deviate from the GPUs of their replica class, and device error events (NVML)."""
        if not self._devices_new:
            return []
        self._devices_new = False
        classes: dict[str, list[str]] = {}
        placed: set[str] = set()
        for r in sorted(live):
            gpu, group = self.rank_gpu.get(r), self.ranks[r].state.replica_group if r in self.ranks else None
            if gpu is None or group is None or gpu in placed:
                continue
            placed.add(gpu)
            classes.setdefault(group, []).append(gpu)
        out = []
        for obs in self.devices.update(list(classes.values()), now):
            ranks = sorted(r for r, g in self.rank_gpu.items() if g == obs.gpu)
            out.append(
                Finding(
                    kind=HEALTH,
                    summary=obs.summary,
                    culprit_ranks=ranks if obs.attributable else [],
                    status="attributed" if obs.attributable else "inconclusive",
                    confidence=0.9 if obs.attributable else 0.4,
                    devices=[obs.gpu],
                    pg=f"device:{obs.gpu}",
                    evidence={"type": obs.kind, "gpu": obs.gpu, **obs.evidence},
                )
            )
        return out

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
        # A lost agent's last report goes stale: judging it would blame ranks for our own blindness (a rank of
        # no known agent is judged).
        lost = {ident for ident, n in self.nodes.items() if n.get("lost")}
        seen = {r: o for r, o in self.ranks.items() if self.rank_node.get(r) not in lost} if lost else self.ranks
        findings, fetches = self.desync.update(seen)
        for f in findings:
            self.emit(f, now)
        for req in fetches:
            self._start_fetch(req, now)
        for suspect in self.hang.update(now, seen):
            self._start_stacks(suspect, now)
        members = self.memberships.members
        live = {r for r, o in seen.items() if o.state.alive}
        replicas = sorted(r for r in live if self.ranks[r].state.replica_group is not None)
        for f in (
            self.state.update(now, members, live)
            + self._numeric(now, live)
            + self.nonfinite.update(now, self.ranks)
            + self.hpz.update(now, live)
            + self.replay.update(now, replicas)
            + self._stragglers(now, live)
            + self._device_findings(now, live)
        ):
            self.emit(f, now)
        if self.root_found:
            self.exits.done = True  # later exits follow from the fault already named
        for f in self.exits.update(now, self.ranks, self.launcher_codes, self.launcher_done):
            self.emit(f, now)
        self._flush_due(now)
        self._publish_trust(now)
        self._track_topology()

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
            with open(self.topology_file + ".tmp", "wb") as fh:
                fh.write(msgspec.json.encode(changed))  # json.dump took seconds for 10k ranks' groups
            os.replace(self.topology_file + ".tmp", self.topology_file)
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
        verified, first = verified_window(self.state.step_clean, slots)
        if suspect_since is not None and first > suspect_since:
            suspect_since = None  # a whole clean rotation after the finding re-verified the state
        return {
            "verified_step": verified,
            "state_period": period,
            "suspect_since": suspect_since,
            "replay_layers": layers,
            "replay_rotation_clean": set(layers) <= self.replay.clean_layers,
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

    def _stragglers(self, now: float, live: set[int]) -> list[Finding]:
        devices = [self.ranks[r].state.device for r in live if self.ranks[r].state.device]
        self.straggler.shared_gpu = len(devices) != len(set(devices))  # ranks competing for one GPU
        findings = []
        for f in self.straggler.update(now, live):
            # a stall names where the training code waits: the call site the probe saw (slow loads, saves)
            where = {"data_loading": "data", "checkpoint_write": "ckpt"}.get(f.evidence.get("type", ""))
            if where:
                for r in f.culprit_ranks:
                    site = self.ranks[r].state.io_sites.get(where) if r in self.ranks else None
                    if site:
                        f.stacks[str(r)] = site
            if f.culprit_ranks and f.evidence.get("type") in PROFILED and self._start_profile(f, live, now):
                continue  # emitted once the samples are in (_flush_due)
            findings.append(f)
        wanted = self.straggler.comm.take_request()
        if wanted is not None:
            self._schedule_link_probe(now, *wanted)
        return findings

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

    def _numeric(self, now: float, live: set[int]) -> list[Finding]:
        """Numerical outliers: each suspect waits for a confirmation (replay of its layers and the whole
        replicated state, on every replica at one step ahead); the completed findings once it is in."""
        classes: dict[str, list[int]] = {}
        for r in live:
            group = self.ranks[r].state.replica_group
            if group:
                classes.setdefault(group, []).append(r)
        suspects = self.numerics.update(now, classes)
        if suspects:  # what the probes can replay, as the rotation orders it
            self.confirmations.replay_layers = next(
                (list(o.state.replay_layers) for o in self.ranks.values() if o.state.replay_layers), []
            )
        for s in suspects:
            self.confirmations.add(s, confirmation.numeric_finding(s))
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
        if self.confirmations.queued is not None and self.confirmations.current is None:
            step, rate = self._step_ahead(now, confirmation.LEAD_S, lead_steps=3)
            rid = next(self.request_ids)
            step_s = statistics.median(self._step_walls) if self._step_walls else 0.0
            payload = self.confirmations.next_request(step, rid, now, step_s)
            if payload is not None:
                for ident in self.nodes:
                    self.endpoint.send(ident, Command(kind="replay", request_id=rid, payload=payload))
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
        return self.confirmations.resolve(now, self.replay.outcomes, self.state.step_clean, self.state.outliers_at)

    def _schedule_link_probe(self, now: float, pg: str, members: list[int], before_s: float, now_s: float) -> None:
        """Collectives of `pg` slowed on every member: have the members time exchanges with each other at a
        step far enough ahead that every probe has read the request (see probe/link_probe.py)."""
        step, rate = self._step_ahead(now)
        if step is None:
            return
        rid = next(self.request_ids)
        payload = json.dumps({"id": rid, "step": step, "members": members})
        for ident in self.nodes:
            self.endpoint.send(ident, Command(kind="linkprobe", request_id=rid, payload=payload))
        self.straggler.comm.scheduled(rid, pg, members, step, before_s, now_s, now)
        self.console.info(
            f"collectives of pg {pg} slowed on every member ({before_s * 1e3:.1f} -> "
            f"{now_s * 1e3:.1f} ms per step): link probe at step {step}"
        )
        self.events.write("link_probe_requested", pg=pg, step=step, members=members, steps_per_s=round(rate, 2))

    def _step_ahead(
        self, now: float, lead_s: float = REPLAY_LEAD_S, lead_steps: int = REPLAY_LEAD_STEPS
    ) -> tuple[int | None, float]:
        """A step a few seconds of training ahead of where the ranks are now, and the recent step rate.

        The furthest step known is a digest old (up to an agent interval, plus the coordinator's own
        tick), so the steps made since are added. The rate comes from the last few seconds of that step
        (start-up, when steps did not move, is left out), or, before it has moved over a few seconds, from
        the steps' own wall times."""
        if not self._step_history:
            return None, 0.0
        t1, s1 = self._step_history[-1]
        t0, s0 = next((t, s) for t, s in self._step_history if t >= t1 - max(lead_s, REPLAY_LEAD_S))
        rate = (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else 0.0
        if rate <= 0.0 and self._step_walls:
            rate = 1.0 / max(1e-6, statistics.median(self._step_walls))
        ahead = rate * (max(0.0, now - t1) + lead_s)
        return s1 + max(lead_steps, int(ahead) + 1), rate

    def _replay_on_command(self, now: float) -> None:
        """`trainscout replay RUN_DIR` drops a request file; schedule the replay a few seconds of steps ahead.

        Every replica must replay at the same step (the input travels by a side-group broadcast), so the
        step is picked far enough ahead that every probe has read the request before reaching it.
        """
        if not os.path.exists(self.replay_request_file):
            return
        try:
            with open(self.replay_request_file) as fh:
                request = json.load(fh)
            os.unlink(self.replay_request_file)
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
        payload = json.dumps({"id": next(self.request_ids), "step": step, "layer": layer})
        for ident in self.nodes:
            self.endpoint.send(ident, Command(kind="replay", request_id=next(self.request_ids), payload=payload))
        self.console.info(f"replay requested: {layer or 'next layer of the rotation'} at step {step}")
        self.events.write("replay_requested", step=step, layer=layer, steps_per_s=round(rate, 2))

    def _start_stacks(self, suspect: Suspect, now: float) -> None:
        suspect.finding.first_seen = time.time()
        self.root_found = self.root_found or suspect.finding.kind in ROOT_KINDS
        rid = next(self.request_ids)
        by_node: dict[bytes, list[int]] = {}
        for r in suspect.stack_ranks:
            if r in self.rank_node:
                by_node.setdefault(self.rank_node[r], []).append(r)
        sent: set[int] = set()
        for ident, ranks in by_node.items():
            if self.endpoint.send(ident, Command(kind="dump_stacks", request_id=rid, ranks=ranks)):
                sent.update(ranks)
        self.pending_stacks[rid] = PendingStacks(suspect.finding, sent, now + self.stack_timeout_s)
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

    def _start_fetch(self, req: FetchRequest, now: float) -> None:
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
        self.pending_fetch[rid] = PendingFetch(req, set(req.ranks), now + self.stack_timeout_s)

    def _on_records(self, msg: RecordsReport, now: float) -> None:
        pending = self.pending_fetch.get(msg.request_id)
        if pending is None:
            return
        pending.records[msg.rank] = msg.records
        pending.waiting.discard(msg.rank)

    def _flush_due(self, now: float) -> None:
        for rid, p in list(self.pending_stacks.items()):
            if not p.waiting or now >= p.deadline:
                del self.pending_stacks[rid]
                if self._stale(p.finding):
                    self.events.write("suspect_dropped", request=rid, reason="an agent went silent meanwhile")
                    continue
                self.emit(p.finding, now)
        for rid, pp in list(self.pending_profiles.items()):
            if not pp.waiting or now >= pp.deadline:
                del self.pending_profiles[rid]
                self.emit(self._finish_profile(pp), now)
        for rid, pf in list(self.pending_fetch.items()):
            if not pf.waiting or now >= pf.deadline:
                del self.pending_fetch[rid]
                f = self.desync.resolve(pf.request, pf.records)
                if f is not None:
                    self.emit(f, now)

    def emit(self, finding: Finding, now: float) -> None:
        key = finding.key()
        if key in self.emitted:
            return
        if self._is_consequence(finding):
            self.events.write(
                "consequence", finding_kind=finding.kind, culprits=finding.culprit_ranks, summary=finding.summary
            )
            return
        self.emitted.add(key)
        if finding.kind in ("sdc", "nonfinite"):
            for r in finding.culprit_ranks:
                self.numerically_named.setdefault(r, finding.step or 0)
        if finding.kind in ROOT_KINDS:
            self.root_found = True
        wall = time.time()
        finding.first_seen = finding.first_seen or wall
        finding.confirmed = wall
        self._fill_identity(finding)
        self.findings.append(finding)
        self.findings_sink.finding(finding)
        self.events.write("finding", finding_kind=finding.kind, culprits=finding.culprit_ranks, summary=finding.summary)
        self.console.finding(finding)
        if finding.kind in self.abort_on and not self.aborting:
            self.abort(f"{finding.kind} found")

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
        if not f.devices:
            f.devices = [
                self.rank_gpu.get(r, f"local_rank {self.ranks[r].state.local_rank}")
                for r in f.culprit_ranks
                if r in self.ranks
            ]
        for r in f.culprit_ranks:  # what the culprit's GPU looked like when the finding was made
            gpu = self.rank_gpu.get(r)
            text = self.devices.summary(gpu) if gpu is not None else None
            if text:
                f.evidence.setdefault("device", {})[str(r)] = text

    def abort(self, reason: str) -> None:
        self.aborting = True
        self.console.warn(f"stopping the training job ({reason}; --abort-on)")
        self.events.write("abort", reason=reason)
        for ident in self.nodes:
            self.endpoint.send(ident, Command(kind="abort", request_id=next(self.request_ids)))

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
                # from the pass's end: a pass that takes long (a large job) must leave time for the digests,
                # or passes run back to back with one digest handled between them
                last_detect = time.monotonic()
                next_detect = last_detect + detect_every_s
        self.finish()

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
        now = time.monotonic()
        self.detect(now)
        for p in list(self.pending_stacks.values()) + []:
            p.deadline = now
        for pp in self.pending_profiles.values():
            pp.deadline = now
        for pf in self.pending_fetch.values():
            pf.deadline = now
        self._flush_due(now)
        for f in self.confirmations.abandon():
            self.emit(f, now)
        self.events.write("straggler_trace", steps=self.straggler.trace_rows(), waits="per-step")
        self.events.write(
            "coordinator_exit",
            findings=len(self.findings),
            rejected=dict(self.endpoint.rejected),
            state_ranges_compared=self.state.compared,
            replays_compared=self.replay.replays_compared,
        )
        self.evidence_log.close()
        self.endpoint.close()


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
        gpu_stragglers=config.from_environ()[0].stragglers.gpu,
    )
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
