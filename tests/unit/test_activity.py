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
