"""`evidence.jsonl`: every rank's per-step evidence as the coordinator received it.

One line per rank and digest: the step records (timing split) and the numeric records (loss, layer gradient
norms), in the order the wire carries them (msgspec's array form: see wire/messages.py StepRecord and
NumericRecord for the field order), plus the layer names whenever they change. It is what the report's
timelines and offline replays of the detectors (benchmarks/evidence_replay.py) read. Written only for jobs
up to `max_ranks` ranks: beyond that it would grow with the job, and the detectors keep what they need.

Its size on disk is bounded: a 4-rank demo job writes ~40 MB an hour, a 256-rank job would write gigabytes, and
a run folder must not fill the disk over a week. Once the log reaches half of `max_bytes` it becomes
`evidence.1.jsonl` (replacing the one before) and a new log starts: the latest half to whole of the budget is
kept, which is what a finding's timeline needs.
"""

from __future__ import annotations

import math
import os
from typing import BinaryIO

import msgspec

from trainscout.wire.messages import NumericRecord, StepRecord

_encoder = msgspec.json.Encoder()


MAX_BYTES = 1 << 30  # evidence.jsonl and evidence.1.jsonl together, at most


def older_log(path: str) -> str:
    """Where a log that reached its size goes: evidence.jsonl -> evidence.1.jsonl."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.1{ext}"


def log_files(path: str | os.PathLike) -> list[str]:
    """The files of an evidence log that exist, oldest first: its rotated predecessor, then the log."""
    path = os.fspath(path)
    return [p for p in (older_log(path), path) if os.path.exists(p)]


class EvidenceLog:
    def __init__(self, path: str | os.PathLike, max_ranks: int = 256, max_bytes: int = MAX_BYTES) -> None:
        self.path = os.fspath(path)
        self.max_ranks = max_ranks
        self.max_bytes = max_bytes
        self._file: BinaryIO | None = None
        self._layers: dict[int, list[str]] = {}
        self._size = 0
        self.lines = 0
        self.rotations = 0

    def write(
        self, rank: int, steps: list[StepRecord], numerics: list[NumericRecord], layers: list[str], ranks_known: int
    ) -> None:
        if ranks_known > self.max_ranks or not (steps or numerics):
            return
        line: dict = {"rank": rank}
        if steps:
            line["steps"] = steps
        if numerics:
            line["numerics"] = numerics
        try:
            if self._file is not None and self._size >= self.max_bytes // 2:
                self._rotate()
            if self._file is None:
                self._file = open(self.path, "ab")
                self._size = self._file.tell()  # a restarted coordinator appends to its predecessor's log
                self._layers.clear()  # each file names the layers its lines need
            if layers and self._layers.get(rank) != layers:
                self._layers[rank] = list(layers)
                line["layers"] = layers
            data = _encoder.encode(line) + b"\n"
            self._file.write(data)
            self._file.flush()
            self._size += len(data)
            self.lines += 1
        except OSError:
            self.max_ranks = -1  # a full or read-only disk: stop trying, detection goes on

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        os.replace(self.path, older_log(self.path))
        self.rotations += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _num(x) -> float:
    return math.nan if x is None else float(x)


class _Numeric(msgspec.Struct, array_like=True):
    """NumericRecord as written. JSON has no NaN: msgspec wrote a non-finite loss or norm as null."""

    step: int
    loss: float | None
    norms: list[float | None] = []  # absent in logs of older versions


class _Line(msgspec.Struct):
    """One line as `EvidenceLog.write` writes it."""

    rank: int
    steps: list[StepRecord] = []
    numerics: list[_Numeric] = []
    layers: list[str] | None = None


_line_decoder = msgspec.json.Decoder(_Line)


def read(path: str | os.PathLike) -> dict:
    """{rank: {"steps": [StepRecord], "numerics": [NumericRecord], "layers": [...]}} from an evidence log.
    A line of another shape (the torn last line of a log still being written, a hand edit) is skipped. The
    log's rotated predecessor (evidence.1.jsonl), if any, is read first."""
    path = os.fspath(path)
    names = log_files(path)
    if path not in names:
        names.append(path)  # (not there: open says so)
    out: dict[int, dict] = {}
    for name in names:
        with open(name, "rb") as fh:
            for raw in fh:
                if not raw.strip():
                    continue
                try:
                    line = _line_decoder.decode(raw)
                except msgspec.DecodeError:  # ValidationError included: types are checked before anything is kept
                    continue
                entry = out.setdefault(line.rank, {"steps": [], "numerics": [], "layers": []})
                entry["steps"].extend(line.steps)
                entry["numerics"].extend(
                    NumericRecord(step=row.step, loss=_num(row.loss), norms=[_num(x) for x in row.norms])
                    for row in line.numerics
                )
                if line.layers is not None:
                    entry["layers"] = line.layers
    return out
