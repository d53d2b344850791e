"""Device health: the GPU that deviates from the GPUs of its replica class, and error events needing no peers.

The node agents sample every GPU through NVML about once a second (agent/device_health.py); the
coordinator turns each reading into a GpuSample and feeds this detector. GPUs of one replica class do
the same work, so they should run at the same clocks, temperatures and power: a GPU that does not is
named by a strict majority of its peers, as consensus/ names a slow rank.

Relative rules (each GPU's last `window` samples, all of them beyond the median of its peers' medians,
leave-one-out, by relative AND absolute thresholds AND a robust z; then k of the last m judgements):
- sm_clock_low: SM clock well below its peers' while it is busy and about as busy as they are;
- throttle: a slowdown reason (hw_slowdown, hw_thermal, sw_thermal, hw_power_brake) that a strict
  majority of its peers does not have;
- temperature_high: far hotter than its peers at comparable utilisation;
- power_deviation: power far from its peers' at comparable utilisation, either side;
- power_limit_low: an enforced power limit below its peers' (a capped or misconfigured board).
A class needs a strict majority of normal members to attribute: with 2 GPUs (or a tie) the deviation
is reported as inconclusive, never blamed on one GPU.
Absolute rules (per GPU, attributed with any class size): uncorrected ECC errors increasing, new XIDs,
retired pages / remapped rows pending or a remap failure, PCIe replays or NVLink errors increasing
faster than a link at rest produces them, a GPU NVML reports lost.
Thresholds and why: docs/device-health.md. Pure logic: no torch, no I/O, no wire types.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from trainscout.consensus.robust import MAD_FLOOR_ABS, MAD_FLOOR_FRACTION, MAD_TO_SIGMA, median_mad
from trainscout.consensus.leave_one_out import middle

# Observation kinds (the coordinator files them as "health" findings with this as their type).
SM_CLOCK_LOW = "sm_clock_low"
THROTTLE = "throttle"
TEMPERATURE_HIGH = "temperature_high"
POWER_DEVIATION = "power_deviation"
POWER_LIMIT_LOW = "power_limit_low"
ECC_UNCORRECTED = "ecc_uncorrected"
XID = "xid"
ROWS_PENDING = "rows_pending"
PCIE_REPLAY = "pcie_replay"
NVLINK_ERRORS = "nvlink_errors"
GPU_LOST = "gpu_lost"

# What the XIDs most often seen on data-centre GPUs mean, and whether they usually point at the device
# or at the program running on it (an illegal address in a kernel is not a faulty GPU).
XID_MEANINGS: dict[int, tuple[str, str]] = {
    13: ("graphics engine exception", "application"),
    31: ("GPU memory page fault", "application"),
    43: ("GPU stopped processing", "application"),
    45: ("preemptive cleanup after an earlier error or a killed process", "application"),
    48: ("double-bit ECC error", "device"),
    61: ("internal micro-controller breakpoint", "device"),
    62: ("internal micro-controller halt", "device"),
    63: ("ECC page retirement or row remapping recorded", "device"),
    64: ("ECC page retirement or row remapping failed", "device"),
    74: ("NVLink error", "device"),
    79: ("GPU has fallen off the bus", "device"),
    92: ("high single-bit ECC error rate", "device"),
    94: ("contained ECC error", "device"),
    95: ("uncontained ECC error", "device"),
    109: ("context switch timeout", "unknown"),
    119: ("GSP RPC timeout", "device"),
    120: ("GSP error", "device"),
    121: ("C2C link error", "device"),
    140: ("unrecovered ECC error", "device"),
}


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment, as this detector needs it; -1 (or empty) where a value is unavailable.

    Field names match the agent's reading, so `GpuSample.from_reading(key, reading)` copies one over.
    """

    gpu: str  # the caller's name for the GPU, unique in the job (e.g. "host-3:gpu5", or its UUID)
    time_s: float = 0.0  # the sampling agent's clock; only compared with the same GPU's earlier samples
    name: str = ""
    sm_clock_mhz: float = -1
    mem_clock_mhz: float = -1
    max_sm_clock_mhz: float = -1
    throttle_mask: int = -1
    throttle_reasons: tuple[str, ...] = ()
    temperature_c: float = -1
    power_w: float = -1
    power_limit_w: float = -1
    gpu_util_pct: float = -1
    mem_util_pct: float = -1
    ecc_corrected: int = -1
    ecc_uncorrected: int = -1
    retired_pages_pending: int = -1
    remapped_rows_pending: int = -1
    remap_failure: int = -1
    pcie_replay: int = -1
    nvlink_crc_flit: int = -1
    nvlink_crc_data: int = -1
    nvlink_replay: int = -1
    nvlink_recovery: int = -1
    xids: tuple[tuple[int, float], ...] = ()  # (xid, time seen) since the GPU's previous sample
    errors: tuple[str, ...] = ()

    @classmethod
    def from_reading(cls, gpu: str, reading: Any) -> GpuSample:
        """A sample from any object or mapping with the same field names (the wire struct included)."""
        get = reading.get if isinstance(reading, Mapping) else (lambda name: getattr(reading, name, None))
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = get(f.name) if f.name != "gpu" else None
            if value is None:
                continue
            if isinstance(value, list):
                value = tuple(tuple(x) if isinstance(x, list) else x for x in value)
            values[f.name] = value
        return cls(gpu=gpu, **values)


