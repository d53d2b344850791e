"""What the agent knows about one local rank: its channel, its process, its protocol state per group."""

from __future__ import annotations

import json
import os
import time
from collections import deque, namedtuple
from itertools import islice

import numpy as np
import psutil

from trainscout.channel.layout import (
    DESC_BYTES,
    ERROR_PG_INDEX,
    RECORD_DTYPE,
    evidence_table_path,
    pg_table_path,
    tensor_table_path,
)
from trainscout.channel.reader import ChannelReader
from trainscout.probe import protocol
from trainscout.probe.local_evidence import EVIDENCE_PG_INDEX, NORMS_PER_RECORD, loss_from_bits, unpack_header
from trainscout.probe.nonfinite import NONFINITE_PG_INDEX
from trainscout.probe.replay import REPLAY_PG_INDEX
from trainscout.probe.state_check import STATE_PG_INDEX
from trainscout.probe.step_timing import STEP_PG_INDEX
from trainscout.wire.messages import (
    ANCHOR_EVERY,
    GPU_UNMEASURED,
    CollectiveRecord,
    LinkRecord,
    NonFiniteEvent,
    NumericRecord,
    PgState,
    RankExit,
    RankState,
    ReplayRecord,
    StateRecord,
    StepRecord,
)

# one ring record, fields as Python values; the field names come from the (structured, so named) record dtype,
# which mypy cannot read: it types a namedtuple only from a literal list of names
Record = namedtuple("Record", RECORD_DTYPE.names)  # type: ignore[misc, arg-type]
RECENT_IN_DIGEST = 4
KEEP_RECORDS = 4096
MAX_ERRORS_PER_DIGEST = 16  # a burst beyond this is counted, not listed
# a step record's timing fields in microseconds, as the probe writes them (step_timing.StepTiming._emit); the
# values an older probe's shorter record lacks: data, ckpt, wait, gpu, gpu wait, run queue, probe thread, between
_STEP_DEFAULTS = [0, 0, 0, -1, -1, -1, 0, -1, 0, 0, -1]


GAP_GIVE_UP_S = 3.0
_INT64 = 1 << 63


def _int64(value: int) -> int:
    """A number read from a record's text or a sidecar table; ValueError beyond 64 bits (what the wire carries):
    what the probe wrote never is, a corrupted record may be."""
    if not -_INT64 <= value < 2 * _INT64:
        raise ValueError("number out of range")
    return value


class PgTrack:
    """One rank's collectives on one group, put in sequence order and chained into a rolling hash.

    Records can arrive out of order (the Python path records before the call, the Flight Recorder path
    a little later); a record waits in `pending` until every earlier one is in. A gap that never fills
    (the recorder overwrote entries) makes this rank's chain incomparable: `complete` turns False.
    A native collective (issued outside Python) chains as NATIVE_HASH whether or not it is described yet;
    its description arrives later, on its own (`describe`), and fills in the stored record.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.desc = ""
        self.members: list[int] = []
        self.role = ""  # declared by a framework integration (trainscout.integrations)
        self.framework = ""
        self.seq = 0  # highest seq seen
        self.chained_seq = 0
        self.rolling = 0
        self.complete = True
        self.changed_ns = time.monotonic_ns()
        self.anchors: deque[tuple[int, int]] = deque(maxlen=8)
        self.records: deque[CollectiveRecord] = deque(maxlen=KEEP_RECORDS)
        self.pending: dict[int, CollectiveRecord] = {}
        self._gap_since_ns = 0

    def add(self, record: CollectiveRecord) -> None:
        if record.seq <= self.chained_seq or record.seq in self.pending:
            return
        self.pending[record.seq] = record
        if record.seq > self.seq:
            self.seq = record.seq
            self.changed_ns = time.monotonic_ns()
        self._chain()

    def describe(self, seq: int, op: str, desc: str, entry_hash: int) -> None:
        """The Flight Recorder's description of native collective `seq`, placed earlier."""
        rec = self.pending.get(seq)
        if rec is None and self.records and self.records[0].seq <= seq <= self.records[-1].seq:
            at = seq - self.records[0].seq  # chained records are consecutive unless a gap was given up on
            rec = (
                self.records[at]
                if at < len(self.records) and self.records[at].seq == seq  # past a gap, `at` can overshoot
                else next((r for r in reversed(self.records) if r.seq == seq), None)
            )
        if rec is not None and rec.native:
            rec.op, rec.desc, rec.entry_hash = op, desc, entry_hash

    def _chain(self) -> None:
        while self.chained_seq + 1 in self.pending:
            rec = self.pending.pop(self.chained_seq + 1)
            self.rolling = protocol.chain(self.rolling, protocol.NATIVE_HASH if rec.native else rec.entry_hash)
            rec.rolling_hash = self.rolling
            self.chained_seq = rec.seq
            self.records.append(rec)
            if rec.seq % ANCHOR_EVERY == 0:
                self.anchors.append((rec.seq, rec.rolling_hash))
        self._gap_since_ns = time.monotonic_ns() if self.pending else 0

    def check_gap(self, now_ns: int) -> None:
        """Give up on a gap that stayed open: continue the chain without the missing records."""
        if self.pending and self._gap_since_ns and now_ns - self._gap_since_ns > GAP_GIVE_UP_S * 1e9:
            self.complete = False
            self.chained_seq = min(self.pending) - 1
            self._chain()

    def recent(self, n: int) -> list[CollectiveRecord]:
        if not n:
            return []
        # the newest records matter most (a hang or abort happens at the latest collective); read them from
        # the right end: copying the whole deque (up to KEEP_RECORDS) per group per digest was the cost
        chained = list(islice(reversed(self.records), n))[::-1]
        return chained + [self.pending[s] for s in sorted(self.pending)[-n:]]


