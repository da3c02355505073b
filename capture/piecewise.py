"""PIECEWISE graphs: torch.compile splits a function at opaque ops and graphs each piece.

    compiled = PiecewiseCompiled(model, [torch.ops.graphrunner.unified_attention], token_args=(0, 1))
    compiled.capture(*args_at_size_n, pool=pool_handle, stream=side_stream)   # per padded size, largest first
    out = compiled(*args)   # replays the pieces' graphs when args' token count was captured

How it works. Dynamo traces the function once (fullgraph) with the token dimension of
the `token_args` marked *unbacked*, so one FX graph, with a symbolic token count, serves
every size including 1 (a merely dynamic dim specializes 0 and 1 and would recompile at
T=1). The backend cuts that graph at every call of a split op: each split op gets a piece
of its own and runs eagerly; every other piece is compiled once, with the fake tensors of
dynamo's own fake mode (symbolic shapes), by inductor or a debug backend.

Each compiled piece is wrapped in a `_Piece` that, per runtime token count, either runs
the compiled code, or captures it into a `torch.cuda.CUDAGraph` in the caller's pool, or
replays that graph. Under replay a piece returns the static outputs of its graph, so the
next piece (and the eager op between them) reads and writes the captured addresses. A
split op must therefore write into a buffer allocated by the preceding piece, never
return a fresh tensor.

Memory. Pieces keep *non-owning* aliases of their graph outputs, so once a capture call
returns, that size's activations go back to the pool and the next (smaller) size reuses
them; replays of different sizes may thus overwrite each other's memory. That is safe
because every replay rewrites, in capture order, everything it reads; the one rule for
callers: consume (or copy) the returned output before the next replay of any graph in
the same pool.

On a CPU there are no graphs (docs/architecture.md §7): `capture` runs the compiled pieces and
records the size, calls run them directly. This module is model-agnostic: it imports
torch only.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from capture.pool import CAPTURE_MODE
from capture.split import compile_pieces, normalize_split_ops, split_at_ops

logger = logging.getLogger("capture.piecewise")

# Debug backends that need no C++ / Triton toolchain (fast CPU tests) and the real one.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


# ------------------------------------------------------------------ runtime state


@dataclass
class _Runtime:
    """What the pieces of one `PiecewiseCompiled` need to know about the current call.

    Owned by that instance (no module-global state); set for the length of one call.
    """

    check_addresses: bool
    num_tokens: int = 0
    use_graphs: bool = False  # CUDA: pieces capture / replay; CPU: direct calls only
    capturing: bool = False
    pool: Any = None  # graph pool handle for captures
    stream: Any = None  # torch.cuda.Stream captures run on


@dataclass
class _GraphEntry:
    """One piece captured at one token count."""

    graph: Any  # torch.cuda.CUDAGraph
    outputs: Any  # non-owning aliases of the graph's static outputs (same structure as the piece's)
    input_addresses: tuple[tuple[int, int], ...]  # (argument position, data_ptr) at capture
    replayed: bool = False


class AddressMismatchError(RuntimeError):
    """A captured graph would replay with an input whose address differs from its capture."""


def _tensor_addresses(args: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    return tuple((i, a.data_ptr()) for i, a in enumerate(args) if isinstance(a, torch.Tensor))


def _non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not keep the memory alive.

    Graph outputs live in the graph pool; holding them strongly would pin every captured
    size's activations at once. The pool keeps the memory reserved for as long as its
    graphs exist, which is as long as the pieces hold this alias.
    """
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.size(), t.stride())


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


# ------------------------------------------------------------------ one piece


