"""The expert distribution recorder: tokens routed to each (MoE layer, logical expert) while
recording is on, dumped to a file that `elastic-ep eplb --load` reads.

The control thread adds each step's counts; HTTP handlers start, stop and dump. A lock keeps
the two apart (a dump never sees half a step).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from elastic_ep.errors import ElasticEPError


class ExpertRecorder:
    """num_layers x num_experts counters; `moe_layers` (model layer ids) go into the file."""

    def __init__(self, num_layers: int, num_experts: int, moe_layers: list[int]):
        self.shape = (num_layers, num_experts)
        self.moe_layers = moe_layers
        self._lock = threading.Lock()
        self._load: np.ndarray | None = None
        self._recording = False
        self._steps = 0

    def start(self) -> None:
        """Start from zero."""
        with self._lock:
            self._load = np.zeros(self.shape, dtype=np.int64)
            self._recording, self._steps = True, 0

    def stop(self) -> None:
        """Stop adding; the counts stay for a dump."""
        with self._lock:
            self._recording = False

    def add(self, load: np.ndarray | None) -> None:
        """load: [L, E] tokens of one step, None when no rank reported in it (the step still counts)."""
        with self._lock:
            if self._recording and self._load is not None:
                if load is not None:
                    self._load += load
                self._steps += 1

    def dump(self, directory: str | Path) -> dict[str, Any]:
        """Write {"load": [L][E], "steps", "moe_layers"} as JSON in `directory`."""
        with self._lock:
            if self._load is None:
                raise ElasticEPError("no expert distribution recorded; POST /start_expert_distribution_record first")
            load, steps = self._load.copy(), self._steps
        path = Path(directory) / f"expert_distribution_{int(time.time() * 1000)}.json"
        path.write_text(json.dumps({"load": load.tolist(), "steps": steps, "moe_layers": self.moe_layers}))
        return {"path": str(path.resolve()), "layers": int(load.shape[0]), "experts": int(load.shape[1]),
                "tokens": int(load.sum())}
