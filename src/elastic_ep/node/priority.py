"""A liveness thread that is scheduled ahead of the work of its node, so a saturated CPU does not silence it.

Measured on a 2-core machine (docs/ARCHITECTURE.md, "Why a loading rank went silent"): while four
processes fault in and fill gigabytes of fresh memory, a thread that wakes every 10 ms to say it is
alive waits up to 1.7 s, 99% of it on the run queue (its /proc schedstat); the GIL is not what it
waits for (every step of a load, the mapped safetensors read, the dtype conversion, the zeroing,
the CRC, releases it). Under the real-time policy SCHED_RR at the lowest priority the same thread
waits at most 0.09 s; at nice -10 at most 0.16 s. Both need CAP_SYS_NICE (root has it; a
Kubernetes pod gets it with `securityContext.capabilities.add: [SYS_NICE]`); without it the thread
keeps its priority and the loading deadline (--load-heartbeat-timeout-s) still guards a load.
A process started from a thread raised to SCHED_RR starts at the ordinary policy (SCHED_RESET_ON_FORK).
"""

from __future__ import annotations

import os
import threading

RT_PRIORITY = 1  # the lowest real-time priority: ahead of every ordinary thread, behind the kernel's own
NICE = -10


def prioritize_this_thread() -> str:
    """Raise the calling thread (only it: its native thread id) to SCHED_RR priority 1, else to
    nice -10. Returns what it got: "SCHED_RR", "nice -10" or "" (not permitted here)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(RT_PRIORITY))
        return "SCHED_RR"
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICE)
        return f"nice {NICE}"
    except (OSError, AttributeError):
        return ""

