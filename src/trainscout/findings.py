"""The one Finding schema used by detectors, the coordinator, every sink and the tests.

A finding names culprits (ranks, and where known their hosts, pids and devices) for one kind of fault.
It is plain data: msgspec encodes it to JSON for `findings.jsonl` and to msgpack on the wire.
"""

from __future__ import annotations

import msgspec

SCHEMA_VERSION = 1

# Kinds a finding can have. Detectors use these names; sinks and docs explain them.
HANG = "hang"  # some ranks wait in a collective that others never entered
DESYNC = "desync"  # members of one process group issued different collectives at the same sequence number
CRASH = "crash"  # a rank died abnormally (exception, signal) while its peers were healthy
EARLY_EXIT = "early_exit"  # a rank exited cleanly while its peers went on training
STALL = "stall"  # the whole job stopped making progress with no rank to blame
STRAGGLER = "straggler"
SDC = "sdc"
NONFINITE = "nonfinite"
HEALTH = "health"
HPZ_RACE = "hpz_race"
MONITORING = "monitoring"  # trainscout itself lost part of its view of the job

KINDS = (HANG, DESYNC, CRASH, EARLY_EXIT, STALL, STRAGGLER, SDC, NONFINITE, HEALTH, HPZ_RACE, MONITORING)


class Finding(msgspec.Struct, kw_only=True):  # every field in the JSON: readers filter on status, schema
    kind: str
    summary: str  # one line a person reads first
    culprit_ranks: list[int]
    status: str = "attributed"  # attributed | inconclusive (see consensus.Verdict)
    step: int | None = None
    hosts: list[str] = []
    pids: list[int] = []
    devices: list[str] = []
    pg: str | None = None  # process group name as torch.distributed names it ("0" is the default group)
    collective_seq: int | None = None
    collective: str | None = None  # e.g. "all_reduce"
    confidence: float = 1.0
    evidence: dict = {}
    stacks: dict[str, str] = {}  # rank (as str, for JSON) -> Python stack captured from outside the process
    first_seen: float = 0.0  # coordinator wall-clock seconds when the fault was first suspected
    confirmed: float = 0.0  # when the finding was emitted
    attempt: int = 0  # the launcher's restart attempt it was made in (torchrun --max-restarts; 0: the first)
    schema: int = SCHEMA_VERSION

    def key(self) -> tuple:
        """Identity used to emit a finding once, however many detection passes see it."""
        detail = self.evidence.get("check") or self.evidence.get("type")
        return (self.kind, tuple(sorted(self.culprit_ranks)), self.pg, self.collective_seq, detail)


_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(Finding)


def to_json(finding: Finding) -> bytes:
    return _json_encoder.encode(finding)


def from_json(data: bytes | str) -> Finding:
    return _json_decoder.decode(data)
