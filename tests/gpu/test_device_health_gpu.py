"""The NVML sampler on a real GPU: sane readings under load, this process found on its GPU, the CUDA device
matched to its NVML reading by UUID, and the cost of one sample (printed; run with -s to see it)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import time

import pytest
import torch

from trainscout.agent.device_health import DeviceSampler
from trainscout.detectors.device_health import DeviceHealthDetector, GpuSample, summarize

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="nvidia-ml-py not installed")


@pytest.fixture
def sampler():
    s = DeviceSampler()
    if not s.enabled:
        pytest.skip(f"NVML unavailable: {s.reason}")
    yield s
    s.close()


def _load(cuda: torch.device) -> torch.Tensor:
    """Enqueue about a second of matrix products, so the GPU is busy (boost clocks, power) while sampled."""
    a = torch.randn(8192, 8192, device=cuda, dtype=torch.bfloat16)
    for _ in range(600):
        a = a @ a
        a = a / a.abs().amax().clamp_min(1)
    return a


def test_sampler_reads_sane_values_under_load(sampler, cuda):
    print("\n" + sampler.describe())
    out = _load(cuda)
    time.sleep(0.3)  # let utilisation and power (averaged over ~1 s by the driver) see the load
    readings = sampler.sample()
    assert readings, sampler.reason
    for r in readings:
        print(r)
        assert r.name and r.uuid.startswith("GPU-") and r.pci_bus_id
        assert r.sm_clock_mhz > 0 and r.mem_clock_mhz > 0 and r.max_sm_clock_mhz >= r.sm_clock_mhz
        assert 10 <= r.temperature_c <= 110
        assert r.power_w > 0 and r.power_limit_w > 0
        assert 0 <= r.gpu_util_pct <= 100
        assert "gpu_lost" not in r.errors
    # this process holds a CUDA context: NVML lists it on the GPU it runs on
    mine = sampler.gpus_of_pid(os.getpid())
    print(f"pid {os.getpid()} on NVML GPU(s) {mine}; pids by GPU {sampler.pids_by_gpu()}")
    assert mine, "this process's pid is not among NVML's compute processes (pid namespace?)"
    # the rank-side way to find its GPU without pids: the CUDA device's UUID
    uuid = "GPU-" + str(torch.cuda.get_device_properties(cuda).uuid)
    by_uuid = [r.index for r in readings if r.uuid == uuid]
    print(f"CUDA {cuda} has UUID {uuid}: NVML index {by_uuid}")
    assert by_uuid and by_uuid[0] in mine
    busy = next(r for r in readings if r.index == by_uuid[0])
    print("busy GPU:", summarize(GpuSample.from_reading("this", busy)))
    torch.cuda.synchronize()
    del out


def test_sample_cost_and_no_finding_on_a_healthy_gpu(sampler, cuda):
    out = _load(cuda)
    costs, det, found = [], DeviceHealthDetector(), []
    for i in range(20):
        start = time.perf_counter()
        readings = sampler.sample()
        costs.append(time.perf_counter() - start)
        for r in readings:
            det.add(GpuSample.from_reading(f"gpu{r.index}", r), now=float(i))
        found += det.update([[f"gpu{r.index}" for r in readings]], now=float(i))
        time.sleep(0.05)
    torch.cuda.synchronize()
    n = len(readings)
    print(
        f"\n{n} GPU(s), XID events {sampler.xid_status}; one sample: median "
        f"{1e3 * statistics.median(costs):.2f} ms, max {1e3 * max(costs):.2f} ms "
        f"({1e3 * statistics.median(costs) / n:.2f} ms per GPU)"
    )
    for r in readings:
        print(f"gpu {r.index}: {summarize(GpuSample.from_reading(str(r.index), r))}; errors {r.errors}")
    assert found == []
    # one sample per agent interval (~1 s): it must stay a small part of it
    assert statistics.median(costs) < 0.05 * max(1, n)
    del out


def _time_call(fn, *args, reps: int = 50) -> float:
    fn(*args)
    start = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - start) / reps


def test_cost_of_each_nvml_query(sampler):
    """Where the time of one sample goes (printed), so the agent can drop an expensive query if needed."""
    import pynvml as nvml

    h = nvml.nvmlDeviceGetHandleByIndex(0)
    calls = {
        "compute processes": (nvml.nvmlDeviceGetComputeRunningProcesses, h),
        "sm clock": (nvml.nvmlDeviceGetClockInfo, h, 1),
        "clock event reasons": (nvml.nvmlDeviceGetCurrentClocksEventReasons, h),
        "temperature": (nvml.nvmlDeviceGetTemperature, h, 0),
        "power usage": (nvml.nvmlDeviceGetPowerUsage, h),
        "enforced power limit": (nvml.nvmlDeviceGetEnforcedPowerLimit, h),
        "utilization": (nvml.nvmlDeviceGetUtilizationRates, h),
        "field values (10 counters)": (nvml.nvmlDeviceGetFieldValues, h, [3, 4, 31, 38, 45, 52, 59, 94, 144, 145]),
    }
    print()
    for what, (fn, *args) in calls.items():
        try:
            print(f"{what:28s} {1e6 * _time_call(fn, *args):8.1f} us")
        except Exception as exc:  # report, do not fail: the sampler guards each of them the same way
            print(f"{what:28s} failed: {exc}")
    if sampler._events is not None:
        wait = getattr(nvml, "nvmlEventSetWait_v2", nvml.nvmlEventSetWait)

        def drain():
            try:
                wait(sampler._events, 0)
            except nvml.NVMLError:
                pass

        print(f"{'event wait (timeout 0)':28s} {1e6 * _time_call(drain):8.1f} us")
    start = time.perf_counter()
    DeviceSampler().close()
    print(f"{'start + close a sampler':28s} {1e3 * (time.perf_counter() - start):8.1f} ms")
