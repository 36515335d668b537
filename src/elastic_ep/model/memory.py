"""Large tensors on transparent huge pages, so a process that holds gigabytes of them (expert
slots, KV cache) dies in milliseconds.

When a process is killed the kernel frees all its memory before its sockets close and before its
parent's wait() returns, page by page, so gigabytes on 2 MiB pages go far faster than on 4 KiB
ones. The survivors of a rank's death sit in a collective until that rank's sockets close, so this time is part of
every recovery's pause and grows with the model unless
the memory is on huge pages. Where transparent huge pages are off (or not Linux), or the tensor
is on a GPU, the tensors are ordinary ones.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

MADV_HUGEPAGE = 14  # include/uapi/asm-generic/mman-common.h
HUGE_PAGE = 2 * 2**20
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def huge_zeros(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(*shape, dtype=dtype, device=device); on the CPU its memory is advised onto huge
    pages before it is first touched."""
    if torch.device(device).type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    t = torch.empty(*shape, dtype=dtype, device="cpu")
    start = (t.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (t.data_ptr() + t.numel() * t.element_size()) & ~(HUGE_PAGE - 1)
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    return t.zero_()


def return_freed_memory() -> None:
    """Hand memory freed by dropped tensors back to the OS (collect cycles, then glibc's
    malloc_trim), so the process's resident size shows the release."""
    import gc

    gc.collect()
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
