"""Splitting a dynamo graph at opaque ops, and compiling each piece between them once.

`split_at_ops` cuts the FX graph so that every call of a split op (attention) is a piece
of its own; `compile_pieces` propagates dynamo's fake tensors (symbolic token count)
through the split module and compiles every other piece with them: one compile per
piece serves every size (the eager backend keeps the pieces as they are: nothing to
propagate). Pieces of the same structure (the decoder layers between two attention calls:
the same nodes over inputs of the same shapes, weights among the inputs) share one compiled
callable, so a model of L layers compiles a handful of pieces, not L + 1.
capture/piecewise.py wraps the result in graph-capturing pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.node import Target
from torch.fx.passes.split_module import split_module


def normalize_split_ops(split_ops: Iterable[Any]) -> frozenset:
    """Every target dynamo may record for the given ops: packet and each overload."""
    targets: set = set()
    for op in split_ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            targets.add(op)
            targets.update(getattr(op, name) for name in op.overloads())
        elif isinstance(op, torch._ops.OpOverload):
            targets.update((op, op.overloadpacket))
        else:
            raise TypeError(f"split op {op!r} is not a torch.ops operator (an OpOverloadPacket or OpOverload)")
    return frozenset(targets)


def is_split_node(node: fx.Node, targets: frozenset) -> bool:
    return node.op == "call_function" and node.target in targets


def compile_piece(gm: fx.GraphModule, example_args: list[Any], backend: str | Callable) -> Callable:
    if backend == "eager":
        return gm
    compiler = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return compiler(gm, example_args)
    # AOT-based compilers want a tuple output; a piece with one output returns it bare.
    output.args = ((output.args[0],),)
    gm.recompile()
    compiled = compiler(gm, example_args)
    return lambda *args: compiled(*args)[0]


def _arg_meta(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return ("tensor", tuple(map(str, arg.shape)), tuple(map(str, arg.stride())), arg.dtype, arg.device.type,
                arg.requires_grad)
    if isinstance(arg, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("sym", str(arg))
    return ("value", repr(arg))


def structure_key(gm: fx.GraphModule, example_args: list[Any]) -> tuple | None:
    """What makes two pieces interchangeable: their nodes (op, target, arguments as node positions)
    and their inputs' metadata. None when the piece reads module state (get_attr): its compiled
    form would carry that module's tensors."""
    position: dict[fx.Node, int] = {}
    nodes = []
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "get_attr":
            return None
        position[node] = i
        args = fx.node.map_arg(node.args, lambda n: ("%", position[n]))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: ("%", position[n]))
        target = node.target if node.op in ("call_function", "call_method") else None
        nodes.append((node.op, target, repr(args), repr(kwargs)))
    return tuple(nodes), tuple(_arg_meta(a) for a in example_args)


def split_at_ops(gm: fx.GraphModule, targets: frozenset) -> tuple[fx.GraphModule, list[str], dict[str, bool]]:
    """`gm` cut at every call of a split op: (split module, piece names in run order,
    name -> whether the piece is a split op alone)."""
    partition: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if is_split_node(node, targets):
            current += 1
            partition[node] = current  # the split op alone in its piece
            current += 1
        else:
            partition[node] = current
    split = split_module(gm, gm, lambda n: partition[n], keep_original_order=True)
    names = [str(n.target) for n in split.graph.nodes if n.op == "call_module"]  # run order
    is_split = {name: any(is_split_node(n, targets) for n in getattr(split, name).graph.nodes) for name in names}
    return split, names, is_split


def compile_pieces(
    split: fx.GraphModule, is_split: dict[str, bool], backend: str | Callable, example_inputs: list[Any]
) -> dict[str, Callable]:
    """Piece name -> its compiled callable, for every piece that is not a split op."""
    if backend == "eager":  # compile_piece keeps each piece as it is: no fake inputs to propagate
        return {name: getattr(split, name) for name, alone in is_split.items() if not alone}
    fake_mode = detect_fake_mode(example_inputs)
    fake_args = [
        fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) and fake_mode is not None else a
        for a in example_inputs
    ]
    return _CompileEachPiece(split, is_split, backend).run_fake(fake_mode, fake_args)


class _CompileEachPiece(fx.Interpreter):
    """Propagates fake tensors through the split module, compiling each non-split piece
    with the fake (symbolic-shape) inputs it receives: one compile per piece, every size."""

    def __init__(self, split: fx.GraphModule, is_split: dict[str, bool], backend: str | Callable) -> None:
        super().__init__(split)
        self.is_split = is_split
        self.backend = backend
        self.compiled: dict[str, Callable] = {}
        self.by_structure: dict[tuple, Callable] = {}  # `structure_key` -> the compiled piece

    def run_fake(self, fake_mode: Any, fake_args: list[Any]) -> dict[str, Callable]:
        if fake_mode is None:
            self.run(*fake_args)
        else:
            with fake_mode:
                self.run(*fake_args)
        return self.compiled

    def call_module(self, target: Target, args: Any, kwargs: Any) -> Any:
        assert isinstance(target, str), "a call_module node names its module"
        assert not kwargs, "split_module passes piece inputs positionally"
        out = super().call_module(target, args, kwargs)
        if not self.is_split[target]:
            piece = getattr(self.module, target)
            key = structure_key(piece, list(args))
            compiled = self.by_structure.get(key) if key is not None else None
            if compiled is None:
                compiled = compile_piece(piece, list(args), self.backend)
                if key is not None:
                    self.by_structure[key] = compiled
            self.compiled[target] = compiled
        return out
