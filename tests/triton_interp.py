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

It also memoizes the interpreter's `_get_np_dtype` (a pure lookup that rebuilt its table on
every call) and, per module, which language modules a helper's globals hold, and defers the type
of a `tl.tuple` built without one until it is read (`_install_lazy_tuple_type`).
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
    _install_np_dtype(interpreter, tl)
    _install_lazy_tuple_type(tl)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None:
        return False
    if getattr(patch_lang, "_graphrunner_once", False):
        return True
    local = threading.local()

    seen: dict[int, tuple[dict, int, frozenset[int]]] = {}  # id(globals) -> (globals, its size, langs)

    def langs_of(fn) -> frozenset[int]:
        # Walked again only when fn's module globals changed size (the walk was ~7% of a kernel's time).
        g = fn.__globals__
        entry = seen.get(id(g))
        if entry is None or entry[0] is not g or entry[1] != len(g):
            langs = frozenset(id(v) for v in g.values() if inspect.ismodule(v) and v in (tl, tl.core))
            entry = seen[id(g)] = (g, len(g), langs)
        return entry[2]

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


def _install_np_dtype(interpreter, tl) -> None:
    """`_get_np_dtype` memoized: upstream builds its 19-entry dtype table on every call (each
    op's result and cast asks it, ~10% of an interpreted kernel's time). Same answers: pointers
    (and blocks of them) are uint64, a block is its element's type, the rest comes from upstream
    once per dtype (an unknown dtype still raises upstream's KeyError, and is not remembered)."""
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "_graphrunner_memo", False):
        return
    pointer, block = tl.pointer_type, tl.block_type
    u64 = original(pointer(tl.int8))
    memo: dict = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, block):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, pointer):
            return u64
        np_dtype = memo.get(tt_dtype)
        if np_dtype is None:
            np_dtype = memo[tt_dtype] = original(tt_dtype)
        return np_dtype

    get_np_dtype._graphrunner_memo = True  # type: ignore[attr-defined]
    interpreter._get_np_dtype = get_np_dtype


class _LazyTupleType:
    """`tl.tuple.type` computed at its first read, from the values then held (a non-data descriptor:
    an assigned type, given or recomputed by `_setitem`, lands in the instance and wins)."""

    def __init__(self, type_of) -> None:
        self.type_of = type_of

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        t = obj.__dict__["type"] = self.type_of(obj.values)
        return t


def _install_lazy_tuple_type(tl) -> None:
    """Every interpreted tensor holds its shape as a `tl.tuple`, whose constructor builds a
    `tuple_type` and its name string from the values' types: ~24% of a sampler kernel's interpreter
    time (test_sample_reject), though the interpreter reads almost none of them. Built without a
    type, a tuple now gets the same one, from the same values (only `_setitem` changes them, and it
    assigns the type anew), when it is first read."""
    core = tl.core
    cls = core.tuple
    type_of = getattr(core, "_type_for_tuple_values", None)
    if type_of is None or getattr(cls, "_graphrunner_lazy", False) or "type" in vars(cls):
        return
    original = cls.__init__

    def __init__(self, args, type=None):
        if type is not None:
            original(self, args, type)
        else:
            self.values = [i for i in args]

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls.type = _LazyTupleType(type_of)
    cls._graphrunner_lazy = True
