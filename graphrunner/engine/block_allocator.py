"""KV-cache block allocator: a pool of physical block ids handed out to requests.

The vocabulary is nano-vllm's predicate/action pairs, so the scheduler reads like prose:

    if allocator.can_allocate(n):
        req.block_ids += allocator.allocate(n)
    ...
    allocator.free(req.block_ids)

Host-side bookkeeping only; the runner never sees this object, only the ids it hands out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockAllocator:
    """Hands out ids `0 .. num_blocks - 1`; each id is held by at most one owner at a time.

    Freed ids go to the back of the free queue and allocation takes from the front, so a
    run is deterministic and recently freed blocks are reused last.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """How many blocks `allocate` can still hand out."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        """True when `allocate(n)` would succeed."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free block ids. Raises ValueError when `n` is negative or more than `num_free`."""
        if n < 0:
            raise ValueError(f"cannot allocate n={n} blocks: n must be >= 0")
        if n > len(self._free):
            raise ValueError(f"cannot allocate n={n} blocks: only num_free={len(self._free)} of {self.num_blocks} left")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool.

        All ids are checked before any is freed, so a bad call changes nothing. Raises
        ValueError for an id outside `[0, num_blocks)`, one that is not allocated (double
        free), or one listed twice in the same call.
        """
        ids = list(block_ids)
        seen: set[int] = set()
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} is not in this allocator's range [0, {self.num_blocks})")
            if block_id not in self._used or block_id in seen:
                raise ValueError(f"block id {block_id} is not allocated (double free?)")
            seen.add(block_id)
        self._used.difference_update(ids)
        self._free.extend(ids)

    def is_allocated(self, block_id: int) -> bool:
        return block_id in self._used

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free={self.num_free})"
