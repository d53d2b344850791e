"""Device health on plain data: the detector over synthetic NVML readings (healthy jitter, a throttled GPU,
a hot one, error counters, XIDs, two GPUs), the one-line summary, and the sampler without a GPU (without
nvidia-ml-py, with it but no driver, and over a fake NVML that refuses some queries)."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from types import SimpleNamespace

import msgspec
import pytest

from trainscout.agent.device_health import XID_EVENT, DeviceSampler
from trainscout.detectors.device_health import (
    ECC_UNCORRECTED,
    GPU_LOST,
    NVLINK_ERRORS,
    PCIE_REPLAY,
    POWER_DEVIATION,
    ROWS_PENDING,
    SM_CLOCK_LOW,
    TEMPERATURE_HIGH,
    THROTTLE,
    XID,
    DeviceHealthConfig,
    DeviceHealthDetector,
    GpuSample,
    summarize,
)
from trainscout.wire.device import DeviceReading, decode_throttle

CFG = DeviceHealthConfig()


def _gpus(n: int) -> list[str]:
    return [f"h0:gpu{i}" for i in range(n)]


def _healthy(
    gpu: str,
    t: float,
    rng: random.Random,
    *,
    temp_offset: float = 0.0,
    idle: bool = False,
    clock_bias: float = 0.0,
    **over,
) -> GpuSample:
    """A busy (or idle) healthy H200 as NVML shows it during training: boost clock with power-cap dips,
    power swinging with the step's phases, temperature by slot position plus noise."""
    if idle:
        values = dict(
            sm_clock_mhz=345,
            throttle_mask=0x1,
            throttle_reasons=("gpu_idle",),
            gpu_util_pct=0,
            power_w=rng.uniform(80, 120),
            temperature_c=round(38 + temp_offset + rng.gauss(0, 1)),
        )
    else:
        dip = rng.random() < 0.3
        clock = rng.choice([1755, 1830, 1905]) if dip else 1980
        clock = round(clock * (1 - clock_bias))
        values = dict(
            sm_clock_mhz=clock,
            throttle_mask=0x4 if dip else 0,
            throttle_reasons=("sw_power_cap",) if dip else (),
            gpu_util_pct=rng.choice([96, 99, 100, 100]),
            power_w=rng.uniform(420, 700),
            temperature_c=round(62 + temp_offset + rng.gauss(0, 2)),
        )
    base = dict(
        gpu=gpu,
        time_s=t,
        name="NVIDIA H200",
        max_sm_clock_mhz=1980,
        mem_clock_mhz=3201,
        power_limit_w=700,
        mem_util_pct=40,
        ecc_corrected=3,
        ecc_uncorrected=0,
        retired_pages_pending=-1,
        remapped_rows_pending=0,
        remap_failure=0,
        pcie_replay=2,
        nvlink_crc_flit=0,
        nvlink_crc_data=0,
        nvlink_replay=0,
        nvlink_recovery=0,
    )
    base.update(values)
    base.update(over)
    return GpuSample(**base)


def _run(det, gpus, rounds, make, start=0):
    """Feed `rounds` sample rounds (one sample per GPU per round, 1 s apart); observations per round."""
    per_round = []
    for i in range(start, start + rounds):
        for g in gpus:
            det.add(make(g, float(i), i), now=float(i))
        per_round.append(det.update([gpus], now=float(i)))
    return per_round


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_healthy_gpus_with_jitter_give_nothing(n):
    """The first requirement: nothing at all over a long run of healthy, jittery, not quite identical GPUs,
    with idle phases the GPUs enter and leave a sample or two apart (their agents sample unsynchronised)."""
    gpus = _gpus(n)
    rng = random.Random(n)
    offsets = {g: rng.uniform(-6, 8) for g in gpus}  # slot position in the chassis
    lag = {g: rng.randint(0, 2) for g in gpus}
    bias = {g: (0.06 if i == 0 else 0.0) for i, g in enumerate(gpus)}  # a leaky chip, 6 % lower under the cap

    def make(g, t, i):
        idle = (i + lag[g]) % 200 < 12  # eval / checkpoint pauses every 200 s
        return _healthy(g, t, rng, temp_offset=offsets[g], idle=idle, clock_bias=bias[g])

    found = [o for r in _run(DeviceHealthDetector(), gpus, 1000, make) for o in r]
    assert found == []


