"""A placement computed off the control thread once the group is large, on this thread when small.

A placement over every member takes a few ms at 16 ranks and up to seconds at 1,024 on 2 cores
(EPLB's check with a plan 6.8 s, a derate's weighted placement 0.4 s, a rebalance's target 6-10
s; benchmarks/control_pieces.py): on the control thread, that long without a heartbeat read or a
fault named. `OffThread` holds one such computation at a time for whoever asks for it (the
background rebalance's target, EPLB's plan, the straggler policy's weighted placement): from
`min_ranks` members on it goes to `submit` (the worker process of the restores computed ahead,
`restore_ahead.py`), below it is computed at once. The caller asks again at each step boundary
with the key of what it wants now (its members, its epoch); a result for another key is dropped,
and a worker that died leaves the computation to this thread, with the same arguments.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

OFF_THREAD_RANKS = 16  # from this many members, computed off the control thread


@dataclass(frozen=True)
class Computed:
    """What `fn(*args)` returned, with the arguments it was computed from (the load it used)."""

    value: Any
    args: tuple


class OffThread:
    """`start(key, ranks, fn, *args)`, then `take(key)` at later boundaries until it returns the
    result. `submit(fn, *args)`: a Future of `fn(*args)` off the control thread (None: always here)."""

    def __init__(self, submit: Callable[..., cf.Future] | None, min_ranks: float = OFF_THREAD_RANKS):
        self.submit = submit
        self.min_ranks = min_ranks
        self._key: Hashable | None = None
        self._fn: Callable | None = None
        self._args: tuple = ()
        self._future: cf.Future | None = None
        self._value: Computed | None = None  # computed here

    def asked(self, key: Hashable) -> bool:
        """Whether `key`'s computation is under way or done and not yet taken."""
        return self._fn is not None and self._key == key

    @property
    def busy(self) -> bool:
        """A computation runs off the thread."""
        return self._future is not None and not self._future.done()

    @property
    def ready(self) -> bool:
        """A result waits to be taken."""
        return self._value is not None or (self._future is not None and self._future.done())

    def start(self, key: Hashable, ranks: int, fn: Callable, *args) -> None:
        """Compute `fn(*args)` for `key` (what was asked before is dropped): off the thread from
        `min_ranks` ranks on when there is a worker, else now."""
        self.cancel()
        self._key, self._fn, self._args = key, fn, args
        if self.submit is None or ranks < self.min_ranks:
            self._value = Computed(fn(*args), args)
        else:
            self._future = self.submit(fn, *args)

    def take(self, key: Hashable) -> Computed | None:
        """`key`'s result once there (and forgotten here); None while it is computed, or when
        nothing or something else was asked (which is dropped)."""
        if not self.asked(key):
            self.cancel()
            return None
        if self._value is None:
            assert self._future is not None
            if not self._future.done():
                return None
            try:
                self._value = Computed(self._future.result(), self._args)
            except Exception as e:  # the worker process died (BrokenProcessPool): computed here instead
                assert self._fn is not None
                log.warning("%s failed off the control thread (%s): computed on it", self._fn.__name__, e)
                self._value = Computed(self._fn(*self._args), self._args)
        value = self._value
        self.cancel()
        return value

    def cancel(self) -> None:
        """Forget what was asked; a computation under way is not waited for."""
        self._key, self._fn, self._args, self._future, self._value = None, None, (), None, None
