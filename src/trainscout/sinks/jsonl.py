"""Append-only JSON-lines files of a run: `findings.jsonl` and the event log.

Findings are appended the moment they are emitted, one unbuffered write per line, so a run that is killed
(or a coordinator that crashes) still leaves every finding on disk; a full disk holds them in memory until
there is space (see held_lines); `trainscout report` and the tests
read them back with `findings.from_json`. The event log records what trainscout itself did and saw
(agents joining, commands sent, monitoring gaps) for debugging a run after the fact.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from trainscout.findings import Finding, to_json
from trainscout.sinks.held_lines import FullFolderNotice, HeldLines


def _open_append(path: str, notice: FullFolderNotice | None) -> HeldLines:
    if notice is None:
        return HeldLines(path)
    return HeldLines(path, on_full=notice.full, on_space=notice.space)


class JsonlSink:
    """One JSON line per finding, appended at once (held while the disk is full)."""

    def __init__(self, path: str | os.PathLike, notice: FullFolderNotice | None = None) -> None:
        self.path = os.fspath(path)
        self._file = _open_append(self.path, notice)
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Findings not on disk yet (the disk was full)."""
        return self._file.held

    def finding(self, f: Finding) -> None:
        line = to_json(f) + b"\n"
        with self._lock:
            self._file.append(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(value: Any) -> Any:
    """A JSON-safe copy of value: containers kept, anything unknown turned into its str()."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    try:
        return msgspec.to_builtins(value)  # structs, dataclasses, enums, datetimes...
    except Exception:
        return str(value)


def read_objects(path: str | os.PathLike) -> list[dict]:
    """The JSON objects of a JSON-lines file, in order; [] when it cannot be read. A line that is not one (the
    torn last line of a file still being written, a process killed mid-line, a hand edit) is skipped."""
    rows = []
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    doc = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    rows.append(doc)
    except OSError:
        pass
    return rows


class EventLog:
    """Timestamped events, one JSON object per line: {"t": wall-clock seconds, "kind": ..., **fields}."""

    def __init__(self, path: str | os.PathLike, notice: FullFolderNotice | None = None) -> None:
        self.path = os.fspath(path)
        self._file = _open_append(self.path, notice)
        # enc_hook covers the common case (a stray object) without copying every event.
        self._encoder = msgspec.json.Encoder(enc_hook=str)
        self._lock = threading.Lock()
        # called with (kind, fields) after each event is written: the metrics count monitoring gaps from them
        self.observers: list[Callable[[str, dict[str, Any]], None]] = []

    def write(self, kind: str, **fields: Any) -> None:
        event = {"t": time.time(), "kind": kind, **fields}
        try:
            line = self._encoder.encode(event)
        except Exception:  # e.g. dict keys of an unsupported type: fall back to a sanitised copy
            line = self._encoder.encode(_plain(event))
        with self._lock:
            self._file.append(line + b"\n")
        for observe in self.observers:
            observe(kind, fields)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