def test_throttled_gpu_is_named_after_persistence_not_before():
    gpus = _gpus(4)
    rng = random.Random(1)
    fault_from = 30

    def make(g, t, i):
        if g == gpus[2] and i >= fault_from:
            return _healthy(g, t, rng, sm_clock_mhz=1386, throttle_mask=0x8, throttle_reasons=("hw_slowdown",))
        return _healthy(g, t, rng)

    det = DeviceHealthDetector()
    rounds = _run(det, gpus, fault_from + 40, make)
    when = {o.kind: i for i, r in enumerate(rounds) for o in r}
    # named at the sample persistence allows, not one before: the throttle reason after 5 faulty
    # samples, the clock (every sample of the window low, then k judgements) after 7
    assert when == {
        THROTTLE: fault_from + CFG.samples_to_name_throttle - 1,
        SM_CLOCK_LOW: fault_from + CFG.samples_to_name - 1,
    }
    assert (CFG.samples_to_name_throttle, CFG.samples_to_name) == (5, 7)
    found = [o for r in rounds for o in r]
    assert sorted(o.kind for o in found) == [SM_CLOCK_LOW, THROTTLE]  # once per episode, not every round
    assert all(o.gpu == gpus[2] and o.attributable for o in found)
    clock = next(o for o in found if o.kind == SM_CLOCK_LOW)
    assert clock.evidence["value"] == 1386 and clock.evidence["peers_median"] >= 1830
    assert "30 % below" in clock.summary and "throttled: hw_slowdown" in clock.summary
    throttle = next(o for o in found if o.kind == THROTTLE)
    assert throttle.evidence["reason"] == "hw_slowdown" and throttle.evidence["status"] == "attributed"


def test_a_short_dip_is_not_named():
    gpus = _gpus(4)
    rng = random.Random(2)

    def make(g, t, i):
        if g == gpus[1] and 20 <= i < 20 + CFG.samples_to_name_throttle - 1:
            return _healthy(g, t, rng, sm_clock_mhz=1200, throttle_mask=0x8, throttle_reasons=("hw_slowdown",))
        return _healthy(g, t, rng)

    assert [o for r in _run(DeviceHealthDetector(), gpus, 60, make) for o in r] == []


def test_thermal_outlier_is_named():
    gpus = _gpus(4)
    rng = random.Random(3)

    def make(g, t, i):
        return _healthy(g, t, rng, temperature_c=95 if g == gpus[3] and i >= 10 else round(62 + rng.gauss(0, 2)))

    found = [o for r in _run(DeviceHealthDetector(), gpus, 40, make) for o in r]
    assert [(o.gpu, o.kind, o.attributable) for o in found] == [(gpus[3], TEMPERATURE_HIGH, True)]
    assert "95 C" in found[0].summary and "above its peers'" in found[0].summary


def test_hot_because_busier_is_not_named():
    """One GPU working while its peers idle (rank 0 alone on an evaluation) is hotter for a reason."""
    gpus = _gpus(4)
    rng = random.Random(4)

    def make(g, t, i):
        if g == gpus[0]:
            return _healthy(g, t, rng, temperature_c=85)
        return _healthy(g, t, rng, idle=True)

    assert [o for r in _run(DeviceHealthDetector(), gpus, 40, make) for o in r] == []


