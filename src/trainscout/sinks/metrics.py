"""Prometheus metrics of a run, served by the coordinator over HTTP (`trainscout run --metrics-port N`).

The coordinator calls `RunMetrics.on_finding` for each finding it emits and `RunMetrics.on_pass` once per
detection pass with the ranks' latest digests; the events it writes (agents lost, its own stalls, failed
alerts) reach `on_event` through the event log. A pass only keeps a reference to each rank's newest digest;
per-rank figures and metric families are computed when Prometheus scrapes, and per-rank series are capped
(`exported_ranks`), so a large job costs the detection loop little whatever the scrape interval. Everything
lives in a registry of its own (not prometheus-client's global one), so nothing else in the process adds to it.
docs/metrics.md lists every metric.

prometheus-client is optional (`pip install 'trainscout[metrics]'`); `available()` says whether it is here.
"""

from __future__ import annotations

import heapq
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainscout.detectors.observations import RankObs
    from trainscout.findings import Finding

INSTALL_HINT = "pip install 'trainscout[metrics]' (prometheus-client)"


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class RankFigures:
    """A rank's latest figures, from the newest digest that carried them."""

    step: int
    step_s: float  # mean wall seconds of the steps in that digest (NaN: no step measured yet)
    wait_s: float  # mean seconds per step blocked in collectives
    probe_s: float  # mean seconds per step the probe's own thread worked
    loss: float  # latest local loss (NaN: not measured)
    progress_age_s: float  # seconds since progress, as the digest said
    seen_at: float  # monotonic time the digest arrived (its age is added to progress_age_s at scrape)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def figures_of(latest: RankObs, with_steps: RankObs | None, with_loss: RankObs | None) -> RankFigures:
    """A rank's figures from its latest digest, the latest one that carried steps and the latest with a loss."""
    steps = [r for r in with_steps.state.steps if r.wall_s > 0] if with_steps is not None else []
    losses = [n.loss for n in with_loss.state.numerics if math.isfinite(n.loss)] if with_loss is not None else []
    return RankFigures(
        step=latest.state.step,
        step_s=_mean([r.wall_s for r in steps]),
        wait_s=_mean([r.wait_s for r in steps]),
        probe_s=_mean([r.probe_thread_s for r in steps]),
        loss=losses[-1] if losses else math.nan,
        progress_age_s=latest.state.progress_age_s,
        seen_at=latest.seen_at,
    )


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, max, max/median) of the finite values; NaNs where there is none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    median, top = statistics.median(finite), max(finite)
    return median, top, (top / median if median > 0 else math.nan)


def exported_ranks(ranks: Mapping[int, RankFigures], limit: int) -> list[int]:
    """The ranks given series of their own, in rank order: all of them up to `limit`, else the `limit` slowest
    by step time (per-rank series cost each scrape ~10 us a sample, and a 10k-rank job's are of little use
    beyond its outliers; the job-wide gauges still cover every rank)."""
    if len(ranks) <= limit:
        return sorted(ranks)
    slowest = heapq.nlargest(
        limit, ranks, key=lambda r: (ranks[r].step_s if math.isfinite(ranks[r].step_s) else -1.0, -r)
    )
    return sorted(slowest)