class RankView:
    def __init__(self, run_id: str, rank: int, path: str) -> None:
        self.run_id = run_id
        self.rank = rank
        self.reader = ChannelReader(path)
        self.pgs: dict[str, PgTrack] = {}
        self._index_to_name: dict[int, str] = {}
        self._pg_table_version = -1
        self._process: psutil.Process | None = None
        self.pid = 0
        self.exit: RankExit | None = None
        self._exit_seen_ns = 0
        self._tensor_names: list[str] = []
        self._tensor_groups: list[str | None] = []
        self.replica_group: str | None = None
        self.state_period = 0
        self.state_slots = 0
        self._table_checked = 0.0
        self._table_mtime = 0
        self.replay_layers: list[str] = []
        self._state_out: list[StateRecord] = []
        self._replays_out: list[ReplayRecord] = []
        self._steps_out: list[StepRecord] = []
        self._links_out: list[LinkRecord] = []
        self.io_sites: dict[str, str] = {}
        self.nonfinite: list[NonFiniteEvent] = []
        self._errors_out: list[str] = []  # probe errors since the last digest, in order
        self._errors_dropped = 0
        self.numeric_layers: list[str] = []
        self.device = ""  # the accelerator the rank computes on, as its probe names it (a CUDA UUID)
        self._evidence_version = -1
        self._numerics_out: list[NumericRecord] = []
        self._norm_parts: dict[int, tuple[float, np.ndarray, int]] = {}  # step -> (loss, norms, filled)
        self.malformed = 0  # ring records whose text did not parse (a corrupted channel): dropped, counted
        self._malformed_told = 0

    def refresh(self) -> None:
        if not self.reader.ready():
            return
        h = self.reader.header()
        if self.pid != int(h["pid"]):
            self.pid = int(h["pid"])
            try:
                self._process = psutil.Process(self.pid)
                self._process.cpu_percent(None)  # prime: the next call reports usage since now
            except (psutil.Error, ValueError, OverflowError):  # a corrupted header's pid (<= 0, > pid_t)
                self._process = None
        if int(h["pg_table_version"]) != self._pg_table_version:
            self._load_pg_table(int(h["pg_table_version"]))
        # one C-level conversion of the whole batch: indexing numpy records field by field cost the
        # agent more than everything else it does per record
        for rec in self.reader.new_records().tolist():
            try:
                self._ingest(Record._make(rec))
            except ValueError:  # text that does not parse: not what the probe wrote, so not evidence
                self.malformed += 1
        now = time.monotonic_ns()
        for track in self.pgs.values():
            track.check_gap(now)
        if self.exit is None:
            self._check_exit(h)

    def _load_pg_table(self, version: int) -> None:
        try:
            with open(pg_table_path(self.run_id, self.rank)) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            return
        try:
            index = {int(i): str(name) for name, i in doc.get("index", {}).items()}
            groups = {
                str(name): (str(info.get("desc", "")), [_int64(int(r)) for r in info.get("members", [])])
                for name, info in doc.get("groups", {}).items()
            }
            roles = {
                str(name): (str(r.get("role", "")), str(r.get("framework", "")))
                for name, r in doc.get("roles", {}).items()
                if r
            }
        except (AttributeError, TypeError, ValueError, OverflowError):  # another shape: keep the last good table
            return
        self._pg_table_version = version
        self._index_to_name = index
        self.device = str(doc.get("device") or "")
        for name, (desc, members) in groups.items():
            track = self.pgs.setdefault(name, PgTrack(name))
            track.desc, track.members = desc, members
            track.role, track.framework = roles.get(name, ("", ""))

    def _ingest(self, rec) -> None:
        idx = rec.pg_index
        if idx == STATE_PG_INDEX:
            self._ingest_state(rec)
            return
        if idx == STEP_PG_INDEX:
            self._ingest_step(rec)
            return
        if idx == EVIDENCE_PG_INDEX:
            self._ingest_evidence(rec)
            return
        if idx == REPLAY_PG_INDEX:
            layer, _, rest = rec.desc.decode(errors="replace").partition("|")
            params, _, source = rest.partition("|")
            self._replays_out.append(
                ReplayRecord(
                    step=rec.step,
                    layer=layer,
                    output=rec.entry_hash,
                    grads=rec.rolling_hash,
                    params=_int64(int(params or "0", 16)),
                    source=int(source) if source.isdigit() else -1,
                )
            )
            return
        if idx == ERROR_PG_INDEX:
            if len(self._errors_out) < MAX_ERRORS_PER_DIGEST:
                self._errors_out.append(rec.desc.decode(errors="replace"))
            else:
                self._errors_dropped += 1
            return
        if idx == NONFINITE_PG_INDEX:
            self.nonfinite.append(NonFiniteEvent(step=rec.step, what=rec.desc.decode(errors="replace")))
            return
        name = self._index_to_name.get(idx)
        if name is None:
            self._load_pg_table(self._pg_table_version)
            name = self._index_to_name.get(idx, f"#{idx}")
        track = self.pgs.get(name)
        if track is None:
            track = self.pgs[name] = PgTrack(name)
        flags = rec.rolling_hash  # collectives use this slot for flags; the agent computes the rolling hash
        if flags & protocol.DETAIL:
            track.describe(rec.seq, rec.op.decode(errors="replace"), rec.desc.decode(errors="replace"), rec.entry_hash)
            return
        track.add(
            CollectiveRecord(
                seq=rec.seq,
                op=rec.op.decode(errors="replace"),
                desc=rec.desc.decode(errors="replace"),
                entry_hash=rec.entry_hash,
                rolling_hash=0,
                wall_ns=rec.wall_ns,
                step=rec.step,
                native=bool(flags & protocol.NATIVE),
            )
        )

    def _ingest_step(self, rec) -> None:
        """Step timings ("step"), call sites of slow loads/saves ("site") and link-probe results ("link")."""
        op = rec.op.decode(errors="replace")
        desc = rec.desc.decode(errors="replace")
        if op == "site":
            kind, _, site = desc.partition("|")
            self.io_sites[kind] = site
            return
        if op == "link":
            seconds = {}
            for part in filter(None, desc.split(",")):
                peer, _, us = part.partition("=")
                seconds[_int64(int(peer))] = _int64(int(us)) / 1e6
            self._links_out.append(LinkRecord(request_id=rec.seq, step=rec.step, seconds=seconds))
            return
        times, _, groups = desc.partition("|")
        us = [_int64(int(x)) for x in times.split(":")]
        us += _STEP_DEFAULTS[len(us) :]  # older probes send fewer fields
        pg_wait = {}
        parts = groups.split(",")
        if len(rec.desc) >= DESC_BYTES:
            # cut at the record's size: the last group's figure may be partial (read low); a description of exactly
            # that size loses its last group's wait, which only details a communication straggler
            parts = parts[:-1]
        for part in filter(None, parts):
            name, _, t = part.rpartition("=")
            if name and t.lstrip("-").isdigit():
                pg_wait[name] = _int64(int(t)) / 1e6
        self._steps_out.append(
            StepRecord(
                step=rec.step,
                wall_s=rec.rolling_hash / 1e9,
                cpu_s=rec.entry_hash / 1e9,
                data_s=us[0] / 1e6,
                ckpt_s=us[1] / 1e6,
                wait_s=us[2] / 1e6,
                gpu_s=us[3] / 1e6 if us[3] >= 0 else float(max(us[3], GPU_UNMEASURED)),
                gpu_wait_s=us[4] / 1e6 if us[4] >= 0 else float(max(us[4], GPU_UNMEASURED)),
                pg_wait=pg_wait,
                runq_s=us[5] / 1e6 if us[5] >= 0 else -1.0,
                probe_thread_s=us[6] / 1e6,
                between_s=us[7] / 1e6 if us[7] >= 0 else -1.0,
                data_workers_s=max(0, us[8]) / 1e6,
                frozen_s=max(0, us[9]) / 1e6,
                fwd_s=us[10] / 1e6 if us[10] >= 0 else -1.0,
            )
        )

    def _ingest_evidence(self, rec) -> None:
        """A step's loss and layer norms; a large model's norms come in several records (parts)."""
        part, count, version = unpack_header(rec.rolling_hash)
        loss = loss_from_bits(rec.entry_hash)
        if version != self._evidence_version:
            self._load_evidence_table()
        layers = len(self.numeric_layers)
        if count == 0 or version != self._evidence_version or not layers:
            self._numerics_out.append(NumericRecord(step=rec.step, loss=loss))
            return
        loss_seen, norms, filled = self._norm_parts.pop(rec.step, (loss, None, 0))
        if norms is None:
            norms = np.full(layers, np.nan, dtype=np.float32)
        start = part * NORMS_PER_RECORD
        # numpy's bytes fields drop trailing zero bytes (a norm of 0.0 ends in them): pad back
        values = np.frombuffer(rec.desc.ljust(4 * count, b"\0")[: 4 * count], dtype="<f4")
        norms[start : start + count] = values[: max(0, layers - start)]
        filled += count
        if filled >= layers:
            self._numerics_out.append(NumericRecord(step=rec.step, loss=loss_seen, norms=norms.tolist()))
        else:
            self._norm_parts[rec.step] = (loss_seen, norms, filled)
            for old in [s for s in self._norm_parts if s < rec.step - 64]:  # a part that never came
                del self._norm_parts[old]

    def _load_evidence_table(self) -> None:
        try:
            with open(evidence_table_path(self.run_id, self.rank)) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            return
        try:
            version, layers = int(doc.get("version", -1)), [str(x) for x in doc.get("layers", [])]
        except (AttributeError, TypeError, ValueError, OverflowError):  # a table of another shape: keep the last
            return
        self._evidence_version, self.numeric_layers = version, layers

    def take_numerics(self) -> list[NumericRecord]:
        out, self._numerics_out = self._numerics_out, []
        return out

    def _ingest_state(self, rec) -> None:
        tid = rec.seq
        if tid >= len(self._tensor_names) or self._tensor_table_changed():
            self._load_tensor_table()
        known = 0 <= tid  # a negative id would index the table from its end
        name = self._tensor_names[tid] if known and tid < len(self._tensor_names) else f"tensor#{tid}"
        group = self._tensor_groups[tid] if known and tid < len(self._tensor_groups) else None
        start, _, end = rec.desc.decode().partition(":")
        self._state_out.append(
            StateRecord(
                step=rec.step,
                tensor=str(name),
                start=_int64(int(start)),
                end=_int64(int(end)),
                digest=rec.entry_hash,
                group=str(group or ""),
            )
        )

    def _tensor_table_changed(self) -> bool:
        """The probe rewrites the table when its schedule changes (stride, slots): look once a second."""
        now = time.monotonic()
        if now < self._table_checked + 1.0:
            return False
        self._table_checked = now
        try:
            return os.stat(tensor_table_path(self.run_id, self.rank)).st_mtime_ns != self._table_mtime
        except OSError:
            return False

    def _load_tensor_table(self) -> None:
        try:
            self._table_mtime = os.stat(tensor_table_path(self.run_id, self.rank)).st_mtime_ns
        except OSError:
            pass
        try:
            with open(tensor_table_path(self.run_id, self.rank)) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            return
        try:
            names, groups = [str(n) for n in doc.get("tensors", [])], list(doc.get("groups", []))
            group = doc.get("replica_group")
            period, slots = _int64(int(doc.get("period_steps", 0))), _int64(int(doc.get("slots", 0)))
            layers = [str(x) for x in doc.get("replay_layers", [])]
        except (AttributeError, TypeError, ValueError, OverflowError):  # a table of another shape: keep the last
            return
        self._tensor_names, self._tensor_groups = names, groups
        self.replica_group = None if group is None else str(group)
        self.state_period, self.state_slots, self.replay_layers = period, slots, layers

    def take_state(self) -> list[StateRecord]:
        out, self._state_out = self._state_out, []
        return out

    def take_steps(self) -> list[StepRecord]:
        out, self._steps_out = self._steps_out, []
        return out

    def take_links(self) -> list[LinkRecord]:
        out, self._links_out = self._links_out, []
        return out

    def take_replays(self) -> list[ReplayRecord]:
        out, self._replays_out = self._replays_out, []
        return out

    def _check_exit(self, h) -> None:
        alive, zombie_status = process_state(self._process)
        if not alive and not int(h["exit_state"]):
            # this tick's header was copied before the death was seen: a record written in between (the rank's
            # last act, e.g. os._exit) is there now, for a dead process writes nothing more
            h = self.reader.header()
        if int(h["exit_state"]):
            # Report at once, even while the process is still tearing down: a rank that decided to
            # exit is not a rank that hangs, and its peers may block on it meanwhile.
            code = int(h["exit_code"])
            sig = int(h["exit_signal"]) or None
            self.exit = RankExit(
                how=h["exit_how"].decode(errors="replace") or "exit",
                code=None if code == -1 else code,
                signal=sig,
                message=h["exit_text"].decode(errors="replace"),
                step=int(h["step"]),
                age_s=0.0,
            )
            # the rank's own clock (same host): exits seen in one tick keep the order they happened in
            recorded_ns = int(h["exit_ns"])
            self._exit_seen_ns = min(recorded_ns, time.monotonic_ns()) if recorded_ns > 0 else time.monotonic_ns()
            return
        elif not alive:
            code, sig = (None, None)
            if zombie_status is not None:
                code, sig = zombie_status
            self.exit = exit_without_record(code, sig, int(h["step"]))
        else:
            return
        self._exit_seen_ns = time.monotonic_ns()

    def state(self) -> RankState | None:
        if not self.reader.ready():
            return None
        h = self.reader.header()
        now = time.monotonic_ns()
        progress_ns = max(int(h["progress_ns"]), int(h["step_ns"]))
        cpu = 0.0
        if self._process is not None and self.exit is None:
            try:
                cpu = self._process.cpu_percent(None)
            except psutil.Error:
                cpu = 0.0
        exit_ = None
        if self.exit is not None:
            exit_ = RankExit(
                how=self.exit.how,
                code=self.exit.code,
                signal=self.exit.signal,
                message=self.exit.message,
                step=self.exit.step,
                age_s=(now - self._exit_seen_ns) / 1e9,
            )
        pgs = [
            PgState(
                name=t.name,
                desc=t.desc,
                members=[],  # sent once per agent in NodeDigest.groups (see Agent._new_groups)
                seq=t.seq,
                rolling_hash=t.rolling,
                anchors=list(t.anchors),
                recent=t.recent(RECENT_IN_DIGEST),
                seq_age_s=(now - t.changed_ns) / 1e9,
                chained_seq=t.chained_seq,
                complete=t.complete,
                role=t.role,
                framework=t.framework,
            )
            for t in self.pgs.values()
        ]
        errors, self._errors_out = self._errors_out, []
        if self._errors_dropped:
            errors.append(f"{self._errors_dropped} more probe errors (not shown: too many at once)")
            self._errors_dropped = 0
        if self.malformed > self._malformed_told:
            errors.append(f"{self.malformed} channel records unreadable so far (corrupted shared memory?)")
            self._malformed_told = self.malformed
        last = h["error_text"].decode(errors="replace")  # also errors written to the header only (publisher)
        if last:  # the coordinator shows each (rank, error) once: a ring record cut short gets the header's whole text
            cut = next((i for i, e in enumerate(errors) if last.startswith(e)), None)
            if cut is None:
                errors.append(last)
            else:
                errors[cut] = last
        if int(h["sig_mismatch"]):
            errors.append(
                "the Python collective path described a collective differently from the Flight "
                "Recorder (protocol checks may misfire; please report)"
            )
        return RankState(
            rank=int(h["rank"]),
            local_rank=int(h["local_rank"]),
            world_size=int(h["world_size"]),
            pid=int(h["pid"]),
            alive=self.exit is None,
            step=int(h["step"]),
            heartbeat_age_s=(now - int(h["heartbeat_ns"])) / 1e9,
            progress_age_s=(now - progress_ns) / 1e9,
            busy=int(h["busy"]),
            busy_age_s=(now - int(h["busy_ns"])) / 1e9,
            moving_age_s=(now - int(h["moving_ns"])) / 1e9 if int(h["moving_ns"]) else 1e9,
            gpu_pending_s=(now - int(h["gpu_pending_ns"])) / 1e9 if int(h["gpu_pending_ns"]) else 0.0,
            collectives=int(h["collectives"]),
            pgs=pgs,
            exit=exit_,
            cpu_percent=cpu,
            probe_errors=errors,
            fr_available=bool(int(h["fr_available"])),
            replica_group=self.replica_group,
            state=self.take_state(),
            nonfinite=list(self.nonfinite),
            replays=self.take_replays(),
            steps=self.take_steps(),
            state_period=self.state_period,
            state_slots=self.state_slots,
            replay_layers=self.replay_layers,
            io_sites=dict(self.io_sites),
            links=self.take_links(),
            numerics=self.take_numerics(),
            numeric_layers=self.numeric_layers,
            device=self.device,
            attempt=int(h["attempt"]),
        )

    def records(self, pg: str, seq_from: int, seq_to: int) -> list[CollectiveRecord]:
        track = self.pgs.get(pg)
        if track is None:
            return []
        known = list(track.records) + list(track.pending.values())
        return sorted((r for r in known if seq_from <= r.seq <= seq_to), key=lambda r: r.seq)

    def close(self) -> None:
        self.reader.close()


