"""The `graphrunner` console script: one argparse subcommand per tool.

Each subcommand lives in its own module, which exposes

    register(subparsers) -> None   # adds its parser; sets `func=run` via set_defaults
    run(args) -> int               # the exit status

and is listed in `subcommands()` below. Modules are imported when the parser is built,
so they must keep heavy imports (torch, the model stack) inside `run`.

The options several subcommands share (how a runner is built, the scheduler limits, the
graph mode) come from `graphrunner.cli_args`, so that one option reads the same in
`generate`, `bench` and `inspect`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Protocol


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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # a subcommand may re-launch itself (generate --tp/--pp/--dp)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
