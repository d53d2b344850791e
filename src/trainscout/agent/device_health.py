"""NVML sampler of the node agent: clocks, throttle reasons, temperature, power, error counters, XIDs.

The agent owns one DeviceSampler and calls `sample()` on its own thread once per interval (~1 s), out
of band: nothing here touches the training processes, so a sample costs the job nothing but a little
agent CPU (0.7 ms for one H200: docs/device-health.md). The readings go to the coordinator,
whose device-health detector compares the GPUs of one replica class (detectors/device_health.py).

nvidia-ml-py (`import pynvml`) is optional: without it, or without a driver or a GPU, the sampler is
disabled with a one-line `reason` and `sample()` returns []. Nothing in this module raises to its caller.
Every field is read on its own, so one query the GPU does not support (or forbids) leaves the others
intact; a field that answered "not supported" once is not asked again. XID errors arrive through an NVML
event set that is drained without waiting (timeout 0); where events are unsupported, `xid_status` says
why, once.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainscout.wire.device import UNAVAILABLE, DeviceReading, decode_throttle

# NVML return codes and constants used here (nvml.h); stable across NVML versions.
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_TIMEOUT = 10
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_CLOCK_SM = 1
_CLOCK_MEM = 2
_TEMPERATURE_GPU = 0
_ECC_CORRECTED = 0
_ECC_UNCORRECTED = 1
_VOLATILE_ECC = 0
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError: every XID the driver reports, not only "critical" ones
MAX_EVENTS_PER_SAMPLE = 256  # an XID storm must not hold the agent's thread

# Counters read with one nvmlDeviceGetFieldValues call per GPU (reading field -> NVML_FI_* id): one call
# instead of six, and each field still carries its own return code.
_FIELD_IDS = {
    "ecc_corrected": 3,  # NVML_FI_DEV_ECC_SBE_VOL_TOTAL
    "ecc_uncorrected": 4,  # NVML_FI_DEV_ECC_DBE_VOL_TOTAL
    "retired_pages_pending": 31,  # NVML_FI_DEV_RETIRED_PENDING
    "nvlink_crc_flit": 38,  # NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL
    "nvlink_crc_data": 45,  # NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
    "nvlink_replay": 52,  # NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL
    "nvlink_recovery": 59,  # NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL
    "pcie_replay": 94,  # NVML_FI_DEV_PCIE_REPLAY_COUNTER
    "remapped_rows_pending": 144,  # NVML_FI_DEV_REMAPPED_PENDING
    "remap_failure": 145,  # NVML_FI_DEV_REMAPPED_FAILURE
}
_UNSUPPORTED_CODES = (_NOT_SUPPORTED, _NO_PERMISSION, _FUNCTION_NOT_FOUND)


class _GpuLost(Exception):
    pass


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    max_sm_clock_mhz: int = UNAVAILABLE
    skip: dict[str, str] = field(default_factory=dict)  # field -> why it is no longer asked
    field_ids: dict[str, int] = field(default_factory=lambda: dict(_FIELD_IDS))  # still asked by field id


class DeviceSampler:
    """Reads every GPU of the node through NVML. `enabled` False: `reason` says why, sample() is []."""

    def __init__(self, *, xid_events: bool = True, nvml: Any = None) -> None:
        self.enabled = False
        self.reason = ""
        self.xid_status = "off"
        self.driver = ""
        self.last_cost_s = 0.0  # wall time of the last sample()
        self._nvml: Any = None
        self._gpus: list[_Gpu] = []
        self._events: Any = None
        self._last: list[DeviceReading] = []
        try:
            self._start(nvml, xid_events)
        except Exception as exc:  # never raise into the agent: disabled, with the reason
            self._disable(f"NVML start failed: {_reason(exc)}")

    # -- start and stop -------------------------------------------------------------------------------

    def _start(self, nvml: Any, xid_events: bool) -> None:
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError:
                self.reason = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
                return
        try:
            nvml.nvmlInit()
        except Exception as exc:
            self.reason = f"nvmlInit failed: {_reason(exc)}"
            return
        self._nvml = nvml
        try:
            self.driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            pass
        count = nvml.nvmlDeviceGetCount()
        for index in range(count):
            gpu = self._open(index)
            if gpu is not None:
                self._gpus.append(gpu)
        if not self._gpus:
            self._disable(f"no GPU visible to NVML ({count} devices, none opened)")
            return
        self.enabled = True
        self._throttle = _fallback(
            nvml, "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"
        )
        self._temperature = _fallback(nvml, "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
        self._processes = _fallback(
            nvml, "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"
        )
        if xid_events:
            self._start_events()

    def _open(self, index: int) -> _Gpu | None:
        nvml = self._nvml
        try:
            gpu = _Gpu(index, nvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:
            return None  # no permission on this one (cgroups), or gone: the others are still sampled
        # Identity and the maximum clock do not change while the agent runs: read once.
        for attr, read in (
            ("uuid", lambda h: _text(nvml.nvmlDeviceGetUUID(h))),
            ("name", lambda h: _text(nvml.nvmlDeviceGetName(h))),
            ("pci_bus_id", lambda h: _text(nvml.nvmlDeviceGetPciInfo(h).busId)),
            ("max_sm_clock_mhz", lambda h: int(nvml.nvmlDeviceGetMaxClockInfo(h, _CLOCK_SM))),
        ):
            try:
                setattr(gpu, attr, read(gpu.handle))
            except Exception as exc:
                gpu.skip[attr] = _reason(exc)
        return gpu

    def _start_events(self) -> None:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except Exception as exc:
            self.xid_status = f"unavailable: nvmlEventSetCreate: {_reason(exc)}"
            return
        registered, refused = [], []
        for gpu in self._gpus:
            try:
                if not nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle) & XID_EVENT:
                    refused.append(f"gpu {gpu.index}: XID events not supported")
                    continue
                nvml.nvmlDeviceRegisterEvents(gpu.handle, XID_EVENT, events)
                registered.append(gpu.index)
            except Exception as exc:
                refused.append(f"gpu {gpu.index}: {_reason(exc)}")
        if not registered:
            _quietly(nvml.nvmlEventSetFree, events)
            self.xid_status = "unavailable: " + "; ".join(refused)
            return
        self._events = events
        self._wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        self.xid_status = "on" + (f" (not on {'; '.join(refused)})" if refused else "")

    def _disable(self, reason: str) -> None:
        self.close()
        self.enabled = False
        self.reason = reason

    def close(self) -> None:
        """Frees the event set and shuts NVML down; the sampler is disabled afterwards."""
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        if self._events is not None:
            _quietly(nvml.nvmlEventSetFree, self._events)
            self._events = None
        _quietly(nvml.nvmlShutdown)
        self.enabled = False
        self.reason = self.reason or "closed"

    def __enter__(self) -> DeviceSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        """One line for the agent's log: what is sampled, or why nothing is."""
        if not self.enabled:
            return f"device health off: {self.reason}"
        names = sorted({g.name for g in self._gpus if g.name})
        return (
            f"device health: {len(self._gpus)} GPU(s) {', '.join(names)}, driver {self.driver or '?'}, "
            f"XID events {self.xid_status}"
        )

    # -- sampling -------------------------------------------------------------------------------------

    def sample(self) -> list[DeviceReading]:
        """One reading per GPU of the node ([] when disabled). Never raises."""
        if not self.enabled:
            return []
        start = time.perf_counter()
        now = time.time()
        try:
            xids = self._drain_xids(now)
            readings = [self._read_gpu(gpu, now, xids.pop(gpu.index, [])) for gpu in self._gpus]
        except Exception as exc:  # a bug or a library surprise: report nothing rather than break the agent
            readings = []
            self.reason = f"sample failed: {_reason(exc)}"
        self._last = readings
        self.last_cost_s = time.perf_counter() - start
        return readings

    def pids_by_gpu(self) -> dict[int, list[int]]:
        """NVML index -> pids with a compute context on it, from the last sample (read now if none yet).

        NVML reports pids as the host's kernel sees them: in a container with its own pid namespace they
        may not match the ranks' own pids (docs/device-health.md).
        """
        if self._last:
            return {r.index: list(r.pids) for r in self._last}
        found = {}
        for gpu in self._gpus if self.enabled else ():
            try:
                found[gpu.index] = sorted({int(p.pid) for p in self._processes(gpu.handle)})
            except Exception:
                found[gpu.index] = []
        return found

    def gpus_of_pid(self, pid: int) -> list[int]:
        """NVML indices of the GPUs on which `pid` runs (a rank usually has one; [] if not seen)."""
        return sorted(index for index, pids in self.pids_by_gpu().items() if pid in pids)

    def _read_gpu(self, gpu: _Gpu, now: float, xids: list[tuple[int, float]]) -> DeviceReading:
        nvml = self._nvml
        errors: list[str] = []
        r = DeviceReading(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            pci_bus_id=gpu.pci_bus_id,
            time_s=now,
            max_sm_clock_mhz=gpu.max_sm_clock_mhz,
            xids=xids,
            errors=errors,
        )
        for attr in ("uuid", "name", "pci_bus_id", "max_sm_clock_mhz"):
            if attr in gpu.skip:
                errors.append(f"{attr}: {gpu.skip[attr]}")

        def read(name: str, fn: Callable, *args: Any) -> Any:
            if name in gpu.skip:
                errors.append(f"{name}: {gpu.skip[name]}")
                return None
            try:
                return fn(gpu.handle, *args)
            except Exception as exc:
                code = _code(exc)
                if code == _GPU_IS_LOST:
                    raise _GpuLost from exc
                if code in _UNSUPPORTED_CODES or isinstance(exc, AttributeError):
                    gpu.skip[name] = _reason(exc)  # asking again every second would only cost time
                errors.append(f"{name}: {_reason(exc)}")
                return None

        try:
            procs = read("pids", self._processes)
            if procs is not None:
                r.pids = sorted({int(p.pid) for p in procs})
            r.sm_clock_mhz = _int(read("sm_clock_mhz", nvml.nvmlDeviceGetClockInfo, _CLOCK_SM))
            r.mem_clock_mhz = _int(read("mem_clock_mhz", nvml.nvmlDeviceGetClockInfo, _CLOCK_MEM))
            mask = read("throttle_mask", self._throttle)
            if mask is not None:
                r.throttle_mask = int(mask)
                r.throttle_reasons = decode_throttle(int(mask))
            r.temperature_c = _int(read("temperature_c", self._temperature, _TEMPERATURE_GPU))
            r.power_w = _watts(read("power_w", nvml.nvmlDeviceGetPowerUsage))
            r.power_limit_w = _watts(read("power_limit_w", nvml.nvmlDeviceGetEnforcedPowerLimit))
            util = read("utilization", nvml.nvmlDeviceGetUtilizationRates)
            if util is not None:
                r.gpu_util_pct, r.mem_util_pct = int(util.gpu), int(util.memory)
            self._read_counters(gpu, r, read, errors)
        except _GpuLost:
            errors.append("gpu_lost")
        return r

    def _read_counters(self, gpu: _Gpu, r: DeviceReading, read: Callable, errors: list[str]) -> None:
        """Error counters through one field-values call; per-field APIs where that call is refused."""
        nvml = self._nvml
        if "field_values" not in gpu.skip:
            names = list(gpu.field_ids)
            values = (
                read("field_values", nvml.nvmlDeviceGetFieldValues, [gpu.field_ids[n] for n in names]) if names else ()
            )
            if values is None and "field_values" in gpu.skip:
                values = ()  # refused as a whole: fall through to the dedicated calls below
            elif values is not None:
                for name, fv in zip(names, values):
                    ret = int(fv.nvmlReturn)
                    if ret == 0:
                        setattr(r, name, _field_value(fv))
                        continue
                    if ret == _GPU_IS_LOST:
                        raise _GpuLost
                    reason = _code_text(nvml, ret)
                    if ret in _UNSUPPORTED_CODES:  # not asked again; still listed in every reading
                        gpu.skip[name] = reason
                        del gpu.field_ids[name]
                    else:
                        errors.append(f"{name}: {reason}")
                errors.extend(f"{n}: {gpu.skip[n]}" for n in _FIELD_IDS if n in gpu.skip)
            if "field_values" not in gpu.skip:
                return
        # Field values refused (an old driver): the dedicated calls, NVLink counters left out.
        r.ecc_corrected = _int(read("ecc_corrected", nvml.nvmlDeviceGetTotalEccErrors, _ECC_CORRECTED, _VOLATILE_ECC))
        r.ecc_uncorrected = _int(
            read("ecc_uncorrected", nvml.nvmlDeviceGetTotalEccErrors, _ECC_UNCORRECTED, _VOLATILE_ECC)
        )
        r.pcie_replay = _int(read("pcie_replay", nvml.nvmlDeviceGetPcieReplayCounter))
        r.retired_pages_pending = _int(read("retired_pages_pending", nvml.nvmlDeviceGetRetiredPagesPendingStatus))
        rows = read("remapped_rows", nvml.nvmlDeviceGetRemappedRows)
        if rows is not None:
            r.remapped_rows_pending, r.remap_failure = int(bool(rows[2])), int(bool(rows[3]))

    def _drain_xids(self, now: float) -> dict[int, list[tuple[int, float]]]:
        """XIDs queued since the last drain, per NVML index; never waits (timeout 0)."""
        found: dict[int, list[tuple[int, float]]] = {}
        if self._events is None:
            return found
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                data = self._wait(self._events, 0)
            except Exception as exc:
                if _code(exc) != _TIMEOUT:  # anything but "nothing queued": stop asking, say why once
                    self.xid_status = f"stopped: nvmlEventSetWait: {_reason(exc)}"
                    _quietly(self._nvml.nvmlEventSetFree, self._events)
                    self._events = None
                break
            if int(data.eventType) & XID_EVENT:
                found.setdefault(self._index_of(data.device), []).append((int(data.eventData), now))
        return found

    def _index_of(self, handle: Any) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetIndex(handle))
        except Exception:
            pass
        try:
            uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
        except Exception:
            return UNAVAILABLE
        return next((g.index for g in self._gpus if g.uuid == uuid), UNAVAILABLE)