class JobView:
    """What the metrics say about the job, updated by detection passes and read by scrapes (another thread).

    A pass only keeps references to the digests (one identity check per rank); figures are computed when a
    scrape asks, typically every 5-15 s rather than every pass."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latest: dict[int, RankObs] = {}
        self.with_steps: dict[int, RankObs] = {}  # a digest without a finished step keeps the last step time
        self.with_loss: dict[int, RankObs] = {}
        self.live: set[int] = set()
        self.agents_silent = 0

    def update(self, ranks: Mapping[int, RankObs], live: set[int], agents_silent: int) -> None:
        with self.lock:
            for rank, obs in ranks.items():
                if self.latest.get(rank) is not obs:
                    self.latest[rank] = obs
                    if obs.state.steps:
                        self.with_steps[rank] = obs
                    if obs.state.numerics:
                        self.with_loss[rank] = obs
            self.live = set(live)
            self.agents_silent = agents_silent

    def snapshot(self) -> tuple[dict[int, RankFigures], set[int], int]:
        with self.lock:
            digests = [(r, o, self.with_steps.get(r), self.with_loss.get(r)) for r, o in self.latest.items()]
            live, silent = set(self.live), self.agents_silent
        return {r: figures_of(o, s, n) for r, o, s, n in digests}, live, silent


# name, help, the RankFigures field (per-rank gauges)
RANK_GAUGES = (
    ("trainscout_rank_step", "Last optimizer step the rank completed", "step"),
    ("trainscout_rank_step_seconds", "Wall seconds per step of the rank (mean over its latest digest)", "step_s"),
    (
        "trainscout_rank_collective_wait_seconds",
        "Seconds per step the rank waited inside collectives (mean over its latest digest)",
        "wait_s",
    ),
    (
        "trainscout_rank_probe_seconds",
        "Seconds per step trainscout's probe thread worked inside the rank (its cost)",
        "probe_s",
    ),
    ("trainscout_rank_loss", "Latest local loss of the rank (before any reduction)", "loss"),
)


class RunMetrics:
    """The run's metrics in a registry of their own; `serve` exposes them over HTTP."""

    def __init__(
        self, max_ranks: int = 512, clock: Callable[[], float] = time.monotonic, supervisor_events: str = ""
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.clock = clock
        self.max_ranks = max_ranks  # ranks with series of their own (see exported_ranks)
        self.view = JobView()
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.findings = Counter(
            "trainscout_findings", "Findings emitted, by kind and status", ["kind", "status"], registry=reg
        )
        self.passes = Counter("trainscout_detection_passes", "Detection passes the coordinator ran", registry=reg)
        self.agents_lost = Counter(
            "trainscout_agents_lost", "Times an agent went silent (monitoring of its ranks interrupted)", registry=reg
        )
        self.stalls = Counter(
            "trainscout_coordinator_stalls",
            "Times the coordinator did not run a detection pass for over 5 s (stopped or starved)",
            registry=reg,
        )
        self.stalled_s = Counter(
            "trainscout_coordinator_stalled_seconds", "Seconds covered by those coordinator stalls", registry=reg
        )
        self.notify_failures = Counter(
            "trainscout_notify_failures", "Findings that could not be posted to a --notify endpoint", registry=reg
        )
        reg.register(_ViewCollector(self))
        if supervisor_events:
            reg.register(_ToolRestartCollector(supervisor_events))
        self.server: Any = None
        self.url = ""

    # ---- what the coordinator calls --------------------------------------------------------
    def on_finding(self, finding: Finding) -> None:
        self.findings.labels(kind=finding.kind, status=finding.status).inc()

    def on_pass(self, ranks: Mapping[int, RankObs], live: set[int], nodes: Mapping[Any, dict]) -> None:
        silent = sum(1 for n in nodes.values() if n.get("agent") and n.get("lost"))
        self.view.update(ranks, live, silent)
        self.passes.inc()

    def on_event(self, kind: str, fields: Mapping[str, Any]) -> None:
        """An event the coordinator wrote to events.jsonl (see EventLog.observers)."""
        if kind == "agent_lost":
            self.agents_lost.inc()
        elif kind == "coordinator_stalled":
            self.stalls.inc()
            self.stalled_s.inc(float(fields.get("seconds") or 0.0))
        elif kind == "notify_failed":
            self.notify_failures.inc()

    # ---- HTTP ------------------------------------------------------------------------------
    def serve(self, port: int, addr: str) -> str:
        """Serve /metrics on addr:port from a background thread; returns its URL. OSError if it cannot bind."""
        from prometheus_client import start_http_server

        started = start_http_server(port, addr=addr, registry=self.registry)
        self.server = started[0] if isinstance(started, tuple) else None
        port = self.server.server_port if self.server is not None else port  # the one bound, for port 0
        host = f"[{addr}]" if ":" in addr else addr
        self.url = f"http://{host}:{port}/metrics"
        return self.url

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def tool_restarts(events: Iterable[dict]) -> dict[str, tuple[int, float]]:
    """(restarts, seconds down) per component from the supervisor's tool_died / tool_restarted events: the
    gaps a killed agent or coordinator left, including those before this coordinator started."""
    died: dict[str, float] = {}
    out: dict[str, tuple[int, float]] = {}
    for e in events:
        name, t = e.get("component"), e.get("t")
        if not isinstance(name, str) or not isinstance(t, (int, float)):
            continue
        if e.get("kind") == "tool_died":
            died.setdefault(name, float(t))
        elif e.get("kind") == "tool_restarted":
            n, down = out.get(name, (0, 0.0))
            out[name] = (n + 1, down + max(0.0, float(t) - died.pop(name, float(t))))
    return out


class _ToolRestartCollector:
    """trainscout's own processes restarted by the supervisor, read from its event log at scrape time (the
    coordinator serving them may itself be a restarted one)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        from trainscout.sinks.jsonl import read_objects

        gaps = tool_restarts(read_objects(self.path))
        restarts = CounterMetricFamily(
            "trainscout_tool_restarts",
            "Times the supervisor restarted a dead agent or coordinator",
            labels=["component"],
        )
        down = CounterMetricFamily(
            "trainscout_tool_down_seconds",
            "Seconds an agent or coordinator was down before its restart (monitoring gaps)",
            labels=["component"],
        )
        for name in ("agent", "coordinator"):
            n, seconds = gaps.get(name, (0, 0.0))
            restarts.add_metric([name], n)
            down.add_metric([name], seconds)
        yield restarts
        yield down


class _ViewCollector:
    """Builds the per-rank and job-wide gauges from the view at scrape time."""

    def __init__(self, metrics: RunMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ranks, live, silent = self.metrics.view.snapshot()
        now = self.metrics.clock()
        order = exported_ranks(ranks, self.metrics.max_ranks)
        for name, doc, attr in RANK_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["rank"])
            for r in order:
                value = getattr(ranks[r], attr)
                if math.isfinite(value):
                    family.add_metric([str(r)], value)
            yield family
        age = GaugeMetricFamily(
            "trainscout_rank_progress_age_seconds",
            "Seconds since the rank last issued a collective or finished a step",
            labels=["rank"],
        )
        up = GaugeMetricFamily("trainscout_rank_up", "1 if the rank is alive and its agent reporting", labels=["rank"])
        for r in order:
            age.add_metric([str(r)], ranks[r].progress_age_s + max(0.0, now - ranks[r].seen_at))
            up.add_metric([str(r)], 1.0 if r in live else 0.0)
        yield age
        yield up
        median, top, ratio = spread([f.step_s for r, f in ranks.items() if r in live])
        for name, doc, value in (
            ("trainscout_step_seconds_median", "Median across live ranks of their seconds per step", median),
            ("trainscout_step_seconds_max", "Slowest live rank's seconds per step", top),
            ("trainscout_step_seconds_spread_ratio", "Slowest live rank's step time over the median", ratio),
        ):
            if math.isfinite(value):
                yield GaugeMetricFamily(name, doc, value=value)
        losses = [f.loss for r, f in ranks.items() if r in live and math.isfinite(f.loss)]
        if len(losses) > 1:
            yield GaugeMetricFamily(
                "trainscout_loss_spread",
                "Highest minus lowest latest local loss across live ranks",
                value=max(losses) - min(losses),
            )
        yield GaugeMetricFamily("trainscout_ranks_seen", "Ranks that ever reported", value=len(ranks))
        yield GaugeMetricFamily("trainscout_ranks_live", "Ranks alive whose agent is reporting", value=len(live))
        yield GaugeMetricFamily(
            "trainscout_ranks_exported", "Ranks with per-rank series (all, or the slowest)", value=len(order)
        )
        yield GaugeMetricFamily("trainscout_agents_silent", "Agents silent right now", value=silent)
        yield CounterMetricFamily(
            "trainscout_coordinator_cpu_seconds", "CPU seconds the coordinator process used", value=time.process_time()
        )


def start(
    port: int,
    addr: str,
    info: Callable[[str], None],
    warn: Callable[[str], None],
    events: Any,
    max_ranks: int = 512,
    supervisor_events: str = "",
) -> RunMetrics | None:
    """The coordinator's metrics, served on addr:port; None (with a warning and an event) if they cannot be:
    monitoring goes on without them."""
    if not available():
        warn(f"metrics not served: {INSTALL_HINT} is not installed")
        events.write("metrics_failed", reason="prometheus-client not installed")
        return None
    metrics = RunMetrics(max_ranks, supervisor_events=supervisor_events)
    try:
        url = metrics.serve(port, addr)
    except OSError as exc:
        warn(f"metrics not served: cannot listen on {addr}:{port} ({exc.strerror or exc})")
        events.write("metrics_failed", reason=str(exc), addr=addr, port=port)
        return None
    events.observers.append(metrics.on_event)
    info(f"Prometheus metrics at {url}")
    events.write("metrics_serving", url=url)
    return metrics
