"""Sentinel values the probe, the wire messages and the detectors share.

They live apart from all three so the pure detectors can compare against them without importing the probe or
the wire (detectors take plain records; a test checks what they import).
"""

from __future__ import annotations

import hashlib

# StepRecord.gpu_s / gpu_wait_s of a CUDA step whose GPU span was not read (-1: not a CUDA step)
GPU_UNMEASURED = -2
# StepRecord.pg_wait key (not a process group's name): time in blocking point-to-point calls; present whenever
# the rank issued any in the step, so its step is a pipeline stage's, whose work differs from its peers' by design
P2P_WAIT = "p2p"
# StepRecord.pg_wait key: time waiting on asynchronous calls' handles (Work.wait after isend or an async_op
# all-gather, a functional collective's wait_tensor), whose process group the wait does not tell
ASYNC_WAIT = "async"
# What a collective issued outside Python (DDP's C++ reducer, functional collectives) chains as, whether or not
# the Flight Recorder has described it yet: every member chains the same value for it.
NATIVE_HASH = int.from_bytes(hashlib.blake2b(b"native collective", digest_size=8).digest(), "little")
# RankState.busy: what a rank does between collectives (probe/activity.py): nothing known, a forward pass or the end
# of a save or compilation at busy_age_s ago, or inside a save or a torch.compile compilation for busy_age_s
BUSY_IDLE, BUSY_ACTIVE, BUSY_CHECKPOINT, BUSY_COMPILE = 0, 1, 2, 3
BUSY_WHAT = {
    BUSY_ACTIVE: "running forward passes",
    BUSY_CHECKPOINT: "writing a checkpoint",
    BUSY_COMPILE: "compiling (torch.compile)",
}
# Evidence layer names (probe/grad_sync.py) of the k-th gradient reduction of a step, as it entered the collective:
# the one gradient statistic a sharded class's members can compare (their parameters' gradients are shards)
GRAD_SYNC_LAYER = "grad-sync."
# Evidence entries that count, per layer, the parameters whose local gradient this step is exactly 0, and those whose
# gradient is bit for bit the one of the rank's previous step (nonzero): not made from this step's batch
ZERO_PARAMS = "zero-params:"
REPEATED_PARAMS = "repeated-params:"
PARAM_COUNTS = (ZERO_PARAMS, REPEATED_PARAMS)
# The role of the process groups trainscout makes beside the job's own (replay's, link probes', the fault
# injector's): no part of the job's topology, and no evidence of where the job's own collectives hang
PROBE_GROUP_ROLE = "trainscout"
# The fault injector's group (a drill's "collective on another process group"): no part of the topology shown, but
# it stands for one of the job's groups, and the hang and desync votes see it as such
DRILL_GROUP_ROLE = "trainscout-drill"
