"""Failure rate and cause mix, from the Llama 3 interruption counts shipped in `data/`.

Each cause is put in a class that fixes its blast radius in the fleet simulation:
`gpu` takes one GPU out until repaired, `node` takes every GPU of a node out, and
`software` kills one rank's process while its hardware stays good.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

from elastic_ep.errors import SimulationError

# Why these classes: a GPU-side fault (memory, SRAM, GSP, thermal, SDC) is fixed by
# draining that GPU; network, host, power and chassis faults take the whole node off
# the fabric; software and NCCL watchdog faults end a process but leave the hardware good.
CAUSE_CLASS: dict[str, str] = {
    "Faulty GPU": "gpu",
    "GPU HBM3 memory": "gpu",
    "GPU SRAM memory": "gpu",
    "GPU system processor": "gpu",
    "GPU thermal interface + sensor": "gpu",
    "Silent data corruption": "gpu",
    "Network switch/cable": "node",
    "Host maintenance": "node",
    "NIC": "node",
    "SSD": "node",
    "Power supply": "node",
    "Server chassis": "node",
    "IO expansion board": "node",
    "CPU": "node",
    "System memory": "node",
    "Software bug": "software",
    "NCCL watchdog timeouts": "software",
    "Dependency": "software",
}
FAILURE_CLASSES = ("gpu", "node", "software")


@dataclass(frozen=True)
class FailureData:
    """Interruption counts of one observed fleet.

    by_cause: interruptions per cause; their sum is the number of interruptions.
    """

    source: str
    gpus: int
    days: float
    by_cause: dict[str, int]

    @property
    def interruptions(self) -> int:
        return sum(self.by_cause.values())

    @property
    def rate_per_gpu_hour(self) -> float:
        return self.interruptions / (self.days * 24 * self.gpus)

    def class_shares(self) -> dict[str, float]:
        """Fraction of interruptions in each failure class (`gpu`, `node`, `software`)."""
        shares = dict.fromkeys(FAILURE_CLASSES, 0.0)
        for cause, count in self.by_cause.items():
            shares[CAUSE_CLASS.get(cause, "node")] += count / self.interruptions
        return shares


@functools.cache
def load_llama3() -> FailureData:
    """The Llama 3 paper's 54-day, 16,384-GPU interruption table (rate ~1.97e-05 per GPU-hour)."""
    text = resources.files("elastic_ep.sim").joinpath("data/llama3_interruptions.json").read_text()
    return failure_data_from_json(json.loads(text))


def failure_data_from_json(raw: dict) -> FailureData:
    missing = [key for key in ("gpus", "days", "by_cause") if key not in raw]
    if missing:
        raise SimulationError(f"failure data lacks {', '.join(missing)}: give gpus, days and by_cause counts")
    data = FailureData(
        str(raw.get("source", "")), int(raw["gpus"]), float(raw["days"]), dict(raw["by_cause"])
    )
    if data.gpus <= 0 or data.days <= 0 or data.interruptions <= 0:
        raise SimulationError("failure data needs gpus > 0, days > 0 and at least one interruption")
    return data


def parse_rate(text: str) -> float:
    """`--rate` value: `FROM_DATA` (the Llama 3 rate) or a positive number per GPU-hour."""
    if text.upper() == "FROM_DATA":
        return load_llama3().rate_per_gpu_hour
    try:
        rate = float(text)
    except ValueError:
        raise SimulationError(
            f"--rate {text!r} is not a number: give failures per GPU-hour or FROM_DATA"
        ) from None
    if not rate > 0:
        raise SimulationError(f"--rate {text} must be > 0 failures per GPU-hour")
    return rate
