"""The webhook notifier against a real HTTP server on 127.0.0.1: what it posts, how it retries, and that a
dead endpoint never blocks the caller."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainscout.findings import Finding, to_json
from trainscout.sinks.jsonl import EventLog
from trainscout.sinks.notify import Notifier, notify_urls, parse_urls, shown


class Hook:
    """A webhook receiver: records every POST (time, body) and answers with the next scripted status."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.posts: list[tuple[float, bytes, str]] = []
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with hook.lock:
                    hook.posts.append((time.monotonic(), body, self.headers.get("Content-Type", "")))
                    status = hook.statuses.pop(0) if hook.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/T0KEN"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook_factory():
    made: list[Hook] = []

    def make(statuses: list[int] | None = None) -> Hook:
        made.append(Hook(statuses))
        return made[-1]

    yield make
    for h in made:
        h.close()


def _finding() -> Finding:
    return Finding(
        kind="hang",
        summary="rank 2 (host h, pid 7) never entered all_reduce #41 of pg 0; 3/4 ranks wait there",
        culprit_ranks=[2],
        step=20,
        hosts=["h"],
        pids=[7],
        pg="0",
        collective_seq=41,
        collective="all_reduce",
        evidence={"waiting": [0, 1, 3]},
        stacks={"2": "File train.py, line 9\n  in step"},
    )


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _events(tmp_path) -> list[dict]:
    with open(tmp_path / "events.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_posts_exactly_the_finding_plus_one_chat_line(tmp_path, hook_factory):
    hook = hook_factory()
    warnings: list[str] = []
    n = Notifier([hook.url], EventLog(tmp_path / "events.jsonl"), warnings.append, run_id="r1")
    finding = _finding()
    n.notify(finding)
    _wait_for(lambda: n.sent == 1)
    (_, body, content_type), *more = hook.posts
    assert not more and content_type == "application/json"
    got = json.loads(body)
    text = got.pop("text")
    assert got == json.loads(to_json(finding))  # every field of the finding, as findings.jsonl holds it
    assert text == (
        "trainscout [run r1]: HANG at step 20: rank 2 (host h, pid 7) never entered all_reduce #41 of pg 0; "
        "3/4 ranks wait there (culprit ranks: 2; attributed)"
    )
    assert n.failed == 0 and not warnings


def test_server_errors_are_retried_with_growing_backoff_until_the_post_lands(tmp_path, hook_factory):
    hook = hook_factory([500, 500, 200])
    n = Notifier([hook.url], EventLog(tmp_path / "events.jsonl"), print, first_backoff_s=0.1)
    n.notify(_finding())
    _wait_for(lambda: n.sent == 1)
    assert len(hook.posts) == 3 and n.failed == 0
    assert hook.posts[0][1] == hook.posts[1][1] == hook.posts[2][1]  # the same post each time
    gaps = [b[0] - a[0] for a, b in zip(hook.posts, hook.posts[1:])]
    assert 0.1 <= gaps[0] < gaps[1] and gaps[1] >= 0.2, gaps
    assert not [e for e in _events(tmp_path) if e["kind"] == "notify_failed"]


def test_a_refusal_is_not_retried_and_is_recorded(tmp_path, hook_factory):
    hook = hook_factory([404])
    warnings: list[str] = []
    n = Notifier([hook.url], EventLog(tmp_path / "events.jsonl"), warnings.append, first_backoff_s=0.05)
    n.notify(_finding())
    _wait_for(lambda: n.failed == 1)
    time.sleep(0.2)
    assert len(hook.posts) == 1 and n.sent == 0
    (event,) = [e for e in _events(tmp_path) if e["kind"] == "notify_failed"]
    assert event["tries"] == 1 and "404" in event["error"]
    assert event["endpoint"] == shown(hook.url) and "T0KEN" not in json.dumps(event)  # the path stays secret
    assert len(warnings) == 1 and "T0KEN" not in warnings[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_endpoint_never_blocks_and_fails_after_its_retries(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/hook"
    warnings: list[str] = []
    n = Notifier([url], EventLog(tmp_path / "events.jsonl"), warnings.append, first_backoff_s=0.05)
    t0 = time.monotonic()
    n.notify(_finding())
    n.notify(_finding())
    assert time.monotonic() - t0 < 0.05  # queued, not sent inline
    assert n.failed == 0
    _wait_for(lambda: n.failed == 2)
    failed = [e for e in _events(tmp_path) if e["kind"] == "notify_failed"]
    assert [e["tries"] for e in failed] == [4, 4]
    assert "Connection refused" in failed[0]["error"] or "URLError" in failed[0]["error"]
    assert len(warnings) == 1  # the console warns once per endpoint


def test_close_drains_pending_posts_for_a_bounded_time(tmp_path, hook_factory):
    hook = hook_factory()
    dead = f"http://127.0.0.1:{_closed_port()}/hook"
    # the dead endpoint would retry for a long time; close() must not wait for it
    n = Notifier([hook.url, dead], EventLog(tmp_path / "events.jsonl"), lambda _: None, first_backoff_s=30.0)
    n.notify(_finding())
    t0 = time.monotonic()
    n.close(drain_s=0.5)
    assert time.monotonic() - t0 < 1.5
    assert len(hook.posts) == 1  # the live endpoint got its post within the drain
    _wait_for(lambda: n.failed == 1, timeout=3.0)  # the dead one gave up once closing


def test_urls_are_checked():
    assert parse_urls(" http://a:1/x , https://b/y ") == ["http://a:1/x", "https://b/y"]
    with pytest.raises(ValueError, match="ftp://a"):
        parse_urls("http://ok/,ftp://a")
    warnings: list[str] = []
    assert notify_urls("http://ok/,nope", warnings.append) == ["http://ok/"]
    assert len(warnings) == 1 and "nope" in warnings[0]
    assert shown("https://hooks.example:8443/services/SECRET") == "https://hooks.example:8443/..."
