"""The probe's background thread: heartbeat, Flight Recorder polling, protocol records into the channel.

It writes most header fields and appends the records of collectives the Flight Recorder reports. The
Python collective wrappers append records too, synchronously and before the call, so a collective that
hangs or aborts its process is already on record; a lock keeps the two appenders apart. Records may
reach the ring out of sequence order: the agent orders and chains them. The publisher reads the Flight
Recorder's cheap status every tick (a moved sequence number is progress) and dumps entries only when
about half the buffer is new, when progress stopped with entries unread, or MAX_DUMP_GAP_S after the last
dump. A failure disables the collective check (fail open) and is reported in the header;
the heartbeat goes on, so the agent can still tell a live rank from a frozen one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import OrderedDict

from trainscout.channel.layout import pg_table_path
from trainscout.channel.writer import ChannelWriter
from trainscout.probe import flight_recorder as fr
from trainscout.probe import protocol

CHECK_COLLECTIVES = 1
_KEEP_SYNCED = 4096
MAX_DUMP_GAP_S = 2.0  # collectives issued from C++ (DDP's all-reduces) reach the agent at least this often: a
# Python-recorded collective behind them is chained, and a desync that does not hang is seen, only then


class Publisher(threading.Thread):
    def __init__(self, writer: ChannelWriter, run_id: str, rank: int, tap, get_step,
                 tick_s: float = 0.5, buffer_entries: int = 256) -> None:
        super().__init__(name="trainscout-probe", daemon=True)
        self.writer = writer
        self.run_id = run_id
        self.rank = rank
        self.tap = tap
        self.get_step = get_step
        self.tick_s = tick_s
        # A full dump costs a few microseconds per buffered entry (5 ms for 256 on a small CPU, every rank),
        # so dump when about half the buffer is new (it must never wrap between dumps), when progress stops
        # (a hang or a desync needs the entries now), or after MAX_DUMP_GAP_S; a status poll is cheap.
        self.buffer_entries = max(16, buffer_entries)
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._last_status: dict[str, int] = {}
        self._dumped_status: dict[str, int] = {}  # the status seen just before the last dump
        self._records_per_collective = 1.0  # p2p entries fill the buffer too; status counts collectives only
        self._last_dump_ns = 0
        self.dumps, self.dump_s = 0, 0.0  # Flight Recorder dumps and their cost (this thread, GIL held)
        self._last_record_id = -1
        self._pg_index: dict[str, int] = {}
        self._recorded: dict[str, int] = {}  # pg -> highest seq ingested from the Flight Recorder
        self._synced: "OrderedDict[tuple[str, int], int]" = OrderedDict()  # written by the wrappers
        self._pg_table_keys: frozenset = frozenset()
        self._roles: dict[str, dict] = {}  # pg name -> {"role", "framework"} declared by an integration
        self._collectives = 0
        self._mismatch = 0
        self._collectives_ok = True
        self.on_tick = None  # extra work of the probe on this thread (e.g. reading requests)

    def run(self) -> None:
        w = self.writer
        while not self.stop_event.wait(self.tick_s):
            w.set("heartbeat_ns", time.monotonic_ns())
            if self.on_tick is not None:
                try:
                    self.on_tick()
                except Exception:
                    pass
            if self._collectives_ok:
                try:
                    self.poll_collectives()
                except Exception as exc:
                    self._collectives_ok = False
                    w.set("disabled_checks", int(w.header["disabled_checks"]) | CHECK_COLLECTIVES)
                    w.set("error_text", f"collective tracking disabled: {exc!r}".encode()[:480])

    def poll_collectives(self, force: bool = False) -> None:
        with self._poll_lock:  # the training thread flushes too, at destroy_process_group and exit
            self._poll(force)

    def _poll(self, force: bool) -> None:
        if not (fr.available() and fr.dist_initialized()):
            return
        self.writer.set("fr_available", 1)
        st = fr.status()
        now = time.monotonic_ns()
        moved = st != self._last_status
        if moved:  # a collective was issued since the last look: progress, whether or not it is ingested yet
            self._last_status = st
            with self.lock:
                self.writer.set("progress_ns", now)
        issued = sum(max(0, seq - self._dumped_status.get(pg, 0)) for pg, seq in st.items())
        if not issued:
            return
        due = (force or not moved or now - self._last_dump_ns >= MAX_DUMP_GAP_S * 1e9
               or issued * self._records_per_collective >= self.buffer_entries // 2)
        if due:
            self._dumped_status = st
            self._last_dump_ns = now
            t0 = time.perf_counter()
            entries, _ = fr.entries()
            fresh = self._ingest(entries)
            if fresh:
                self._records_per_collective = max(1.0, fresh / issued)
            self.dumps += 1
            self.dump_s += time.perf_counter() - t0

    def record_sync(self, pg_name: str, seq: int, op: str, sig: tuple, desc: str) -> None:
        """Called by the Python wrapper before it issues the collective (training thread)."""
        h = protocol.entry_hash(sig)
        with self.lock:
            idx = self._index_of(pg_name)
            self._synced[(pg_name, seq)] = h
            if len(self._synced) > _KEEP_SYNCED:
                self._synced.popitem(last=False)
            self.writer.append(idx, seq, h, 0, time.time_ns(), self.get_step(), op, desc)
            self._collectives += 1
            self.writer.set("collectives", self._collectives)
            self.writer.set("progress_ns", time.monotonic_ns())

    def append_locked(self, *record) -> None:
        """Append a non-collective record (state fingerprint, non-finite event) from any thread."""
        with self.lock:
            self.writer.append(*record)

    def set_role(self, group, role: str, framework: str) -> None:
        """An integration says what a group is for (see trainscout.integrations); the first word stays."""
        name = str(group.group_name)
        if name in self._roles:
            return
        with self.lock:
            self._roles[name] = {"role": role, "framework": framework}
            self._write_pg_table()

    def _index_of(self, pg_name: str) -> int:
        idx = self._pg_index.get(pg_name)
        if idx is None:
            idx = self._pg_index[pg_name] = len(self._pg_index)
            self._write_pg_table()
        return idx

    def _ingest(self, entries: list[dict]) -> int:
        """Append the entries not seen before; returns how many were new."""
        keys = frozenset(self._last_status)
        if keys != self._pg_table_keys:
            self._pg_table_keys = keys
            with self.lock:
                self._write_pg_table()
        w = self.writer
        new = [e for e in entries if e.get("record_id", -1) > self._last_record_id]
        if not new:
            return 0
        first_id = new[0]["record_id"]
        if self._last_record_id >= 0 and first_id > self._last_record_id + 1:
            w.set("dropped", int(w.header["dropped"]) + first_id - self._last_record_id - 1)
        self._last_record_id = new[-1]["record_id"]
        step = self.get_step()
        appended = 0
        for e in new:
            if e.get("is_p2p"):
                continue  # point-to-point pairs are not equal across group members
            pg_name = str(e["process_group"][0])
            seq = int(e["collective_seq_id"])
            if seq <= self._recorded.get(pg_name, 0):
                continue
            self._recorded[pg_name] = seq
            op = protocol.op_name(e["profiling_name"])
            extra = self.tap.pop_extra(pg_name, seq) if self.tap is not None else ""
            sig = protocol.signature(op, e["input_sizes"], e["input_dtypes"], e["output_sizes"],
                                     e["output_dtypes"], extra)
            h = protocol.entry_hash(sig)
            with self.lock:
                synced = self._synced.pop((pg_name, seq), None)
                if synced is not None:
                    if synced != h:  # the Python path must describe a collective exactly as the recorder does
                        self._mismatch += 1
                        w.set("sig_mismatch", self._mismatch)
                    continue
                idx = self._index_of(pg_name)
                desc = protocol.describe(op, e["input_sizes"], e["input_dtypes"], extra)
                w.append(idx, seq, h, 0, int(e.get("time_created_ns") or 0), step, op, desc)
                self._collectives += 1
                appended += 1
        if appended:
            with self.lock:
                w.set("collectives", self._collectives)
                w.set("progress_ns", time.monotonic_ns())
        return len(new)

    def _write_pg_table(self) -> None:
        # The Flight Recorder's own pg_config is not reliable on every backend; torch's Python-side
        # registry is authoritative for names and members.
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        table = {}
        if c10d is not None:
            world = c10d._world
            for pg, name in list(world.pg_names.items()):
                members = sorted(int(r) for r in world.pg_group_ranks.get(pg, {}))
                desc = getattr(pg, "group_desc", "") or ""
                table[str(name)] = {"desc": str(desc), "members": members}
        # the ring stores a pg index; the agent maps it back through this order
        for name in table:
            self._pg_index.setdefault(name, len(self._pg_index))
        doc = {"index": dict(self._pg_index), "groups": table, "roles": dict(self._roles)}
        path = pg_table_path(self.run_id, self.rank)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)
        self.writer.set("pg_table_version", int(self.writer.header["pg_table_version"]) + 1)
