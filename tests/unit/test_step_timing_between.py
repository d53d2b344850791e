"""The time a rank spends between steps (probe/step_timing.py): from the optimizer step to the next training
forward, less data loading, waits and the probe's own checks; an evaluation loop's batches are not data."""

from __future__ import annotations

import time

import torch

from trainscout.probe.step_timing import StepTiming


def _timing():
    records = []
    timing = StepTiming(lambda *rec: records.append(rec))
    return timing, records


def _between_us(records) -> int:
    desc = records[-1][-1]
    return int(desc.partition("|")[0].split(":")[7])


def test_work_before_the_training_forward_is_time_between_steps():
    timing, records = _timing()
    timing.after_step(1)
    time.sleep(0.03)  # the script's own work: evaluation, logging
    timing.training_forward()
    time.sleep(0.02)  # the training step itself
    timing.training_forward()  # a second micro-batch: not the step's first forward
    timing.after_step(2)
    assert 25_000 <= _between_us(records) < 45_000


def test_data_waits_and_the_probes_own_checks_are_not_time_between_steps():
    timing, records = _timing()
    timing.after_step(1)
    timing.exclude_wall(0.02)
    timing.add_wait("0", 0.01)
    timing.data_s += 0.005
    time.sleep(0.036)
    timing.training_forward()
    timing.after_step(2)
    assert _between_us(records) < 8_000


def test_a_step_without_a_training_forward_reports_none():
    timing, records = _timing()
    timing.after_step(1)
    timing.after_step(2)
    assert _between_us(records) == -1


def test_batches_fetched_with_autograd_off_are_not_data_loading():
    import torch.utils.data.dataloader as dataloader

    timing, _ = _timing()
    cls = dataloader._BaseDataLoaderIter
    real = cls.__next__
    timing.wrap_dataloader(dataloader)
    try:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 2)), batch_size=8)
        with torch.no_grad():
            assert len(list(loader)) == 8  # an evaluation loop
        assert timing.data_s == 0.0
        assert len(list(loader)) == 8  # the training's batches
        assert timing.data_s > 0.0
    finally:
        cls.__next__ = real


def _wait_us(records) -> int:
    return int(records[-1][-1].partition("|")[0].split(":")[2])


def test_the_gradient_sync_wait_ends_when_backward_returns():
    timing, records = _timing()
    timing.after_step(1)
    timing.backward_ended()
    time.sleep(0.01)  # DDP waits for its reduction in the engine's final callback
    timing.backward_returned()
    time.sleep(0.03)  # the script's own time before the optimizer step (a wrapped step, clipping)
    timing.before_optimizer_step()
    timing.after_step(2)
    assert 8_000 <= _wait_us(records) < 25_000


def test_without_backwards_return_the_wait_ends_at_the_optimizer_step():
    timing, records = _timing()
    timing.after_step(1)
    timing.backward_ended()
    time.sleep(0.02)
    timing.before_optimizer_step()
    timing.after_step(2)
    assert _wait_us(records) >= 18_000


class _SlowItems(torch.utils.data.Dataset):
    """Each item takes 5 ms to make, in whichever process makes it."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.zeros(2)


def test_waiting_for_dataloader_workers_is_reported_apart_from_loading_in_the_rank():
    """A worker process's batch is waited for, not loaded, by the rank: the step reports that part on its own
    (its healthy waits come in bursts on a busy machine, and are judged over longer windows)."""
    import torch.utils.data.dataloader as dataloader

    timing, records = _timing()
    cls = dataloader._BaseDataLoaderIter
    real = cls.__next__
    timing.wrap_dataloader(dataloader)
    try:
        timing.after_step(1)
        assert len(list(torch.utils.data.DataLoader(_SlowItems(), batch_size=4))) == 4  # in the rank
        timing.after_step(2)
        in_rank = [int(x) for x in records[-1][-1].partition("|")[0].split(":")]
        assert in_rank[0] >= 60_000 and in_rank[8] == 0
        workers = torch.utils.data.DataLoader(_SlowItems(), batch_size=4, num_workers=1, prefetch_factor=1)
        assert len(list(workers)) == 4
        timing.after_step(3)
        from_workers = [int(x) for x in records[-1][-1].partition("|")[0].split(":")]
        assert from_workers[8] > 0 and from_workers[8] == from_workers[0]
    finally:
        cls.__next__ = real


def test_the_probes_own_checks_are_not_in_the_steps_wall_time():
    """A replay or state check after the optimizer step is trainscout's time: left in the next step's wall time
    (less its CPU) it read as time the rank was blocked, and its regular schedule as an intermittent straggler."""
    timing, records = _timing()
    timing.after_step(1)
    time.sleep(0.03)  # the probe's checks after step 1
    timing.exclude_wall(0.03)
    timing.training_forward()
    time.sleep(0.02)  # the training step itself
    timing.after_step(2)
    wall_ns = records[-1][3]
    assert 15_000_000 <= wall_ns < 40_000_000


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _fwd_cpu_us(records) -> int:
    return int(records[-1][-1].partition("|")[0].split(":")[10])


def test_the_forward_phase_cpu_is_counted_per_micro_batch_up_to_backwards_call():
    timing, records = _timing()
    timing.after_step(1)
    _burn(0.01)  # before the forward: not the forward phase
    for _ in range(2):  # two micro-batches: each forward to its backward's call
        timing.training_forward()
        _burn(0.02)
        timing.backward_started()
        _burn(0.015)  # backward
    timing.after_step(2)
    assert 38_000 <= _fwd_cpu_us(records) < 50_000
    timing.after_step(3)  # a step without a training forward: not measured
    assert _fwd_cpu_us(records) == -1
