"""The timelines of the visual report: evidence.jsonl reduced to a bounded number of points to draw.

evidence.jsonl grows with the job (one line per rank and digest, up to 256 ranks). The report reads at most
`max_bytes` of it: all of a small log, or evenly spaced windows across a large one, so rendering stays a
few seconds and bounded in memory for a run of any length. Each drawn line then keeps at most MAX_POINTS
points (per bucket of steps its lowest and highest value, so a spike survives, and its first non-finite
value, so a gap stays a gap). Beyond MAX_PEER_LINES non-culprit ranks, the peers are drawn as their median
and range per step instead of one line each. Pure numpy; the SVG is drawn by report_html.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field

import msgspec
import numpy as np

from trainscout.markers import GRAD_SYNC_LAYER, PARAM_COUNTS
from trainscout.wire.messages import StepRecord

MAX_POINTS = 360  # per drawn line, after downsampling
MAX_PEER_LINES = 24  # beyond this many non-culprit ranks, peers are drawn as their median and range
EVIDENCE_READ_BYTES = 32 << 20  # of evidence.jsonl read for the report (windows across a larger log)
EVIDENCE_WINDOWS = 64

CULPRIT_COLOURS = ("#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
PEER_COLOUR = "#9aa5b1"
MEDIAN_COLOUR = "#1f77b4"

# (key, title, unit); StepRecord rows are in msgspec's array form (field order of wire/messages.py)
METRICS = (
    ("wall", "Step time", "ms"),
    ("wait", "Wait in collectives", "ms"),
    ("loss", "Local loss (before the all-reduce)", ""),
    ("grad", "Local gradient norm (before the all-reduce)", ""),
)
_STEP, _WALL, _WAIT = (StepRecord.__struct_fields__.index(n) for n in ("step", "wall_s", "wait_s"))

Point = tuple[float, float]


@dataclass
class Evidence:
    """metric -> (rank, step, value) arrays, one value per rank and step (the last one received)."""

    metrics: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    ranks: int = 0
    log_bytes: int = 0
    read_bytes: int = 0  # less than log_bytes: windows of a large log were read

    @property
    def sampled(self) -> bool:
        return self.read_bytes < self.log_bytes


def _chunks(path: str, max_bytes: int, windows: int) -> tuple[list[bytes], int, int]:
    """The whole file, or `windows` evenly spaced slices of it with their torn first and last lines dropped."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size <= max_bytes:
            return [fh.read()], size, size
        width = max_bytes // windows
        out, read = [], 0
        for i in range(windows):
            fh.seek(i * (size - width) // max(1, windows - 1))
            data = fh.read(width)
            read += len(data)
            start = 0 if fh.tell() - len(data) == 0 else data.find(b"\n") + 1
            end = data.rfind(b"\n") + 1
            if 0 < start < end:
                out.append(data[start:end])
            elif start == 0 and end > 0:
                out.append(data[:end])
        return out, size, read


def _decode(lines: list[bytes]) -> list[dict]:
    docs = []
    for raw in lines:
        try:
            doc = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            continue  # the torn last line of a log still being written
        rank = doc.get("rank") if isinstance(doc, dict) else None
        # a rank beyond any job's (or a bool) is not a line the coordinator wrote; the (rank, step) keys below
        # are int64 and a huge rank would wrap them
        if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < 1 << 22:
            docs.append(doc)
    return docs


def _norm_mask(layers: list) -> np.ndarray:
    """Which entries of a numerics record are layer norms: not a gradient bucket as it entered its reduction
    (those hold the same gradients again) nor a count of odd parameters."""
    skip = (GRAD_SYNC_LAYER, *PARAM_COUNTS)
    return np.array([not (isinstance(n, str) and n.startswith(skip)) for n in layers], dtype=bool)


def _grad_norms(normed: list[tuple[int, list]], masks: dict[int, np.ndarray]) -> np.ndarray:
    """Each record's total gradient norm over its layer norms (every entry where its rank's layer list is not
    known, or does not fit it)."""
    with np.errstate(over="ignore"):  # norms near the float limit: the total norm is infinite, and drawn so
        try:  # the usual batch: one layer list, every rank's the same
            norms = np.array([r[2] for _, r in normed], dtype=np.float64).reshape(len(normed), -1)
            shared = {masks[rank].tobytes() if rank in masks else None for rank in {rank for rank, _ in normed}}
            if shared == {None}:  # no layer list known: every entry
                return np.sqrt(np.square(norms).sum(axis=1))
            mask = masks[normed[0][0]] if len(shared) == 1 else None
            if mask is not None and len(mask) == norms.shape[1]:
                return np.sqrt(np.square(norms[:, mask]).sum(axis=1))
        except ValueError:  # the layer list changed within the batch: rows of different lengths
            pass
    rows = [np.array([math.nan if x is None else x for x in r[2]], dtype=np.float64) for _, r in normed]
    out = np.empty(len(rows))
    with np.errstate(over="ignore"):
        for i, ((rank, _), row) in enumerate(zip(normed, rows)):
            mask = masks.get(rank)
            kept = row[mask] if mask is not None and len(mask) == len(row) else row
            out[i] = math.sqrt(float(np.square(kept).sum()))
    return out


def _arrays(
    docs: list[dict], masks: dict[int, np.ndarray] | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A batch of log lines as metric -> (rank, step, value) arrays (null in the JSON: NaN here). masks: each
    rank's layer-norm entries, as its lines name them (kept across batches, in the order read)."""
    masks = {} if masks is None else masks
    for d in docs:
        if isinstance(d.get("layers"), list):
            masks[d["rank"]] = _norm_mask(d["layers"])
    timing = np.array(
        [(d["rank"], r[_STEP], r[_WALL], r[_WAIT]) for d in docs for r in d.get("steps") or ()], dtype=np.float64
    ).reshape(-1, 4)
    numeric = [(d["rank"], r) for d in docs for r in d.get("numerics") or ()]
    loss = np.array([(rank, r[0], r[1]) for rank, r in numeric], dtype=np.float64).reshape(-1, 3)
    normed = [(rank, r) for rank, r in numeric if len(r) > 2 and r[2]]
    grad_at = np.array([(rank, r[0]) for rank, r in normed], dtype=np.float64).reshape(-1, 2)
    grad = _grad_norms(normed, masks)
    return {
        "wall": (timing[:, 0], timing[:, 1], timing[:, 2] * 1e3),
        "wait": (timing[:, 0], timing[:, 1], timing[:, 3] * 1e3),
        "loss": (loss[:, 0], loss[:, 1], loss[:, 2]),
        "grad": (grad_at[:, 0], grad_at[:, 1], grad.reshape(-1)),
    }


# what a line of another shape raises in _arrays (OverflowError: an integer beyond float range)
_MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError)


def read_evidence(path: str | os.PathLike | list, max_bytes: int = EVIDENCE_READ_BYTES, batch: int = 4096) -> Evidence:
    """The four per-rank series of an evidence log (see evidence_log.py for its lines), or of several, oldest
    first (a rotated log and its successor), read in batches of lines so memory stays bounded by the arrays,
    not by decoded JSON. `max_bytes` is shared among the files by their sizes."""
    paths = [os.fspath(p) for p in (path if isinstance(path, list) else [path])]
    sizes = [os.path.getsize(p) for p in paths]
    chunks, size, read = [], 0, 0
    for p, n in zip(paths, sizes):
        budget = max(64 << 10, max_bytes * n // max(1, sum(sizes)))
        file_chunks, file_size, file_read = _chunks(p, budget, EVIDENCE_WINDOWS)
        chunks += file_chunks
        size += file_size
        read += file_read
    parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {key: [] for key, _, _ in METRICS}
    ranks: set[int] = set()
    masks: dict[int, np.ndarray] = {}  # rank -> its layer-norm entries, from the last layer list read
    for chunk in chunks:
        lines = chunk.splitlines()
        for i in range(0, len(lines), batch):
            docs = _decode(lines[i : i + batch])
            try:
                arrays = _arrays(docs, masks)
            except _MALFORMED:  # a malformed line: decode them one by one
                arrays = {}
                for d in docs:
                    try:
                        for key, cols in _arrays([d], masks).items():
                            parts[key].append(cols)
                    except _MALFORMED:
                        continue
            for key, cols in arrays.items():
                parts[key].append(cols)
            ranks.update(d["rank"] for d in docs)
    out = Evidence(ranks=len(ranks), log_bytes=size, read_bytes=read)
    for key, arrays_of_key in parts.items():
        if not arrays_of_key:
            continue
        rank_f, step_a, value_a = (np.concatenate(col) for col in zip(*arrays_of_key))
        if len(rank_f) == 0:
            continue
        rank_a = rank_f.astype(np.int64)
        # one value per (rank, step): the last received; the unique keys come out sorted by rank, then step
        keys = rank_a * (1 << 40) + step_a.astype(np.int64)
        _, last = np.unique(keys[::-1], return_index=True)
        idx = len(keys) - 1 - last
        out.metrics[key] = (rank_a[idx], step_a[idx], value_a[idx])
    return out


def downsample(xs: np.ndarray, ys: np.ndarray, limit: int = MAX_POINTS) -> list[Point]:
    """At most `limit` points in step order: per bucket its lowest and highest value and its first
    non-finite one."""
    n = len(xs)
    if n <= limit:
        return list(zip(xs.tolist(), ys.tolist()))
    buckets = max(1, limit // 3)
    bounds = np.linspace(0, n, buckets + 1).astype(int)
    finite = np.isfinite(ys)
    keep: list[int] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            continue
        chosen: set[int] = set()
        ok = np.flatnonzero(finite[lo:hi])
        if len(ok):
            seg = ys[lo:hi][ok]
            chosen.update((lo + int(ok[np.argmin(seg)]), lo + int(ok[np.argmax(seg)])))
        bad = np.flatnonzero(~finite[lo:hi])
        if len(bad):
            chosen.add(lo + int(bad[0]))
        keep.extend(sorted(chosen))
    return [(float(xs[i]), float(ys[i])) for i in keep]


@dataclass
class Line:
    label: str
    points: list[Point]
    role: str  # culprit | peer | median
    colour: str
    rank: int | None = None


@dataclass
class Chart:
    key: str
    title: str
    unit: str
    lines: list[Line]
    band: list[tuple[float, float, float]] = field(default_factory=list)  # (step, low, high) of the peers
    markers: list[tuple[float, str]] = field(default_factory=list)  # (step, label): each finding's onset
    nonfinite: int = 0  # values that could not be drawn (NaN/Inf)


def _peer_median_and_band(rank_a, step_a, value_a) -> tuple[list[Point], list[tuple[float, float, float]]]:
    """Median and range of the peers per step (a matrix peers x steps: bounded by the values read)."""
    peers, r_idx = np.unique(rank_a, return_inverse=True)
    steps, s_idx = np.unique(step_a, return_inverse=True)
    grid = np.full((len(peers), len(steps)), np.nan)
    grid[r_idx, s_idx] = np.where(np.isfinite(value_a), value_a, np.nan)
    with warnings.catch_warnings():  # a step whose every value is NaN has no median: it stays NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        median = np.nanmedian(grid, axis=0)
        low, high = np.nanmin(grid, axis=0), np.nanmax(grid, axis=0)
    stride = max(1, math.ceil(len(steps) / MAX_POINTS))
    band = [
        (float(x), float(lo), float(hi))
        for x, lo, hi in zip(steps[::stride], low[::stride], high[::stride])
        if math.isfinite(lo)
    ]
    return downsample(steps, median), band


def build_timelines(evidence: Evidence, culprits: list[int], onsets: dict[int, list[str]]) -> list[Chart]:
    """One chart per metric present: culprits in colour, peers in grey (or their median and range on large
    jobs), a marker at each finding's step (onsets: step -> labels)."""
    colour = {r: CULPRIT_COLOURS[i % len(CULPRIT_COLOURS)] for i, r in enumerate(sorted(set(culprits)))}
    charts = []
    for key, title, unit in METRICS:
        if key not in evidence.metrics:
            continue
        rank_a, step_a, value_a = evidence.metrics[key]
        if not np.isfinite(value_a).any():
            continue
        chart = Chart(key=key, title=title, unit=unit, lines=[])
        chart.nonfinite = int(np.count_nonzero(~np.isfinite(value_a)))
        is_culprit = np.isin(rank_a, list(colour))
        peer_ranks = np.unique(rank_a[~is_culprit])
        if len(peer_ranks) > MAX_PEER_LINES:
            median, chart.band = _peer_median_and_band(rank_a[~is_culprit], step_a[~is_culprit], value_a[~is_culprit])
            chart.lines.append(Line(f"median of {len(peer_ranks)} peers", median, "median", MEDIAN_COLOUR))
        else:
            for r in peer_ranks.tolist():
                sel = rank_a == r
                chart.lines.append(Line(f"rank {r}", downsample(step_a[sel], value_a[sel]), "peer", PEER_COLOUR, r))
        for r in sorted(colour):  # drawn last: on top of the peers
            sel = rank_a == r
            if sel.any():
                points = downsample(step_a[sel], value_a[sel])
                chart.lines.append(Line(f"rank {r} (culprit)", points, "culprit", colour[r], r))
        chart.markers = [(float(s), ", ".join(labels)) for s, labels in sorted(onsets.items())]
        charts.append(chart)
    return charts
