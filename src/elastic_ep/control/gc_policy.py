"""The controller process's garbage collector policy.

The control thread holds every sequence in flight (its prompt, its tokens, its blocks): at 256
ranks x 64 sequences that is millions of long-lived objects. CPython's full collection walks all
of them, and with the default thresholds it ran about every 13 steps there, each time on the
control thread in the middle of a step, which then took several times a median step
(docs/BENCHMARKS.md, "The controller's garbage collector"). Almost nothing the control plane
allocates forms reference cycles (messages, plans and tokens are freed by reference counting), so
collecting rarely loses little memory and takes the pause off the step path.
"""

from __future__ import annotations

import gc

# Allocations (less deallocations) between two young collections; CPython's default is 700. A
# step at 256 x 64 allocates tens of thousands of short-lived objects that reference counting
# frees: at 700 a young collection runs many times per step for nothing, and each one promotes
# what is alive at that moment, which fills the old generation and brings the full collections.
GEN0_THRESHOLD = 50_000
# Young collections per collection of the middle generation (CPython: 10): survivors of a step
# are promoted a few steps later, not at once.
GEN1_THRESHOLD = 20
# Middle collections per full collection (CPython: 10). CPython also waits for the objects not yet
# fully collected to reach a quarter of the long-lived ones, so a full collection stays rare as
# the sequences in flight grow.
GEN2_THRESHOLD = 100


def tune_for_serving() -> None:
    """Collect once, freeze what start-up allocated (modules, the model's config, the app: never
    garbage, and no collection walks it again), and raise the thresholds (the constants above).
    Called once by `elastic-ep serve` before the controller starts; process-wide."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
