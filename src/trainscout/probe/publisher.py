"""The probe's background thread: heartbeat, Flight Recorder polling, protocol records into the channel.

It is the only writer of most header fields and of the ring. It reads the Flight Recorder's cheap
status every tick and dumps entries only when a sequence number moved, at most `max_dumps_per_s`.
A failure disables the collective check (fail open) and is reported in the header; the heartbeat
goes on, so the agent can still tell a live rank from a frozen one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from trainscout.channel.layout import pg_table_path
from trainscout.channel.writer import ChannelWriter
from trainscout.probe import flight_recorder as fr
from trainscout.probe import protocol

CHECK_COLLECTIVES = 1


class Publisher(threading.Thread):
    def __init__(self, writer: ChannelWriter, run_id: str, rank: int, tap, get_step,
                 tick_s: float = 0.1, max_dumps_per_s: float = 4.0) -> None:
        super().__init__(name="trainscout-probe", daemon=True)
        self.writer = writer
        self.run_id = run_id
        self.rank = rank
        self.tap = tap
        self.get_step = get_step
        self.tick_s = tick_s
        self.min_dump_gap_ns = int(1e9 / max_dumps_per_s)
        self.stop_event = threading.Event()
        self._last_status: dict[str, int] = {}
        self._dirty = False
        self._last_dump_ns = 0
        self._last_record_id = -1
        self._pg_index: dict[str, int] = {}
        self._rolling: dict[str, int] = {}
        self._last_seq: dict[str, int] = {}
        self._pg_config_keys: frozenset = frozenset()
        self._collectives = 0
        self._collectives_ok = True

    def run(self) -> None:
        w = self.writer
        while not self.stop_event.wait(self.tick_s):
            w.set("heartbeat_ns", time.monotonic_ns())
            if self._collectives_ok:
                try:
                    self.poll_collectives()
                except Exception as exc:
                    self._collectives_ok = False
                    w.set("disabled_checks", int(w.header["disabled_checks"]) | CHECK_COLLECTIVES)
                    w.set("error_text", f"collective tracking disabled: {exc!r}".encode()[:480])

    def poll_collectives(self, force: bool = False) -> None:
        if not (fr.available() and fr.dist_initialized()):
            return
        self.writer.set("fr_available", 1)
        st = fr.status()
        if st != self._last_status:
            self._last_status = st
            self._dirty = True
        now = time.monotonic_ns()
        if self._dirty and (force or now - self._last_dump_ns >= self.min_dump_gap_ns):
            self._dirty = False
            self._last_dump_ns = now
            entries, _ = fr.entries()
            self._ingest(entries)

    def _ingest(self, entries: list[dict]) -> None:
        keys = frozenset(self._last_status)
        if keys != self._pg_config_keys:
            self._pg_config_keys = keys
            self._write_pg_table()
        w = self.writer
        new = [e for e in entries if e.get("record_id", -1) > self._last_record_id]
        if not new:
            return
        first_id = new[0]["record_id"]
        if self._last_record_id >= 0 and first_id > self._last_record_id + 1:
            w.set("dropped", int(w.header["dropped"]) + first_id - self._last_record_id - 1)
        self._last_record_id = new[-1]["record_id"]
        step = self.get_step()
        for e in new:
            if e.get("is_p2p"):
                continue  # point-to-point pairs are not equal across group members
            pg_name = str(e["process_group"][0])
            seq = int(e["collective_seq_id"])
            if seq <= self._last_seq.get(pg_name, 0):
                continue
            self._last_seq[pg_name] = seq
            op = protocol.op_name(e["profiling_name"])
            extra = self.tap.pop_extra(pg_name, seq) if self.tap is not None else ""
            sig = protocol.signature(op, e["input_sizes"], e["input_dtypes"], e["output_sizes"],
                                     e["output_dtypes"], extra)
            h = protocol.entry_hash(sig)
            rolling = protocol.chain(self._rolling.get(pg_name, 0), h)
            self._rolling[pg_name] = rolling
            idx = self._pg_index.setdefault(pg_name, len(self._pg_index))
            desc = protocol.describe(op, e["input_sizes"], e["input_dtypes"], extra)
            w.append(idx, seq, h, rolling, int(e.get("time_created_ns") or 0), step, op, desc)
            self._collectives += 1
        w.set("collectives", self._collectives)
        w.set("progress_ns", time.monotonic_ns())

    def _write_pg_table(self) -> None:
        # The Flight Recorder's own pg_config is not reliable on every backend; torch's Python-side
        # registry is authoritative for names and members.
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        world = c10d._world
        table = {}
        for pg, name in list(world.pg_names.items()):
            members = sorted(int(r) for r in world.pg_group_ranks.get(pg, {}))
            desc = getattr(pg, "group_desc", "") or ""
            table[str(name)] = {"desc": str(desc), "members": members}
        # the ring stores a pg index; the agent maps it back through this order
        for name in table:
            self._pg_index.setdefault(name, len(self._pg_index))
        doc = {"index": self._pg_index, "groups": table}
        path = pg_table_path(self.run_id, self.rank)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)
        self.writer.set("pg_table_version", int(self.writer.header["pg_table_version"]) + 1)
