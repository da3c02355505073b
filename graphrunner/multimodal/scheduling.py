"""EncoderScheduler: the engine's side of the encoder (vLLM's encoder budget and cache manager).

The scheduler asks it about every chunk it plans. A chunk whose tokens reach into an image's
placeholders needs that image's encoder output in the runner's cache: it is there already (an
earlier step, maybe another request, encoded the same content hash), or it is encoded in this step
if the step's encoder budget (tokens of encoder output) and the cache's room allow; otherwise the
chunk stops before the image and the rest waits for a later step. At the end of `schedule()` the
plan gets `scheduled_encoder_inputs` (per request, the inputs to encode) and
`free_encoder_mm_hashes` (entries the runner may drop).

Entries are reference counted by the live requests that show them; an entry no live request holds
stays cached (an image sent again later is not encoded again) until its room is needed, then it is
evicted, least recently used first, never in a step that reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderScheduler:
    """budget: encoder output tokens one step may produce; cache_size: tokens the runner's encoder
    cache may hold. Each must hold one image (`check_request` refuses a request otherwise)."""

    def __init__(self, budget: int, cache_size: int) -> None:
        self.budget, self.cache_size = budget, cache_size
        self._cached: OrderedDict[str, int] = OrderedDict()  # hash -> tokens, least recently used first
        self._holders: dict[str, set[str]] = {}  # hash -> live request ids showing it
        self._step: dict[str, list[int]] = {}  # this plan's scheduled_encoder_inputs
        self._step_hashes: dict[str, int] = {}  # hashes encoded or read in this plan -> tokens
        self._step_tokens = 0
        self._freed: list[str] = []

    def check_request(self, req: Any) -> None:
        """ValueError naming the request when one of its inputs could never be encoded."""
        for f in req.extras.mm_features:
            n = f.mm_position.length
            if n > min(self.budget, self.cache_size):
                raise ValueError(f"request {req.req_id!r}: an image of {n} encoder tokens exceeds the encoder budget "
                                 f"{self.budget} / cache size {self.cache_size} tokens")

    def trim(self, req: Any, start: int, num_new: int) -> int:
        """The tokens of [start, start + num_new) this step can compute given the encoder (no change)."""
        tokens, room = self._step_tokens, self._room()
        for f in req.extras.mm_features:
            pos = f.mm_position
            if pos.end <= start or pos.offset >= start + num_new:
                continue
            if f.identifier in self._cached or f.identifier in self._step_hashes:
                continue
            if tokens + pos.length <= self.budget and pos.length <= room:
                tokens += pos.length
                room -= pos.length
                continue
            return max(0, pos.offset - start)  # stop before the image
        return num_new

    def commit(self, req: Any, start: int, num_new: int) -> None:
        """`req` computes [start, start + num_new) in this plan: schedule the inputs it needs encoded."""
        for index, f in enumerate(req.extras.mm_features):
            pos, h = f.mm_position, f.identifier
            # Held while positions of the input remain to compute after this chunk (this step's
            # own reads are protected by `_step_hashes`).
            if pos.end > start + num_new:
                self._holders.setdefault(h, set()).add(req.req_id)
            else:
                self._drop_holder(h, req.req_id)
            if pos.end <= start or pos.offset >= start + num_new:
                continue
            if h not in self._cached and h not in self._step_hashes:
                self._make_room(pos.length)
                self._step.setdefault(req.req_id, []).append(index)
                self._step_tokens += pos.length
            self._step_hashes[h] = pos.length
            if h in self._cached:
                self._cached.move_to_end(h)

    def release(self, req: Any) -> None:
        """A request ended or was preempted: it holds its inputs no longer (they stay cached)."""
        for f in req.extras.mm_features:
            self._drop_holder(f.identifier, req.req_id)

    def _drop_holder(self, mm_hash: str, req_id: str) -> None:
        holders = self._holders.get(mm_hash)
        if holders is not None:
            holders.discard(req_id)
            if not holders:
                del self._holders[mm_hash]

    def take(self) -> tuple[dict[str, list[int]], list[str]]:
        """End of a plan: (scheduled_encoder_inputs, free_encoder_mm_hashes); the step's inputs count as cached."""
        for h, n in self._step_hashes.items():
            self._cached[h] = n
            self._cached.move_to_end(h)
        out = (self._step, self._freed)
        self._step, self._step_hashes, self._step_tokens, self._freed = {}, {}, 0, []
        return out

    @property
    def cached_hashes(self) -> list[str]:
        return list(self._cached)

    def _room(self) -> int:
        """Tokens the cache can take this step: free room plus entries no live request holds."""
        used = sum(self._cached.values()) + self._step_tokens
        evictable = sum(n for h, n in self._cached.items() if h not in self._holders and h not in self._step_hashes)
        return self.cache_size - used + evictable

    def _make_room(self, tokens: int) -> None:
        used = sum(self._cached.values()) + self._step_tokens
        for h in [h for h in self._cached if h not in self._holders and h not in self._step_hashes]:
            if used + tokens <= self.cache_size:
                break
            used -= self._cached.pop(h)
            self._freed.append(h)
