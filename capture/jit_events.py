"""How many Triton kernels a stretch of host code specialized: a JIT compile or a load from Triton's
disk cache, each the first launch of a (kernel, constexprs, argument specialization) in this process.

Capturing a graph launches every kernel of its step once; a specialization that is new there (a
constexpr that depends on the batch size, say) costs a compile of 0.3-2 s on a cold cache, which is
what a slow graph in `CaptureReport` usually means. Counted with Triton's `jit_cache_hook`, which
Triton calls before it compiles or loads a specialization (never for one already in memory); the
hook returns None, so Triton proceeds as usual, and a hook installed before stays called.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def _hooked(record: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """`record(kwargs)` for every specialization inside the block (nothing without such a Triton)."""
    try:
        from triton import knobs
    except ImportError:
        yield
        return
    runtime = knobs.runtime
    if not hasattr(runtime, "jit_cache_hook"):
        yield
        return
    previous = runtime.jit_cache_hook

    def hook(*args: Any, **kwargs: Any) -> Any:
        record(kwargs)
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        runtime.jit_cache_hook = previous


@contextmanager
def count_triton_jit() -> Iterator[list[int]]:
    """`with count_triton_jit() as count:` ... `count[0]`: the specializations inside the block (stays
    0 without Triton, or with a Triton that has no such hook)."""
    count = [0]

    def record(kwargs: dict[str, Any]) -> None:
        count[0] += 1

    with _hooked(record):
        yield count


@contextmanager
def record_triton_jit() -> Iterator[list[tuple[float, str]]]:
    """`with record_triton_jit() as events:` ... `events`: (time.monotonic(), kernel name) of each
    specialization inside the block, to tell a slow step that specialized a kernel from one that
    computed slowly."""
    events: list[tuple[float, str]] = []

    def record(kwargs: dict[str, Any]) -> None:
        fn = kwargs.get("fn")
        events.append((time.monotonic(), str(getattr(fn, "name", fn))))

    with _hooked(record):
        yield events


__all__ = ["count_triton_jit", "record_triton_jit"]
