"""RowGenerations: per-row counters of how often a request row changed hands.

A token (or any per-row result) that is applied some steps after it was produced must not
land on a row that was freed and handed to another request in between. Snapshot the
counters of the rows when the result is launched; apply only where they are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RowGenerations:
    """Per-row generation counters on the host: bump a row each time it changes hands.

    Call `bump(row)` when a row is freed (a request finished or was preempted); calling
    it again when the row is allocated is harmless (the counter only has to *change*
    between a snapshot and its check). int64, so it never wraps.
    """

    def __init__(self, num_rows: int) -> None:
        if not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"num_rows={num_rows!r} must be an int >= 1")
        self._gen = np.zeros(num_rows, dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return len(self._gen)

    @property
    def values(self) -> np.ndarray:
        """Read-only view of the counters: [num_rows] int64."""
        view = self._gen.view()
        view.flags.writeable = False
        return view

    def bump(self, rows: int | Sequence[int] | np.ndarray) -> None:
        """Mark `rows` as having changed hands (a row repeated in `rows` is bumped once per mention)."""
        rows = self._check(rows)
        np.add.at(self._gen, rows, 1)

    # Readable call sites in the runner: both just bump.
    on_free = bump
    on_alloc = bump

    def snapshot(self, rows: np.ndarray) -> np.ndarray:
        """The counters of `rows` now (a copy): [n] int64."""
        return self._gen[self._check(rows)].copy()

    def unchanged(self, rows: np.ndarray, snapshot: np.ndarray) -> np.ndarray:
        """[n] bool: which of `rows` still have the counter they had at `snapshot`."""
        return self._gen[self._check(rows)] == snapshot

    def _check(self, rows: int | Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.atleast_1d(np.asarray(rows, dtype=np.int64))
        if arr.ndim != 1:
            raise ValueError(f"rows must be an int or a 1-D sequence, got shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_rows):
            bad = arr[(arr < 0) | (arr >= self.num_rows)][0]
            raise ValueError(f"row {int(bad)} is outside [0, num_rows={self.num_rows})")
        return arr


__all__ = ["RowGenerations"]
