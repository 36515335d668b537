"""The project's user-facing error type.

Every error a user can cause (a bad checkpoint dir, an impossible placement, an invalid
scale request) is an `ElasticEPError` whose message names the problem and what to do.
The CLI prints it without a traceback; the HTTP server maps it to a 4xx.
This module imports nothing, so the pure libraries (`model/`, `placement/`, `sim/`) may use it.
"""


class ElasticEPError(Exception):
    """An error caused by the user's input, with a message that says how to fix it."""


class CheckpointError(ElasticEPError):
    """A checkpoint directory, config or tensor is missing or malformed."""


class PlacementError(ElasticEPError):
    """An expert placement is invalid or cannot be built for the given ranks."""


class SimulationError(ElasticEPError):
    """A simulation or planning input is impossible."""
