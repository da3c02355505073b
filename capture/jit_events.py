"""How many Triton kernels a stretch of host code specialized: a JIT compile or a load from Triton's
disk cache, each the first launch of a (kernel, constexprs, argument specialization) in this process.

Capturing a graph launches every kernel of its step once; a specialization that is new there (a
constexpr that depends on the batch size, say) costs a compile of 0.3-2 s on a cold cache, which is
what a slow graph in `CaptureReport` usually means. Counted with Triton's `jit_cache_hook`, which
Triton calls before it compiles or loads a specialization (never for one already in memory); the
hook returns None, so Triton proceeds as usual, and a hook installed before stays called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def count_triton_jit() -> Iterator[list[int]]:
    """`with count_triton_jit() as count:` ... `count[0]`: the specializations inside the block (stays
    0 without Triton, or with a Triton that has no such hook)."""
    count = [0]
    try:
        from triton import knobs
    except ImportError:
        yield count
        return
    runtime = knobs.runtime
    if not hasattr(runtime, "jit_cache_hook"):
        yield count
        return
    previous = runtime.jit_cache_hook

    def hook(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook
    try:
        yield count
    finally:
        runtime.jit_cache_hook = previous


__all__ = ["count_triton_jit"]
