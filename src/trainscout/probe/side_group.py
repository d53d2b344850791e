"""Waits on trainscout's own side groups (replay's broadcasts, link probes' sends and receives), bounded.

Ranks meet there at a step the coordinator or the replay schedule named. One that is not there (its optimizer
steps no longer match its peers': the job skipped or repeated a step on it; it read the command late; it is
stopped) waits in the job's next collective, which the others, waiting here, never enter. Each wait is therefore
bounded to seconds, well under the hang timeout; past it the check that waited turns itself off on that rank and
training goes on, instead of being held for the side group's own timeout (a minute).
"""

from __future__ import annotations

import datetime

# Ranks reach such a meeting within milliseconds of each other: the job's gradient reduction just synchronised
# them, and all do the same optimizer step and checks since. Seconds apart, one of them is elsewhere.
JOIN_S = 3.0
SIDE_BYTES_S = 50e6  # the slowest side link assumed for a transfer's time, on top of JOIN_S


class PeerAbsent(RuntimeError):
    """A side-group call was not completed by its peers in time."""


def wait_within(work, limit_s: float, what: str) -> None:
    """Wait for `work` (an async side-group call) at most `limit_s`, else raise PeerAbsent naming `what`. An
    unfinished call stays queued on the group, which the caller does not use again."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=limit_s))
    except RuntimeError as exc:
        raise PeerAbsent(
            f"a peer did not join {what} within {limit_s:.1f} s (its optimizer steps no longer match its peers': "
            f"the job skipped or repeated a step there, or it is stopped): {exc}"
        ) from exc
