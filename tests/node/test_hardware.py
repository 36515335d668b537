"""Hardware signals: read where present, reported absent with the reason where not (this machine
has no NVIDIA GPU: NVML must say so), and read from NVML through a stand-in of its API."""

from types import SimpleNamespace

from elastic_ep.node.hardware import HardwareReader, throttle_names


def test_without_an_nvidia_driver_nvml_is_absent_and_says_why_and_the_cpu_is_read():
    reader = HardwareReader()
    report = reader.read("n0")
    reader.close()
    assert report.gpus == []
    assert "NVML" in report.absent["nvml"]  # e.g. "NVML unavailable: NVMLError_LibraryNotFound: ..."
    assert report.cpu_steal_ratio is not None and 0 <= report.cpu_steal_ratio <= 1
    assert (report.cpu_freq_mhz is None) == ("cpu_freq" in report.absent)


class FakeNvml:
    """The few pynvml calls the reader makes, for one GPU that runs hot and has had an Xid."""

    NVML_VOLATILE_ECC, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 0, 1
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    nvmlEventTypeXidCriticalError = 8

    def __init__(self):
        self.events = [SimpleNamespace(device="gpu0", eventData=79)]

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"gpu{i}"

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        if kind == 1:
            raise RuntimeError("Not Supported")
        return 3

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1200 if clock == 1 else 2600

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        return 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x40 | 0x4  # hardware thermal slowdown, software power cap

    def nvmlEventSetCreate(self):
        return "events"

    def nvmlDeviceRegisterEvents(self, h, kind, events):
        pass

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        if not self.events:
            raise RuntimeError("Timeout")
        return self.events.pop()

    def nvmlEventSetFree(self, events):
        pass

    def nvmlShutdown(self):
        pass


def test_nvml_signals_are_read_and_a_counter_the_gpu_lacks_is_absent():
    reader = HardwareReader(FakeNvml())
    first, second = reader.read("n0"), reader.read("n0")
    gpu = first.gpus[0]
    assert (gpu.ecc_corrected, gpu.ecc_uncorrected) == (3, None) and "ecc_uncorrected" in gpu.absent
    assert (gpu.sm_clock_mhz, gpu.sm_clock_max_mhz, gpu.mem_clock_mhz) == (1200, 1980, 2600)
    assert gpu.throttle_reasons == ["sw_power_cap", "hw_thermal_slowdown"]
    assert gpu.xid_errors == [79] and second.gpus[0].xid_errors == []  # each Xid reported once
    assert "nvml" not in first.absent and "xid" not in first.absent


def test_throttle_reason_names():
    assert throttle_names(0) == [] and throttle_names(0x1 | 0x8) == ["gpu_idle", "hw_slowdown"]
