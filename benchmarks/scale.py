"""Scale harness: the real coordinator fed by simulated node agents, for jobs of 1k to 100k ranks.

The coordinator is trainscout's own (`trainscout.coordinator.main.Coordinator` over its ZeroMQ ROUTER endpoint,
HMAC-signed msgspec frames); only the nodes are simulated. Simulator processes each speak for many nodes, one
DEALER socket and identity per node as a real agent has, and send one `NodeDigest` per node per interval, built
from the same wire structs the agent fills: per rank its process groups' sequence numbers, rolling hashes,
anchors and last records, its step timings and its replicated-state fingerprints; they answer the coordinator's
commands (stacks, records of a group) as an agent does. Simulated ranks advance steps on a shared wall clock and issue
their groups' collectives stage by stage (tensor-parallel all-reduces, pipeline sends, the data-parallel
gradient all-reduce), so every member of a group agrees, as in a healthy job.

`--fault` strikes a seeded random rank with a hang, a crash, a desync, a straggler or an SDC, each showing only
the evidence a real rank sends (benchmarks/scale_faults.py). A hang is a rank that stops before its next
collective: its group peers enter that collective and wait, the ranks depending on those wait in turn (computed
as the fixed point of who can still complete a collective), so the coordinator sees the frozen job a real one
would show. The harness reports the detection pass time, the coordinator's CPU and memory, the digest bytes per
node per second, and when (and whom) the coordinator named. `python -m benchmarks scale faults` runs every fault
at several scales (benchmarks/scale_matrix.py).

    python -m benchmarks scale coordinator --layout 8x16x784 --seconds 40 --fault hang   # TP 8 x PP 16 x DP 784
    python -m benchmarks scale coordinator --layout dp:1024 --seconds 30 --fault sdc      # pure data parallel
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import scale_faults  # noqa: E402
from scale_faults import FAULTS, Fault  # noqa: E402

RANKS_PER_NODE = 8
MASK64 = (1 << 64) - 1
ANCHOR_EVERY = 16
KEEP_RECORDS = 4096  # records an agent keeps of each rank's group (agent/rank_view.py)


# ---- the job's layout -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One kind of collective a step issues, on one family of groups, in order within the step."""

    kind: str  # tensor | pipeline | data | world
    group_of: np.ndarray  # rank -> index of its group of this family
    members: list[range]  # group index -> its members
    per_step: int  # collectives per step on each group
    op: str
    desc: str


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @staticmethod
    def parse(text: str) -> Layout:
        if text.startswith("dp:"):
            return Layout(1, 1, int(text[3:]))
        tp, pp, dp = (int(x) for x in text.split("x"))
        return Layout(tp, pp, dp)

    def label(self) -> str:
        return f"pure DP {self.world}" if self.tp == self.pp == 1 else f"TP {self.tp} x PP {self.pp} x DP {self.dp}"

    def stages(self) -> tuple[list[Stage], dict[str, str]]:
        """The step's stages and every group's name ("0" is the world, then TP, PP, DP groups in creation order,
        as torch names groups by a counter). Rank = (dp_i * pp + pp_i) * tp + tp_i: TP inside a node."""
        ranks = np.arange(self.world)
        tp_i, pp_i, dp_i = ranks % self.tp, (ranks // self.tp) % self.pp, ranks // (self.tp * self.pp)
        stages: list[Stage] = []
        names: dict[str, str] = {}
        if self.tp == self.pp == 1:
            stages.append(
                Stage(
                    "world",
                    np.zeros(self.world, dtype=np.int64),
                    [range(self.world)],
                    3,
                    "all_reduce",
                    "all_reduce float32[25165824] op=SUM",
                )
            )
            return stages, names
        next_name = 1
        fams = [
            (
                "tensor",
                self.tp,
                ranks // self.tp,
                lambda g: range(g * self.tp, (g + 1) * self.tp),
                4,
                "all_reduce",
                "all_reduce bfloat16[4096,8192] op=SUM",
            ),
            (
                "pipeline",
                self.pp,
                dp_i * self.tp + tp_i,
                lambda g: range(
                    (g // self.tp) * self.tp * self.pp + g % self.tp, (g // self.tp + 1) * self.tp * self.pp, self.tp
                ),
                2,
                "send",
                "send bfloat16[1,4096,8192]",
            ),
            (
                "data",
                self.dp,
                pp_i * self.tp + tp_i,
                lambda g: range((g // self.tp) * self.tp + g % self.tp, self.world, self.tp * self.pp),
                1,
                "all_reduce",
                "all_reduce float32[50331648] op=SUM",
            ),
        ]
        for kind, size, group_of, members_of, per_step, op, desc in fams:
            if size <= 1:
                continue
            count = int(group_of.max()) + 1
            members = [members_of(g) for g in range(count)]
            for g in range(count):
                names[f"{kind}:{g}"] = str(next_name)
                next_name += 1
            stages.append(Stage(kind, group_of.astype(np.int64), members, per_step, op, desc))
        return stages, names


def group_name(stage: Stage, names: dict[str, str], g: int) -> str:
    return "0" if stage.kind == "world" else names[f"{stage.kind}:{g}"]


def entry_hash(kind: str, seq: int) -> int:
    salt = sum(ord(c) << (8 * (i % 4)) for i, c in enumerate(kind))  # not hash(): it differs per process
    return ((seq + 1) * 0x9E3779B97F4A7C15 ^ salt) & MASK64


def rolling(kind: str, seq: int) -> int:
    return (entry_hash(kind, seq) * 0xBF58476D1CE4E5B9 + 7) & MASK64


# ---- a hang and where every rank ends up ------------------------------------------------------------------
def frozen_positions(stages: list[Stage], world: int, culprit: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Where every rank stops when `culprit` never issues a collective of `step` again.

    Returns (seq per stage per rank, shape (stages, world); the time it stopped, in steps after the onset).
    A collective completes only when every member of its group entered it; a rank that cannot complete one
    waits in it, and the ranks that need that rank in their own next collective wait in turn.
    """
    seqs = np.zeros((len(stages), world), dtype=np.int64)
    when = np.zeros(world, dtype=np.float64)
    stuck = np.zeros(world, dtype=bool)
    for i, st in enumerate(stages):
        seqs[i, culprit] = step * st.per_step
    stuck[culprit] = True
    s = step
    while not stuck.all():
        for i, st in enumerate(stages):
            blocked_groups = np.unique(st.group_of[stuck])
            newly = np.isin(st.group_of, blocked_groups) & ~stuck
            for m, other in enumerate(stages):
                seqs[m, newly] = (s + 1) * other.per_step if m < i else s * other.per_step
            seqs[i, newly] = s * st.per_step + 1  # entered this collective, waits in it
            when[newly] = (s - step) + i / len(stages)
            stuck |= newly
        s += 1
    return seqs, when


# ---- simulated nodes --------------------------------------------------------------------------------------
def simulate(args: argparse.Namespace) -> int:
    import msgspec
    import zmq

    from trainscout.wire.framing import Codec
    from trainscout.wire.membership import pack_members
    from trainscout.wire.messages import (
        CollectiveRecord,
        Command,
        GroupInfo,
        Hello,
        LauncherReport,
        NodeDigest,
        PgState,
        RankExit,
        RankState,
        RecordsReport,
        StackReport,
        StateRecord,
        StepRecord,
    )
    from trainscout.wire.security import secure_client

    layout = Layout.parse(args.layout)
    stages, names = layout.stages()
    world = layout.world
    secret = bytes.fromhex(os.environ["TRAINSCOUT_SECRET"])
    codec = Codec(secret)
    ctx = zmq.Context(io_threads=2)
    ctx.set(zmq.MAX_SOCKETS, 2 * (args.node_to - args.node_from) + 64)  # zmq's default is 1023 sockets
    nodes = list(range(args.node_from, args.node_to))
    socks = []
    for n in nodes:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"node-{n:05d}".encode())
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.LINGER, 0)
        secure_client(s, secret)  # a real agent's CURVE handshake and per-message encryption
        s.connect(args.coordinator)
        socks.append(s)
    for n, s in zip(nodes, socks):
        s.send_multipart(codec.encode(Hello(node_id=f"node-{n:05d}", host=f"host-{n:05d}", agent_pid=100000 + n)))
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    sock_node = {s: n for n, s in zip(nodes, socks)}

    t0, step_s, interval = args.t0 or 0.0, args.step_s, args.interval
    frozen = None
    onset = args.onset_step
    fault = Fault(args.fault, args.culprit, onset, step_s, t0, args.seed)
    data_i = len(stages) - 1  # the data-parallel gradient all-reduce (the world group's, in pure DP)
    data_of = stages[data_i].group_of  # rank -> its replica group (the model shard it holds)
    if fault.freezes and args.culprit >= 0:
        seqs_at, when_at = frozen_positions(stages, world, args.culprit, onset)
        frozen = (seqs_at.T.tolist(), when_at.tolist())
    # every rank's groups, in the order torch creates them (world first)
    rank_groups: dict[int, list[tuple[int, str, list[int]]]] = {}
    replica_group: dict[int, str] = {}  # rank -> the group of its data-parallel replicas (equal replicated state)
    member_lists: dict[str, list[int]] = {}  # one list per group, shared by its local members
    for n in nodes:
        for r in range(n * RANKS_PER_NODE, min(world, (n + 1) * RANKS_PER_NODE)):
            gs = []
            if stages[0].kind != "world":
                if "0" not in member_lists:
                    member_lists["0"] = list(range(world))
                gs.append((-1, "0", member_lists["0"]))
            for i, st in enumerate(stages):
                g = int(st.group_of[r])
                name = group_name(st, names, g)
                if name not in member_lists:
                    member_lists[name] = list(st.members[g])
                gs.append((i, name, member_lists[name]))
            rank_groups[r] = gs
            replica_group[r] = group_name(stages[data_i], names, int(data_of[r]))
    packed: dict[str, list[tuple[int, int, int]]] = {}
    sent_groups: set[int] = set()  # nodes whose memberships went out (membership sent once)
    rec_cache: dict[tuple[int, int], CollectiveRecord] = {}
    last_step: dict[int, int] = {}
    rng = random.Random(args.node_from)
    enc_bytes = 0
    digests = 0
    lag_max = 0.0

    def position(r: int, now: float) -> tuple[int, list[int], float]:
        """(completed steps, seq per stage, seconds since the rank last issued anything)."""
        el = fault.elapsed_steps(now)
        j, f = int(el), el - int(el)
        if frozen is not None and el >= onset + frozen[1][r]:
            seqs = frozen[0][r]
            done = min(s // st.per_step for s, st in zip(seqs, stages))
            return done, seqs, (el - onset - frozen[1][r]) * step_s
        length = fault.step_length(j + 1)
        seqs = []
        n = len(stages)
        for i, st in enumerate(stages):
            part = min(1.0, max(0.0, f * n - i))
            seqs.append(j * st.per_step + int(part * st.per_step + 1e-9) if part < 1.0 else (j + 1) * st.per_step)
        return j, seqs, (f * length) % (length / (n * 4))

    def record(i: int, seq: int, step: int) -> CollectiveRecord:
        key = (i, seq)
        rec = rec_cache.get(key)
        if rec is None:
            st = stages[i]
            rec = CollectiveRecord(
                seq, st.op, st.desc, entry_hash(st.kind, seq), rolling(st.kind, seq), int(t0 * 1e9 + seq * 1e6), step
            )
            rec_cache[key] = rec
        return rec

    def own_record(r: int, i: int, seq: int, step: int) -> CollectiveRecord:
        """Rank r's record of collective `seq` of its stage-i group: the shared one, but for a desync's culprit."""
        rec = record(i, seq, step)
        odd, carried = fault.deviates(r, i == data_i, seq, stages[i].per_step)
        if not carried:
            return rec
        return CollectiveRecord(
            seq,
            rec.op,
            scale_faults.DESYNC_DESC if odd else rec.desc,
            rec.entry_hash ^ scale_faults.DESYNC_SALT if odd else rec.entry_hash,
            rec.rolling_hash ^ scale_faults.DESYNC_SALT,
            rec.wall_ns,
            rec.step,
        )

    hist_cache: dict[tuple[int, int], tuple[list, list, int]] = {}

    def history(i: int, kind: str, seq: int, done: int) -> tuple[list, list, int]:
        """(anchors, recent records, rolling hash) of a group at `seq`: equal on every member, so built once."""
        got = hist_cache.get((i, seq))
        if got is None:
            if i < 0:
                got = ([], [], rolling(kind, seq))
            else:
                first = max(ANCHOR_EVERY, (seq // ANCHOR_EVERY - 7) * ANCHOR_EVERY)
                anchors = [(a, rolling(kind, a)) for a in range(first, seq + 1, ANCHOR_EVERY)]
                got = (anchors, [record(i, q, done) for q in range(max(1, seq - 3), seq + 1)], rolling(kind, seq))
            hist_cache[(i, seq)] = got
        return got

    def own_history(r: int, i: int, kind: str, seq: int, done: int) -> tuple[list, list, int]:
        """A desync's culprit's history of its data-parallel group: its own rolling hashes from the deviation on."""
        anchors, recent, rolling_hash = history(i, kind, seq, done)
        if i != data_i or not fault.deviates(r, True, seq, stages[i].per_step)[1]:
            return anchors, recent, rolling_hash
        salted = [
            (a, h ^ scale_faults.DESYNC_SALT) if fault.deviates(r, True, a, stages[i].per_step)[1] else (a, h)
            for a, h in anchors
        ]
        return salted, [own_record(r, i, rec.seq, rec.step) for rec in recent], rolling_hash ^ scale_faults.DESYNC_SALT

    def rank_state(r: int, now: float, world_members: bool) -> RankState:
        done, seqs, quiet = position(r, now)
        pgs = []
        culprit = r == fault.culprit
        for i, name, members in rank_groups[r]:
            seq = 1 if i < 0 else seqs[i]
            kind = "world" if i < 0 else stages[i].kind
            anchors, recent, rolling_hash = (own_history if culprit else lambda _r, *a: history(*a))(
                r, i, kind, seq, done
            )
            pgs.append(
                PgState(
                    name=name,
                    desc="default_pg" if i < 0 else stages[i].kind,
                    members=members if world_members else [],
                    seq=seq,
                    rolling_hash=rolling_hash,
                    anchors=anchors,
                    recent=recent,
                    seq_age_s=quiet,
                    chained_seq=seq,
                    complete=True,
                )
            )
        prev = last_step.get(r, done)
        steps = []
        state = []
        for s in range(max(prev, done - 8), done):
            wall, compute, wait = fault.step_split(r, s + 1)
            steps.append(
                StepRecord(
                    step=s + 1,
                    wall_s=wall + 0.01 * step_s * rng.random(),
                    cpu_s=compute,
                    data_s=scale_faults.DATA * step_s,
                    ckpt_s=0.0,
                    wait_s=wait,
                )
            )
            # the replicated-state rotation: after each optimizer step, one slot, fingerprinted
            state.append(
                StateRecord(
                    step=s + 1,
                    tensor=f"layers.{(s + 1) % scale_faults.STATE_SLOTS}.weight",
                    start=0,
                    end=scale_faults.STATE_BYTES,
                    digest=fault.state_digest(r, int(data_of[r]), s + 1),
                )
            )
        last_step[r] = done
        ended = fault.exit_of(r, now, RANKS_PER_NODE)
        return RankState(
            rank=r,
            local_rank=r % RANKS_PER_NODE,
            world_size=world,
            pid=200000 + r,
            alive=ended is None,
            step=done,
            heartbeat_age_s=0.05,
            progress_age_s=quiet,
            collectives=sum(seqs),
            pgs=pgs,
            exit=None if ended is None else RankExit(ended[0], ended[1], ended[2], ended[3], done, ended[4]),
            steps=steps,
            replica_group=replica_group[r],
            state=state,
            state_period=scale_faults.STATE_SLOTS,
            state_slots=scale_faults.STATE_SLOTS,
        )

    def answer(s, cmd: Command) -> None:
        n = sock_node[s]
        if cmd.kind in ("dump_stacks", "profile"):
            for r in cmd.ranks:
                s.send_multipart(
                    codec.encode(
                        StackReport(
                            node_id=f"node-{n:05d}",
                            request_id=cmd.request_id,
                            rank=r,
                            pid=200000 + r,
                            method="none",
                            text="(simulated rank)",
                        )
                    )
                )
        elif cmd.kind == "fetch_records":  # as an agent answers from the records it keeps of each rank
            for r in cmd.ranks:
                s.send_multipart(
                    codec.encode(
                        RecordsReport(
                            node_id=f"node-{n:05d}",
                            request_id=cmd.request_id,
                            rank=r,
                            pg=cmd.pg,
                            records=kept_records(r, cmd.pg, cmd.seq_from, cmd.seq_to),
                        )
                    )
                )
        elif cmd.kind == "send_groups":
            sent_groups.discard(n)

    def kept_records(r: int, pg: str, seq_from: int, seq_to: int) -> list[CollectiveRecord]:
        stage = next((i for i, name, _ in rank_groups.get(r, []) if name == pg and i >= 0), None)
        if stage is None:
            return []
        done, seqs, _ = position(r, time.time())
        top = min(seq_to, seqs[stage])
        first = max(seq_from, top - KEEP_RECORDS + 1, 1)
        per = stages[stage].per_step
        return [own_record(r, stage, q, (q - 1) // per) for q in range(first, top + 1)]

    launcher_node = fault.culprit // RANKS_PER_NODE if fault.kind == "crash" else -1
    launcher_sent = False
    decoder = msgspec.msgpack.Decoder(Command)
    if args.t0_file:  # connected and set up: say so, and take the job's start from the driver once all are
        Path(args.stats + ".ready").write_text("")
        while not Path(args.t0_file).exists():
            time.sleep(0.02)
        t0 = float(Path(args.t0_file).read_text())  # the closures above read t0 and fault when called
        fault = Fault(args.fault, args.culprit, onset, step_s, t0, args.seed)
    end = t0 + args.seconds
    k = 0
    while time.time() < end:
        base = t0 + k * interval
        for idx, (n, s) in enumerate(zip(nodes, socks)):
            due = base + interval * idx / len(nodes)
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            else:
                lag_max = max(lag_max, -wait)
            now = time.time()
            mine = range(n * RANKS_PER_NODE, min(world, (n + 1) * RANKS_PER_NODE))
            ranks = [rank_state(r, now, args.legacy_members) for r in mine]
            groups = []
            if not args.legacy_members and n not in sent_groups:  # as the agent does: each membership once
                named = {name: members for r in mine for _, name, members in rank_groups[r]}
                groups = [
                    GroupInfo(name, packed.get(name) or packed.setdefault(name, pack_members(members)))
                    for name, members in named.items()
                ]
            digest = NodeDigest(node_id=f"node-{n:05d}", host=f"host-{n:05d}", number=k + 1, ranks=ranks, groups=groups)
            frames = codec.encode(digest)
            if n == launcher_node and not launcher_sent and now >= fault.onset_wall + scale_faults.TEARDOWN_S + 0.5:
                # the culprit's launcher (torchrun) printed its failed workers; the node's supervisor reports them
                s.send_multipart(
                    codec.encode(
                        LauncherReport(
                            node_id=f"node-{n:05d}",
                            exit_code=0,
                            worker_exits=fault.launcher_exits(RANKS_PER_NODE, world),
                            final=False,
                        )
                    )
                )
                launcher_sent = True
            try:
                s.send_multipart(frames, zmq.NOBLOCK)
                sent_groups.add(n)
            except zmq.Again:
                pass
            enc_bytes += sum(len(f) for f in frames)
            digests += 1
            if idx % 64 == 0:
                for sock, _ in poller.poll(0):
                    while True:
                        try:
                            parts = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        payload = codec._verified_payload(parts)
                        if payload is not None:
                            answer(sock, decoder.decode(payload))
        if len(rec_cache) > 100000:
            rec_cache.clear()
            hist_cache.clear()
        k += 1
    stats = {"digests": digests, "bytes": enc_bytes, "nodes": len(nodes), "lag_max_s": round(lag_max, 3), "rounds": k}
    Path(args.stats).write_text(json.dumps(stats))
    for s in socks:
        s.close(0)
    ctx.term()
    return 0


# ---- the real coordinator, its passes timed ---------------------------------------------------------------
def serve_coordinator(args: argparse.Namespace) -> int:
    from trainscout.coordinator.main import Coordinator
    from trainscout.sinks import ConsoleSink
    from trainscout.wire.endpoints import CoordinatorEndpoint

    endpoint = CoordinatorEndpoint("tcp://127.0.0.1:0", bytes.fromhex(os.environ["TRAINSCOUT_SECRET"]))
    run_dir = Path(args.run_dir)
    console = ConsoleSink(open(run_dir / "console.log", "w", buffering=1), rich=False)
    # an agent is lost after 3 intervals of silence (3 s at the default interval of 1 s)
    coord = Coordinator(
        endpoint,
        str(run_dir),
        console,
        hang_timeout_s=args.hang_timeout,
        agent_silence_s=3.0 * max(1.0, args.interval),
    )
    passes: list[list[float]] = []  # (wall-clock end, seconds, ranks known, CPU seconds)
    handle_s = [0.0, 0]
    detect, handle = coord.detect, coord.handle

    profile = handle_profile = None
    if args.profile:
        import cProfile

        profile, handle_profile = cProfile.Profile(), cProfile.Profile()

    def timed_detect(now: float) -> None:
        t, c = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        detect(now)
        if profile is not None:
            profile.disable()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        quiet = min(((o.progress_age(now), r) for r, o in coord.ranks.items()), default=(0.0, -1))
        passes.append([time.time(), wall, len(coord.ranks), cpu, *quiet])

    def timed_handle(identity, msg, now) -> None:
        t = time.process_time()
        if handle_profile is not None:
            handle_profile.enable()
        handle(identity, msg, now)
        if handle_profile is not None:
            handle_profile.disable()
        handle_s[0] += time.process_time() - t
        handle_s[1] += 1

    gc_s = [0.0, 0.0, 0.0]  # seconds in garbage collection, per generation
    gc_freed: list[int] = []  # unreachable objects each collection found
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_s[info["generation"]] += time.perf_counter() - gc_start[0]
            gc_freed.append(info.get("collected", 0))

    gc.callbacks.append(on_gc)
    coord.detect = timed_detect  # type: ignore[method-assign]
    coord.handle = timed_handle  # type: ignore[method-assign]

    def stop(*_):
        coord.stop = True

    signal.signal(signal.SIGTERM, stop)
    # written whole, then renamed: the driver polls for the file and must never read it half-written
    (run_dir / "coordinator.addr.tmp").write_text(endpoint.address)
    (run_dir / "coordinator.addr.tmp").rename(run_dir / "coordinator.addr")
    try:
        coord.run()
    finally:
        if profile is not None:
            profile.dump_stats(str(run_dir / "detect.prof"))
        if handle_profile is not None:
            handle_profile.dump_stats(str(run_dir / "handle.prof"))
        (run_dir / "passes.json").write_text(
            json.dumps(
                {
                    "passes": passes,
                    "handle_cpu_s": handle_s[0],
                    "messages": handle_s[1],
                    "gc_s": gc_s,
                    "gc_freed": gc_freed,
                }
            )
        )
    return 0


# ---- the driver -------------------------------------------------------------------------------------------
def run_once(args: argparse.Namespace) -> dict:
    import psutil

    layout = Layout.parse(args.layout)
    world = layout.world
    nodes = (world + RANKS_PER_NODE - 1) // RANKS_PER_NODE
    run_dir = Path(tempfile.mkdtemp(prefix="trainscout-scale-", dir=args.runs_under))
    env = dict(os.environ, TRAINSCOUT_SECRET=secrets.token_hex(32))
    me = [sys.executable, __file__]
    coord = subprocess.Popen(
        me
        + ["--serve-coordinator", "--run-dir", str(run_dir), "--interval", str(args.interval)]
        + ["--hang-timeout", str(args.hang_timeout)]
        + (["--profile"] if args.profile else []),
        env=env,
    )
    addr_file = run_dir / "coordinator.addr"
    while not addr_file.exists():
        time.sleep(0.05)
    address = addr_file.read_text()
    culprit = random.Random(args.seed).randrange(world) if args.fault != "none" else -1
    t0_file = run_dir / "t0"
    onset_step = int(args.onset_s / args.step_s)
    procs = []
    per = (nodes + args.procs - 1) // args.procs
    for p in range(args.procs):
        a, b = p * per, min(nodes, (p + 1) * per)
        if a >= b:
            continue
        cmd = me + [
            "--simulate",
            "--layout",
            args.layout,
            "--coordinator",
            address,
            "--node-from",
            str(a),
            "--node-to",
            str(b),
            "--t0-file",
            str(t0_file),
            "--seconds",
            str(args.seconds),
            "--step-s",
            str(args.step_s),
            "--interval",
            str(args.interval),
            "--culprit",
            str(culprit),
            "--onset-step",
            str(onset_step),
            "--fault",
            args.fault,
            "--seed",
            str(args.seed),
            "--stats",
            str(run_dir / f"sim{p}.json"),
        ]
        if args.legacy_members:
            cmd.append("--legacy-members")
        procs.append(subprocess.Popen(cmd, env=env))
    # the job starts once every simulator connected its sockets (a loaded machine takes seconds to start them)
    ready = [Path(str(run_dir / f"sim{p}.json") + ".ready") for p in range(len(procs))]
    while not all(r.exists() for r in ready):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a simulator ended before it was ready (run folder {run_dir})")
        time.sleep(0.05)
    t0 = time.time() + 1.0
    (run_dir / "t0.tmp").write_text(repr(t0))
    (run_dir / "t0.tmp").rename(t0_file)
    proc = psutil.Process(coord.pid)
    rss_max = 0
    cpu_start = None
    while any(p.poll() is None for p in procs):
        time.sleep(0.5)
        rss_max = max(rss_max, proc.memory_info().rss)
        if cpu_start is None and time.time() >= t0 + args.warmup_s:
            ct = proc.cpu_times()
            cpu_start = (time.time(), ct.user + ct.system)
    ct = proc.cpu_times()
    cpu_end = (time.time(), ct.user + ct.system)
    coord.send_signal(signal.SIGTERM)
    coord.wait(timeout=120)
    sims = [json.loads((run_dir / f"sim{p}.json").read_text()) for p in range(len(procs))]
    timing = json.loads((run_dir / "passes.json").read_text())
    steady_passes = [p for p in timing["passes"] if p[0] >= t0 + args.warmup_s and p[2] == world]
    steady = [p[1] for p in steady_passes]
    steady_cpu = [p[3] for p in steady_passes]
    findings = (
        [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines()]
        if (run_dir / "findings.jsonl").exists()
        else []
    )
    onset_wall = t0 + onset_step * args.step_s
    expected = scale_faults.expected_kind(args.fault)
    named = next((f for f in findings if f["kind"] == expected), None)
    others = [f for f in findings if f is not named]
    out = {
        "layout": layout.label(),
        "ranks": world,
        "nodes": nodes,
        "passes": len(steady),
        "pass_p50_s": _common.percentile(steady, 50) if steady else None,
        "pass_p99_s": _common.percentile(steady, 99) if steady else None,
        "pass_cpu_p50_s": _common.percentile(steady_cpu, 50) if steady else None,
        "pass_cpu_p99_s": _common.percentile(steady_cpu, 99) if steady else None,
        "coordinator_rss_gib": rss_max / 2**30,
        "coordinator_cpu": (cpu_end[1] - cpu_start[1]) / (cpu_end[0] - cpu_start[0]) if cpu_start else None,
        "handle_cpu_ms_per_digest": 1e3 * timing["handle_cpu_s"] / max(1, timing["messages"]),
        # the coordinator's seconds in garbage collection per second of the run, young and full collections
        "gc_s_per_s": [round(g / max(1e-9, cpu_end[0] - t0), 4) for g in timing.get("gc_s", [])],
        "gc_freed": timing.get("gc_freed", [])[-20:],  # what the last collections found unreachable
        "digest_bytes_per_node_s": sum(s["bytes"] for s in sims)
        / max(1, sum(s["digests"] for s in sims))
        / args.interval,
        "digests_per_node_s": sum(s["digests"] for s in sims) / nodes / args.seconds,
        "sim_lag_max_s": max(s["lag_max_s"] for s in sims),
        "culprit": culprit,
        "findings": [
            (f["kind"], f["culprit_ranks"][:10], len(f["culprit_ranks"]), round(f["confirmed"] - onset_wall, 2))
            for f in findings
        ],
        "load1_after": _common.load1(),
        "fault": args.fault,
        "named_after_s": round(named["confirmed"] - onset_wall, 2) if named else None,
        "named_summary": named["summary"][:300] if named else None,
        # exact: the fault's kind, its culprit and no other rank, and no other finding (none at all if clean)
        "exact": (named is not None and named["culprit_ranks"] == [culprit] and not others)
        if expected
        else not findings,
        "other_findings": len(others),
        "run_dir": str(run_dir),
    }
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="8x16x8", help="TPxPPxDP, or dp:N for pure data parallel")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the simulated job runs")
    p.add_argument("--step-s", type=float, default=1.0, help="seconds per training step")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between a node's digests (agent default)")
    p.add_argument(
        "--fault", choices=FAULTS, default="none", help="what strikes a random rank (benchmarks/scale_faults.py)"
    )
    # a hang is judged on each rank's last digest: with digests rarer than the timeout, some show a rank
    # before the job froze, so the timeout must exceed the interval (true at the defaults, 5 s and 1 s)
    p.add_argument("--hang-timeout", type=float, default=5.0, help="the coordinator's hang timeout (default 5 s)")
    p.add_argument("--onset-s", type=float, default=15.0, help="seconds into the job the fault starts")
    p.add_argument("--warmup-s", type=float, default=8.0, help="passes and CPU before this are not counted")
    p.add_argument("--procs", type=int, default=2, help="simulator processes")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--legacy-members", action="store_true", help="every digest carries every group's members")
    p.add_argument("--profile", action="store_true", help="profile the detection passes (detect.prof)")
    p.add_argument("--runs-under", default=None, help="make the run folder in this folder (default: the temp dir)")
    # internal modes
    p.add_argument("--simulate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-coordinator", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--node-from", type=int, help=argparse.SUPPRESS)
    p.add_argument("--node-to", type=int, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    p.add_argument("--t0-file", help=argparse.SUPPRESS)
    p.add_argument("--culprit", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--onset-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stats", help=argparse.SUPPRESS)
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.simulate:
        return simulate(args)
    if args.serve_coordinator:
        return serve_coordinator(args)
    out = run_once(args)
    print(json.dumps(out))
    Path(out["run_dir"], "result.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