@dataclass(frozen=True)
class DeviceObservation:
    """A finding-to-be: `attributable` False means the class disagrees but no GPU can be blamed."""

    gpu: str
    kind: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    attributable: bool = True


@dataclass(frozen=True)
class DeviceHealthConfig:
    window: int = 5  # samples per GPU judged together: every one of them must lie beyond the threshold
    k: int = 3  # a GPU is named when flagged in k of its last m judgements
    m: int = 5
    stale_s: float = 10.0  # a GPU without a sample for this long takes no part in votes
    min_util_pct: float = 50.0  # clocks and power are compared between busy GPUs only (idle clocks drop)
    util_gap_pct: float = 15.0  # "comparable utilisation": within this of the peers' median
    z: float = 5.0  # robust z against the peers' spread (with >= 2 peers)
    clock_rel: float = 0.15  # 15 % and 200 MHz below the peers' median SM clock
    clock_abs_mhz: float = 200.0
    temp_rel: float = 0.25  # 25 % and 15 C above the peers' median temperature
    temp_abs_c: float = 15.0
    power_rel: float = 0.30  # 30 % and 75 W away from the peers' median power, either side
    power_abs_w: float = 75.0
    power_limit_rel: float = 0.05  # enforced limit 5 % and 10 W below the peers'
    power_limit_abs_w: float = 10.0
    throttle_share: float = 0.5  # a reason counts when present in at least this share of the window
    throttle_reasons: tuple[str, ...] = ("hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake")
    pcie_replays: int = 8  # PCIe replays within rate_window_s
    nvlink_errors: int = 100  # NVLink CRC (flit + data) and replay errors within rate_window_s
    rate_window_s: float = 60.0
    repeat_s: float = 300.0  # an absolute event of one GPU is reported again at most this often
    ignored_xids: tuple[int, ...] = (45,)  # follows any killed CUDA process: not a device fault
    exact_below: int = 32  # leave-one-out statistics below this class size; class statistics above

    def __post_init__(self) -> None:
        if not (1 <= self.k <= self.m and self.window >= 1):
            raise ValueError(f"need window >= 1 and 1 <= k <= m, got {self.window}, {self.k}, {self.m}")

    @property
    def samples_to_name(self) -> int:
        """Samples of a sustained deviation of a value (clock, temperature, power) before it is named: a
        whole window of them, then k judgements."""
        return self.window + self.k - 1

    @property
    def samples_to_name_throttle(self) -> int:
        """Samples of a throttle reason present in every sample before it is named: enough of the window
        to reach throttle_share, then k judgements."""
        return math.ceil(self.throttle_share * self.window) + self.k - 1


@dataclass
class _Counter:
    """Increase of one counter since an anchor; the anchor moves after a report or every `window_s`."""

    threshold: int
    window_s: float
    anchor_t: float = 0.0
    anchor_v: int = -1

    def increase(self, t: float, v: int) -> tuple[int, float] | None:
        """(increase, seconds) once the counter rose by at least `threshold` within the window."""
        if v < 0:
            return None
        if self.anchor_v < 0 or v < self.anchor_v:  # first reading, or reset (driver reload)
            self.anchor_t, self.anchor_v = t, v
            return None
        delta, span = v - self.anchor_v, t - self.anchor_t
        if delta >= self.threshold:
            return delta, span
        if span > self.window_s:
            self.anchor_t, self.anchor_v = t, v
        return None

    def rearm(self, t: float, v: int) -> None:
        self.anchor_t, self.anchor_v = t, v


