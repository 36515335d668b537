"""A node's hardware signals, agent -> controller on the health socket (read by node/hardware.py).
Every value is None when it could not be read, with the reason in `absent`: never a guess."""

from __future__ import annotations

import msgspec

from .codec import Message, Record

# NVML's clock event (throttle) reason bits, by name (nvml.h nvmlClocksEventReason*)
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
IDLE_REASONS = frozenset({"gpu_idle"})  # clocks down because there is nothing to do: not a slowdown


class GpuSignals(Record):
    """One GPU (NVML index): volatile ECC error counts, SM clock against its maximum, memory clock,
    the reasons its clocks are held down (names, `node/hardware.py` THROTTLE_REASONS), the Xid
    codes of critical errors since the last report; `absent`: signal -> why it is missing."""

    index: int
    ecc_corrected: int | None
    ecc_uncorrected: int | None
    sm_clock_mhz: int | None
    sm_clock_max_mhz: int | None
    mem_clock_mhz: int | None
    throttle_reasons: list[str] | None
    xid_errors: list[int] = msgspec.field(default_factory=list)
    absent: dict[str, str] = msgspec.field(default_factory=dict)


class HardwareReport(Message):
    """cpu_steal_ratio: the share of CPU time the hypervisor stole since the last report;
    cpu_freq_mhz: the current CPU frequency; gpus: every GPU NVML sees; absent: signal (`nvml`,
    `xid`, `cpu_steal`, `cpu_freq`) -> why it is missing."""

    node: str
    cpu_steal_ratio: float | None
    cpu_freq_mhz: float | None
    gpus: list[GpuSignals]
    absent: dict[str, str]
