"""The probe's module hooks under torch.compile: run as plain Python, never recompiled, never in the graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from trainscout.probe.compiled import compiled_in_place, eager_hook, forced_eager, on_dynamo_import


class Counter:
    """A hook whose state changes at every call, as the probe's do: dynamo would guard on it."""

    def __init__(self) -> None:
        self.calls = 0
        self.shapes: list[tuple] = []

    def __call__(self, module, args) -> None:
        self.calls += 1
        self.shapes.append(tuple(args[0].shape))


class Net(nn.Module):
    """A model of the user's own (dynamo traces nn's built-in containers differently)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


@pytest.fixture
def no_recompiles():
    import torch._dynamo

    on_dynamo_import()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["in place", "wrapper"])
def test_a_hook_on_a_compiled_model_runs_every_call_without_recompiling(no_recompiles, how):
    model = Net()
    counter = Counter()
    model.register_forward_pre_hook(eager_hook(counter))
    if how == "in place":
        model.compile(fullgraph=True, backend="eager", dynamic=True)
        run = model
    else:
        run = torch.compile(model, fullgraph=True, backend="eager", dynamic=True)
    for batch in (2, 3, 5, 7, 2):
        run(torch.randn(batch, 4))
    assert counter.calls == 5 and [s[0] for s in counter.shapes] == [2, 3, 5, 7, 2]


def test_a_hook_inside_a_compiled_model_leaves_its_graph_alone(no_recompiles):
    """A hook on a layer traced into the graph does nothing there: no guard on its state, no graph break."""
    model = Net()
    counter = Counter()
    model.first.register_forward_pre_hook(eager_hook(counter))
    model.compile(fullgraph=True, backend="eager")
    for _ in range(4):
        model(torch.randn(3, 4))
    assert counter.calls == 0
    assert compiled_in_place(model) and not compiled_in_place(model.first)
    model.first(torch.randn(3, 4))  # the same layer called eagerly: the hook runs
    assert counter.calls == 1


def test_forced_eager_runs_a_compiled_model_without_compiling(no_recompiles):
    model = Net()
    model.compile(fullgraph=True, backend="eager")
    x = torch.randn(3, 4)
    expected = model(x)
    model.eval()  # a new mode: compiled, it would be a recompilation
    with forced_eager(), torch.enable_grad():
        assert torch.equal(model(x), expected)
