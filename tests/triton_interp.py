"""The Triton interpreter without its redundant re-patching (tests on CPU only).

Under TRITON_INTERPRET=1 a kernel launch patches triton.language (every builtin of
`tl`, `tl.tensor`, `tl.math` wrapped for the interpreter) and restores it when the launch
ends. Every call of a nested `@triton.jit` helper inside the kernel runs the same patching
again (`InterpretedFunction.__call__` -> `_patch_lang`), although the launch already did
it: it finds nothing left to wrap, yet walks the modules with `inspect.getmembers` each
time. The sampler's kernels call helpers hundreds of times per launch, and that walk was
~40% of their interpreter time.

`install()` makes a nested call skip the patching when its language modules are a subset
of those already patched in its launch (on the same thread): the kernel runs with exactly
the patched language it had before, and the launch's restore puts everything back as
before. A nested helper that sees a module not yet patched (triton.language.standard's
`tl.sum` sees triton.language.core) is patched as upstream does, once per launch; upstream
never restores such a nested patch either, so later calls would find it in place. Nothing
else changes; where the interpreter lacks these internals (another Triton version)
`install()` does nothing.
"""

from __future__ import annotations

import inspect
import threading


def install() -> bool:
    """Patch the interpreter once; True if it was patched (now or before)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # pragma: no cover - no triton: nothing to patch
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None:
        return False
    if getattr(patch_lang, "_graphrunner_once", False):
        return True
    local = threading.local()

    def langs_of(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang_once(fn):
        active = getattr(local, "langs", None)
        if active is not None:  # inside a launch on this thread: a nested helper's call
            langs = langs_of(fn)
            if langs <= active:
                return scope_type()
            local.langs = active | langs  # upstream's nested patch stays until the launch ends (never restored)
            return patch_lang(fn)
        scope = patch_lang(fn)  # a launch: patch, and remember what until its restore
        local.langs = langs_of(fn)
        restore = scope.restore

        def restore_and_forget() -> None:
            local.langs = None
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang_once._graphrunner_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang_once
    return True