def test_relative_deviation_with_two_gpus_is_inconclusive():
    gpus = _gpus(2)
    rng = random.Random(5)

    def make(g, t, i):
        if g == gpus[1] and i >= 10:
            return _healthy(g, t, rng, sm_clock_mhz=1386, throttle_mask=0x8, throttle_reasons=("hw_slowdown",))
        return _healthy(g, t, rng)

    found = [o for r in _run(DeviceHealthDetector(), gpus, 40, make) for o in r]
    assert sorted(o.kind for o in found) == [SM_CLOCK_LOW, THROTTLE]
    assert all(not o.attributable and o.gpu == gpus[1] for o in found)
    assert all(o.summary.startswith("no majority among 2 GPUs") for o in found)
    assert all(o.evidence["status"] == "inconclusive" for o in found)


def test_two_gpus_far_apart_in_power_give_one_inconclusive_observation():
    gpus = _gpus(2)
    rng = random.Random(6)

    def make(g, t, i):
        return _healthy(g, t, rng, power_w=300 if g == gpus[0] else 650)

    found = [o for r in _run(DeviceHealthDetector(), gpus, 30, make) for o in r]
    assert [(o.kind, o.attributable) for o in found] == [(POWER_DEVIATION, False)]
    assert found[0].evidence["suspects"] == gpus


def test_inconclusive_becomes_attributed_when_a_third_gpu_joins():
    gpus = _gpus(3)
    rng = random.Random(7)
    det = DeviceHealthDetector()

    def make(g, t, i):
        return _healthy(g, t, rng, temperature_c=97 if g == gpus[0] else 60)

    found = []
    for i in range(30):
        members = gpus if i >= 15 else gpus[:2]
        for g in members:
            det.add(make(g, float(i), i), now=float(i))
        found += det.update([members], now=float(i))
    assert [(o.gpu, o.kind, o.attributable) for o in found] == [
        (gpus[0], TEMPERATURE_HIGH, False),
        (gpus[0], TEMPERATURE_HIGH, True),
    ]


def test_ecc_uncorrected_increase_is_attributed_even_with_two_gpus():
    gpus = _gpus(2)
    rng = random.Random(8)

    def make(g, t, i):
        return _healthy(g, t, rng, ecc_uncorrected=2 if g == gpus[1] and i >= 12 else 0)

    rounds = _run(DeviceHealthDetector(), gpus, 30, make)
    assert [(i, o.gpu, o.kind, o.attributable) for i, r in enumerate(rounds) for o in r] == [
        (12, gpus[1], ECC_UNCORRECTED, True)
    ]
    assert rounds[12][0].evidence["increase"] == 2


def test_counters_that_were_already_nonzero_or_reset_are_not_events():
    det = DeviceHealthDetector()
    rng = random.Random(9)
    values = [5, 5, 5, 0, 0, 0]  # nonzero since before the job, then a driver reload resets it
    found = []
    for i, v in enumerate(values):
        det.add(_healthy("g", float(i), rng, ecc_uncorrected=v, pcie_replay=1000 - 900 * (i >= 3)), now=float(i))
        found += det.update([["g"]], now=float(i))
    assert found == []


def test_xid_is_attributed_and_a_killed_process_cleanup_is_not():
    gpus = _gpus(2)
    rng = random.Random(10)

    def make(g, t, i):
        xids = ((79, t),) if g == gpus[0] and i == 7 else ((45, t),) if i == 9 else ()
        return _healthy(g, t, rng, xids=xids)

    found = [o for r in _run(DeviceHealthDetector(), gpus, 15, make) for o in r]
    assert [(o.gpu, o.kind, o.attributable) for o in found] == [(gpus[0], XID, True)]
    assert found[0].evidence["xid"] == 79 and found[0].evidence["cause"] == "device"
    assert "fallen off the bus" in found[0].summary


def test_application_xid_says_so():
    det = DeviceHealthDetector()
    det.add(_healthy("g", 1.0, random.Random(0), xids=((31, 1.0),)), now=1.0)
    (obs,) = det.update([], now=1.0)
    assert obs.kind == XID and obs.evidence["cause"] == "application" and "program error" in obs.summary