_VALUES = ("sm_clock_mhz", "power_w", "temperature_c", "power_limit_w")


@dataclass
class _Stats:
    """What the relative rules read of one GPU's window, computed once per new sample."""

    util: float | None
    values: dict[str, tuple[float, float, float] | None]  # field -> (median, min, max)
    throttle_known: bool
    throttle_share: dict[str, float]  # reasons present in the window -> share of its samples
    latest_reasons: tuple[str, ...]

    @classmethod
    def of(cls, window: list[GpuSample]) -> _Stats:
        share: dict[str, float] = {}
        for s in window:
            for reason in s.throttle_reasons:
                share[reason] = share.get(reason, 0.0) + 1.0 / len(window)
        return cls(
            util=_median_valid([s.gpu_util_pct for s in window]),
            values={a: _window_stats([getattr(s, a) for s in window]) for a in _VALUES},
            throttle_known=any(s.throttle_mask >= 0 for s in window),
            throttle_share=share,
            latest_reasons=window[-1].throttle_reasons,
        )


@dataclass
class _GpuState:
    window: deque
    stats: _Stats | None = None  # of the current window, once asked for
    received: float = 0.0
    fresh: int = 0  # samples added since the GPU was last judged
    counters: dict[str, _Counter] = field(default_factory=dict)
    last_report: dict[tuple, float] = field(default_factory=dict)  # absolute event key -> sample time
    pending_rows: bool = False
    lost: bool = False


