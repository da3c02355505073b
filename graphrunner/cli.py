"""The `graphrunner` console script: one argparse subcommand per tool.

Each subcommand lives in its own module, which exposes

    register(subparsers) -> None   # adds its parser; sets `func=run` via set_defaults
    run(args) -> int               # the exit status

The library's own subcommands (`generate`, `launch`) are listed in `subcommands()`; the
command-line tools (`inspect`, `bench`) register themselves through the entry-point group
`graphrunner.commands` of the installed distribution (pyproject.toml), so this package never
imports the tools. Modules are imported when the parser is built, so they must keep heavy
imports (torch, the model stack) inside `run`.

Global options come before the subcommand: `--version`, and `--log-level` (or the env
variable GRAPHRUNNER_LOGGING_LEVEL; the option wins), which shows the `graphrunner` loggers'
messages (load time, KV cache size, graph capture summary at `info`).

The options several subcommands share (how a runner is built, the scheduler limits, the
graph mode) come from `graphrunner.cli_args`, so that one option reads the same in
`generate`, `bench` and `inspect`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Protocol, cast

from graphrunner import __version__

LOG_LEVEL_ENV = "GRAPHRUNNER_LOGGING_LEVEL"
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
COMMAND_GROUP = "graphrunner.commands"  # entry points: name = "module" exposing register / run


class Subcommand(Protocol):
    """What a subcommand module provides (a module satisfies this protocol)."""

    def register(self, subparsers: argparse._SubParsersAction) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def subcommands() -> list[Subcommand]:
    """The subcommand modules, in the order of `graphrunner --help`: the library's own, then
    the registered ones (entry-point group `graphrunner.commands`) by name.

    Imported here rather than at the top, so that `import graphrunner.cli` stays free of
    torch (the `graphrunner.engine` package imports it).
    """
    from graphrunner.distributed import launch
    from graphrunner.engine import cli as generate
    from graphrunner.engine import serve_cli as serve

    builtin: list[Subcommand] = [generate, serve, launch]  # modules satisfy the protocol
    registered = sorted(entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name)
    return builtin + [cast(Subcommand, ep.load()) for ep in registered]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphrunner", description="An LLM model runner whose whole step runs from CUDA graphs."
    )
    parser.add_argument("--version", action="version", version=f"graphrunner {__version__}")
    parser.add_argument(
        "--log-level", type=str.lower, choices=list(LOG_LEVELS), default=None,
        help=f"level of the graphrunner loggers (default: ${LOG_LEVEL_ENV}, else Python's: warnings only)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in subcommands():
        module.register(subparsers)
    return parser


def configure_logging(level: str) -> None:
    """Set the level of the `graphrunner` logger hierarchy to `level` (a key of LOG_LEVELS).

    Adds a stderr handler with a short format unless the `graphrunner` or the root logger
    already has one (an application that configured logging keeps its own).
    """
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    logger = logging.getLogger("graphrunner")
    logger.setLevel(LOG_LEVELS[level])
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # Neither the option nor the env variable: logging is left as it was (warnings and
    # errors reach stderr through Python's last-resort handler).
    level = args.log_level or os.environ.get(LOG_LEVEL_ENV, "").strip().lower()
    if level:
        if level not in LOG_LEVELS:
            parser.error(f"{LOG_LEVEL_ENV}={level!r} is not one of {', '.join(LOG_LEVELS)}")
        configure_logging(level)
    args.argv = argv  # a subcommand may re-launch itself (generate --tp/--pp/--dp)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
