"""The probe thread's work is credited to the step it happened in (probe/publisher.py `busy_now`)."""

from __future__ import annotations

import threading
import time
import uuid

from trainscout.channel.writer import ChannelWriter
from trainscout.probe.publisher import Publisher
from trainscout.probe.step_timing import StepTiming


def test_a_tick_under_way_counts_for_the_step_that_ends_meanwhile():
    """A Flight Recorder dump holds the GIL for ~5 ms; the training thread waiting for it ended its step before
    the tick ended, and the dump's time was credited to the next step, where nothing was blocked: a dump every
    18 steps read as a rank blocked 5 ms every 18 steps (a clean 4-rank job named it a straggler)."""
    writer = ChannelWriter(f"busy-{uuid.uuid4().hex[:8]}", 0, 0, 1)
    in_tick, release = threading.Event(), threading.Event()

    def slow_tick() -> None:
        in_tick.set()
        release.wait(5.0)

    pub = Publisher(writer, writer.path, 0, None, lambda: 0, tick_s=0.01, on_tick=slow_tick)
    timing = StepTiming(lambda *record: None, other_thread_s=pub.busy_now)
    try:
        pub.start()
        assert in_tick.wait(5.0)
        before = timing._other_us()
        time.sleep(0.2)
        during = timing._other_us()  # the step ends while the tick is still under way
        release.set()
        time.sleep(0.05)
        after = timing._other_us()
        assert pub.busy_s >= 0.2 and during >= 190_000, (before, during, after)
        assert after < 100_000  # the tick's time is not credited a second time when it ends
    finally:
        release.set()
        pub.stop_event.set()
        pub.join(2.0)
        writer.close()