class DeviceHealthDetector:
    """Feed samples with `add`, then call `update` with the replica classes; observations come out once
    per episode (a relative deviation is named again only after it cleared)."""

    def __init__(self, config: DeviceHealthConfig | None = None) -> None:
        self.config = config or DeviceHealthConfig()
        self._gpus: dict[str, _GpuState] = {}
        self._flags: dict[tuple[str, str], deque] = {}  # (gpu, rule) -> recent judgements
        self._active: dict[tuple[str, str], bool] = {}  # named episodes -> attributed?
        self._pending: list[DeviceObservation] = []

    # -- input ----------------------------------------------------------------------------------------

    def add(self, sample: GpuSample, now: float) -> None:
        """One sample of one GPU; `now` is the caller's (coordinator) clock when it arrived."""
        cfg = self.config
        state = self._gpus.get(sample.gpu)
        if state is None:
            state = self._gpus[sample.gpu] = _GpuState(window=deque(maxlen=cfg.window))
            rw = cfg.rate_window_s
            state.counters = {
                ECC_UNCORRECTED: _Counter(1, float("inf")),
                PCIE_REPLAY: _Counter(cfg.pcie_replays, rw),
                "nvlink_recovery": _Counter(1, float("inf")),
                "nvlink_crc_replay": _Counter(cfg.nvlink_errors, rw),
            }
        elif state.window and sample.time_s and sample.time_s <= state.window[-1].time_s:
            return  # a reading already seen (resent digest) or out of order
        state.window.append(sample)
        state.stats = None
        state.received = now
        state.fresh += 1
        self._pending.extend(self._absolute(sample, state))

    def forget(self, gpu: str) -> None:
        """Drop a GPU (its node left the job)."""
        self._gpus.pop(gpu, None)
        for key in [k for k in self._flags if k[0] == gpu]:
            self._flags.pop(key, None)
            self._active.pop(key, None)

    # -- output ---------------------------------------------------------------------------------------

    def update(self, classes: Iterable[Sequence[str]], now: float) -> list[DeviceObservation]:
        """Judge every class with a new sample since the last call; return new observations.

        `classes`: the GPUs that must behave alike (those of one replica class), each GPU in one class at
        most. GPUs in no class get the absolute rules only.
        """
        out, self._pending = self._pending, []
        seen: set[str] = set()
        for members in classes:
            members = list(members)
            if seen.intersection(members):
                raise ValueError("a GPU may belong to one class only")
            seen.update(members)
            out.extend(self._judge_class(members, now))
        for state in self._gpus.values():
            state.fresh = 0
        return out

    def summary(self, gpu: str) -> str | None:
        """The GPU's recent readings in one line, for attaching to another finding about it."""
        state = self._gpus.get(gpu)
        return summarize(list(state.window)) if state and state.window else None

    def latest(self, gpu: str) -> GpuSample | None:
        state = self._gpus.get(gpu)
        return state.window[-1] if state and state.window else None

    # -- relative rules -------------------------------------------------------------------------------

    def _judge_class(self, members: list[str], now: float) -> list[DeviceObservation]:
        cfg = self.config
        live: dict[str, _Stats] = {}
        fresh = set()
        for g in members:
            state = self._gpus.get(g)
            if state and len(state.window) == cfg.window and now - state.received <= cfg.stale_s and not state.lost:
                if state.stats is None:
                    state.stats = _Stats.of(list(state.window))
                live[g] = state.stats
                if state.fresh:
                    fresh.add(g)
        if len(live) < 2 or not fresh:
            return []
        util = {g: st.util for g, st in live.items()}
        out: list[DeviceObservation] = []

        def valid(attr: str, among: Iterable[str]) -> dict[str, tuple[float, float, float]]:
            return {g: v for g in among if (v := live[g].values[attr]) is not None}

        busy = [g for g, u in util.items() if u is not None and u >= cfg.min_util_pct]
        clocks = valid("sm_clock_mhz", busy)
        found = _deviants(clocks, "below", cfg.clock_rel, cfg.clock_abs_mhz, cfg.z, cfg.exact_below)
        found = self._comparable(found, util, clocks)
        out += self._conclude(SM_CLOCK_LOW, SM_CLOCK_LOW, clocks, found, fresh)

        power = valid("power_w", busy)
        found = _deviants(power, "both", cfg.power_rel, cfg.power_abs_w, cfg.z, cfg.exact_below)
        found = self._comparable(found, util, power)
        out += self._conclude(POWER_DEVIATION, POWER_DEVIATION, power, found, fresh)

        temps = valid("temperature_c", [g for g, u in util.items() if u is not None])
        found = _deviants(temps, "above", cfg.temp_rel, cfg.temp_abs_c, cfg.z, cfg.exact_below)
        found = self._comparable(found, util, temps)
        out += self._conclude(TEMPERATURE_HIGH, TEMPERATURE_HIGH, temps, found, fresh)

        limits = valid("power_limit_w", live)
        found = _deviants(limits, "below", cfg.power_limit_rel, cfg.power_limit_abs_w, cfg.z, cfg.exact_below)
        out += self._conclude(POWER_LIMIT_LOW, POWER_LIMIT_LOW, limits, found, fresh)

        known = [g for g, st in live.items() if st.throttle_known]
        for reason in cfg.throttle_reasons:
            share = {g: live[g].throttle_share.get(reason, 0.0) for g in known}
            # in enough of the window AND in the latest sample: a flag never outlives the episode
            found = {
                g: {"value": v, "reason": reason}
                for g, v in share.items()
                if v >= cfg.throttle_share and reason in live[g].latest_reasons
            }
            if found and len(found) == len(share):
                continue  # every GPU has it: a condition of the whole class, not a deviation of one GPU
            out += self._conclude(f"{THROTTLE}:{reason}", THROTTLE, share, found, fresh)
        return out

    def _comparable(
        self, found: dict[str, dict], util: dict[str, float | None], values: Mapping[str, object]
    ) -> dict[str, dict]:
        """Keep the deviants about as busy as their peers: a GPU that works more (or less) than the others
        is hotter, draws more power or clocks differently for a reason that is not a fault."""
        kept = {}
        for g, ev in found.items():
            peers = [u for p in values if p != g and (u := util.get(p)) is not None]
            own = util.get(g)
            if own is None or not peers:
                continue
            peer_util = statistics.median(peers)
            if abs(own - peer_util) <= self.config.util_gap_pct:
                kept[g] = {**ev, "util_pct": own, "peers_util_pct": peer_util}
        return kept

    def _conclude(
        self, rule: str, kind: str, values: Mapping[str, object], found: dict[str, dict], fresh: set[str]
    ) -> list[DeviceObservation]:
        """Record this judgement for the GPUs that took part with a new sample; name the persistent ones."""
        cfg = self.config
        n = len(values)
        attributed = 2 * len(found) < n  # the normal members are a strict majority
        confirmed = []
        for g in values:
            key = (g, rule)
            if g in fresh:
                flags = self._flags.get(key)
                if g in found:
                    if flags is None:
                        flags = self._flags[key] = deque(maxlen=cfg.m)
                    flags.append(True)
                elif flags is not None:
                    flags.append(False)
                    if not any(flags):  # episode over: a later one is named again
                        del self._flags[key]
                        self._active.pop(key, None)
            flags = self._flags.get(key)
            if g in found and flags is not None and sum(flags) >= cfg.k:
                was = self._active.get(key)
                if was is None or (attributed and not was):
                    confirmed.append(g)
        if not confirmed:
            return []
        for g in confirmed:
            self._active[(g, rule)] = attributed
        common = {
            "rule": rule,
            "n": n,
            "members": sorted(values),
            "status": "attributed" if attributed else "inconclusive",
            "window": cfg.window,
            "k": cfg.k,
            "m": cfg.m,
        }
        window = {g: list(self._gpus[g].window) for g in confirmed}
        if attributed:
            return [
                DeviceObservation(
                    g,
                    kind,
                    _relative_summary(kind, g, found[g], n, window[g]),
                    {**common, **found[g], "summary": summarize(window[g])},
                    True,
                )
                for g in sorted(confirmed)
            ]
        suspects = sorted(found)
        first = min(confirmed)
        others = [g for g in suspects if g != first]
        text = (
            f"no majority among {n} GPUs: "
            + _relative_summary(kind, first, found[first], n, window[first])
            + (f" (also flagged: {', '.join(others)})" if others else "")
        )
        return [
            DeviceObservation(
                first,
                kind,
                text,
                {
                    **common,
                    "suspects": suspects,
                    "deviations": {g: found[g] for g in suspects},
                    "summary": summarize(window[first]),
                },
                False,
            )
        ]

    # -- absolute rules -------------------------------------------------------------------------------

    def _absolute(self, s: GpuSample, state: _GpuState) -> list[DeviceObservation]:
        cfg, g, t, out = self.config, s.gpu, s.time_s, []

        def report(kind: str, text: str, evidence: dict, detail: object = None) -> bool:
            key = (kind, detail)
            last = state.last_report.get(key)
            if last is not None and t - last < cfg.repeat_s:
                return False
            state.last_report[key] = t
            out.append(DeviceObservation(g, kind, f"gpu {g}: {text}", {**evidence, "summary": summarize(s)}, True))
            return True

        lost = "gpu_lost" in s.errors
        if lost and not state.lost:
            report(GPU_LOST, "NVML reports the GPU lost (fallen off the bus, or needs a reset)", {})
        state.lost = lost

        seen = state.counters[ECC_UNCORRECTED].increase(t, s.ecc_uncorrected)
        if seen and report(
            ECC_UNCORRECTED,
            f"{seen[0]} new uncorrected ECC error(s), {s.ecc_uncorrected} since the driver loaded",
            {"increase": seen[0], "total": s.ecc_uncorrected},
        ):
            state.counters[ECC_UNCORRECTED].rearm(t, s.ecc_uncorrected)

        for xid, when in s.xids:
            if xid in cfg.ignored_xids:
                continue
            meaning, cause = XID_MEANINGS.get(xid, ("see NVIDIA's XID catalog", "unknown"))
            note = "; usually a program error, not a faulty GPU" if cause == "application" else ""
            report(
                XID,
                f"XID {xid} ({meaning}){note}",
                {"xid": xid, "meaning": meaning, "cause": cause, "seen_at": when},
                detail=xid,
            )

        pending = [
            what
            for what, flag in (
                ("row remapping pending", s.remapped_rows_pending),
                ("page retirement pending", s.retired_pages_pending),
                ("row remap failure", s.remap_failure),
            )
            if flag == 1
        ]
        if pending and not state.pending_rows:
            report(
                ROWS_PENDING,
                ", ".join(pending) + " (memory errors recorded; the GPU needs a reset)",
                {"pending": pending},
            )
        if pending or s.remapped_rows_pending == 0 or s.retired_pages_pending == 0:
            state.pending_rows = bool(pending)

        seen = state.counters[PCIE_REPLAY].increase(t, s.pcie_replay)
        if seen and report(
            PCIE_REPLAY,
            f"{seen[0]} PCIe replays in {seen[1]:.0f} s (total {s.pcie_replay})",
            {"increase": seen[0], "seconds": seen[1], "total": s.pcie_replay},
        ):
            state.counters[PCIE_REPLAY].rearm(t, s.pcie_replay)

        seen = state.counters["nvlink_recovery"].increase(t, s.nvlink_recovery)
        if seen and report(
            NVLINK_ERRORS,
            f"{seen[0]} NVLink recovery error(s) (link retrained; total {s.nvlink_recovery})",
            {"counter": "recovery", "increase": seen[0], "total": s.nvlink_recovery},
            detail="recovery",
        ):
            state.counters["nvlink_recovery"].rearm(t, s.nvlink_recovery)
        crc = _sum_all(s.nvlink_crc_flit, s.nvlink_crc_data, s.nvlink_replay)
        seen = state.counters["nvlink_crc_replay"].increase(t, crc)
        if seen and report(
            NVLINK_ERRORS,
            f"{seen[0]} NVLink CRC / replay errors in {seen[1]:.0f} s",
            {
                "counter": "crc_replay",
                "increase": seen[0],
                "seconds": seen[1],
                "crc_flit": s.nvlink_crc_flit,
                "crc_data": s.nvlink_crc_data,
                "replay": s.nvlink_replay,
            },
            detail="crc_replay",
        ):
            state.counters["nvlink_crc_replay"].rearm(t, crc)
        return out