def test_counter_rates_rows_pending_and_lost_gpu():
    det = DeviceHealthDetector()
    rng = random.Random(11)
    found = []
    for i in range(80):
        over = dict(
            pcie_replay=2 + (i // 20),  # 1 replay every 20 s: a link at rest, not reported
            nvlink_recovery=1 if i >= 30 else 0,
            remapped_rows_pending=1 if 40 <= i < 50 else 0,
        )
        det.add(_healthy("a", float(i), rng, **over), now=float(i))
        det.add(
            _healthy(
                "b",
                float(i),
                rng,
                pcie_replay=2 + 3 * max(0, i - 62),  # 3 a second from 63 s
                errors=("gpu_lost",) if i >= 70 else (),
            ),
            now=float(i),
        )
        found += [(i, o.gpu, o.kind) for o in det.update([["a", "b"]], now=float(i))]
    assert found == [(30, "a", NVLINK_ERRORS), (40, "a", ROWS_PENDING), (65, "b", PCIE_REPLAY), (70, "b", GPU_LOST)]


def test_repeated_events_are_reported_at_most_every_repeat_s():
    det = DeviceHealthDetector(DeviceHealthConfig(repeat_s=100))
    rng = random.Random(12)
    found = []
    for i in range(250):
        det.add(_healthy("g", float(i), rng, ecc_uncorrected=i // 10), now=float(i))
        found += [(i, o.evidence["increase"]) for o in det.update([], now=float(i))]
    assert found == [(10, 1), (110, 10), (210, 10)]


def test_summary_text():
    s = GpuSample(
        gpu="g",
        sm_clock_mhz=1410,
        max_sm_clock_mhz=1980,
        throttle_mask=0x8,
        throttle_reasons=("hw_slowdown",),
        temperature_c=83,
        power_w=412.4,
        power_limit_w=700,
        gpu_util_pct=100,
        ecc_uncorrected=0,
        remapped_rows_pending=1,
    )
    assert (
        summarize(s) == "sm clock 1410 of 1980 MHz, throttled: hw_slowdown; 83 C; 412 of 700 W; util 100 %; "
        "row remap pending"
    )
    window = [
        s,
        GpuSample(
            gpu="g", sm_clock_mhz=1980, max_sm_clock_mhz=1980, throttle_mask=0, temperature_c=80, xids=((79, 1.0),)
        ),
    ]
    assert summarize(window).startswith("sm clock 1695 of 1980 MHz, throttled: hw_slowdown (1/2); 82 C")
    assert summarize(window).endswith("xid 79")
    assert summarize(GpuSample(gpu="g")) == "no device readings"


def test_detector_summary_of_a_gpu_for_another_finding():
    det = DeviceHealthDetector()
    rng = random.Random(13)
    for i in range(5):
        det.add(
            _healthy(
                "g",
                float(i),
                rng,
                sm_clock_mhz=1410,
                throttle_mask=0x8,
                throttle_reasons=("hw_slowdown",),
                temperature_c=83,
            ),
            now=float(i),
        )
    assert det.summary("g").startswith("sm clock 1410 of 1980 MHz, throttled: hw_slowdown; 83 C; ")
    assert det.summary("unknown") is None


def test_a_gpu_in_two_classes_is_refused():
    with pytest.raises(ValueError):
        DeviceHealthDetector().update([["a", "b"], ["b", "c"]], now=0.0)


def test_wire_reading_round_trips_and_converts():
    r = DeviceReading(
        index=3,
        uuid="GPU-1",
        name="NVIDIA H200",
        pci_bus_id="00000000:19:00.0",
        time_s=5.0,
        pids=[41],
        sm_clock_mhz=1410,
        throttle_mask=0x88,
        throttle_reasons=decode_throttle(0x88),
        xids=[(79, 4.5)],
        errors=["pcie_replay: Not Supported"],
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=DeviceReading)
    assert back == r and back.throttle_reasons == ["hw_slowdown", "hw_power_brake"]
    s = GpuSample.from_reading("h:3", back)
    assert s.gpu == "h:3" and s.sm_clock_mhz == 1410 and s.xids == ((79, 4.5),) and s.temperature_c == -1
    assert s.errors == ("pcie_replay: Not Supported",)
    assert GpuSample.from_reading("h:3", {"sm_clock_mhz": 7}).sm_clock_mhz == 7
    assert decode_throttle(-1) == [] and decode_throttle(0x1000) == []


def test_detector_imports_no_wire_probe_or_torch():
    code = (
        "import sys, trainscout.detectors.device_health; "
        "print([m for m in sys.modules if m.startswith(('trainscout.wire', 'trainscout.probe', 'torch'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- the sampler without a GPU ----------------------------------------------------------------------


def test_sampler_without_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    sampler = DeviceSampler()
    assert not sampler.enabled and "nvidia-ml-py is not installed" in sampler.reason
    assert sampler.sample() == [] and sampler.pids_by_gpu() == {} and sampler.gpus_of_pid(1) == []
    assert sampler.describe().startswith("device health off: ")
    sampler.close()


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="nvidia-ml-py not installed")
def test_sampler_with_nvidia_ml_py_but_no_driver():
    sampler = DeviceSampler()
    if sampler.enabled:
        sampler.close()
        pytest.skip("this machine has an NVIDIA driver and GPU: tests/gpu covers it")
    assert sampler.reason.startswith("nvmlInit failed: ")
    assert "\n" not in sampler.reason
    assert sampler.sample() == []


class _Err(Exception):
    TEXT = {3: "Not Supported", 10: "Timeout", 13: "Function Not Found", 15: "GPU is lost"}

    def __init__(self, value: int) -> None:
        super().__init__(self.TEXT.get(value, f"error {value}"))
        self.value = value


class _FakeNvml:
    """Enough of pynvml for the sampler: two GPUs, one refusing some queries, one XID queued."""

    NVMLError = _Err

    def __init__(self, init_error: int | None = None) -> None:
        self.init_error = init_error
        self.lost: set[int] = set()
        self.events = [SimpleNamespace(device=1, eventType=XID_EVENT, eventData=79)]
        self.asked_fields: list[list[int]] = []
        self.power_calls = 0
        self.shut = False

    def nvmlInit(self):
        if self.init_error is not None:
            raise _Err(self.init_error)

    def nvmlShutdown(self):
        self.shut = True

    def nvmlSystemGetDriverVersion(self):
        return b"580.159.04"

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{h + 0x19:02X}:00.0".encode())

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=4000 + h, usedGpuMemory=1 << 30)]

    def _check(self, h):
        if h in self.lost:
            raise _Err(15)

    def nvmlDeviceGetClockInfo(self, h, kind):
        self._check(h)
        return 1980 if kind == 1 else 3201

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x8 if h == 1 else 0

    def nvmlDeviceGetTemperatureV(self, h, sensor):
        raise _Err(13)  # an older driver: the sampler falls back to nvmlDeviceGetTemperature

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        self.power_calls += 1
        if h == 1:
            raise _Err(3)
        return 512_345

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=100, memory=37)

    def nvmlDeviceGetFieldValues(self, h, ids):
        self.asked_fields.append(list(ids))
        out = []
        for fid in ids:
            ret = 3 if fid in (31, 38, 45, 52, 59) else 0  # no page retirement, no NVLink on this board
            out.append(SimpleNamespace(nvmlReturn=ret, valueType=3, value=SimpleNamespace(ullVal=fid)))
        return out

    def nvmlEventSetCreate(self):
        return "events"

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return XID_EVENT | 0x1

    def nvmlDeviceRegisterEvents(self, h, types, events):
        assert types == XID_EVENT

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        assert timeout_ms == 0  # never blocks the agent
        if not self.events:
            raise _Err(10)
        return self.events.pop(0)

    def nvmlDeviceGetIndex(self, h):
        return h

    def nvmlEventSetFree(self, events):
        pass


