"""A child process that ends with its parent (Linux's PR_SET_PDEATHSIG): a worker with its agent,
a stand-in or an API server process with whoever started it, so that none is left behind."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def end_with_parent(sig: signal.Signals) -> None:
    """Have the kernel send this process `sig` when its parent exits (nothing where libc has no
    prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass
