"""Command-line options shared by the `graphrunner` subcommands (generate, bench, inspect).

Each `add_*` helper adds one group of options to a parser; `runner_kwargs` and
`limit_kwargs` hand the parsed values on to a spec or `LLM` by their field names. Kept
free of torch, so that building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
CUDAGRAPH_MODES = "NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE"
# Each scheduler limit's help, for add_limit_args; a subcommand may say more.
_LIMIT_HELP = {
    "max_num_seqs": "requests in one step at most",
    "max_num_batched_tokens": "tokens in one step at most",
    "max_model_len": "prompt + output tokens of one request at most",
    "num_kv_blocks": "KV cache blocks",
}
# CacheConfig.cache_dtype's values (graphrunner.config.KV_CACHE_DTYPES; kept equal by a test, as this
# module stays free of torch).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3")
# The options add_runner_args adds, as the keyword arguments of a spec (runner_kwargs).
_RUNNER_FIELDS = ("model", "dtype", "device", "block_size", "compile_backend", "load_format", "seed")
# A help text that already says what happens by default ("default: ...", "unset = ...").
_STATES_DEFAULT = re.compile(r"\bunset\b|\bdefault[: ]")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help once: not where the help already says
    the default, and not for an unset (None) or off (False) default, which say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is False or _STATES_DEFAULT.search(text):
            return action.help
        return super()._get_help_string(action)


def add_subcommand(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser; `--help` shows `help` and every option's default, once."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=help, formatter_class=DefaultsHelpFormatter
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


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype (vLLM's flag), parsed into `args.kv_cache_dtype`: `CacheConfig.cache_dtype`."""
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="how the KV cache stores keys and values: auto = the model's dtype; fp8 (= fp8_e4m3) = "
                        "float8_e4m3fn over each layer's k_scale / v_scale (the checkpoint's, else 1.0)")


def runner_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The options of `add_runner_args`, by their spec field names."""
    return {name: getattr(args, name) for name in _RUNNER_FIELDS}


# `graphrunner.config.QUANT_METHODS`, spelled out: building a parser imports no torch (a test holds
# the two equal).
QUANTIZATION_CHOICES = ("fp8",)


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    """--quantization (vLLM's flag): `LLM(quantization=...)`."""
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                   help="fp8: quantize the decoder's linear weights to e4m3 at load (vLLM's option); "
                        "unset: the checkpoint's own, if any")


def add_limit_args(p: argparse.ArgumentParser, *, help: dict[str, str] | None = None, **defaults: int | None) -> None:
    """The scheduler limits named in `defaults`, in that order: `max_num_seqs=64` adds
    --max-num-seqs with default 64. `help` adds to a limit's help text."""
    more = help or {}
    for name, default in defaults.items():
        text = _LIMIT_HELP[name] + (f"; {more[name]}" if name in more else "")
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=text)


def limit_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler limits `add_limit_args` added to the parser of `args`, by name."""
    return {name: getattr(args, name) for name in _LIMIT_HELP if hasattr(args, name)}


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """--speculative-config (vLLM's flag), parsed into `args.speculative_config`: the JSON text
    that `LLM(speculative_config=...)` takes; `speculative_kwargs` checks it."""
    p.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_min": 1, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", '
             '"model": "builtin:NAME", "num_speculative_tokens": 2}\' or \'{"method": "eagle3", "model": '
             '"builtin:eagle3-NAME" (or a head folder), "num_speculative_tokens": 3}\'; unset = off',
    )


def speculative_kwargs(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """`speculative_config=` for `LLM` from `add_speculative_args`' option; SystemExit naming
    the option and the bad value (before any model loads)."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return {}
    from graphrunner.config import SpeculativeConfig  # torch: only when the option is used

    try:
        SpeculativeConfig.from_dict(text)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{command}: --speculative-config: {e}") from None
    return {"speculative_config": text}


# Dual batch overlap's `ParallelConfig` fields (vLLM's names): `LLM` keywords and CLI options alike.
DBO_FIELDS = ("enable_dbo", "dbo_decode_token_threshold", "dbo_prefill_token_threshold")


def add_dbo_args(p: argparse.ArgumentParser) -> None:
    """--enable-dbo and its thresholds (vLLM's flags): dual batch overlap under lockstep DP
    (graphrunner/step/microbatch.py); `dbo_cli_kwargs` hands them on to `LLM`."""
    p.add_argument("--enable-dbo", action="store_true",
                   help="with --data-parallel-lockstep: run steps every replica agrees to split as two "
                        "microbatches on two streams (dual batch overlap)")
    p.add_argument("--dbo-decode-token-threshold", type=int, default=32,
                   help="a decode-only step splits from this many tokens")
    p.add_argument("--dbo-prefill-token-threshold", type=int, default=512,
                   help="a step with prefills splits from this many tokens")


def dbo_cli_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`add_dbo_args`' options as `LLM`'s keywords (none when the parser has no --enable-dbo)."""
    if not hasattr(args, "enable_dbo"):
        return {}
    return {name: getattr(args, name) for name in DBO_FIELDS}


def add_command_group(
    subparsers: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    description: str,
    metavar: str,
    run: Callable[[argparse.Namespace], int],
) -> argparse._SubParsersAction:
    """A subcommand with subcommands of its own (`bench`, `inspect`): the chosen one lands
    in `args.<name>_command`, and `run(args)` dispatches on it."""
    p = subparsers.add_parser(name, help=help, description=description)
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest=f"{name}_command", metavar=metavar)
    sub.required = True
    return sub


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
