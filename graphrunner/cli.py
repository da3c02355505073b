"""The `graphrunner` console script: one argparse subcommand per tool.

Each subcommand lives in its own module, which exposes

    register(subparsers) -> None   # adds its parser; sets `func=run` via set_defaults
    run(args) -> int               # the exit status

and is listed in `subcommands()` below. Modules are imported when the parser is built,
so they must keep heavy imports (torch, the model stack) inside `run`.

The options several subcommands share (how a runner is built, the scheduler limits, the
graph mode) are added by the `add_*_args` helpers below, so that one option reads the
same in `generate`, `bench` and `inspect`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Protocol


class Subcommand(Protocol):
    """What a subcommand module provides (a module satisfies this protocol)."""

    def register(self, subparsers: argparse._SubParsersAction) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def subcommands() -> list[Subcommand]:
    """The subcommand modules, in the order of `graphrunner --help`.

    Imported here rather than at the top, so that `import graphrunner.cli` stays free of
    torch (the `graphrunner.engine` package imports it).
    """
    from graphrunner.distributed import launch
    from graphrunner.engine import cli as generate
    from graphrunner_tools.bench import cli as bench
    from graphrunner_tools.inspect import cli as inspect

    return [generate, inspect, bench, launch]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphrunner", description="An LLM model runner whose whole step runs from CUDA graphs."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in subcommands():
        module.register(subparsers)
    return parser


# ---- options the subcommands share ------------------------------------------------------
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
CUDAGRAPH_MODES = "NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE"
# Each scheduler limit's help, for add_limit_args; a subcommand may say more.
_LIMIT_HELP = {
    "max_num_seqs": "requests in one step at most",
    "max_num_batched_tokens": "tokens in one step at most",
    "max_model_len": "prompt + output tokens of one request at most",
    "num_kv_blocks": "KV cache blocks",
}
# The options add_runner_args adds, as the keyword arguments of a spec (runner_kwargs).
_RUNNER_FIELDS = ("model", "dtype", "device", "block_size", "compile_backend", "load_format", "seed")


def add_subcommand(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser; `--help` shows `help` and every option's default."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    return parser


def add_model_args(p: argparse.ArgumentParser, *, model: str | None) -> None:
    """--model and --device."""
    p.add_argument("--model", default=model, help="builtin:NAME (dummy weights) or a Hugging Face checkpoint folder")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")


def add_runner_args(p: argparse.ArgumentParser, *, model: str, compile_backend: str | None = None) -> None:
    """How a runner is built: --model, --device, --dtype, --block-size, --compile-backend,
    --load-format, --seed. `runner_kwargs` hands them on to a spec."""
    add_model_args(p, model=model)
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--compile-backend",
        default=compile_backend,
        choices=COMPILE_BACKENDS,
        help="compiles the model for graph modes (PIECEWISE pieces)"
        + ("; unset = inductor on CUDA, eager on CPU" if compile_backend is None else ""),
    )
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"), help="builtins always use dummy weights")
    p.add_argument("--seed", type=int, default=0, help="seeds dummy weights and whatever else is random")


def runner_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The options of `add_runner_args`, by their spec field names."""
    return {name: getattr(args, name) for name in _RUNNER_FIELDS}


def add_limit_args(p: argparse.ArgumentParser, *, help: dict[str, str] | None = None, **defaults: int | None) -> None:
    """The scheduler limits named in `defaults`, in that order: `max_num_seqs=64` adds
    --max-num-seqs with default 64. `help` adds to a limit's help text."""
    more = help or {}
    for name, default in defaults.items():
        text = _LIMIT_HELP[name] + (f"; {more[name]}" if name in more else "")
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=text)


def add_graph_args(
    p: argparse.ArgumentParser, *, mode: str | None, mode_help: str = CUDAGRAPH_MODES, capture_sizes: bool = True
) -> None:
    """--cudagraph-mode (alias --mode) and, with `capture_sizes`, --cudagraph-capture-sizes
    (alias --capture-sizes); parsed into `args.mode` and `args.capture_sizes`."""
    p.add_argument("--cudagraph-mode", "--mode", dest="mode", default=mode, help=mode_help)
    if capture_sizes:
        p.add_argument("--cudagraph-capture-sizes", "--capture-sizes", dest="capture_sizes", default=None,
                       help="comma-separated token counts; unset = the runner's default ladder")


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    """"1,8,32" -> (1, 8, 32); ValueError naming `what` on anything but positive ints."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what}={text!r} must be a comma-separated list of ints") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what}={text!r} must list at least one int, each >= 1")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # a subcommand may re-launch itself (generate --tp/--pp/--dp)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