class _Piece(nn.Module):
    """A compiled piece plus its CUDA graphs, one per captured token count."""

    def __init__(self, name: str, runnable: Callable, arg_names: list[str], runtime: _Runtime) -> None:
        super().__init__()
        self.name = name
        self.runnable = runnable
        self.arg_names = arg_names  # placeholder names, for error messages
        self._runtime = runtime
        self.entries: dict[int, _GraphEntry] = {}

    # Bypass nn.Module's hook machinery: this runs once per piece per step.
    def __call__(self, *args: Any) -> Any:
        rt = self._runtime
        if not rt.use_graphs:
            return self.runnable(*args)
        entry = self.entries.get(rt.num_tokens)
        if entry is not None:
            # Always on the first replay of an entry (cheap, catches a stale pointer
            # before it corrupts output silently); on every replay in debug mode.
            if rt.check_addresses or not entry.replayed:
                self._check_addresses(entry, args)
                entry.replayed = True
            entry.graph.replay()
            return entry.outputs
        if rt.capturing:
            return self._capture(args)
        return self.runnable(*args)

    forward = __call__

    def _capture(self, args: Sequence[Any]) -> Any:
        rt = self._runtime
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than `torch.cuda.graph(...)`, whose synchronize +
        # empty_cache on every entry would dominate a capture of many small pieces.
        rt.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(rt.stream):
            # Warm-up at this size, on the capture stream: lazy initialization (autotuning,
            # the cuBLAS workspace of this stream) must not happen inside the capture.
            self.runnable(*args)
            graph.capture_begin(pool=rt.pool, capture_error_mode=CAPTURE_MODE)
            try:
                outputs = self.runnable(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(rt.stream)
        # Capture only recorded the work: run it, so that this call's outputs (and the
        # eager op that reads them next) hold real values.
        graph.replay()
        aliases = _map_tensors(_non_owning_alias, outputs)
        self.entries[rt.num_tokens] = _GraphEntry(graph, aliases, _tensor_addresses(args))
        return outputs

    def _check_addresses(self, entry: _GraphEntry, args: Sequence[Any]) -> None:
        for i, captured in entry.input_addresses:
            arg = args[i]
            now = arg.data_ptr() if isinstance(arg, torch.Tensor) else None
            if now != captured:
                name = self.arg_names[i] if i < len(self.arg_names) else f"#{i}"
                now_s = "a non-tensor" if now is None else hex(now)
                raise AddressMismatchError(
                    f"piece {self.name!r} at num_tokens={self._runtime.num_tokens}: input {i} ({name}) is at "
                    f"{now_s} but was captured at {hex(captured)}; a graph input must be a view of a persistent "
                    "buffer or the output of the previous piece"
                )

    def release(self) -> None:
        self.entries.clear()


# ------------------------------------------------------------------ the torch.compile backend


@dataclass
class _SplitResult:
    """What the backend leaves behind for inspection and tests."""

    pieces: list[tuple[str, bool]] = field(default_factory=list)  # (name, is_split_op), run order, latest graph
    compile_seconds: float = 0.0


class _PiecewiseBackend:
    """The dynamo backend: split at the split ops, compile every other piece once."""

    def __init__(self, targets: frozenset, compile_backend: str | Callable, runtime: _Runtime) -> None:
        self.targets = targets
        self.compile_backend = compile_backend
        self.runtime = runtime
        self.num_graphs = 0  # dynamo graphs this backend compiled: 1 means no recompiles
        self.result = _SplitResult()
        self.pieces: list[_Piece] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        start = time.perf_counter()
        self.num_graphs += 1
        if self.num_graphs > 1:
            # A recompile: the new graph's pieces have no captured entries, so captured
            # sizes silently run ungraphed code from now on. Say so loudly.
            logger.warning(
                "piecewise: dynamo compiled graph #%d (a guard failed; run with TORCH_LOGS=recompiles to see "
                "which); its pieces have no CUDA graphs", self.num_graphs,
            )
        split, names, is_split = split_at_ops(gm, self.targets)
        compiled = compile_pieces(split, is_split, self.compile_backend, example_inputs)

        pieces: list[_Piece] = []
        for name in names:
            if is_split[name]:
                continue  # runs eagerly: the split op with the real per-step context
            sub = getattr(split, name)
            arg_names = [n.name for n in sub.graph.nodes if n.op == "placeholder"]
            piece = _Piece(name, compiled[name], arg_names, self.runtime)
            split._modules[name] = piece  # the split module's forward now calls the wrapper
            pieces.append(piece)
        self.pieces.extend(pieces)
        self.result.pieces = [(name, is_split[name]) for name in names]  # of the latest graph
        self.result.compile_seconds += time.perf_counter() - start
        logger.info(
            "piecewise: %d pieces (%d compiled with %s, %d split ops) in %.2f s",
            len(names), len(pieces), self.compile_backend, len(names) - len(pieces), self.result.compile_seconds,
        )
        return split


# ------------------------------------------------------------------ the public wrapper


def _private_entry(fn: Callable) -> Callable:
    """A trampoline to `fn` whose code object belongs to it alone.

    Dynamo keys its cache of compiled graphs (and its recompile limit, 8) on the code
    object of the frame it compiles. Compiling `fn` (say, a model's forward) directly
    would make every `PiecewiseCompiled` of that class share one cache: the ninth
    instance in a process would hit the limit, and dead instances' graphs would linger.
    A private code object makes the cache live and die with this instance.
    """

    def entry(*args: Any) -> Any:
        return fn(*args)

    code = entry.__code__.replace(co_name=f"piecewise_entry_{id(fn):x}")
    return types.FunctionType(code, entry.__globals__, code.co_name, None, entry.__closure__)


class PiecewiseCompiled:
    """`fn` compiled piecewise: split at `split_ops`, pieces compiled once and graphed per size.

    Args:
        fn: the function (or module) to compile; must trace with fullgraph=True.
        split_ops: torch.ops operators to cut at (packets or overloads); they run eagerly.
        token_args: positions of the tensor arguments whose dim 0 is the token count; the
            first one gives the runtime size. All must agree.
        compile_backend: "inductor" (production), "aot_eager" or "eager" (fast tests),
            or a dynamo backend callable.
        device: where graphs are used; None = the first token argument's device. Graphs
            exist only on CUDA; elsewhere capture only records the size.
        check_addresses: on every replay, check every piece's input addresses against its
            capture (always checked on an entry's first replay).
        name: for logs and errors.
    """

    def __init__(
        self,
        fn: Callable,
        split_ops: Iterable[Any],
        *,
        token_args: Sequence[int] = (0,),
        compile_backend: str | Callable = "inductor",
        device: torch.device | str | None = None,
        check_addresses: bool = False,
        name: str = "piecewise",
    ) -> None:
        if isinstance(compile_backend, str) and compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend={compile_backend!r}; allowed: {list(COMPILE_BACKENDS)} or a callable")
        if not token_args:
            raise ValueError("token_args must name at least one argument position")
        self.name = name
        self.token_args = tuple(token_args)
        self.device = None if device is None else torch.device(device)
        self._runtime = _Runtime(check_addresses=check_addresses)
        self._backend = _PiecewiseBackend(normalize_split_ops(split_ops), compile_backend, self._runtime)
        self._compiled = torch.compile(_private_entry(fn), backend=self._backend, fullgraph=True)
        # num_tokens -> (argument position, data_ptr) of the top-level tensor inputs at capture
        self._captured: dict[int, tuple[tuple[int, int], ...]] = {}
        self._own_pool: Any = None
        self._own_stream: Any = None

    # ---- inspection -------------------------------------------------------------
    @property
    def captured_sizes(self) -> list[int]:
        """Token counts captured (emulated on CPU), largest first."""
        return sorted(self._captured, reverse=True)

    @property
    def num_graphs_compiled(self) -> int:
        """Dynamo graphs compiled so far: 1 once traced, and it stays 1 (no recompiles)."""
        return self._backend.num_graphs

    @property
    def pieces(self) -> list[tuple[str, bool]]:
        """(name, is_split_op) of every piece in run order (empty before the first call)."""
        return list(self._backend.result.pieces)

    @property
    def check_addresses(self) -> bool:
        return self._runtime.check_addresses

    @check_addresses.setter
    def check_addresses(self, enabled: bool) -> None:
        self._runtime.check_addresses = bool(enabled)

    # ---- running ----------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        """Run `fn(*args)`: replays graphs when the token count was captured (on CUDA)."""
        num_tokens, device = self._prepare(args)
        if num_tokens in self._captured:
            self._check_top_level(num_tokens, args)
        with self._step(num_tokens, use_graphs=device.type == "cuda" and bool(self._captured)):
            return self._compiled(*args)

    def run_compiled(self, *args: Any) -> Any:
        """Run the compiled pieces with no piece graphs (no replay, no capture).

        For callers that capture the whole call inside a graph of their own (FULL step
        graphs): they get the compiled, fused kernels without nesting graph replays.
        """
        num_tokens, _ = self._prepare(args)
        with self._step(num_tokens, use_graphs=False):
            return self._compiled(*args)

    def capture(self, *args: Any, pool: Any = None, stream: Any = None) -> Any:
        """Run `fn(*args)`, capturing every compiled piece at this token count; returns the output.

        Each piece gets one warm-up run, then its capture into `pool` (a
        `torch.cuda.graph_pool_handle()`; None = one owned by this object) on `stream`
        (None = a side stream owned by this object), then one replay. The split ops run
        eagerly, for real: give the call inputs whose side effects are harmless (e.g.
        padded slots of -1). A size already captured is replayed, not captured again.
        On CPU nothing is captured; the size is recorded and the call runs as usual.
        """
        num_tokens, device = self._prepare(args)
        if num_tokens in self._captured:
            return self(*args)
        if device.type != "cuda":
            with self._step(num_tokens, use_graphs=False):
                out = self._compiled(*args)
            self._captured[num_tokens] = _tensor_addresses(args)
            return out
        if pool is None:
            self._own_pool = self._own_pool or torch.cuda.graph_pool_handle()
            pool = self._own_pool
        if stream is None:
            self._own_stream = self._own_stream or torch.cuda.Stream(device)
            stream = self._own_stream
        start = time.perf_counter()
        try:
            with self._step(num_tokens, use_graphs=True, capturing=True, pool=pool, stream=stream):
                out = self._compiled(*args)
        except BaseException:
            for piece in self._backend.pieces:  # never leave a size half captured
                piece.entries.pop(num_tokens, None)
            raise
        self._captured[num_tokens] = _tensor_addresses(args)
        logger.debug("%s: captured num_tokens=%d in %.3f s", self.name, num_tokens, time.perf_counter() - start)
        return out

    def release(self) -> None:
        """Drop every captured graph (their pool memory returns once no graph uses it).

        Outputs returned by earlier replays alias graph memory: do not use them after this.
        The compiled code is kept; `capture` may be called again.
        """
        for piece in self._backend.pieces:
            piece.release()
        self._captured.clear()
        self._own_pool = None
        self._own_stream = None

    # ---- helpers ----------------------------------------------------------------
    def _prepare(self, args: Sequence[Any]) -> tuple[int, torch.device]:
        """Validate the token arguments, mark their dim 0 unbacked; (token count, device)."""
        if max(self.token_args) >= len(args):
            raise ValueError(f"{self.name}: token_args={self.token_args} but the call has {len(args)} arguments")
        first = args[self.token_args[0]]
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise TypeError(f"{self.name}: argument {self.token_args[0]} must be a tensor with a token dimension")
        num_tokens = first.shape[0]
        if num_tokens < 1:
            raise ValueError(f"{self.name}: num_tokens={num_tokens} must be >= 1")
        for i in self.token_args:
            t = args[i]
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != num_tokens:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{self.name}: argument {i} has shape {shape}; expected dim 0 = {num_tokens} tokens")
            # Unbacked, not dynamic: a dynamic dim specializes sizes 0 and 1, so T=1 would
            # compile a second graph. Marking is idempotent and costs an attribute set.
            torch._dynamo.decorators.mark_unbacked(t, 0)
        return num_tokens, self.device or first.device

    def _check_top_level(self, num_tokens: int, args: Sequence[Any]) -> None:
        # Always on: a handful of pointer compares that catch the classic bug of feeding a
        # captured size from a freshly allocated tensor instead of the persistent buffer.
        for i, captured in self._captured[num_tokens]:
            arg = args[i]
            now = arg.data_ptr() if isinstance(arg, torch.Tensor) else None
            if now != captured:
                raise AddressMismatchError(
                    f"{self.name}: argument {i} at num_tokens={num_tokens} is at "
                    f"{'a non-tensor' if now is None else hex(now)} but was captured at {hex(captured)}; "
                    "pass views of the same persistent buffers as at capture"
                )

    @contextmanager
    def _step(self, num_tokens: int, *, use_graphs: bool, capturing: bool = False, pool: Any = None,
              stream: Any = None) -> Iterator[None]:
        rt = self._runtime
        if rt.num_tokens:
            raise RuntimeError(f"{self.name}: re-entrant call (already running num_tokens={rt.num_tokens})")
        rt.num_tokens, rt.use_graphs, rt.capturing, rt.pool, rt.stream = num_tokens, use_graphs, capturing, pool, stream
        try:
            yield
        finally:
            rt.num_tokens, rt.use_graphs, rt.capturing, rt.pool, rt.stream = 0, False, False, None, None


__all__ = ["COMPILE_BACKENDS", "AddressMismatchError", "PiecewiseCompiled"]
