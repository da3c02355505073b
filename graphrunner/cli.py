"""The `graphrunner` console script: one argparse subcommand per tool.

Each subcommand lives in its own module, which exposes

    register(subparsers) -> None   # adds its parser; sets `func=run` via set_defaults
    run(args) -> int               # the exit status

and is listed in `SUBCOMMANDS` below. Modules are imported when the parser is built,
so they must keep heavy imports (torch, the model stack) inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand name -> module with `register`/`run`; the order is the order of
# `graphrunner --help`.
SUBCOMMANDS: dict[str, str] = {
    "generate": "graphrunner.engine.cli",
    "inspect": "tools.inspect.cli",
    "bench": "tools.bench.cli",
    "launch": "graphrunner.distributed.launch",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphrunner", description="An LLM model runner whose whole step runs from CUDA graphs."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # a subcommand may re-launch itself (generate --tp/--pp/--dp)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
