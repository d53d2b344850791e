"""Message types on the agent <-> coordinator link (msgspec structs, msgpack-encoded, tagged union).

Agents send one NodeDigest per interval: O(1) data per local rank, whatever the collective count or group
size. A group's members travel once (`NodeDigest.groups`, when the agent first sees the group or it changes),
compactly as runs; the coordinator keeps them (coordinator/memberships.py) and fills them back in.
Detailed collective records stay on the agent; the coordinator pulls them (FetchRecords) only for the
ranks and sequence ranges a verdict implicates. Ages are measured by the sender on its own monotonic
clock, so no cross-host clock agreement is assumed.
"""

from __future__ import annotations

from typing import Union

import msgspec

from trainscout.wire.device import DeviceReading


class CollectiveRecord(msgspec.Struct, array_like=True, gc=False):
    seq: int  # per-process-group collective sequence number (1-based, as the Flight Recorder counts)
    op: str  # e.g. "all_reduce"
    desc: str  # human-readable signature: op, dtypes, shapes, reduce op, root
    entry_hash: int  # 64-bit hash of this collective's protocol signature
    rolling_hash: int  # 64-bit hash chained over every collective of this group up to seq
    wall_ns: int  # wall-clock time the rank issued it (only compared within one host)
    step: int  # optimizer steps completed when it was issued (when placed, for a native one: a tick later)
    # issued outside Python (DDP's reducer, functional collectives, compiled code): chained as NATIVE_HASH;
    # op, desc and entry_hash are empty (0) until the Flight Recorder described it on that rank
    native: bool = False


class PgState(msgspec.Struct, array_like=True, gc=False):
    name: str  # torch.distributed group name, identical on every member
    desc: str
    members: list[int]  # global ranks; empty: sent once in NodeDigest.groups (the coordinator fills it in)
    seq: int  # highest collective sequence number this rank issued on this group
    rolling_hash: int  # rolling hash at chained_seq
    anchors: list[tuple[int, int]]  # recent (seq, rolling_hash) at seq % ANCHOR_EVERY == 0
    recent: list[CollectiveRecord]  # the last few records by seq, newest last (rolling_hash 0: not chained yet)
    seq_age_s: float  # seconds since this rank's seq on this group last changed
    chained_seq: int = 0  # every record up to here is known, so rolling_hash covers them all
    complete: bool = True  # False once records were lost: rolling hashes of this rank are not comparable
    role: str = ""  # what the group is for, as a framework integration declared it (replicate, shard, tensor...)
    framework: str = ""  # who declared it (DDP, HSDP, DeepSpeed ZeRO-2, ...)


class RankExit(msgspec.Struct, array_like=True, gc=False):
    how: str  # exit | exception | signal | vanished
    code: int | None
    signal: int | None
    message: str
    step: int
    age_s: float  # seconds since the exit was observed


class StateRecord(msgspec.Struct, array_like=True, gc=False):
    """Fingerprint of one byte range of one replicated tensor after an optimizer step."""

    step: int
    tensor: str  # parameter name, or "name:state_key" for optimizer state
    start: int  # byte range [start, end)
    end: int
    digest: int
    group: str = ""  # process group whose members must agree on it ("" = the rank's replica group)


class NonFiniteEvent(msgspec.Struct, array_like=True, gc=False):
    step: int  # the step being computed when the value turned non-finite (before any reduction)
    what: str  # "loss" or "grad <parameter name>"


class ReplayRecord(msgspec.Struct, array_like=True, gc=False):
    step: int
    layer: str
    output: int  # fingerprint of the layer's output
    grads: int  # combined fingerprint of input and parameter gradients
    params: int = 0  # combined fingerprint of the layer's parameters (equal on healthy replicas)
    # the global rank whose input the replicas recomputed: one per group of replicas (the whole job's DDP, or
    # each pipeline stage's), so records of different groups are never compared (-1: not sent)
    source: int = -1


# re-exported: a CUDA step whose GPU span was not read (StepRecord.gpu_s / gpu_wait_s)
from trainscout.markers import GPU_UNMEASURED  # noqa: E402, F401


class StepRecord(msgspec.Struct, array_like=True, gc=False):
    """One optimizer step of one rank: durations measured by the rank itself (no clock comparison)."""

    step: int
    wall_s: float  # since the previous step ended
    cpu_s: float  # CPU time of the training thread in that span (minus data loading / checkpoint CPU)
    data_s: float  # time inside DataLoader iteration
    ckpt_s: float  # time inside torch.save / torch.distributed.checkpoint.save
    wait_s: float = 0.0  # blocked in collectives: Python-level calls + the gradient-sync wait after backward
    gpu_s: float = -1.0  # CUDA: GPU time from the step's start to the end of backward (-1: not a CUDA step;
    # GPU_UNMEASURED: a CUDA step whose GPU time was not read)
    gpu_wait_s: float = -1.0  # CUDA: GPU time from the end of backward to the optimizer step (gradient sync)
    pg_wait: dict[str, float] = {}  # Python-level collective time per process group name
    runq_s: float = -1.0  # the training thread was runnable but had no CPU (run-queue delay; -1: unknown)
    probe_thread_s: float = 0.0  # the probe's own thread worked this long meanwhile (the GIL may have been its)
    # previous optimizer step -> this step's first training forward, less data loading, checkpoint writes,
    # collective waits and the probe's checks: the script's own work between steps (-1: no forward seen)
    between_s: float = -1.0
    data_workers_s: float = 0.0  # the part of data_s spent waiting for DataLoader worker processes' batches
    frozen_s: float = 0.0  # the whole process was stopped this long in the step (its probe thread woke that late)
    # the step's training forwards (each to backward's call, the loss included), in the measure of its compute: the
    # training thread's CPU time (a part of cpu_s), on CUDA steps the GPU's span less collectives (a part of gpu_s);
    # -1: not measured
    fwd_s: float = -1.0


