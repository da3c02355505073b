"""Prefix caching: KV blocks keyed by their content, reused by later requests with the same prefix.

vLLM's scheme. A *full* block (all `block_size` positions computed) of a request is keyed by
(its parent block's key, its token ids), so a key names the whole prefix up to that block. The
keys are exact tuples (a dict of them), not digests: two different prefixes never share a key.
Blocks are reference counted: requests sharing a prefix hold the same blocks. A block whose
count drops to zero joins the free queue's *back* and keeps its key, so its content can still
be hit until `allocate` reuses it (least recently freed first), which drops the key.

The scheduler asks `lookup(token_ids)` when it admits a request: the longest chain of cached
full blocks from its first token. It takes them with `touch` (their counts go up; free ones
leave the queue), tells the runner `num_computed_tokens` = their tokens (the runner prefills
only the rest), and after each step `register`s the blocks the request has filled since.

A `salt` (a LoRA adapter's id; 0: the base model) keys the first block, so requests with different
adapters, whose KV differs for the same tokens, never share blocks (vLLM keys by the adapter too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from graphrunner.engine.block_allocator import BlockAllocator

Key = tuple[int, tuple[int, ...]]  # (parent key's id, the block's token ids); parent id -1 for the first block


class PrefixCachingAllocator(BlockAllocator):
    """`BlockAllocator`'s API (allocate / free / can_allocate / num_free) with reference counts
    and the content cache (module docstring). `block_size`: positions a block serves."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks)
        self.block_size = block_size
        self._lru: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # free, oldest first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, Key] = {}
        self._block_of: dict[Key, int] = {}
        self._key_ids: dict[Key, int] = {}  # keyed blocks' key -> a unique id (the parent part of child keys)
        # Every block `register` walked -> its key's id (a block whose content another block caches: that
        # one's), so that a later call resumes a request's chain where it stopped instead of from block 0.
        self._id_of_block: dict[int, int] = {}
        self._next_key_id = 0
        self.num_queries = self.num_hit_tokens = self.num_query_tokens = 0
        # Called with a cached block's id as `allocate` hands it out again (its content still intact until
        # the step it is now scheduled in writes it): a KV connector may copy it elsewhere first.
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._lru)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._lru)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, least recently freed first; a cached block taken loses its key."""
        if n < 0 or n > len(self._lru):
            raise ValueError(f"cannot allocate n={n} blocks: only num_free={len(self._lru)} of {self.num_blocks} left")
        ids = []
        for _ in range(n):
            block, _ = self._lru.popitem(last=False)
            self._id_of_block.pop(block, None)
            key = self._key_of.pop(block, None)
            if key is not None:  # its children's keys become unreachable: they are evicted in turn
                del self._block_of[key]
                del self._key_ids[key]
                if self.on_evict is not None:
                    self.on_evict(block)
            self._refs[block] = 1
            ids.append(block)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; at zero it joins the free queue, keeping its content key."""
        ids = list(block_ids)
        for block in ids:
            if not 0 <= block < self.num_blocks or self._refs[block] <= 0:
                raise ValueError(f"block id {block} is not allocated (double free?)")
        for block in reversed(ids):  # a request's tail blocks are evicted before its head
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._lru[block] = None

    def is_allocated(self, block_id: int) -> bool:
        return self._refs[block_id] > 0

    # ---- the content cache ------------------------------------------------------------------
    def _keys(self, token_ids: Sequence[int], num_blocks: int, salt: int = 0) -> list[Key]:
        """The keys of the first blocks of `token_ids`, as far as every parent is keyed (its id known)."""
        keys, parent = [], -1 - salt
        bs = self.block_size
        for i in range(num_blocks):
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            keys.append(key)
            if key not in self._key_ids:
                break
            parent = self._key_ids[key]
        return keys

    def lookup(self, token_ids: Sequence[int], max_blocks: int, salt: int = 0) -> list[int]:
        """The cached blocks holding the longest prefix of `token_ids` (at most `max_blocks`) under `salt`."""
        self.num_queries += 1
        self.num_query_tokens += len(token_ids)
        blocks = []
        for key in self._keys(token_ids, min(max_blocks, len(token_ids) // self.block_size), salt):
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks (a hit); free ones leave the free queue."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1
        self.num_hit_tokens += len(blocks) * self.block_size

    def register(self, token_ids: Sequence[int], block_ids: Sequence[int], num_full: int, salt: int = 0,
                 start: int = 0) -> None:
        """Key a request's first `num_full` blocks by their content under `salt` (blocks already keyed, or
        whose content another block already caches, are left as they are). `start`: blocks the request
        registered before (a call per filled block then walks only the new ones: a whole walk each time
        was a quarter of the engine's host time at 256 requests of 281-843 + 281-843 tokens)."""
        bs, ids = self.block_size, self._id_of_block
        parent = ids.get(block_ids[start - 1]) if 0 < start <= len(block_ids) else None
        if parent is None:
            start, parent = 0, -1 - salt
        for i in range(start, num_full):
            block = block_ids[i]
            key = self._key_of.get(block)
            if key is None:
                key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]))
                if key in self._block_of:  # another block caches this content: it stays the one
                    parent = ids[block] = self._key_ids[key]
                    continue
                self._key_of[block], self._block_of[key] = key, block
                self._key_ids[key], self._next_key_id = self._next_key_id, self._next_key_id + 1
            parent = ids[block] = self._key_ids[key]

    def reset(self) -> None:
        """Drop every key (a later lookup hits nothing) and the hit counters."""
        self._key_of.clear()
        self._block_of.clear()
        self._key_ids.clear()
        self._id_of_block.clear()
        self.num_queries = self.num_hit_tokens = self.num_query_tokens = 0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens asked about."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


__all__ = ["PrefixCachingAllocator"]