def test_sampler_disabled_when_nvml_init_fails():
    fake = _FakeNvml(init_error=9)  # driver not loaded
    sampler = DeviceSampler(nvml=fake)
    assert not sampler.enabled and sampler.reason == "nvmlInit failed: error 9" and sampler.sample() == []


def test_sampler_reads_each_field_on_its_own():
    fake = _FakeNvml()
    sampler = DeviceSampler(nvml=fake)
    assert sampler.enabled and sampler.xid_status == "on" and sampler.driver == "580.159.04"
    assert sampler.pids_by_gpu() == {0: [4000], 1: [4001]}  # before any sample: read, the XID left queued
    a, b = sampler.sample()
    assert (a.index, a.uuid, a.name, a.pci_bus_id, a.pids) == (0, "GPU-0", "NVIDIA H200", "00000000:19:00.0", [4000])
    assert (a.sm_clock_mhz, a.mem_clock_mhz, a.max_sm_clock_mhz, a.temperature_c) == (1980, 3201, 1980, 61)
    assert (a.power_w, a.power_limit_w, a.gpu_util_pct, a.mem_util_pct) == (512.3, 700.0, 100, 37)
    assert (a.ecc_corrected, a.ecc_uncorrected, a.pcie_replay, a.remapped_rows_pending) == (3, 4, 94, 144)
    assert a.retired_pages_pending == -1 and a.nvlink_crc_flit == -1 and a.xids == []
    assert "retired_pages_pending: Not Supported" in a.errors and "nvlink_recovery: Not Supported" in a.errors
    # one refused query leaves the others intact
    assert b.power_w == -1 and "power_w: Not Supported" in b.errors and b.temperature_c == 61
    assert b.throttle_reasons == ["hw_slowdown"] and [x for x, _ in b.xids] == [79]
    assert sampler.pids_by_gpu() == {0: [4000], 1: [4001]} and sampler.gpus_of_pid(4001) == [1]
    calls = fake.power_calls
    sampler.sample()
    assert fake.power_calls == calls + 1  # not asked again on the GPU that refused it
    assert fake.asked_fields[-1] == [3, 4, 94, 144, 145]  # unsupported counters no longer asked
    fake.lost.add(0)
    a, b = sampler.sample()
    assert "gpu_lost" in a.errors and a.sm_clock_mhz == -1 and b.sm_clock_mhz == 1980
    assert "power_w: Not Supported" in b.errors
    assert sampler.last_cost_s > 0 and "2 GPU(s) NVIDIA H200" in sampler.describe()
    sampler.close()
    assert fake.shut and not sampler.enabled and sampler.sample() == []