def exit_without_record(code: int | None, sig: int | None, step: int) -> RankExit:
    """A rank gone before its probe recorded why: what its zombie's status tells (None: reaped unseen)."""
    if sig:
        how, message = "signal", "process ended without an exit record (killed or crashed hard)"
    elif code is not None:  # it exited of itself, past the interpreter's exit handlers (os._exit)
        how, message = "exit", f"process exited (code {code}) without an exit record (os._exit)"
    else:
        how, message = "vanished", "process ended without an exit record (killed or crashed hard)"
    return RankExit(how=how, code=code, signal=sig, message=message, step=step, age_s=0.0)


def process_state(process: psutil.Process | None) -> tuple[bool, tuple[int | None, int | None] | None]:
    """(alive, zombie exit (code, signal) or None). A zombie is dead but not yet reaped by torchrun."""
    if process is None:
        return False, None
    try:
        if process.status() != psutil.STATUS_ZOMBIE:
            return True, None
    except psutil.Error:
        return False, None
    try:
        with open(f"/proc/{process.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        status = int(fields[-1])  # exit_code field (Linux >= 3.5), in waitpid() encoding
    except (OSError, ValueError, IndexError):
        return False, (None, None)
    if status & 0x7F:
        return False, (None, status & 0x7F)
    return False, ((status >> 8) & 0xFF, None)
