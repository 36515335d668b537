"""Hardware signals in the controller: the last `HardwareReport` of each node (node/hardware.py reads
them), as `/metrics` gauges, in `/cluster` (`hardware` by node), as one line of evidence beside a
straggler decision, and an event for every Xid critical error.

They are evidence, not a verdict: the straggler verdict rests on per-rank timings alone (a card
that is throttled but not slower changes nothing), and a signal that could not be read is shown
absent with the reason (`elastic_ep_hardware_signal_present` 0), never as a zero.
"""

from __future__ import annotations

import time
from typing import Any

from msgspec.structs import asdict
from prometheus_client import CollectorRegistry, Counter, Gauge

from elastic_ep.wire import IDLE_REASONS, THROTTLE_REASONS, HardwareReport

from ..events import EventKind, EventLog

SIGNALS = ("cpu_steal", "cpu_freq", "nvml", "xid")


class HardwareSignals:
    def __init__(self, registry: CollectorRegistry, events: EventLog):
        self.events = events
        self.reports: dict[str, tuple[float, HardwareReport]] = {}  # node -> (monotonic time, report)
        self.steal = Gauge("elastic_ep_node_cpu_steal_ratio", "Share of CPU time stolen by the hypervisor since "
                           "the node's last hardware report (psutil)", ["node"], registry=registry)
        self.freq = Gauge("elastic_ep_node_cpu_frequency_hertz", "Current CPU frequency (psutil)", ["node"],
                          registry=registry)
        self.present = Gauge("elastic_ep_hardware_signal_present", "1 when the node's agent could read the signal "
                             "(cpu_steal, cpu_freq, nvml, xid), 0 when it is absent (reason in /cluster)",
                             ["node", "signal"], registry=registry)
        self.ecc = Gauge("elastic_ep_gpu_ecc_errors", "Volatile ECC error count per GPU (NVML)",
                         ["node", "gpu", "type"], registry=registry)
        self.clock = Gauge("elastic_ep_gpu_clock_hertz", "GPU clocks (NVML): sm, sm_max, mem", ["node", "gpu", "clock"],
                           registry=registry)
        self.throttled = Gauge("elastic_ep_gpu_clock_event_reason", "1 while NVML reports this reason holding the "
                               "GPU's clocks down", ["node", "gpu", "reason"], registry=registry)
        self.xid = Counter("elastic_ep_gpu_xid_errors", "Xid critical errors per GPU (NVML events)", ["node", "gpu"],
                           registry=registry)

    def on_report(self, msg: HardwareReport) -> None:
        self.reports[msg.node] = (time.monotonic(), msg)
        node = msg.node
        for signal in SIGNALS:
            self.present.labels(node, signal).set(0 if signal in msg.absent else 1)
        if msg.cpu_steal_ratio is not None:
            self.steal.labels(node).set(msg.cpu_steal_ratio)
        if msg.cpu_freq_mhz is not None:
            self.freq.labels(node).set(msg.cpu_freq_mhz * 1e6)
        for g in msg.gpus:
            gpu = str(g.index)
            for kind, count in (("corrected", g.ecc_corrected), ("uncorrected", g.ecc_uncorrected)):
                if count is not None:
                    self.ecc.labels(node, gpu, kind).set(count)
            for clock, mhz in (("sm", g.sm_clock_mhz), ("sm_max", g.sm_clock_max_mhz), ("mem", g.mem_clock_mhz)):
                if mhz is not None:
                    self.clock.labels(node, gpu, clock).set(mhz * 1e6)
            if g.throttle_reasons is not None:
                for reason in THROTTLE_REASONS.values():
                    self.throttled.labels(node, gpu, reason).set(int(reason in g.throttle_reasons))
            xid = self.xid.labels(node, gpu)  # a zero sample from the first report: increase() sees the first Xid
            if g.xid_errors:
                xid.inc(len(g.xid_errors))
                self.events.add(EventKind.HARDWARE, f"node {node} GPU {gpu}: Xid critical errors {g.xid_errors}",
                                node=node, gpu=g.index, xid=g.xid_errors)

    def evidence(self, node: str) -> str:
        """The node's signals in one line, for a straggler decision."""
        if node not in self.reports:
            return f"node {node}: no hardware report yet"
        at, r = self.reports[node]
        parts = [f"CPU steal {r.cpu_steal_ratio:.1%}" if r.cpu_steal_ratio is not None else "CPU steal absent",
                 f"CPU {r.cpu_freq_mhz:.0f} MHz" if r.cpu_freq_mhz is not None else "CPU frequency absent"]
        for g in r.gpus:
            slow = [x for x in g.throttle_reasons or [] if x not in IDLE_REASONS]
            parts.append(f"GPU {g.index}: ECC {g.ecc_corrected} corrected / {g.ecc_uncorrected} uncorrected, SM "
                         f"{g.sm_clock_mhz}/{g.sm_clock_max_mhz} MHz, clocks held by {slow or 'nothing'}"
                         + (f", Xid {g.xid_errors}" if g.xid_errors else ""))
        parts += [f"{signal} absent: {why}" for signal, why in sorted(r.absent.items())]
        return f"node {node} ({time.monotonic() - at:.1f}s ago): " + "; ".join(parts)

    def view(self) -> dict[str, Any]:
        """node -> its last report, for /cluster."""
        now = time.monotonic()
        return {node: {**asdict(r), "gpus": [asdict(g) for g in r.gpus], "age_s": round(now - at, 2)}
                for node, (at, r) in sorted(self.reports.items())}