def _fallback(nvml: Any, *names: str) -> Callable:
    """Calls the first of the named NVML functions this library and driver have; a function the driver
    lacks (FunctionNotFound, or pynvml's version-mismatch error) is dropped for good."""
    fns = [getattr(nvml, n) for n in names if hasattr(nvml, n)]

    def call(*args: Any) -> Any:
        while True:
            if not fns:
                raise AttributeError(f"none of {', '.join(names)} available")
            try:
                return fns[0](*args)
            except Exception as exc:
                missing = _code(exc) == _FUNCTION_NOT_FOUND or type(exc).__name__ == "NVMLLibraryMismatchError"
                if missing and len(fns) > 1:
                    fns.pop(0)
                    continue
                raise

    return call


def _field_value(fv: Any) -> int:
    """The integer in an nvmlFieldValue_t, by its declared type (all the fields read here are counts)."""
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(
        int(fv.valueType), "ullVal"
    )
    return int(getattr(fv.value, member))


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:120]


def _code_text(nvml: Any, code: int) -> str:
    try:
        return str(nvml.NVMLError(code))
    except Exception:
        return f"NVML error {code}"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    return UNAVAILABLE if value is None else int(value)


def _watts(milliwatts: Any) -> float:
    return UNAVAILABLE if milliwatts is None else round(int(milliwatts) / 1000.0, 1)


def _quietly(fn: Callable, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        pass
