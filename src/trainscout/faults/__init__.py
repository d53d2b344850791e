"""Fault injection for the demo, tests and benchmarks: env-driven, so it works on unmodified scripts.

`spec` parses TRAINSCOUT_INJECT text into FaultSpecs; `inject` fires them inside a rank when the probe
calls it. The faults that act inside forward, backward or data loading, or beside the rank, are drills with a
module each (`delay` with its `blockers`, `starve`, `gradnoise`, `outflip`), sharing `schedule` (which
iterations), `layers` (which module) and `fault_log` (what a fired fault reports); `numeric` corrupts
tensors. Nothing here imports torch at import time: the package loads in every process at start.
"""

from trainscout.faults.inject import FaultInjector
from trainscout.faults.spec import ENV_VAR, KINDS, FaultSpec, format_faults, parse_faults

__all__ = ["ENV_VAR", "KINDS", "FaultInjector", "FaultSpec", "format_faults", "parse_faults"]
