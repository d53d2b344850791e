"""What the probe asks of each of its parts (checks, step timing, the publisher), beyond their own work.

The probe composes its parts (probe/probe.py) and, at the end of the rank, asks each the same two things: to
publish what it still has in flight (CUDA results not yet read back) and what it cost this rank, for the run's
summary. Nothing outside a part reads its private state to learn either.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Part(Protocol):
    name: str  # the key of its figures in the rank's cost report (runs/<id>/probe-costs.<rank>.json)

    def costs(self) -> dict[str, Any] | None:
        """Seconds spent on the training thread (and what they bought); None when there is nothing to say."""
        ...


@runtime_checkable
class Flushes(Protocol):
    def flush(self) -> Any:
        """Publish results still in flight (bounded wait); called once as the rank exits."""
        ...
