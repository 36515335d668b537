"""A node's hardware signals, read by its agent every --hardware-interval-s: the evidence behind
"slow, not bad" (ECC retries, thermal throttling, a noisy neighbour).

- any host, through psutil: the share of CPU time the hypervisor stole since the last read (a
  noisy neighbour on a VM) and the CPU frequency;
- NVIDIA hosts, through NVML (nvidia-ml-py): per GPU, volatile ECC error counts (corrected,
  uncorrected), SM and memory clocks against the SM's maximum, the reasons the clocks are held
  down (thermal, power, hardware slowdown, ...), and the Xid critical errors seen since the last
  read.
A signal that cannot be read is reported absent with the reason (no NVIDIA library, a counter the
GPU does not support, a kernel without cpufreq), never guessed or reported as zero. Reading never
raises: a failure is an absence.
"""

from __future__ import annotations

import importlib
from typing import Any

import psutil
from msgspec.structs import replace

from elastic_ep.wire import THROTTLE_REASONS, GpuSignals, HardwareReport


def throttle_names(mask: int) -> list[str]:
    """The reason names set in an NVML clock event reasons bit mask."""
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def _load_nvml() -> Any:
    return importlib.import_module("pynvml")


class HardwareReader:
    """Keeps what successive reads need: the last CPU times (steal is a share of the time
    between reads), NVML's handles and its Xid event set. `nvml`: the pynvml module (tests give
    a stand-in); None: import it, its absence being a reason like any other."""

    def __init__(self, nvml: Any = None):
        self._cpu = psutil.cpu_times()
        self.nvml: Any = None
        self.nvml_absent = ""
        self._handles: list[Any] = []
        self._events: Any = None
        try:
            nvml = nvml if nvml is not None else _load_nvml()
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            self.nvml = nvml
        except Exception as e:  # no package, no driver, no device: NVML is absent, and says why
            self.nvml_absent = f"NVML unavailable: {type(e).__name__}: {e}"
            return
        if not self._handles:
            self.nvml_absent = "NVML found no GPU on this host"
        self._events = self._xid_events()

    def read(self, node: str) -> HardwareReport:
        absent: dict[str, str] = {}
        steal = self._steal_ratio(absent)
        freq = self._cpu_freq_mhz(absent)
        if self.nvml_absent:
            absent["nvml"] = self.nvml_absent
        gpus = [self._gpu(i, h) for i, h in enumerate(self._handles)]
        xids = self._xids()
        if self._events is None and self.nvml is not None:
            absent["xid"] = "this GPU or driver does not report Xid events"
        gpus = [replace(g, xid_errors=xids.get(g.index, [])) for g in gpus]
        return HardwareReport(node, steal, freq, gpus, absent)

    def close(self) -> None:
        if self.nvml is not None:
            try:
                if self._events is not None:
                    self.nvml.nvmlEventSetFree(self._events)
                self.nvml.nvmlShutdown()
            except Exception:  # shutting down: nothing to report to
                pass

    # ---- CPU (psutil) ------------------------------------------------------------------------

    def _steal_ratio(self, absent: dict[str, str]) -> float | None:
        now = psutil.cpu_times()
        before, self._cpu = self._cpu, now
        if not hasattr(now, "steal"):
            absent["cpu_steal"] = "this OS does not account stolen CPU time (Linux does)"
            return None
        total = sum(now) - sum(before)
        return round((now.steal - before.steal) / total, 4) if total > 0 else 0.0

    @staticmethod
    def _cpu_freq_mhz(absent: dict[str, str]) -> float | None:
        try:
            freq = psutil.cpu_freq()
        except Exception as e:  # psutil raises on some kernels instead of returning None
            freq, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "no cpufreq information on this host (a VM or container without /sys/.../cpufreq)"
        if freq is None or not freq.current:
            absent["cpu_freq"] = why
            return None
        return round(float(freq.current), 1)

    # ---- GPUs (NVML) -------------------------------------------------------------------------

    def _gpu(self, index: int, handle: Any) -> GpuSignals:
        nv, absent = self.nvml, {}

        def value(name: str, call):
            try:
                return call()
            except Exception as e:
                absent[name] = f"{type(e).__name__}: {e}"
                return None

        ecc = {kind: value(f"ecc_{kind}", lambda k=code: int(nv.nvmlDeviceGetTotalEccErrors(
                   handle, k, nv.NVML_VOLATILE_ECC)))
               for kind, code in (("corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                  ("uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))}
        sm = value("sm_clock", lambda: int(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)))
        sm_max = value("sm_clock_max", lambda: int(nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM)))
        mem = value("mem_clock", lambda: int(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM)))
        mask = value("throttle_reasons", lambda: int(nv.nvmlDeviceGetCurrentClocksEventReasons(handle)))
        return GpuSignals(index, ecc["corrected"], ecc["uncorrected"], sm, sm_max, mem,
                          None if mask is None else throttle_names(mask), [], absent)

    def _xid_events(self) -> Any:
        nv = self.nvml
        try:
            events = nv.nvmlEventSetCreate()
            for h in self._handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
            return events
        except Exception:  # not supported (e.g. some virtual GPUs): reported absent at each read
            return None

    def _xids(self) -> dict[int, list[int]]:
        """GPU index -> Xid codes of the critical errors since the last read."""
        if self._events is None:
            return {}
        nv, seen = self.nvml, {}
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: no more events
                return seen
            index = next((i for i, h in enumerate(self._handles) if h == data.device), -1)
            seen.setdefault(index, []).append(int(data.eventData))
