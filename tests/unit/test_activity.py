"""The probe's marks of a rank's own work between collectives (probe/activity.py), read by the hang vote."""

from __future__ import annotations


from trainscout.markers import BUSY_ACTIVE, BUSY_CHECKPOINT, BUSY_COMPILE
from trainscout.probe.activity import Activity


def _recording():
    header: dict[str, int] = {}
    changes: list[int] = []

    def set_field(name, value):
        header[name] = value
        if name == "busy":
            changes.append(value)

    return header, changes, set_field


def test_a_save_marks_the_rank_busy_since_it_began_and_only_the_outermost_counts():
    header, changes, set_field = _recording()
    activity = Activity(set_field)
    activity.forward()
    assert header["busy"] == BUSY_ACTIVE
    assert activity.enter(BUSY_CHECKPOINT)
    began = header["busy_ns"]
    activity.forward()  # a forward inside the save (a state-dict hook) does not end it
    assert not activity.enter(BUSY_CHECKPOINT)  # nested save
    assert (header["busy"], header["busy_ns"]) == (BUSY_CHECKPOINT, began)
    activity.leave()
    assert header["busy"] == BUSY_ACTIVE and header["busy_ns"] >= began
    assert changes == [BUSY_ACTIVE, BUSY_CHECKPOINT, BUSY_ACTIVE]


def test_every_dynamo_compilation_is_marked():
    import torch._dynamo

    header, changes, set_field = _recording()
    Activity(set_field).watch_compiles(torch._dynamo)
    fn = torch.compile(lambda x: (x * 2).sin(), backend="eager", dynamic=False)
    fn(torch.randn(4))
    fn(torch.randn(4))  # cached: no compilation
    fn(torch.randn(5))  # a new shape: a recompilation
    assert changes == [BUSY_COMPILE, BUSY_ACTIVE, BUSY_COMPILE, BUSY_ACTIVE]


def _moves_while(work, looks: int = 8, every_s: float = 0.1) -> int:
    """How many looks, after the first, saw a thread running `work` move (progress_ns staying put throughout)."""
    import threading
    import time

    header: dict[str, int] = {}
    activity = Activity(header.__setitem__)
    stop = threading.Event()
    started = threading.Event()

    def training_thread():
        activity.forward()  # the thread that runs forwards is the one looked at
        started.set()
        while not stop.is_set():
            work(stop)

    thread = threading.Thread(target=training_thread, daemon=True)
    thread.start()
    started.wait(5)
    marks = set()
    for _ in range(looks + 1):
        time.sleep(every_s)
        activity.look(progress_ns=42)
        marks.add(header.get("moving_ns"))
    moves = len(marks - {None})
    stop.set()
    _stopped.append(1)
    thread.join(5)
    _stopped.clear()
    return moves


def _tokenize(stop):
    import json

    words = ["alpha", "beta", "gamma", "delta"] * 20
    texts = [" ".join(words[(i + k) % len(words)] for k in range(40)) for i in range(50)]
    vocab: dict[str, int] = {}
    json.dumps([[vocab.setdefault(w, len(vocab)) for w in t.upper().split()] for t in texts])


def _write(stop):
    import os
    import tempfile

    with tempfile.TemporaryFile() as fh:
        while not stop.is_set():
            fh.write(os.urandom(16384))
            fh.flush()
            stop.wait(0.01)


def _sleep(stop):
    stop.wait(10)


def _spin(stop):
    x = 0
    while not _stopped:  # one function, no call: a spin (a loop calling functions of its own looks like work)
        x += 1


_stopped: list[int] = []


def _poll(stop):
    import os

    while not os.path.exists("/nonexistent/ready") and not stop.is_set():
        stop.wait(0.01)


def _poll_logging(stop):
    import tempfile

    with tempfile.TemporaryFile() as fh:  # a wait that says so every 10 ms: a log line is no work
        while not stop.is_set():
            fh.write(b"still waiting for /nonexistent/ready\n" * 2)
            fh.flush()
            stop.wait(0.01)


def test_a_training_thread_working_on_its_own_moves_and_a_stuck_one_does_not():
    # work of its own between collectives: computing in varied code, or reading and writing bytes
    # (a single stack a look read it as moving in 4-7 of 8 looks; four looks missed in a row make a hang finding)
    assert _moves_while(_tokenize) >= 7
    assert _moves_while(_write) >= 6
    # asleep (or blocked), spinning on one line, polling for something that never comes: no move
    assert _moves_while(_sleep) == 0
    assert _moves_while(_spin) == 0
    assert _moves_while(_poll) == 0
    assert _moves_while(_poll_logging) == 0


def test_a_look_after_progress_only_sets_a_new_baseline():
    header: dict[str, int] = {}
    activity = Activity(header.__setitem__)
    for progress in range(5):  # a collective between every two looks: nothing to judge
        activity.look(progress_ns=progress)
    assert "moving_ns" not in header
