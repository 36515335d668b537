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


PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Make this process a child subreaper: an orphan among its descendants (a worker whose
    parent, the zygote's middle process, exited) becomes its child, which it waits for. Whether
    the kernel took it."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    except (OSError, AttributeError):
        return False