def summarize(readings: GpuSample | Sequence[GpuSample]) -> str:
    """ "sm clock 1410 of 1980 MHz, throttled: hw_slowdown; 83 C; 412 of 700 W; util 100 %" for one GPU.

    With several readings (the GPU's recent window) the numbers are medians and each throttle reason
    shows how many readings had it; counters and XIDs come from the latest.
    """
    rs = [readings] if isinstance(readings, GpuSample) else list(readings)
    if not rs:
        return "no device readings"
    last, n = rs[-1], len(rs)
    parts = []
    clock = _median_valid([r.sm_clock_mhz for r in rs])
    if clock is not None:
        text = f"sm clock {clock:.0f}" + (f" of {last.max_sm_clock_mhz:.0f}" if last.max_sm_clock_mhz > 0 else "")
        text += " MHz"
        counts: dict[str, int] = {}
        for r in rs:
            for reason in r.throttle_reasons:
                counts[reason] = counts.get(reason, 0) + 1
        if counts:
            shown = sorted(counts, key=lambda k: (-counts[k], k))
            text += ", throttled: " + ", ".join(k if counts[k] == n else f"{k} ({counts[k]}/{n})" for k in shown)
        parts.append(text)
    temp = _median_valid([r.temperature_c for r in rs])
    if temp is not None:
        parts.append(f"{temp:.0f} C")
    power = _median_valid([r.power_w for r in rs])
    if power is not None:
        parts.append(f"{power:.0f}" + (f" of {last.power_limit_w:.0f}" if last.power_limit_w > 0 else "") + " W")
    util = _median_valid([r.gpu_util_pct for r in rs])
    if util is not None:
        parts.append(f"util {util:.0f} %")
    if last.ecc_uncorrected > 0:
        parts.append(f"ecc uncorrected {last.ecc_uncorrected}")
    pending = [
        what
        for what, flag in (
            ("row remap pending", last.remapped_rows_pending),
            ("page retirement pending", last.retired_pages_pending),
            ("row remap failure", last.remap_failure),
        )
        if flag == 1
    ]
    parts += pending
    if last.pcie_replay > 0:
        parts.append(f"pcie replays {last.pcie_replay}")
    nvlink = _sum_valid(last.nvlink_crc_flit, last.nvlink_crc_data, last.nvlink_replay, last.nvlink_recovery)
    if nvlink > 0:
        parts.append(f"nvlink errors {nvlink}")
    xids = [x for r in rs for x, _ in r.xids]
    if xids:
        parts.append("xid " + ", ".join(str(x) for x in dict.fromkeys(xids)))
    if "gpu_lost" in last.errors:
        parts.append("gpu lost")
    return "; ".join(parts) if parts else "no device readings"


