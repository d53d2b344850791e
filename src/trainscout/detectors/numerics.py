"""Numerical outliers among replicas: a rank whose local loss or local gradient norms leave its peers'.

Data-parallel replicas compute the same model on different batches, so their local losses and the norms of
their local gradients (before the all-reduce) differ by the batches' spread, and by little else. A rank
whose forward went wrong (a layer computing wrong, corrupted weights) moves away from its peers and stays
away; a gradient corrupted on its way to the all-reduce jumps for one step while the rank's loss agrees with
its peers'. After the all-reduce every replica holds the same numbers, so this is the only place such a
fault shows before it spreads.

Per step and per statistic (the loss; the log of each layer's gradient norm), each rank is compared with
the median of its peers (leave-one-out). The scale is the class's own: the median, over the last WINDOW
steps, of each step's median absolute deviation across ranks (robust to one outlier per step, and to the
fault itself while it lasts). A rank is a suspect when it is far out in robust z AND relatively far AND:
- persistent: in PERSIST_K of its last PERSIST_M judged steps, on the same side (loss or a layer's norm);
- spike (gradient norms only): one step at least SPIKE_RATIO times its peers at a robust z of SPIKE_Z, and as far
  from the class's usual value (the median of its recent step medians: with two of four ranks corrupted, the
  healthy ones are far from their peers' median, not from the usual), while it is not a hard batch: the gradient
  went wrong, not the batch. A hard batch raises the loss (z >=
  LOSS_CALM_Z) and with it the gradients of the layers the loss flows back through (their median ratio >=
  BROAD_RATIO); a loss off its peers' by chance (1 step in 20 with 4 ranks) with one layer alone far out hid
  noise.
- zero (gradient norms only): a layer's local gradient exactly 0 in ZERO_STEPS steps in a row while a strict
  majority of its class's is not, after ZERO_HISTORY steps in which it was not either: zeroed on its way (a hook,
  a device writing zeros). The log-norm statistics leave zeros out (a mixture-of-experts layer no token of a
  rank's batch chose has no gradient there, now and then, not for good).
- biased: on one side of its peers' median in BIAS_K of the last BIAS_WINDOW judged steps, at least BIAS_REL away
  in their median (a healthy rank of a symmetric class is above its peers' median in half its steps: 30 of 32 on
  one side is 1 in 4 million), however small against the spread: one weight's gradient doubled by a hook moved
  its block's norm 1.14x, above its peers' in 92 % of steps, at z 1-2. A rank's own data (a language, a domain of
  its own) biases it too, so such a suspect is named only where replay reproduces it; at most one a rank in
  BIAS_GAP steps. A persistent loss deviation that did not set in within the judged steps (the rank's loss was on
  that side already in 3 of 4 of its first judged steps, at least ONSET_HISTORY of them) is such a suspect too.
- odd parameters (gradients only): one of a layer's parameters, not the whole layer, whose local gradient is exactly 0
  for ZERO_PARAM_STEPS steps in a row, or repeats the rank's previous step bit for bit (a gradient dropped or held
  stale on its way, which moves its layer's norm by too little to see), on a strict minority of ranks, after
  ZERO_HISTORY steps in which it did not. Such a suspect is named only where replay reproduces it: a mixture of
  experts' router leaves an expert without a gradient now and then, and a one-step fault is gone by the replay.
Attribution needs a strict majority of agreeing peers: 3 or more ranks. Suspects go to the coordinator,
which confirms them (replay, state fingerprints) before a finding is emitted.

Besides the layers, the evidence lists each gradient bucket as it entered its data-parallel reduction
(`grad-sync.K`, probe/grad_sync.py: a DDP communication hook's bucket, FSDP2's reduce-scatter input), compared
like a layer: a bucket changed on its way to the reduction shows there alone.

Sharded data parallelism (FSDP2 on a 1-D mesh, ZeRO-3) has no replicas, but the members of its shard group
still compute the whole model on their own batches: their local losses and their reduce-scatter inputs are
compared the same way (their parameters' gradients, read after the reduce-scatter, are shards and are not).
Such a suspect has nothing to be confirmed against (`NumericSuspect.confirmable`).

A tensor-parallel rank computes each layer with its tensor-parallel peers, and a pipeline stage's loss is made
from what the stages before it sent: a rank's numbers leaving its class's there say that its model replica went
wrong, not that the rank did (a flip on one stage named the next stage's rank; on one tensor-parallel rank, its
peer too). Such a suspect is `coupled`: the coordinator names it only where replay reproduces the deviation on
that rank, and logs it otherwise.

Pure logic: no torch, no I/O; inputs are plain numbers.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainscout.detectors.interface import Confirm, DetectorBase, JobView, Judgement, shard_group
from trainscout.markers import GRAD_SYNC_LAYER, P2P_WAIT, PARAM_COUNTS, REPEATED_PARAMS, ZERO_PARAMS

if TYPE_CHECKING:  # types only: detectors take plain records and import no wire at run time
    from trainscout.wire.messages import NodeDigest

from trainscout.consensus.leave_one_out import median_without

COUPLING_ROLES = ("tensor", "pipeline")  # groups whose members compute one forward together
PIPELINE_STEPS = 8  # steps with point-to-point calls (in at least half of its steps) that make a rank a stage
MAD_TO_SIGMA = 1.4826
WINDOW = 64  # steps of per-step dispersion the scale is taken from
MIN_HISTORY = 16  # steps of dispersion needed before a statistic is judged
WARMUP_STEPS = 20  # start-up is uneven (first batches, learning-rate warm-up)
PERSIST_Z, PERSIST_K, PERSIST_M = 6.0, 4, 5
LOSS_REL = 0.1  # a persistent loss outlier is also >= 10 % away from its peers' median
NORM_PERSIST_RATIO = 1.5  # ... a persistent norm outlier >= 1.5x (or <= 1/1.5x) its peers'
# A healthy rank's local gradient leaves its peers' by its batch alone: up to 2.3x (z 10.7) over 339 recorded
# CPU runs, 3.6x (z 12.7) once in 145 CUDA runs at load 20, and 8.1x (z 28.5) and 8.9x (z 19.2) on the
# embeddings in one 1-hour (25,000-step) CPU run; injected gradient noise gave 65-137x (z >= 80) late in runs,
# but 63x at z 29.7 at step 100 of 300, while the layers' spread across ranks was still wide: a z bar of 40 let
# the first three of four noisy steps pass. The ratio bar is what keeps heavy-tailed layers quiet (the 8.1x at
# z 28.5 is a spread of 0.07 in log-norm: 32x there reads z 47); z only keeps out layers whose spread is wide.
# A gradient bucket sums many layers, so a healthy rank's moves far less than one layer's: at most 1.52x its
# peers' (z 18.2) over 52,000 rank-steps of 20 clean CPU and CUDA runs with buckets (hooks, FSDP2, HSDP, ZeRO),
# where 100x noise in one bucket read 140x at z +33.
SPIKE_Z, SPIKE_RATIO = 25.0, 32.0
LOSS_CALM_Z = 3.0
BROAD_RATIO = 1.5  # a hard batch: the median of the rank's layer-norm ratios over its peers at least this
TURBULENT = 3.0  # a step whose spread across ranks is this many times the usual is judged on its own spread
SPIKE_GAP = 50  # at most one spike suspect per rank in this many steps (a fault that repeats is not a flood)
ZERO_STEPS = 8  # a layer's gradient exactly 0 this many steps in a row on one rank, every peer's not ...
ZERO_HISTORY = 16  # ... after at least this many judged steps in which it was not 0 either
BIAS_WINDOW, BIAS_K, BIAS_REL, BIAS_GAP = 32, 30, 0.05, 500
ONSET_HISTORY = 8  # first judged steps, before a persistent loss deviation, that show it set in (else: biased)
ZERO_PARAM_STEPS = 3  # one parameter's gradient exactly 0 this many steps in a row (a repeat: once) on a minority
ODD_PATTERNS = {ZERO_PARAMS: "zero-params", REPEATED_PARAMS: "repeated-params"}
WAIT_S = 5.0  # a step is judged once every live member reported it, or after this long
_TINY = 1e-30


@dataclass
class NumericSuspect:
    rank: int
    step: int  # the step that completed the evidence
    statistic: str  # "loss" | "grad_norm"
    pattern: str  # "persistent" | "spike" | "biased" | "zero" | "zero-params" | "repeated-params"
    layer: str = ""  # for grad_norm: the layer that deviates most
    ratio: float = 1.0  # the rank's value over its peers' median (for norms: of the norm)
    z: float = 0.0
    steps: list[int] = field(default_factory=list)  # the steps flagged
    layers: dict[str, float] = field(default_factory=dict)  # every deviating layer -> its ratio, at `step`
    loss_z: float = 0.0  # the rank's loss z at `step`
    confirmable: bool = True  # False in a sharded class: no replica holds the rank's state or replays its layers
    coupled: bool = False  # its numbers depend on other ranks' work (tensor- or pipeline-parallel peers)
    count: int = 0  # odd parameters: how many of the layer's parameters (exactly 0, or repeating the step before)


class _Stat:
    """One statistic (the loss, or one layer's log-norm) of one replica class: its dispersion history."""

    def __init__(self) -> None:
        self.dispersion: deque = deque(maxlen=WINDOW)
        self.centres: deque = deque(maxlen=WINDOW)  # each step's median across the class
        self.level: float | None = None  # the class's usual value before the step judged last (median of centres)
        self.was_wide = False  # the last step's spread was more than TURBULENT x the usual

    def judge(self, values: Mapping[int, float]) -> dict[int, tuple[float, float, float]]:
        """rank -> (deviation from its peers' median, robust z, peers' median) for this step's values; the
        step's dispersion joins the history afterwards (a step is never judged against itself)."""
        ordered = sorted(values.values())
        centre = _middle(ordered)
        mad = _middle(sorted(abs(v - centre) for v in ordered))
        out: dict[int, tuple[float, float, float]] = {}
        judged = len(self.dispersion) >= MIN_HISTORY
        usual = _middle(sorted(self.dispersion)) if judged else 0.0
        self.level = _middle(sorted(self.centres)) if judged else None
        wide = judged and mad > TURBULENT * usual
        if judged:
            # the usual spread, or this step's where the whole class has been far out of its usual for two steps
            # running (a loss spike every replica goes through: a clean vision job's ranks spread 20x wider than
            # usual for 15 steps, and one that happened to lead in 4 of 5 was named). Not on one wide step alone:
            # with 4 ranks, one rank far out moves the median of the deviations to half its peers' range, more than
            # 3x the usual in 18 % of steps of clean 4-rank jobs, and one step of gradient noise went unnamed
            sigma = MAD_TO_SIGMA * (mad if wide and self.was_wide else usual)
            sigma = max(sigma, 1e-6 * abs(centre), 1e-12)
            for r, v in values.items():
                peers = _reference(ordered, v)
                out[r] = (v - peers, (v - peers) / sigma, peers)
        self.was_wide = wide
        self.dispersion.append(mad)
        self.centres.append(centre)
        return out


class NumericDetector(DetectorBase):
    name = "numerics"

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self.wait_s = wait_s
        self._pending: dict[tuple[str, int], dict] = {}  # (class, step) -> {"loss": {r: v}, "norms": {r: [..]}, "t"}
        self._layers: dict[str, list[str]] = {}  # class -> layer names (its members agree on them)
        self._stats: dict[tuple[str, str], _Stat] = {}  # (class, "loss" | layer) -> dispersion
        self._flags: dict[tuple[int, str], deque] = {}  # (rank, "loss" | layer) -> recent (step, side or 0)
        self._reported: set[tuple[int, str, str]] = set()
        self._last_spike: dict[int, int] = {}  # rank -> step of its last spike suspect
        self._named_ranks: set[int] = set()  # ranks already suspected of a persistent deviation
        self._sharded: set[str] = set()  # classes that are a sharded job's shard group (no replicas)
        self._coupled: set[int] = set()  # ranks whose loss and gradients depend on other ranks' computation
        self._p2p_steps: dict[int, list[int]] = {}  # rank -> [steps with point-to-point calls, steps seen]
        self._zero_runs: dict[tuple[int, str], list[int]] = {}  # (rank, layer) -> steps in a row its gradient was 0
        self._nonzero: dict[tuple[int, str], int] = {}  # (rank, layer) -> judged steps its gradient was not 0
        self._sides: dict[tuple[int, str], deque] = {}  # (rank, "loss" | layer) -> recent (step, log ratio)
        self._above: dict[tuple[int, str], int] = {}  # ... how many of them are above its peers' median
        self._below: dict[tuple[int, str], int] = {}  # ... and below
        self._last_bias: dict[int, int] = {}  # rank -> step of its last biased suspect
        self._baseline: dict[tuple[int, str], list] = {}  # (rank, "loss" | layer) -> its first judged deviations
        self._odd_runs: dict[tuple[int, str], list[int]] = {}  # (rank, count entry) -> steps in a row it was odd
        self._even: dict[tuple[int, str], int] = {}  # (rank, count entry) -> judged steps it was not odd
        self.steps_judged = 0
        self.trace: deque = deque(maxlen=200)  # recent suspects and near-misses, for diagnosis

    def observe(self, digest: NodeDigest, now: float) -> None:
        for st in digest.ranks:
            if st.rank not in self._coupled:
                self._learn_coupling(st)
            if not st.numerics:
                continue
            records = [(n.step, n.loss, n.norms) for n in st.numerics]
            if st.replica_group:
                self.add(st.rank, st.replica_group, st.numeric_layers, records, now)
                continue
            shard = shard_group(st)
            if shard is not None:  # its parameters' gradients are shards after the reduce-scatter: not compared
                self._sharded.add(shard)
                keep = [i for i, name in enumerate(st.numeric_layers) if name.startswith(GRAD_SYNC_LAYER)]
                layers = [st.numeric_layers[i] for i in keep]
                whole = len(st.numeric_layers)
                self.add(
                    st.rank,
                    shard,
                    layers,
                    [
                        (step, loss, [norms[i] for i in keep] if len(norms) == whole else [])
                        for step, loss, norms in records
                    ],
                    now,
                )

    def _learn_coupling(self, st) -> None:
        """A tensor- or pipeline-parallel rank: a member of such a declared group, or a pipeline stage, whose
        steps send to and receive from other stages (most of them: the link probe's one exchange does not count)."""
        if any(pg.role in COUPLING_ROLES for pg in st.pgs):
            self._coupled.add(st.rank)
            return
        counts = self._p2p_steps.setdefault(st.rank, [0, 0])
        counts[0] += sum(1 for s in st.steps if P2P_WAIT in s.pg_wait)
        counts[1] += len(st.steps)
        if counts[0] >= PIPELINE_STEPS and 2 * counts[0] >= counts[1]:
            self._coupled.add(st.rank)

    def judge(self, view: JobView) -> Judgement:
        """A statistical outlier is a suspect: it is named only once replay and the state check confirmed it."""
        classes = dict(view.classes)
        for name in self._sharded:
            classes[name] = [r for r in view.members.get(name, ()) if r in view.live]
        return Judgement(asks=[Confirm(s) for s in self.update(view.waited_until, classes)])

    def add(
        self,
        rank: int,
        group: str,
        layers: Sequence[str],
        records: Sequence[tuple[int, float, Sequence[float]]],
        now: float,
    ) -> None:
        """records: (step, loss, layer norms) of one rank, in any order; group: its replica class."""
        if layers:
            self._layers[group] = list(layers)
        for step, loss, norms in records:
            entry = self._pending.setdefault((group, step), {"loss": {}, "norms": {}, "t": now})
            if math.isfinite(loss):
                entry["loss"][rank] = loss
            if norms and len(norms) == len(self._layers.get(group, ())):
                entry["norms"][rank] = list(norms)

    def update(self, now: float, members: Mapping[str, Sequence[int]]) -> list[NumericSuspect]:
        """Judge complete steps in order; members: class -> its live ranks."""
        out: list[NumericSuspect] = []
        for key in sorted(self._pending, key=lambda k: k[1]):
            group, step = key
            entry = self._pending[key]
            live = set(members.get(group, ()))
            reported = set(entry["loss"]) | set(entry["norms"])
            if not live <= reported and now - entry["t"] < self.wait_s:
                continue
            del self._pending[key]
            if len(live) < 3 or step <= WARMUP_STEPS:
                self._learn(group, entry)
                continue
            self.steps_judged += 1
            out.extend(self._judge(group, step, entry))
        return out

    def _learn(self, group: str, entry: dict) -> None:
        """Warm-up: the dispersion history fills, nothing is judged."""
        if len(entry["loss"]) >= 3:
            self._stat(group, "loss").judge(entry["loss"])
        for layer, values in self._layer_values(group, entry).items():
            self._stat(group, layer).judge(values)

    def _stat(self, group: str, name: str) -> _Stat:
        s = self._stats.get((group, name))
        if s is None:
            s = self._stats[(group, name)] = _Stat()
        return s

    def _layer_values(self, group: str, entry: dict) -> dict[str, dict[int, float]]:
        """layer -> {rank: log norm}, finite norms only (NaN/Inf is the non-finite check's business), and no zero:
        a layer no input of the rank's batch went through has no gradient there (a mixture-of-experts job's expert
        that no token of the batch chose), and against it a rank whose tokens did choose it read 1e29x."""
        layers = self._layers.get(group, [])
        out: dict[str, dict[int, float]] = {}
        for r, norms in entry["norms"].items():
            for layer, n in zip(layers, norms):
                if math.isfinite(n) and n > 0 and not layer.startswith(PARAM_COUNTS):
                    out.setdefault(layer, {})[r] = math.log(max(n, _TINY))
        return {layer: v for layer, v in out.items() if len(v) >= 3}

    def _judge(self, group: str, step: int, entry: dict) -> list[NumericSuspect]:
        out: list[NumericSuspect] = []
        loss_z: dict[int, float] = {}
        biases: list[tuple[int, str, str, float, float]] = []  # (rank, statistic, layer, log ratio, z) this step
        if len(entry["loss"]) >= 3:
            judged = self._stat(group, "loss").judge(entry["loss"])
            for r, (dev, z, peers) in judged.items():
                loss_z[r] = z
                far = abs(z) >= PERSIST_Z and abs(dev) >= LOSS_REL * max(abs(peers), 1e-12)
                found = self._persist(r, "loss", step, (1 if dev > 0 else -1) if far else 0)
                if found is not None:
                    ratio = entry["loss"][r] / peers if peers else math.inf
                    # a loss off its peers' since judging began is the rank's own data (a domain of its own), not a
                    # fault that set in: replay decides (a 4-rank job whose ranks read different token ranges
                    # named rank 0 at 0.82x at step 41)
                    pattern = "persistent" if self._set_in(r, "loss", found, dev) else "biased"
                    if pattern == "biased":
                        self._last_bias[r] = step
                    out.append(NumericSuspect(r, step, "loss", pattern, ratio=ratio, z=z, steps=found, loss_z=z))
                if peers > 0:
                    biases.append((r, "loss", "", math.log1p(max(dev / peers, -0.99)), z))
        norm_flags: dict[int, dict[str, tuple[float, float]]] = {}  # rank -> layer -> (ratio, z)
        log_ratios: dict[int, list[float]] = {}  # rank -> every layer's log norm over its peers' median
        layer_values = self._layer_values(group, entry)
        levels: dict[str, float] = {}  # layer -> the class's usual log norm before this step
        for layer, values in layer_values.items():
            stat = self._stat(group, layer)
            judged = stat.judge(values)
            if stat.level is not None:
                levels[layer] = stat.level
            for r, (dev, z, _) in judged.items():
                log_ratios.setdefault(r, []).append(dev)
                biases.append((r, "grad_norm", layer, dev, z))
                ratio = math.exp(dev)
                if abs(z) >= PERSIST_Z and abs(dev) >= math.log(NORM_PERSIST_RATIO):
                    norm_flags.setdefault(r, {})[layer] = (ratio, z)
                found = self._persist(
                    r, layer, step, (1 if dev > 0 else -1) if r in norm_flags and layer in norm_flags[r] else 0
                )
                if found is not None:
                    out.append(
                        NumericSuspect(
                            r,
                            step,
                            "grad_norm",
                            "persistent",
                            layer=layer,
                            ratio=ratio,
                            z=z,
                            steps=found,
                            loss_z=loss_z.get(r, 0.0),
                            layers={k: round(v[0], 3) for k, v in norm_flags[r].items()},
                        )
                    )
        out.extend(self._zeroed(group, step, entry, loss_z))
        out.extend(self._odd_params(group, step, entry, loss_z))
        out.extend(self._biased(step, biases, loss_z))
        for r, layers in norm_flags.items():
            spikes = {
                k: v
                for k, v in layers.items()
                if abs(v[1]) >= SPIKE_Z
                and (v[0] >= SPIKE_RATIO or v[0] <= 1 / SPIKE_RATIO)
                and self._off_level(layer_values[k][r] - levels[k] if k in levels else None, v[0])
                and self._isolated(r, k, step)
            }
            if not spikes or self._hard_batch(loss_z.get(r, math.inf), log_ratios.get(r, [])):
                if spikes:
                    self.trace.append((step, r, "spike with loss outlier", loss_z.get(r)))
                continue
            layer, (ratio, z) = max(spikes.items(), key=lambda kv: abs(kv[1][1]))
            if step - self._last_spike.get(r, -SPIKE_GAP) < SPIKE_GAP:
                continue
            self._last_spike[r] = step
            out.append(
                NumericSuspect(
                    r,
                    step,
                    "grad_norm",
                    "spike",
                    layer=layer,
                    ratio=ratio,
                    z=z,
                    steps=[step],
                    loss_z=loss_z.get(r, 0.0),
                    layers={k: round(v[0], 3) for k, v in layers.items()},
                )
            )
        out = self._one_per_rank(out)
        for s in out:
            s.confirmable = group not in self._sharded
            s.coupled = s.rank in self._coupled
            self.trace.append((s.step, s.rank, s.statistic, s.pattern, s.layer, round(s.ratio, 3), round(s.z, 1)))
        return out

    def _zeroed(self, group: str, step: int, entry: dict, loss_z: dict[int, float]) -> list[NumericSuspect]:
        """Layers whose local gradient is exactly 0 on a strict minority of ranks, for ZERO_STEPS steps in a row
        after ZERO_HISTORY steps of not being 0 (the log-norm statistics cannot hold a 0)."""
        norms = entry["norms"]
        if len(norms) < 3:
            return []
        out: list[NumericSuspect] = []
        for i, layer in enumerate(self._layers.get(group, [])):
            if layer.startswith(PARAM_COUNTS):
                continue
            values = {r: v[i] for r, v in norms.items() if math.isfinite(v[i])}
            zero = [r for r, v in values.items() if v == 0]
            for r, v in values.items():
                key = (r, layer)
                if v != 0:
                    self._nonzero[key] = self._nonzero.get(key, 0) + 1
                    self._zero_runs.pop(key, None)
            if not zero or 2 * len(zero) >= len(values):  # none, or no minority: a layer the batches did not use
                for r in zero:
                    self._zero_runs.pop((r, layer), None)
                continue
            for r in zero:
                key = (r, layer)
                run = self._zero_runs.setdefault(key, [])
                run.append(step)
                if (
                    len(run) < ZERO_STEPS
                    or self._nonzero.get(key, 0) < ZERO_HISTORY
                    or (r, layer, "zero") in self._reported
                ):
                    continue
                self._reported.add((r, layer, "zero"))
                out.append(
                    NumericSuspect(
                        r,
                        step,
                        "grad_norm",
                        "zero",
                        layer=layer,
                        ratio=0.0,
                        steps=list(run),
                        loss_z=loss_z.get(r, 0.0),
                        layers={layer: 0.0},
                    )
                )
        return out

    def _set_in(self, rank: int, name: str, flagged: list[int], dev: float) -> bool:
        """Whether the deviation set in after judging began: of the rank's first judged steps (up to
        BIAS_WINDOW, before its first flagged one), at least ONSET_HISTORY, and fewer than 3 in 4 of them on its
        side of the peers' median (the recent steps would hold the deviation's own start)."""
        before = [v for s, v in self._baseline.get((rank, name), ()) if s < min(flagged)]
        same = sum(1 for v in before if v * dev > 0)
        return len(before) >= ONSET_HISTORY and 4 * same < 3 * len(before)

    def _biased(
        self, step: int, biases: list[tuple[int, str, str, float, float]], loss_z: dict[int, float]
    ) -> list[NumericSuspect]:
        """Statistics of a rank on one side of its peers' median in BIAS_K of the last BIAS_WINDOW steps, BIAS_REL
        or more away in their median: the one furthest away, per rank, at most once in BIAS_GAP steps."""
        found: dict[int, NumericSuspect] = {}
        for r, statistic, layer, log_ratio, z in biases:
            key = (r, layer or statistic)
            hist = self._sides.get(key)
            if hist is None:
                hist = self._sides[key] = deque(maxlen=BIAS_WINDOW)
                self._above[key] = self._below[key] = 0
            if len(hist) == BIAS_WINDOW:  # the oldest leaves the window: its side no longer counts
                _, gone = hist[0]
                self._above[key] -= gone > 0
                self._below[key] -= gone < 0
            hist.append((step, log_ratio))
            self._above[key] += log_ratio > 0
            self._below[key] += log_ratio < 0
            baseline = self._baseline.setdefault(key, [])
            if len(baseline) < BIAS_WINDOW:
                baseline.append((step, log_ratio))
            if max(self._above[key], self._below[key]) < BIAS_K or len(hist) < BIAS_WINDOW:
                continue
            if step - self._last_bias.get(r, -BIAS_GAP) < BIAS_GAP or r in self._named_ranks:
                continue  # judged lately, or already a persistent suspect (the same fault seen again)
            side = 1 if self._above[key] >= BIAS_K else -1
            typical = _middle(sorted(v for _, v in hist))
            if abs(typical) < math.log1p(BIAS_REL):
                continue
            best = found.get(r)
            if best is None or abs(math.log(best.ratio)) < abs(typical):
                steps = [s for s, v in hist if v * side > 0]
                found[r] = NumericSuspect(
                    r,
                    step,
                    statistic,
                    "biased",
                    layer=layer,
                    ratio=math.exp(typical),
                    z=z,
                    steps=steps,
                    loss_z=loss_z.get(r, 0.0),
                )
        for r in found:
            self._last_bias[r] = step
        return list(found.values())

    def _odd_params(self, group: str, step: int, entry: dict, loss_z: dict[int, float]) -> list[NumericSuspect]:
        """A rank with more parameters of a layer gradient-less (exactly 0) or repeating its previous step than a
        strict majority of its class (ZERO_PARAM_STEPS steps in a row for zeros, one step for a repeat), after
        ZERO_HISTORY judged steps in which it had not."""
        norms = entry["norms"]
        if len(norms) < 3:
            return []
        out: list[NumericSuspect] = []
        names = self._layers.get(group, [])
        position = {name: i for i, name in enumerate(names)}
        for i, name in enumerate(names):
            kind = next((k for k in PARAM_COUNTS if name.startswith(k)), None)
            if kind is None:
                continue
            norm_at = position.get(name[len(kind) :])
            # a layer whose whole gradient is 0 is the zero rule's (_zeroed)
            values = {r: v[i] for r, v in norms.items() if math.isfinite(v[i]) and (norm_at is None or v[norm_at] != 0)}
            if len(values) < 3:
                continue
            ordered = sorted(values.values())
            for r, v in values.items():
                key = (r, name)
                fewer = bisect.bisect_left(ordered, v)  # members with fewer odd parameters
                if not (v > 0 and 2 * fewer > len(values)):
                    self._even[key] = self._even.get(key, 0) + 1
                    self._odd_runs.pop(key, None)
                    continue
                run = self._odd_runs.setdefault(key, [])
                run.append(step)
                needed = ZERO_PARAM_STEPS if kind == ZERO_PARAMS else 1
                pattern = ODD_PATTERNS[kind]
                if len(run) < needed or self._even.get(key, 0) < ZERO_HISTORY or (r, name, pattern) in self._reported:
                    continue
                self._reported.add((r, name, pattern))
                layer = name[len(kind) :]
                out.append(
                    NumericSuspect(
                        r,
                        step,
                        "grad_norm",
                        pattern,
                        layer=layer,
                        steps=list(run),
                        loss_z=loss_z.get(r, 0.0),
                        count=int(v),
                    )
                )
        return out

    @staticmethod
    def _off_level(off: float | None, ratio: float) -> bool:
        """Whether a rank far from its peers' median this step is as far, on the same side, from its class's usual
        value: the rank left the class, not the class the rank. With two of four ranks' gradients corrupted in one
        step, each healthy rank's peers' median is a corrupted value, and the healthy ranks read 1e-4x (all four
        were named): they sit at the class's usual level, the corrupted ones 1e4x above it."""
        if off is None:
            return True  # no level yet (the first judged steps): the peers alone decide
        return off >= math.log(SPIKE_RATIO) if ratio > 1 else off <= -math.log(SPIKE_RATIO)

    @staticmethod
    def _hard_batch(loss_z: float, log_ratios: list[float]) -> bool:
        """A batch harder than its peers' raises the loss, and with it the gradient of every layer the loss
        flows back through: the loss above its peers' AND the rank's layers' gradients broadly up (their
        median). A gradient gone wrong in one layer leaves the others at their peers' level, whatever the loss
        did by chance (a 4-rank CUDA job's noise, 100x in one layer, came with a loss z +4.1 and went unnamed)."""
        if loss_z < LOSS_CALM_Z:
            return False
        if not log_ratios:
            return True
        return _middle(sorted(log_ratios)) >= math.log(BROAD_RATIO)

    def _one_per_rank(self, found: list[NumericSuspect]) -> list[NumericSuspect]:
        """One persistent suspect per rank, once: a forward gone wrong moves the loss and most layers' norms
        together (the loss first, else the layer furthest out, with every deviating layer listed)."""
        persistent: dict[int, list[NumericSuspect]] = {}
        out = []
        for s in found:
            if s.pattern == "persistent":
                persistent.setdefault(s.rank, []).append(s)
            else:
                out.append(s)
        for rank, group in persistent.items():
            if rank in self._named_ranks:
                continue  # already named; its other statistics follow from the same fault
            self._named_ranks.add(rank)
            lead = next((s for s in group if s.statistic == "loss"), None) or max(group, key=lambda s: abs(s.z))
            for s in group:
                if s.statistic == "grad_norm":
                    lead.layers[s.layer] = round(s.ratio, 3)
            out.append(lead)
        return out

    def _isolated(self, rank: int, name: str, step: int) -> bool:
        """A spike is one step out of line: this statistic of this rank was not flagged in the steps before
        (a deviation that lasts is the persistent rule's), nor named persistent already."""
        if (rank, name, "persistent") in self._reported:
            return False
        hist = self._flags.get((rank, name), ())
        return not any(side for s, side in hist if s < step)

    def _persist(self, rank: int, name: str, step: int, side: int) -> list[int] | None:
        """Record this step's flag (side +1/-1, 0: not flagged); the flagged steps once PERSIST_K of the last
        PERSIST_M are flagged on one side, reported once per (rank, statistic)."""
        hist = self._flags.setdefault((rank, name), deque(maxlen=PERSIST_M))
        hist.append((step, side))
        if not side or len(hist) < PERSIST_M or (rank, name, "persistent") in self._reported:
            return None
        same = [s for s, d in hist if d == side]
        if len(same) < PERSIST_K:
            return None
        self._reported.add((rank, name, "persistent"))
        return same


def _reference(ordered: list[float], v: float) -> float:
    """What a rank's value is held against: its peers' median, off the one sorted copy; with two peers, the one
    nearer to it. Their midpoint moves half-way to an outlier among them: in a class of three, each healthy
    rank then sat as far from it as the outlier did, on the other side, and all three were named (a pipeline
    job whose one stage computed wrong). A rank is out only when it is far from a majority of its class."""
    if len(ordered) != 3:
        return median_without(ordered, v)
    i = ordered.index(v)
    a, b = (ordered[k] for k in range(3) if k != i)
    return a if abs(v - a) <= abs(v - b) else b


def _middle(s: list[float]) -> float:
    h = len(s) // 2
    return s[h] if len(s) % 2 else (s[h - 1] + s[h]) / 2
