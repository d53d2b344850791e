"""Requests the node agent hands to the probes: small JSON files in shared memory (on-command replay,
link probes), read by the publisher thread. Each carries an id; a request is taken once, and only
while the step it names is still ahead (every member must act at the same step).
"""

from __future__ import annotations

import json
import os


class RequestFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._mtime = 0
        self._done: set[int] = set()

    def take(self, current_step: int, on_missed) -> dict | None:
        """The request (a dict with an integer "id" and "step") if it is new and its step is still ahead;
        None otherwise, and `on_missed(text)` when it came too late or could not be read."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return None
        if mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            with open(self.path) as fh:
                doc = json.load(fh)
            rid, step = int(doc["id"]), int(doc["step"])
        except (OSError, ValueError, TypeError, KeyError, OverflowError):  # not a request (another shape, torn)
            on_missed(f"request file {self.path} unreadable")
            return None
        if rid in self._done:
            return None
        self._done.add(rid)
        if step <= current_step:
            on_missed(f"request {rid} for step {doc['step']} missed (read at step {current_step})")
            return None
        return doc
