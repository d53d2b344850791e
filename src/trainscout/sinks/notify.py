"""Alerts: every finding POSTed as JSON to webhook URLs (`trainscout run --notify URL`).

The coordinator hands each emitted finding to `Notifier.notify`, which only queues it: one background
thread per endpoint posts the finding's own JSON fields plus a `text` line that chat webhooks
(Slack, Mattermost and alike) show as the message. A post that fails (no connection, a timeout, a 5xx
or 429 answer) is retried with exponential backoff for a bounded time; a post still failing then is
counted and written to events.jsonl (`notify_failed`), and the console warns once per endpoint. A full
queue drops the newest finding rather than block detection. At exit the coordinator gives pending
posts a short, bounded drain (`close`).

Standard library only (urllib). URLs are shown without their path: webhook paths often hold a token.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol

from trainscout.findings import Finding, to_json
from trainscout.sinks.console import headline

QUEUE_SIZE = 256  # findings waiting per endpoint; a job emits a handful, so only a dead endpoint fills it
TRIES = 4
FIRST_BACKOFF_S = 0.5  # then doubled: 0.5, 1, 2 s between the four tries
MAX_POST_S = 20.0  # one finding's tries, backoff included, end by then
TIMEOUT_S = 5.0  # one try's connect + answer
DRAIN_S = 2.0  # what close() waits for pending posts, at most


class EventWriter(Protocol):
    def write(self, kind: str, **fields: Any) -> None: ...


def parse_urls(text: str) -> list[str]:
    """The comma-separated webhook URLs of the `notify` setting; ValueError names one that is not http(s)."""
    urls = [u.strip() for u in text.split(",") if u.strip()]
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
    return urls


def notify_urls(text: str, warn: Callable[[str], None]) -> list[str]:
    """The valid URLs of the setting; one that is not (set by hand past `trainscout run`'s check) is left out
    with a warning: monitoring goes on without it."""
    urls = []
    for url in (u.strip() for u in text.split(",")):
        try:
            urls += parse_urls(url)
        except ValueError as exc:
            warn(f"--notify URL ignored: {exc}")
    return urls


def shown(url: str) -> str:
    """The URL as logs show it: scheme, host and port only (a webhook's path is its secret)."""
    parts = urllib.parse.urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}" + ("/..." if parts.path not in ("", "/") else "")


def payload(finding: Finding, run_id: str = "") -> bytes:
    """The finding's own JSON fields plus `text`: the one line a chat channel shows."""
    doc = json.loads(to_json(finding))
    culprits = ", ".join(str(r) for r in finding.culprit_ranks) or "none named"
    where = f" [run {run_id}]" if run_id else ""
    line = " ".join(headline(finding).split())  # one line, whatever the summary holds
    doc["text"] = f"trainscout{where}: {line} (culprit ranks: {culprits}; {finding.status})"
    return json.dumps(doc).encode()


def _retryable(exc: Exception) -> bool:
    """Worth another try: the endpoint was unreachable, slow, overloaded or failing; not a refusal (4xx)."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code >= 500 or exc.code in (408, 429)
    return True


class _Endpoint:
    """One webhook URL: its queue and the thread that posts from it."""

    def __init__(self, url: str, owner: Notifier) -> None:
        self.url = url
        self.owner = owner
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self.warned = False
        self.thread = threading.Thread(target=self._loop, name=f"notify {shown(url)}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            body = self.queue.get()
            try:
                if body is None:
                    return
                self._deliver(body)
            finally:
                self.queue.task_done()

    def _deliver(self, body: bytes) -> None:
        o = self.owner
        deadline = time.monotonic() + o.max_post_s
        backoff = o.first_backoff_s
        error = ""
        for attempt in range(1, o.tries + 1):
            try:
                request = urllib.request.Request(
                    self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
                )
                timeout = max(0.1, min(o.timeout_s, deadline - time.monotonic()))
                with urllib.request.urlopen(request, timeout=timeout) as answer:
                    answer.read()
                with o.lock:
                    o.sent += 1
                return
            except Exception as exc:  # any failure of one try: the run must never fail over an alert
                error = f"{type(exc).__name__}: {exc}"
                if not _retryable(exc) or attempt == o.tries or o.closing.is_set():
                    break
                pause = min(backoff, deadline - time.monotonic())
                if pause <= 0 or o.closing.wait(pause):
                    break
                backoff *= 2
        with o.lock:
            o.failed += 1
        o.events.write("notify_failed", endpoint=shown(self.url), tries=attempt, error=error)
        if not self.warned:
            self.warned = True
            o.warn(f"could not post a finding to {shown(self.url)} ({error}); further failures only in events.jsonl")


class Notifier:
    """Posts findings to webhook URLs from background threads; `notify` never blocks the caller."""

    def __init__(
        self,
        urls: list[str],
        events: EventWriter,
        warn: Callable[[str], None],
        *,
        run_id: str = "",
        tries: int = TRIES,
        first_backoff_s: float = FIRST_BACKOFF_S,
        max_post_s: float = MAX_POST_S,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.events = events
        self.warn = warn
        self.run_id = run_id
        self.tries = max(1, tries)
        self.first_backoff_s = first_backoff_s
        self.max_post_s = max_post_s
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.closing = threading.Event()  # set by close() once its drain time is over: stop retrying
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.endpoints = [_Endpoint(url, self) for url in urls]

    def notify(self, finding: Finding) -> None:
        body = payload(finding, self.run_id)
        for ep in self.endpoints:
            try:
                ep.queue.put_nowait(body)
            except queue.Full:
                with self.lock:
                    self.dropped += 1
                self.events.write("notify_failed", endpoint=shown(ep.url), tries=0, error="queue full: dropped")

    def pending(self) -> int:
        return sum(ep.queue.unfinished_tasks for ep in self.endpoints)

    def close(self, drain_s: float = DRAIN_S) -> None:
        """Let pending posts go out for up to drain_s seconds, then stop retrying and end the threads."""
        deadline = time.monotonic() + drain_s
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.closing.set()
        unsent = self.pending()
        if unsent:
            self.events.write("notify_failed", endpoint="", tries=0, error=f"{unsent} post(s) unsent at exit")
        for ep in self.endpoints:
            try:
                ep.queue.put_nowait(None)
            except queue.Full:
                pass  # the thread is a daemon: it ends with the process
