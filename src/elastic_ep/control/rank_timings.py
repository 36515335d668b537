"""Every rank's recent step timings, as ring arrays indexed by rank: per series a `[window, columns]`
float64 array, a column per rank id, each column with its own write cursor and count.

Why arrays: at 256 to 1,024 ranks a deque per rank and series was appended one rank at a time every
step (four appends a rank, and a fifth as each answer came), and read one rank at a time (a Python
sort per rank and series for the `/cluster` percentiles, a Python sum per member for the expert load
gauge). Here a step's column of answers goes in with one assignment per series, and the readers
take every rank's values at once.

Why a cursor per column (not one per ring): a rank's window is its last `window` answers, as its
deque's was; a rank outside some steps (a standby, a rank left out of an epoch) keeps older values
rather than gaps.

Whose values a column holds: a column belongs to a rank id, and holds the values of one rank record
(`RankInfo.record`, a number no other record gets). A write or a read that names another record
of that id (a new process of the id, a rank id given back and taken again) finds the column empty:
a new rank starts with no values, never its id's last owner's.

Written and read by the control thread only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# series -> its window (values kept per rank), as the deques had them
WINDOWS = {"step_s": 256, "wait_s": 256, "own_s": 256, "link_s": 256, "slot_tokens": 64}


class RankTimings:
    """The rings of `windows` (series -> values kept per rank); columns grow as rank ids come."""

    def __init__(self, windows: Mapping[str, int] = WINDOWS, columns: int = 64):
        self.windows = dict(windows)
        self._column: dict[int, int] = {}  # rank id -> its column
        self._owner = np.full(columns, -1, dtype=np.int64)  # per column: the record its values are of
        self._values = {s: np.full((w, columns), np.nan) for s, w in self.windows.items()}  # [window, columns]
        self._cursor = {s: np.zeros(columns, dtype=np.int64) for s in self.windows}  # the row written next
        self._count = {s: np.zeros(columns, dtype=np.int64) for s in self.windows}  # values held, <= window

    def _columns(self, rank_ids: Sequence[int]) -> np.ndarray:
        """[len(rank_ids)] the column of each rank id, allocated for the ids not seen before."""
        column = self._column
        for r in rank_ids:
            if r not in column:
                column[r] = len(column)
        n = len(column)
        if n > len(self._owner):
            extra = max(n, 2 * len(self._owner)) - len(self._owner)
            self._owner = np.concatenate([self._owner, np.full(extra, -1, dtype=np.int64)])
            for s in self.windows:
                self._values[s] = np.hstack([self._values[s], np.full((self.windows[s], extra), np.nan)])
                self._cursor[s] = np.concatenate([self._cursor[s], np.zeros(extra, dtype=np.int64)])
                self._count[s] = np.concatenate([self._count[s], np.zeros(extra, dtype=np.int64)])
        return np.fromiter(map(column.__getitem__, rank_ids), dtype=np.int64, count=len(rank_ids))

    def _held(self, rank_ids: Sequence[int], records: Sequence[int]) -> np.ndarray:
        """The columns of `rank_ids` (distinct), each taken over by its record when it held another's
        values (emptied)."""
        cols = self._columns(rank_ids)
        records = np.asarray(records, dtype=np.int64)
        other = self._owner[cols] != records
        if other.any():
            taken = cols[other]
            self._owner[taken] = records[other]
            for s in self.windows:
                self._values[s][:, taken] = np.nan
                self._cursor[s][taken] = 0
                self._count[s][taken] = 0
        return cols

    def write(self, series: str, rank_ids: Sequence[int], records: Sequence[int], values: Sequence[float]) -> None:
        """One value of `series` per rank of `rank_ids` (distinct ids; `records`: each one's record),
        oldest dropped past the window."""
        if not len(rank_ids):
            return
        cols = self._held(rank_ids, records)
        cursor, count, window = self._cursor[series], self._count[series], self.windows[series]
        at = cursor[cols]
        self._values[series][at, cols] = np.asarray(values, dtype=np.float64)
        cursor[cols] = (at + 1) % window
        count[cols] = np.minimum(count[cols] + 1, window)

    def window(self, series: str, rank_id: int, record: int) -> list[float]:
        """The rank's values of `series` held now, oldest first ([] when it has none)."""
        col = self._column.get(rank_id)
        if col is None or self._owner[col] != record:
            return []
        n, cursor = int(self._count[series][col]), int(self._cursor[series][col])
        column = self._values[series][:, col]
        if n < self.windows[series]:
            return column[:n].tolist()
        return np.concatenate([column[cursor:], column[:cursor]]).tolist()

    def _gathered(self, series: str, rank_ids: Sequence[int], records: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """([window, k] the values of the k ranks, NaN past each one's count; [k] their counts), a
        rank whose column holds another record's values (or none) with a count of 0."""
        cols = self._columns(rank_ids)
        mine = self._owner[cols] == np.asarray(records, dtype=np.int64)
        return self._values[series][:, cols], np.where(mine, self._count[series][cols], 0)

    def sums(self, series: str, rank_ids: Sequence[int], records: Sequence[int]) -> np.ndarray:
        """[k] the sum of each rank's values of `series` (0 when it has none)."""
        values, counts = self._gathered(series, rank_ids, records)
        return np.where(counts > 0, np.nansum(values, axis=0), 0.0)

    def percentiles_ms(self, series: str, rank_ids: Sequence[int],
                       records: Sequence[int]) -> list[dict[str, float] | None]:
        """Per rank, {p50, p99, max} in milliseconds of its values of `series` (seconds), None when it
        has none: numpy's default (linear) percentile, rounded to the microsecond."""
        if not len(rank_ids):
            return []
        values, counts = self._gathered(series, rank_ids, records)
        ordered = np.sort(values * 1000, axis=0)  # NaN (past a rank's count) last
        last = np.maximum(counts - 1, 0)
        picked = []
        for q in (0.5, 0.99):
            x = q * last
            lo = x.astype(np.int64)
            hi = np.minimum(lo + 1, last)
            a_lo = np.take_along_axis(ordered, lo[None, :], axis=0)[0]
            a_hi = np.take_along_axis(ordered, hi[None, :], axis=0)[0]
            picked.append(np.round(a_lo + (a_hi - a_lo) * (x - lo), 3).tolist())
        picked.append(np.round(np.take_along_axis(ordered, last[None, :], axis=0)[0], 3).tolist())
        return [{"p50": p50, "p99": p99, "max": top} if n else None
                for p50, p99, top, n in zip(*picked, counts.tolist(), strict=True)]
