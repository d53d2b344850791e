"""One GPU at one moment, as the node agent reads it from NVML and sends it to the coordinator.

The agent samples every GPU of its node off the training path (agent/device_health.py), about once per
agent interval, and ships the readings beside its NodeDigest; the coordinator's device-health detector
compares the GPUs of one replica class and watches the error counters (detectors/device_health.py).
The struct is flat and small on purpose (one per GPU per interval, array_like): a field that could not
be read is -1 (or empty) and named in `errors`, so one unsupported query never hides the others.
Counters are NVML's volatile / since-boot totals; the detector works on their increases.
"""

from __future__ import annotations

import msgspec

UNAVAILABLE = -1

# Clock event ("throttle") reason bits as NVML defines them (nvmlClocksEventReason* /
# nvmlClocksThrottleReason*), with the names trainscout prints. Bits NVML does not define are kept in
# the mask and not named.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x0001, "gpu_idle"),
    (0x0002, "applications_clocks"),
    (0x0004, "sw_power_cap"),
    (0x0008, "hw_slowdown"),
    (0x0010, "sync_boost"),
    (0x0020, "sw_thermal"),
    (0x0040, "hw_thermal"),
    (0x0080, "hw_power_brake"),
    (0x0100, "display_clocks"),
    (0x0200, "board_limit"),
    (0x0400, "reliability"),
)


def decode_throttle(mask: int) -> list[str]:
    """The names of the reason bits set in `mask` (empty for 0 or an unavailable mask)."""
    if mask <= 0:
        return []
    return [name for bit, name in THROTTLE_REASONS if mask & bit]


class DeviceReading(msgspec.Struct, array_like=True, gc=False):
    index: int  # NVML index on the node (PCI bus order; not the CUDA ordinal of a rank)
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    time_s: float = 0.0  # agent wall clock when read; only compared with the same GPU's earlier readings
    pids: list[int] = []  # processes with a compute context on the GPU, as NVML sees them
    sm_clock_mhz: int = UNAVAILABLE
    mem_clock_mhz: int = UNAVAILABLE
    max_sm_clock_mhz: int = UNAVAILABLE
    throttle_mask: int = UNAVAILABLE  # clock event reasons, NVML bitmask
    throttle_reasons: list[str] = []  # the same, decoded (decode_throttle)
    temperature_c: int = UNAVAILABLE
    power_w: float = UNAVAILABLE
    power_limit_w: float = UNAVAILABLE  # enforced limit
    gpu_util_pct: int = UNAVAILABLE
    mem_util_pct: int = UNAVAILABLE
    ecc_corrected: int = UNAVAILABLE  # volatile (since driver load) totals
    ecc_uncorrected: int = UNAVAILABLE
    retired_pages_pending: int = UNAVAILABLE  # 1 / 0 (page retirement: pre-Ampere)
    remapped_rows_pending: int = UNAVAILABLE  # 1 / 0 (row remapping: Ampere and later)
    remap_failure: int = UNAVAILABLE  # 1: a row could not be remapped
    pcie_replay: int = UNAVAILABLE
    nvlink_crc_flit: int = UNAVAILABLE  # NVLink error counters, summed over the GPU's links
    nvlink_crc_data: int = UNAVAILABLE
    nvlink_replay: int = UNAVAILABLE
    nvlink_recovery: int = UNAVAILABLE
    xids: list[tuple[int, float]] = []  # (xid, agent wall-clock time seen) since the previous sample
    errors: list[str] = []  # "field: reason" for each field that could not be read; "gpu_lost"
