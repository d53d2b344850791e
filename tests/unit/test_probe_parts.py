"""probe/parts.py: every part the probe composes reports its cost and flushes through one small contract."""

from __future__ import annotations

import inspect

import pytest

from trainscout.probe import gather_check, hpz_check, link_probe, nonfinite, publisher, replay, state_check, step_timing
from trainscout.probe.parts import Flushes, Part

PARTS = [
    state_check.StateCheck,
    nonfinite.NonFiniteCheck,
    step_timing.StepTiming,
    hpz_check.HpzCheck,
    gather_check.GatherCheck,
    replay.Replay,
    link_probe.LinkProbe,
    publisher.Publisher,
]


@pytest.mark.parametrize("cls", PARTS, ids=lambda c: c.__name__)
def test_each_part_names_its_figures_and_reports_its_cost(cls):
    assert isinstance(cls.name, str) and cls.name
    assert callable(getattr(cls, "costs", None))
    assert inspect.signature(cls.costs).parameters.keys() == {"self"}


def test_the_cost_keys_are_distinct():
    names = [c.name for c in PARTS]
    assert len(names) == len(set(names))


def test_a_real_replay_and_link_probe_report_what_they_did():
    records: list = []
    rp = replay.Replay(lambda *a: records.append(a), every=5, rank=0)
    assert isinstance(rp, Part)
    assert rp.costs() == {
        "seconds": 0.0,
        "count": 0,
        "every": 5,
        "interval": 5,
        "layers": 0,
        "layer_names": [],
        "left_out": [],
    }
    lp = link_probe.LinkProbe(lambda *a: records.append(a), 0, lambda text: None)
    assert isinstance(lp, Part) and lp.costs() is None  # nothing probed: nothing to say


def test_checks_with_results_in_flight_flush():
    for cls in (state_check.StateCheck, nonfinite.NonFiniteCheck, step_timing.StepTiming, hpz_check.HpzCheck):
        assert issubclass(cls, Flushes), cls


def test_layers_the_forward_did_not_call_are_skipped_and_the_rotation_stays_per_layer():
    """Experts no token was routed to are never called: replay skips them. Only hooks that never run at all (a
    compiled forward hides them) make the whole model one layer; two uncalled experts in a row did that."""
    import torch
    from torch import nn

    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            h = self.inp(x)
            return self.experts[0](h) + self.experts[3](h)  # experts 1 and 2: never chosen

    model = Routed().train()
    rp = replay.Replay(lambda *a: None, every=1, rank=0)
    rp.attach(model, object(), 0, lambda *a, **k: None)  # one replica: the broadcasts have nobody to reach
    for step in range(1, 16):
        rp.arm_if_due(step)
        model(torch.randn(2, 4)).sum().backward()
        rp.run(step)
    assert [name for name, _ in rp.layers] == ["inp", "experts.0", "experts.1", "experts.2", "experts.3"]
    assert rp.count == 9  # 3 rotations of the 3 layers called


def _module(**children):
    """A container of these submodules (a model's structure is all the rotation reads)."""
    from torch import nn

    m = nn.Module()
    for name, child in children.items():
        setattr(m, name, child)
    return m


def _encoder():
    from torch import nn

    return _module(layer=nn.ModuleList(nn.Linear(4, 4) for _ in range(2)))


def _rotation(model) -> list[str]:
    rp = replay.Replay(lambda *a: None, every=1, rank=0)
    rp.attach(model, object(), 0, lambda *a, **k: None)  # one replica: the broadcasts have nobody to reach
    return [name for name, _ in rp.layers]


def test_the_rotation_goes_down_to_the_blocks_of_nested_library_models():
    """BERT-shaped: the masked-LM model holds the model, which holds the encoder, which holds the block list; the
    rotation was [bert, cls] (the whole encoder one layer)."""
    from torch import nn

    model = _module(bert=_module(embeddings=nn.Embedding(8, 4), encoder=_encoder()), cls=nn.Linear(4, 8))
    assert _rotation(model) == ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls"]


def test_a_child_compiled_in_place_stays_one_layer_of_the_rotation():
    """Hooks inside a compiled module are traced into its graph (a recompilation each time one is added): the
    rotation does not go down into it, whatever block lists it holds."""
    from torch import nn

    encoder = _encoder()
    encoder.compile()
    assert _rotation(_module(encoder=encoder, head=nn.Linear(4, 8))) == ["encoder", "head"]


def test_the_tap_refuses_the_jobs_collectives_while_replay_recomputes():
    """A stage's replicas replay alone: a layer calling a collective there would wait for ranks not replaying."""
    from trainscout.probe.collectives import CollectiveRefused, CollectiveTap

    tap = CollectiveTap(lambda: 0)
    calls = []
    all_reduce = tap._wrap("all_reduce", lambda *a, **k: calls.append(a))
    with tap.refusing():
        with pytest.raises(CollectiveRefused):
            all_reduce("tensor")
    assert calls == []
    all_reduce("tensor")  # outside the replay, as before
    assert calls == [("tensor",)]
