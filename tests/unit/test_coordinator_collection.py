"""The coordinator's collection schedule: no full collection starts by itself while it runs; one runs when due."""

import gc

from trainscout.coordinator import collection
from trainscout.coordinator.collection import Collection


def test_full_collections_wait_for_their_schedule_and_thresholds_come_back():
    before = gc.get_threshold()
    with Collection() as c:
        gen0, gen1, gen2 = gc.get_threshold()
        assert (gen0, gen1) == before[:2] and gen2 == collection.NEVER
        assert c.maybe_full(0.0) == 0.0  # not due yet: the first one comes FULL_EVERY_S after the start
    assert gc.get_threshold() == before


def test_a_due_full_collection_frees_a_cycle_and_sets_the_next_by_its_cost():
    class Node:
        pass

    with Collection() as c:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: reference counting alone never frees it
        del a, b
        due = c._next_full
        took = c.maybe_full(due)
        assert took >= 0.0
        assert not any(type(o) is Node for o in gc.get_objects())
        assert c._next_full >= due + collection.FULL_EVERY_S - 1.0
        assert c.maybe_full(due + 1.0) == 0.0  # the next is a full interval away