def _relative_summary(kind: str, g: str, ev: dict, n: int, window: list[GpuSample]) -> str:
    v: Any = ev.get("value")  # numbers, for the kinds this is called with
    med: Any = ev.get("peers_median")
    if kind == SM_CLOCK_LOW:
        text = (
            f"SM clock {v:.0f} MHz, {100 * (1 - v / med):.0f} % below its peers' {med:.0f} MHz "
            f"at {ev['util_pct']:.0f} % utilisation"
        )
    elif kind == TEMPERATURE_HIGH:
        text = f"{v:.0f} C, {v - med:.0f} C above its peers' {med:.0f} C at comparable utilisation"
    elif kind == POWER_DEVIATION:
        text = f"draws {v:.0f} W, {100 * (v / med - 1):+.0f} % against its peers' {med:.0f} W at comparable utilisation"
    elif kind == POWER_LIMIT_LOW:
        text = f"power limit {v:.0f} W, below its peers' {med:.0f} W"
    else:
        text = (
            f"{ev['reason']} in {round(v * len(window))} of its last {len(window)} samples, which a majority "
            f"of its {n - 1} peers do not have"
        )
    return f"gpu {g}: {text} ({summarize(window)})"


def _deviants(
    stats: Mapping[str, tuple[float, float, float]], side: str, rel: float, abs_: float, z: float, exact_below: int
) -> dict[str, dict]:
    """Members lying beyond their peers' median on `side` ("below", "above", "both").

    `stats`: member -> (median, min, max) of its window. A member is below when even its highest sample
    is below its peers' median (of their window medians) by more than rel * that median AND abs_ AND
    (with >= 2 peers) z robust deviations of the peers' medians; above likewise with its lowest sample.
    One odd sample (a power-cap dip, a phase of the step caught by the sampler) therefore never makes a
    member deviate. Judged leave-one-out below `exact_below` members, against the class above.
    """
    n = len(stats)
    if n < 2:
        return {}
    medians = {g: st[0] for g, st in stats.items()}
    ref_lo, ref_hi = min(medians.values()), max(medians.values())
    sides = []
    # Every reference median lies within [ref_lo, ref_hi]: nobody can stand out unless the extreme
    # window does against that bound. Most judgements of a healthy class end here.
    if side in ("below", "both"):
        lowest = min(st[2] for st in stats.values())
        if ref_hi - lowest > abs_ and lowest < (1 - rel) * ref_hi:
            sides.append("below")
    if side in ("above", "both"):
        highest = max(st[1] for st in stats.values())
        if highest - ref_lo > abs_ and highest > (1 + rel) * ref_lo:
            sides.append("above")
    if not sides:
        return {}
    class_stats = median_mad(list(medians.values())) if n >= exact_below else None
    out = {}
    for g, (median, lo, hi) in stats.items():
        if class_stats is not None:
            ref, mad = class_stats
        else:
            ref, mad = median_mad([x for h, x in medians.items() if h != g])
        for sd in sides:
            bound = hi if sd == "below" else lo
            gap = ref - bound if sd == "below" else bound - ref
            if gap <= rel * abs(ref) or gap <= abs_:
                continue
            score = None
            if n >= 3:  # a spread of one peer means nothing
                score = gap / (MAD_TO_SIGMA * max(mad, MAD_FLOOR_FRACTION * abs(ref), MAD_FLOOR_ABS))
                if score <= z:
                    continue
            out[g] = {"value": median, "bound": bound, "side": sd, "peers_median": ref, "peers_mad": mad, "z": score}
            break
    return out


def _window_stats(values: list[float]) -> tuple[float, float, float] | None:
    """(median, min, max) of the available (>= 0) values; None unless at least half are available."""
    ok = sorted(float(v) for v in values if v >= 0)
    if not ok or 2 * len(ok) < len(values):
        return None
    return middle(ok), ok[0], ok[-1]


def _median_valid(values: Iterable[float]) -> float | None:
    """Median of the available (>= 0) values; None unless at least half are available."""
    values = list(values)
    ok = sorted(float(v) for v in values if v >= 0)
    if not ok or 2 * len(ok) < len(values):
        return None
    return middle(ok)


def _sum_valid(*counters: int) -> int:
    """Sum of the available counters; -1 when none is."""
    ok = [c for c in counters if c >= 0]
    return sum(ok) if ok else -1


def _sum_all(*counters: int) -> int:
    """Sum of the counters, -1 unless all are available: a counter that comes and goes must not look like
    an increase of the sum."""
    return sum(counters) if all(c >= 0 for c in counters) else -1
