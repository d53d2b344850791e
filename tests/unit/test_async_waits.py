"""Waits on asynchronous calls' handles are the step's waits (probe/step_timing.py): on the thread that runs the
steps, outside the gradient-sync wait (counted whole), never twice."""

from __future__ import annotations

import threading
import time

from trainscout.markers import ASYNC_WAIT
from trainscout.probe.step_timing import StepTiming


def _timing():
    records = []
    timing = StepTiming(lambda *rec: records.append(rec))
    timing.after_step(1)  # the stepping thread is known from the first step's end
    return timing, records


def _wait_us(records) -> tuple[int, dict[str, int]]:
    desc = records[-1][-1]
    fields, _, groups = desc.partition("|")
    pg = {name: int(us) for name, us in (item.split("=") for item in groups.split(",") if item)}
    return int(fields.split(":")[2]), pg


def _wait_on_handle(timing, seconds: float) -> None:
    token = timing.async_wait_begin()
    time.sleep(seconds)
    if token is not None:
        timing.async_wait_end(token)


def test_a_wait_on_a_handle_is_a_wait():
    timing, records = _timing()
    _wait_on_handle(timing, 0.02)
    timing.after_step(2)
    wait_us, pg = _wait_us(records)
    assert wait_us >= 19_000
    assert pg[ASYNC_WAIT] == wait_us


def test_a_wait_on_another_thread_is_not_the_steps():
    timing, records = _timing()
    other = threading.Thread(target=_wait_on_handle, args=(timing, 0.02))
    other.start()
    other.join()
    timing.after_step(2)
    assert _wait_us(records) == (0, {})


def test_waits_inside_the_gradient_sync_wait_are_counted_once():
    timing, records = _timing()
    t0 = time.perf_counter()
    timing.backward_ended()
    _wait_on_handle(timing, 0.01)  # FSDP2's last reduce-scatter, waited in its final callback
    timing.add_wait("0", 0.01)  # a blocking collective there: in the span as well
    time.sleep(0.01)
    timing.backward_returned()
    span_us = (time.perf_counter() - t0) * 1e6
    timing.after_step(2)
    wait_us, pg = _wait_us(records)
    assert 19_000 <= wait_us <= span_us  # the span, once: not 10 + 10 ms more
    assert ASYNC_WAIT not in pg
