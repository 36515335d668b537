"""What a rank process has warmed, and what a new epoch leaves cold.

A slot is warm once its expert's weights have computed in this process since they were written:
an epoch that fills a slot (from a peer, the backup, disk or another slot of the rank) makes it
cold again, and a level-2 sleep, which drops every slot, makes all of them cold. A step shape
(tokens, micro-batches) is warm once this process has run it through the readiness gate
(control/serving/warmup.py); the gate asks a group for only the shapes one of its members has
not run. A pure function: the worker holds the state, the stand-ins model the same rule.
"""

from __future__ import annotations

import numpy as np


def slots_to_warm(warmed: np.ndarray, occupied: np.ndarray, filled: list[tuple[int, int]]) -> np.ndarray:
    """The slots an epoch must run before it serves: every (layer, slot) in `filled` (its new
    weights have never computed) and every other occupied slot not warmed yet.

    warmed: [L, S] bool, the slots warm before the epoch; occupied: [L, S] bool, the slots that
    hold an expert in the epoch; filled: (layer index, slot) the epoch wrote. -> [L, S] bool.
    """
    assert warmed.shape == occupied.shape, (warmed.shape, occupied.shape)
    cold = occupied & ~warmed
    if filled:
        layers, slots = zip(*filled, strict=True)
        cold[list(layers), list(slots)] = True
    return cold
