"""The probe's background thread: heartbeat, Flight Recorder polling, protocol records into the channel.

It writes most header fields and puts every collective of the rank in the channel. The Python collective
wrappers append records themselves, synchronously and before the call, so a collective that hangs or
aborts its process is already on record; a lock keeps the two appenders apart. Every tick the publisher
reads the Flight Recorder's cheap status (a moved sequence number is progress) and places each new
sequence number: one the wrappers recorded needs nothing; one a wrapper saw but could not describe waits
for the recorder's entry; any other was issued outside Python (DDP's C++ reducer, functional collectives,
compiled code) and gets a NATIVE placeholder at once, so the agent's chain never waits for a dump.

A full dump costs ~10 us per buffered entry with the GIL held (a 256-entry dump took 5-8 ms on 4 ranks
sharing 2 cores), so entries are read only when needed: when progress stopped (a hang needs the latest
collectives described), when a Python call waits for its entry (about half the buffer new, or
MAX_DUMP_GAP_S), and every DESCRIBE_EVERY_S to describe the native collectives still in the buffer (DETAIL
records: compared between members where each has them). Records may reach the ring out of sequence
order: the agent orders and chains them. A failure disables the collective check (fail open) and is
reported in the header; the heartbeat goes on, so the agent can still tell a live rank from a frozen one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable

from trainscout.channel.layout import pg_table_path
from trainscout.channel.writer import ChannelWriter
from trainscout.probe import flight_recorder as fr
from trainscout.probe import protocol

CHECK_COLLECTIVES = 1
_KEEP_SYNCED = 4096
MAX_DUMP_GAP_S = 2.0  # a Python call the wrappers could not describe (all_gather, ...) is on record within this
DESCRIBE_EVERY_S = 10.0  # native collectives are described at least this often (one dump; their place is known)


# A tick this late means the process did not run at all meanwhile (see run)
FROZEN_MIN_S = 0.2


class Publisher(threading.Thread):
    def __init__(
        self,
        writer: ChannelWriter,
        run_id: str,
        rank: int,
        tap,
        get_step,
        tick_s: float = 0.5,
        buffer_entries: int = 256,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
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
        # all of this thread's work, cumulative: the training thread may wait for the GIL meanwhile, which is
        # not the rank's own blocking (a dump every 10 s, 5-8 ms, would read as a periodic block of the rank)
        self.busy_s = 0.0
        self._tick_began: float | None = None  # perf_counter() at the start of the tick under way
        self._pg_index: dict[str, int] = {}
        self._last_record_id, self._fresh = -1, 0
        self._pg_names: dict[str, str] = {}  # the recorder's group id (per process) -> group name
        self._placed: dict[str, int] = {}  # pg -> every seq up to here is recorded, awaited or has a placeholder
        self._awaiting: dict[str, set[int]] = {}  # pg -> Python calls whose record comes from the recorder
        self._natives: dict[str, set[int]] = {}  # pg -> placeholders not described yet
        self._synced: "OrderedDict[tuple[str, int], int]" = OrderedDict()  # written by the wrappers
        self._pg_table_keys: frozenset = frozenset()
        self._roles: dict[str, dict] = {}  # pg name -> {"role", "framework"} declared by an integration
        self.device = ""  # the accelerator this rank computes on (set_device)
        self._collectives = 0
        self._mismatch = 0
        self._collectives_ok = True
        self.on_tick = on_tick  # extra work of the probe on this thread (e.g. reading requests)
        # (due, woke) on perf_counter's clock when a tick came FROZEN_MIN_S or more late (the step timing's)
        self.on_late: Callable[[float, float], None] | None = None

    name = "flight_recorder"  # its figures' key in the rank's cost report

    def costs(self) -> dict | None:
        """Flight Recorder dumps, on this thread (not the training thread) but holding the GIL."""
        return {"seconds": self.dump_s, "dumps": self.dumps} if self.dumps else None

    def run(self) -> None:
        w = self.writer
        while True:
            due = time.perf_counter() + self.tick_s
            if self.stop_event.wait(self.tick_s):
                break
            t0 = self._tick_began = time.perf_counter()
            # Woken this late, the whole process was stopped (SIGSTOP, a suspended job, a paused VM) or starved:
            # the training thread's own blocking (a sleep, I/O, a lock) releases the GIL and never delays this one
            if t0 - due >= FROZEN_MIN_S and self.on_late is not None:
                self.on_late(due, t0)
            self._tick(w)
            self._tick_began = None
            self.busy_s += time.perf_counter() - t0

    def busy_now(self) -> float:
        """busy_s with the tick under way so far: a step that ends while a dump holds the GIL is the one the
        dump blocked (counted only once the tick ended, its time went to the next step, where nothing was
        blocked, and a dump every 18 steps read as a rank blocked 5 ms every 18 steps)."""
        began = self._tick_began
        return self.busy_s + (time.perf_counter() - began if began is not None else 0.0)

    def _tick(self, w) -> None:
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
        raw = fr.status()  # keyed by the recorder's own group ids, which differ between ranks
        st = self._collective_status(raw)
        now = time.monotonic_ns()
        moved = st != self._last_status
        if moved:  # a collective was issued since the last look: progress, whether or not it is described yet
            self._last_status = st
            with self.lock:
                self.writer.set("progress_ns", now)
        since = now - self._last_dump_ns
        entries = None
        # a group new to the recorder is named by its entries, read when it is new or has issued since
        if any(
            pg_id not in self._pg_names and last != self._dumped_status.get(pg_id) for pg_id, last in st.items()
        ) and (force or not self._pg_names or since >= MAX_DUMP_GAP_S * 1e9):
            entries = self._dump(st, now)
            st = self._collective_status(raw)  # the dump may have named a group: its P2P calls come off now
        self._place(st)
        awaiting = sum(map(len, self._awaiting.values()))
        undescribed = any(self._natives.values())
        if entries is None and (awaiting or undescribed):
            # every collective fills the recorder's buffer, whoever describes it (p2p entries too: per collective)
            issued = sum(max(0, seq - self._dumped_status.get(pg, 0)) for pg, seq in st.items())
            due = (
                force
                or not moved  # stopped: a hang is reported with its latest collectives described
                or awaiting
                and (since >= MAX_DUMP_GAP_S * 1e9 or issued * self._records_per_collective >= self.buffer_entries // 2)
                or undescribed
                and since >= DESCRIBE_EVERY_S * 1e9
            )
            if due and (moved or force or st != self._dumped_status):  # a stopped rank is read once
                entries = self._dump(st, now)
                if self._fresh and issued:
                    self._records_per_collective = max(1.0, self._fresh / issued)
        if entries:
            t0 = time.perf_counter()
            self._ingest(entries)
            self.dump_s += time.perf_counter() - t0

    def _collective_status(self, status: dict[str, int]) -> dict[str, int]:
        """The recorder's status counts a gloo group's point-to-point calls among its collectives (its entries do
        not): those the tap saw are taken off, so that every member numbers the group's collectives alike."""
        taken = self.tap.p2p_taken if self.tap is not None else None
        if not taken:
            return status
        names = self._pg_names
        return {pg_id: last - taken.get(names.get(pg_id, ""), 0) for pg_id, last in status.items()}

    def _dump(self, status: dict[str, int], now: int) -> list[dict]:
        """The recorder's buffered entries (oldest first); learns each group id's name from them."""
        t0 = time.perf_counter()
        self._dumped_status = status
        self._last_dump_ns = now
        entries, _ = fr.entries()
        last_id = self._last_record_id
        self._fresh = sum(1 for e in entries if e.get("record_id", -1) > last_id)  # entries since the last read
        if entries:
            self._last_record_id = entries[-1].get("record_id", last_id)
        for e in entries:
            if "pg_id" in e:
                self._pg_names.setdefault(str(e["pg_id"]), str(e["process_group"][0]))
        self.dumps += 1
        self.dump_s += time.perf_counter() - t0
        return entries

    def _place(self, status: dict[str, int]) -> None:
        """Give every collective the recorder counted a place in the ring (see the module docstring)."""
        synced, noted = self._synced, (self.tap.noted if self.tap is not None else {})
        step = None
        for pg_id, last in status.items():
            pg_name = self._pg_names.get(pg_id)
            if pg_name is None:
                continue  # named by its first dump
            placed = self._placed.get(pg_name, 0)
            if last <= placed:
                continue
            for seq in range(placed + 1, last + 1):
                key = (pg_name, seq)
                if key in synced:
                    continue
                if key in noted:
                    noted.pop(key, None)
                    self._awaiting.setdefault(pg_name, set()).add(seq)
                    continue
                if step is None:
                    step = self.get_step()
                self._natives.setdefault(pg_name, set()).add(seq)
                with self.lock:
                    self.writer.append(self._index_of(pg_name), seq, 0, protocol.NATIVE, time.time_ns(), step, "", "")
                    self._collectives += 1
            self._placed[pg_name] = last
            with self.lock:
                self.writer.set("collectives", self._collectives)

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

    def set_device(self, device: str) -> None:
        """The accelerator this rank computes on (a CUDA device's UUID), published with the group table."""
        with self.lock:
            self.device = device
            self._write_pg_table()

    def set_role(self, group, role: str, framework: str) -> None:
        """An integration says what a group is for (see trainscout.integrations); the first word stays."""
        name = str(group.group_name)
        if name in self._roles:
            return
        with self.lock:
            self._roles[name] = {"role": role, "framework": framework}
            self._write_pg_table()

    def role_of(self, pg_name: str) -> str | None:
        """The role an integration declared for the group, if any."""
        declared = self._roles.get(pg_name)
        return declared["role"] if declared else None

    def has_role(self, role: str) -> bool:
        """Whether an integration declared a group of this rank's for that role."""
        return any(d["role"] == role for d in list(self._roles.values()))

    def _index_of(self, pg_name: str) -> int:
        idx = self._pg_index.get(pg_name)
        if idx is None:
            idx = self._pg_index[pg_name] = len(self._pg_index)
            self._write_pg_table()
        return idx

    def _ingest(self, entries: list[dict]) -> None:
        """Records from a dump's entries: awaited Python calls, DETAILs of native collectives not described
        yet, checks of the Python path's own records. Entries read before are passed over by those tests."""
        keys = frozenset(self._last_status)
        if keys != self._pg_table_keys:
            self._pg_table_keys = keys
            with self.lock:
                self._write_pg_table()
        w = self.writer
        oldest: dict[str, int] = {}  # pg -> its oldest seq still in the recorder's buffer
        step = self.get_step()
        appended = 0
        for e in entries:
            if e.get("is_p2p"):
                continue  # point-to-point pairs are not equal across group members
            pg_name = str(e["process_group"][0])
            seq = int(e["collective_seq_id"])
            oldest.setdefault(pg_name, seq)
            if seq > self._placed.get(pg_name, 0):
                continue  # issued after the status read: placed at the next tick, described at a later dump
            awaiting, natives = self._awaiting.get(pg_name), self._natives.get(pg_name)
            waited = awaiting is not None and seq in awaiting
            if not (waited or natives is not None and seq in natives or (pg_name, seq) in self._synced):
                continue  # read before
            op = protocol.op_name(e["profiling_name"])
            extra = self.tap.pop_extra(pg_name, seq) if self.tap is not None else ""
            sig = protocol.signature(
                op, e["input_sizes"], e["input_dtypes"], e["output_sizes"], e["output_dtypes"], extra
            )
            h = protocol.entry_hash(sig)
            with self.lock:
                synced = self._synced.pop((pg_name, seq), None)
                if synced is not None:
                    if synced != h:  # the Python path must describe a collective exactly as the recorder does
                        self._mismatch += 1
                        w.set("sig_mismatch", self._mismatch)
                    continue
                desc = protocol.describe(op, e["input_sizes"], e["input_dtypes"], extra)
                if waited:
                    assert awaiting is not None  # waited says so
                    awaiting.discard(seq)
                    flags = 0
                else:
                    if natives is None:
                        # the wrapper's record left _synced (evicted) since the test above: fail as before, which
                        # disables collective tracking (see _tick)
                        raise RuntimeError(f"collective {pg_name}#{seq} is neither awaited, native nor synced")
                    natives.discard(seq)
                    flags = protocol.NATIVE | protocol.DETAIL
                w.append(self._index_of(pg_name), seq, h, flags, int(e.get("time_created_ns") or 0), step, op, desc)
                appended += 1
        lost = 0
        for pg_name, seqs in self._awaiting.items():  # overwritten in the recorder before this dump
            gone = {s for s in seqs if s < oldest.get(pg_name, 0)}
            lost += len(gone)
            seqs -= gone
        for pg_name, seqs in self._natives.items():  # placed, never to be described: nothing is lost
            seqs -= {s for s in seqs if s < oldest.get(pg_name, 0)}
        if lost:
            w.set("dropped", int(w.header["dropped"]) + lost)
        if appended:
            with self.lock:
                w.set("progress_ns", time.monotonic_ns())

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
        doc = {"index": dict(self._pg_index), "groups": table, "roles": dict(self._roles), "device": self.device}
        path = pg_table_path(self.run_id, self.rank)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)
        self.writer.set("pg_table_version", int(self.writer.header["pg_table_version"]) + 1)