def test_sampler_survives_a_broken_library():
    fake = _FakeNvml()
    fake.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
    sampler = DeviceSampler(nvml=fake)
    assert not sampler.enabled and "boom" in sampler.reason and sampler.sample() == []


def test_a_programs_xid_is_an_event_and_a_devices_xid_a_finding_naming_the_gpus_ranks():
    # four ranks share one GPU; a kernel of one of them (or of another job there) fails: XID 43, nobody's to blame
    from trainscout.detectors.devices import DeviceWatch
    from trainscout.detectors.interface import JobView

    watch = DeviceWatch()
    watch.rank_gpu = {r: "vm:gpu0" for r in range(4)}
    view = JobView(now=1.0, ranks={}, seen={}, live=set(), members={}, classes={})
    watch.rules.add(_healthy("vm:gpu0", 1.0, random.Random(0), xids=((43, 1.0),)), now=1.0)
    watch._new = True
    judged = watch.judge(view)
    assert judged.findings == [] and [k for k, _ in judged.events] == ["device_event"]
    assert judged.events[0][1]["xid"] == 43 and judged.events[0][1]["cause"] == "application"

    watch.rules.add(_healthy("vm:gpu0", 2.0, random.Random(1), xids=((79, 2.0),)), now=2.0)
    watch._new = True
    (finding,) = watch.judge(JobView(now=2.0, ranks={}, seen={}, live=set(), members={}, classes={})).findings
    assert finding.culprit_ranks == [0, 1, 2, 3] and finding.evidence["xid"] == 79
