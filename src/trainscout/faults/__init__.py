"""Fault injection for the demo, tests and benchmarks: env-driven, so it works on unmodified scripts.

`spec` parses TRAINSCOUT_INJECT text into FaultSpecs; `inject` fires them inside a rank when the probe
calls it. Nothing here imports torch at import time: the package loads in every process at start.
"""

from trainscout.faults.inject import FaultInjector
from trainscout.faults.spec import ENV_VAR, KINDS, FaultSpec, format_faults, parse_faults

__all__ = ["ENV_VAR", "KINDS", "FaultInjector", "FaultSpec", "format_faults", "parse_faults"]
