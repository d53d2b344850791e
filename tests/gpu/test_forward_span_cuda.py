"""The GPU's span of a step's training forwards (probe/step_timing.py), read from events on the training stream:
work queued in the forward shows in it, work queued in backward does not, and it stays within the step's span
to the end of backward (the compute it is a part of)."""

from __future__ import annotations

import torch

from trainscout.probe.step_timing import StepTiming

GPU_FIELD, FWD_FIELD = 3, 10  # in a step record's "a:b:c..." description


def _fields(rec) -> list[int]:
    return [int(x) for x in rec[-1].partition("|")[0].split(":")]


def test_work_queued_in_the_forward_shows_in_its_span_and_backward_work_does_not(cuda):
    records: list = []
    timing = StepTiming(lambda *rec: records.append(rec))
    w = torch.randn(1024, 1024, device=cuda, requires_grad=True)
    extra = torch.randn(2048, 2048, device=cuda)

    def step(n: int, fwd_work: int, bwd_work: int) -> None:
        timing.training_forward()
        with torch.no_grad():
            for _ in range(fwd_work):  # the forward's own extra kernels (a slow module)
                extra @ extra
        loss = (w @ w).float().pow(2).mean()
        timing.backward_started()  # as the probe's backward wrapper calls them
        timing.on_loss(loss)
        loss.backward()
        with torch.no_grad():
            for _ in range(bwd_work):  # work after the forward: backward's side
                extra @ extra
        timing.backward_ended()
        timing.backward_returned()
        timing.before_optimizer_step()
        timing.after_step(n)

    for n in range(1, 7):
        step(n, 0, 0)  # the first CUDA step starts the timing: its own forward is not measured
    for n in range(7, 13):
        step(n, 30, 0)
    for n in range(13, 19):
        step(n, 0, 30)
    timing.flush()
    by_step = {rec[1]: _fields(rec) for rec in records}
    fwd_heavy = [by_step[n] for n in range(8, 13)]
    bwd_heavy = [by_step[n] for n in range(14, 19)]
    for f in fwd_heavy + bwd_heavy:
        assert 0 <= f[FWD_FIELD] <= f[GPU_FIELD] * 1.02 + 50, f
    assert all(f[FWD_FIELD] > 0.7 * f[GPU_FIELD] for f in fwd_heavy), fwd_heavy
    assert all(f[FWD_FIELD] < 0.3 * f[GPU_FIELD] for f in bwd_heavy), bwd_heavy
