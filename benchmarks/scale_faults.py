"""What a simulated rank of the scale harness shows when a fault strikes (benchmarks/scale.py simulates the nodes).

Each fault leaves the evidence a real rank's probe and agent would send, nothing the coordinator is told directly:

- hang: the culprit stops before its next collective; its group peers enter that collective and wait, and the ranks
  that need them wait in turn (scale.frozen_positions).
- crash: the culprit raises (an exception record, code 1) where the hang's culprit would stop; the job freezes
  the same way (NCCL peers block in the collective it never joins); 1.5 s later its node's launcher stops the
  node's other ranks with SIGTERM and reports the worker exits it printed (a LauncherReport, not final).
- desync: at the onset step the culprit issues its data-parallel gradient all-reduce with another reduce op
  (same sizes, so the collective completes and the job runs on); its rolling hash on that group differs from
  that collective on, and its record of it (in the digest's recent window, or pulled from its agent) says how.
- straggler: from the onset on, the culprit's compute takes `STRAGGLER_EXTRA` of a step more (2x); every rank's
  step takes that much longer and the culprit's peers spend it waiting in the gradient sync.
- sdc: every rank fingerprints one slot of its replicated state per step (a rotation of `STATE_SLOTS`); data-
  parallel replicas hold the same state, so their fingerprints agree; from the onset on the culprit's copy of one
  slot (a seeded one) differs, seen the next time the rotation reaches it.

Pure functions of (rank, step): the simulators and the driver agree on them without talking.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULTS = ("none", "hang", "desync", "crash", "straggler", "sdc")
MASK64 = (1 << 64) - 1

# the split of a healthy step's wall time (as a rank's step timing measures it): compute, waiting in collectives,
# data loading; the rest is time off the CPU outside collectives
COMPUTE, WAIT, DATA = 0.55, 0.30, 0.02
STRAGGLER_EXTRA = COMPUTE  # compute 2x: 0.55 of a step more on the culprit

STATE_SLOTS = 16  # steps a replicated-state rotation takes (one slot a step)
STATE_BYTES = 1 << 20  # bytes fingerprinted a slot

CRASH_MESSAGE = "RuntimeError: CUDA error: an illegal memory access was encountered at train.py:212"
TEARDOWN_S = 1.5  # from the crash to its node's launcher stopping the node's other ranks
DESYNC_DESC = "all_reduce float32[50331648] op=MAX"  # the culprit's variant of the gradient all-reduce
DESYNC_SALT = 0x5DEECE66D  # the culprit's rolling hashes from the deviating collective on


@dataclass(frozen=True)
class Fault:
    kind: str  # one of FAULTS
    culprit: int  # -1: none
    onset_step: int  # the fault strikes during this step (the first step it shows in is onset_step + 1)
    step_s: float
    t0: float  # wall-clock start of step 0
    seed: int = 1

    @property
    def freezes(self) -> bool:
        """Whether the job stops making progress (the culprit never issues another collective)."""
        return self.kind in ("hang", "crash")

    @property
    def onset_wall(self) -> float:
        return self.t0 + self.onset_step * self.step_s

    def slowed_step_s(self) -> float:
        return self.step_s * (1.0 + STRAGGLER_EXTRA)

    def elapsed_steps(self, now: float) -> float:
        """Steps of the job's clock done by `now` (a straggler stretches every step after its onset)."""
        x = max(0.0, now - self.t0)
        if self.kind == "straggler" and x > self.onset_step * self.step_s:
            return self.onset_step + (x - self.onset_step * self.step_s) / self.slowed_step_s()
        return x / self.step_s

    def step_length(self, step: int) -> float:
        """Wall seconds of step `step` (1-based, as StepRecord counts)."""
        return self.slowed_step_s() if self.kind == "straggler" and step > self.onset_step else self.step_s

    # ---- straggler: the step's split -----------------------------------------------------------------------
    def step_split(self, rank: int, step: int) -> tuple[float, float, float]:
        """(wall, compute, wait) seconds of `rank`'s step `step`, before noise."""
        wall = self.step_length(step)
        compute, wait = COMPUTE * self.step_s, WAIT * self.step_s
        if wall != self.step_s:  # the job waits for the straggler: its peers in the gradient sync, it in compute
            extra = wall - self.step_s
            if rank == self.culprit:
                compute += extra
            else:
                wait += extra
        return wall, compute, wait

    # ---- crash ---------------------------------------------------------------------------------------------
    def exit_of(
        self, rank: int, now: float, ranks_per_node: int
    ) -> tuple[str, int | None, int | None, str, float] | None:
        """(how, code, signal, message, seconds since) of a rank that has exited by `now`, else None."""
        if self.kind != "crash" or self.culprit < 0:
            return None
        since = now - self.onset_wall
        if rank == self.culprit and since >= 0:
            return ("exception", 1, None, CRASH_MESSAGE, since)
        if rank // ranks_per_node == self.culprit // ranks_per_node and since >= TEARDOWN_S:
            return ("signal", None, 15, "received SIGTERM", since - TEARDOWN_S)
        return None

    def launcher_exits(self, ranks_per_node: int, world: int) -> list[tuple[int, int, int]]:
        """The worker exits the culprit's launcher prints once it stopped its node: (rank, exitcode, pid)."""
        node = self.culprit // ranks_per_node
        mates = range(node * ranks_per_node, min(world, (node + 1) * ranks_per_node))
        return [(r, 1 if r == self.culprit else -15, 200000 + r) for r in mates]

    # ---- desync ----------------------------------------------------------------------------------------------
    def deviates(self, rank: int, data_stage: bool, seq: int, per_step: int) -> tuple[bool, bool]:
        """(this record is the deviating one, the rolling hash at `seq` carries the deviation) on the culprit's
        data-parallel group."""
        if self.kind != "desync" or rank != self.culprit or not data_stage:
            return False, False
        first = self.onset_step * per_step + 1
        return seq == first, seq >= first

    # ---- sdc -------------------------------------------------------------------------------------------------
    def corrupted_slot(self) -> int:
        return random.Random(self.seed * 7919 + 1).randrange(STATE_SLOTS)

    def state_digest(self, rank: int, shard: int, step: int) -> int:
        """Fingerprint of the slot `step` checks, on a rank holding model shard `shard` (equal on its replicas)."""
        slot = step % STATE_SLOTS
        value = ((step + 1) * 0x9E3779B97F4A7C15 ^ (shard + 1) * 0xC2B2AE3D27D4EB4F ^ slot) & MASK64
        if self.kind == "sdc" and rank == self.culprit and step > self.onset_step and slot == self.corrupted_slot():
            value ^= 1 << 52  # one flipped bit somewhere in that slot's bytes changes the fingerprint
        return value


def expected_kind(fault: str) -> str | None:
    """The finding kind a fault must be named as (None: a clean run, no finding at all)."""
    return None if fault == "none" else fault