class NumericRecord(msgspec.Struct, array_like=True, gc=False):
    """One optimizer step of one rank: its local loss and its local gradient's L2 norm per layer, both measured
    before any reduction (after DDP averages, every replica holds the same gradient); after the layer norms, per
    layer, its counts of odd parameters (markers.PARAM_COUNTS), then each gradient reduction's input norm."""

    step: int
    loss: float  # mean of the step's losses; NaN: not measured
    norms: list[float] = []  # per entry of RankState.numeric_layers; empty: not measured


class LinkRecord(msgspec.Struct, array_like=True, gc=False):
    """One link probe on one rank: seconds per round trip with each partner (over the side group)."""

    request_id: int
    step: int
    seconds: dict[int, float]  # partner rank -> best exchange time


class RankState(msgspec.Struct, array_like=True, gc=False):
    rank: int
    local_rank: int
    world_size: int
    pid: int
    alive: bool
    step: int
    heartbeat_age_s: float  # seconds since the probe's publisher thread last ran
    progress_age_s: float  # seconds since this rank last issued a collective or finished a step
    collectives: int  # total collectives seen
    pgs: list[PgState]
    exit: RankExit | None = None
    cpu_percent: float = 0.0
    probe_errors: list[str] = []
    fr_available: bool = True
    replica_group: str | None = None  # process group whose members hold identical replicated state
    state: list[StateRecord] = []  # fingerprints taken since the previous digest
    nonfinite: list[NonFiniteEvent] = []  # first non-finite values seen (all of them, capped by the probe)
    replays: list[ReplayRecord] = []  # replay fingerprints since the previous digest
    steps: list[StepRecord] = []  # step timings since the previous digest
    state_period: int = 0  # steps one replicated-state rotation takes (0: state check off)
    state_slots: int = 0  # slots of that rotation: step s checks slot s mod state_slots
    replay_layers: list[str] = []  # layers the replay rotation covers (empty: replay off)
    io_sites: dict[str, str] = {}  # "data" / "ckpt" -> the training code's call site of slow loads / saves
    links: list[LinkRecord] = []  # link-probe results since the previous digest
    numerics: list[NumericRecord] = []  # per-step loss and layer gradient norms since the previous digest
    numeric_layers: list[str] = []  # the layers NumericRecord.norms follow
    device: str = ""  # the accelerator the rank computes on (a CUDA device's UUID); "" on CPU
    attempt: int = 0  # the launcher's restart attempt this process belongs to (torchrun --max-restarts)
    busy: int = 0  # what the rank does between collectives (markers.BUSY_*)
    busy_age_s: float = 0.0  # seconds since that began (saving, compiling) or was last seen (active)
    moving_age_s: float = 1e9  # seconds since its training thread was last seen working between collectives
    gpu_pending_s: float = 0.0  # seconds its training GPU has not completed the work queued when the probe looked


class Hello(msgspec.Struct, tag=True):
    node_id: str
    host: str
    agent_pid: int


class GroupInfo(msgspec.Struct, array_like=True, gc=False):
    """A process group's members, sent once per agent (and again if they change or the coordinator asks)."""

    name: str
    runs: list[tuple[int, int, int]]  # (first rank, stride, count): see wire.membership


class NodeDigest(msgspec.Struct, tag=True):
    node_id: str
    host: str
    number: int  # increases by one per digest from this agent
    ranks: list[RankState]
    devices: list[DeviceReading] = []  # the node's GPUs (NVML), when the agent can read them
    groups: list[GroupInfo] = []  # memberships this agent has not sent before (or that changed)


class StackReport(msgspec.Struct, tag=True):
    node_id: str
    request_id: int
    rank: int
    pid: int
    method: str  # py-spy | faulthandler | none; py-spy-record: a profile (collapsed stacks of the main thread)
    text: str


class RecordsReport(msgspec.Struct, tag=True):
    node_id: str
    request_id: int
    rank: int
    pg: str
    records: list[CollectiveRecord]


class LauncherReport(msgspec.Struct, tag=True):
    """From the run supervisor: what the launcher (torchrun) said about its workers when it ended."""

    node_id: str
    exit_code: int
    worker_exits: list[tuple[int, int, int]]  # (global rank, exitcode as torchrun prints it, pid)
    final: bool = True  # False: workers' exits reported while the launcher still runs
    signalled_pids: list[int] = msgspec.field(default_factory=list)  # workers the launcher sent a closing signal
    interrupted: bool = False  # the whole job was told to stop (a signal to the supervisor or the launcher)


class Goodbye(msgspec.Struct, tag=True):
    node_id: str
    reason: str


class Command(msgspec.Struct, tag=True):
    """Coordinator -> agent."""

    kind: str  # dump_stacks | profile | fetch_records | abort | trust | replay | linkprobe | send_groups
    request_id: int
    ranks: list[int] = []
    pg: str = ""
    seq_from: int = 0
    seq_to: int = 0
    payload: str = ""  # trust / replay: JSON the agent hands to the probes (certificates, replay request)


ToCoordinator = Union[Hello, NodeDigest, StackReport, RecordsReport, LauncherReport, Goodbye]
ToAgent = Command

ANCHOR_EVERY = 16
