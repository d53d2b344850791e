"""The coordinator's collection schedule: no collection starts by itself while it runs; a full one runs when due."""

import gc

from trainscout.coordinator import collection
from trainscout.coordinator.collection import Collection


def test_no_collection_starts_by_itself_and_the_collector_comes_back_after():
    assert gc.isenabled()
    with Collection() as c:
        assert not gc.isenabled()
        assert c.maybe_full(0.0) == 0.0  # not due yet: the first one comes FULL_EVERY_S after the start
    assert gc.isenabled()


def test_a_due_full_collection_frees_a_cycle_and_sets_the_next_by_its_cost():
    class Node:
        pass

    with Collection() as c:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: reference counting alone never frees it
        del a, b
        assert any(type(o) is Node for o in gc.get_objects())
        due = c._next_full
        assert c.maybe_full(due) >= 0.0
        assert c.found >= 2 and not any(type(o) is Node for o in gc.get_objects())
        assert c._next_full >= due + collection.FULL_EVERY_S
        assert c.maybe_full(due + 1.0) == 0.0  # the next is a full interval away


def test_a_collector_switched_off_by_the_program_stays_off():
    gc.disable()
    try:
        with Collection() as c:
            assert c.maybe_full(c._next_full) == 0.0
        assert not gc.isenabled()
    finally:
        gc.enable()
