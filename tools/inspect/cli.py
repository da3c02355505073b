"""`graphrunner inspect {table,explain,capture,replay,simulate}`: argument parsing and output.

Every subcommand prints a readable table; `--json` prints machine JSON on stdout instead
(progress and warnings go to stderr). Bad arguments exit with a one-line message naming
the offending value, before anything is built. `table`, `explain` and `simulate` build
no model; `capture` and `replay` build a runner with dummy weights.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

_DESCRIPTION = (
    "What was captured, what it cost, and which graph a batch uses. Every subcommand prints a readable "
    "table, or JSON with --json. table, explain and simulate build no model; capture and replay build a "
    "runner with dummy weights. All run on a CPU (FULL graphs are emulated there)."
)
_DEFAULT_MODEL = "builtin:qwen2.5-0.5b"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `inspect` and its subcommands to the `graphrunner` parser."""
    p = subparsers.add_parser(
        "inspect",
        help="graph capture inspection: dispatch table, explain a batch, capture report, replay, simulate",
        description=_DESCRIPTION,
    )
    sub = p.add_subparsers(dest="inspect_command", metavar="SUBCOMMAND")
    sub.required = True
    _register_table(sub)
    _register_explain(sub)
    _register_capture(sub)
    _register_replay(sub)
    _register_simulate(sub)
    p.set_defaults(func=run)


# ---- arguments ----------------------------------------------------------------------
def _parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    return p


def _model_args(p: argparse.ArgumentParser, model: str | None = _DEFAULT_MODEL) -> None:
    p.add_argument("--model", default=model, help="builtin:NAME (dummy weights) or a Hugging Face folder")
    p.add_argument("--device", default=None, help="unset = cuda if available, else cpu")


def _table_args(p: argparse.ArgumentParser) -> None:
    """The inputs of a dispatch table (table, explain, simulate)."""
    from tools.inspect.table import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

    # The table does not depend on the model: --model only labels the output.
    _model_args(p, model=None)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--cudagraph-mode", "--mode", dest="mode", default=None,
                   help="NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE; unset = the runner's default")
    p.add_argument("--cudagraph-capture-sizes", "--capture-sizes", dest="capture_sizes", default=None,
                   help="comma-separated token counts; unset = the runner's default ladder")
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="q = 1 + this for uniform decode")
    p.add_argument("--attention-support", default=None, choices=("NEVER", "UNIFORM_DECODE", "ALWAYS"),
                   type=str.upper,
                   help="what attention allows in FULL graphs; unset = what the backend on --device declares")


def _runner_args(p: argparse.ArgumentParser) -> None:
    """How a real runner is built (capture, replay)."""
    from tools.cli_args import add_runner_args

    add_runner_args(p, model=_DEFAULT_MODEL)


def _register_table(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "table", "capture sizes, mode resolution and per token count the ordered candidate descriptors")
    _table_args(p)


def _register_explain(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "explain", "the descriptor a batch gets, why, and its padding waste")
    _table_args(p)
    p.add_argument("--query-lens", default=None, help="comma-separated tokens per request, e.g. 1,1,7")
    p.add_argument("--num-reqs", type=int, default=None, help="requests in the batch")
    p.add_argument("--num-tokens", type=int, default=None, help="tokens in the batch (with --uniform or --num-reqs)")
    p.add_argument("--uniform", type=int, default=None, metavar="Q", help="every request has exactly Q tokens")


def _register_capture(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "capture", "capture with node inspection; show the CaptureReport and a kernel histogram")
    _runner_args(p)
    p.add_argument("--cudagraph-mode", "--mode", dest="mode", default="FULL_AND_PIECEWISE", help="cudagraph mode")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--cudagraph-capture-sizes", "--capture-sizes", dest="capture_sizes", default=None,
                   help="comma-separated token counts; unset = the runner's default ladder")
    p.add_argument("--top", type=int, default=20, help="kernels shown in the histogram")
    p.add_argument("--dot", nargs=2, metavar=("DESC", "FILE"), default=None,
                   help='write one FULL graph as Graphviz DOT, e.g. --dot "FULL(t=8,r=8,q=1)[greedy]" out.dot (CUDA only)')
    p.add_argument("--progress", action="store_true", help="show the capture progress bar")


def _register_replay(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "replay", "FULL-graph replay latency vs the same batch run eagerly, per size")
    _runner_args(p)
    p.add_argument("--cudagraph-mode", "--mode", dest="mode", default="FULL_DECODE_ONLY",
                   help="a mode with FULL graphs: FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE")
    p.add_argument("--sizes", default="1,8,32", help="comma-separated decode batch sizes (= captured sizes)")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each request's KV cache")
    p.add_argument("--steps", type=int, default=20, help="timed steps per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")


def _register_simulate(sub: argparse._SubParsersAction) -> None:
    from tools.inspect.workloads import WORKLOADS

    p = _parser(sub, "simulate", "dispatch hit rates and padding waste over a recorded or synthesised batch trace")
    _table_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", default=None, help="JSONL from `graphrunner generate --record-batches`")
    src.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                     help="synthesise a trace with the reference scheduler: "
                          + "; ".join(f"{k}: {w.description}" for k, w in WORKLOADS.items()))
    p.add_argument("--num-requests", type=int, default=200, help="requests in a synthesised workload")
    p.add_argument("--seed", type=int, default=0, help="seeds a synthesised workload")
    p.add_argument("--max-model-len", type=int, default=2048, help="synthesised requests fit in it")
    p.add_argument("--block-size", type=int, default=16, help="KV block size of the synthesising scheduler")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks of the synthesising scheduler; unset = room for every request (no preemption)")
    p.add_argument("--save-trace", metavar="FILE", default=None, help="write the synthesised trace as JSONL")
    p.add_argument("--top", type=int, default=10, help="descriptors listed")
    p.add_argument("--plot", metavar="PNG", default=None, help="plot mode shares and tokens per step (needs matplotlib)")


# ---- running ------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Run the chosen subcommand; returns the exit status."""
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "table": _run_table,
        "explain": _run_explain,
        "capture": _run_capture,
        "replay": _run_replay,
        "simulate": _run_simulate,
    }
    from tools.inspect.render import InspectError

    command = args.inspect_command
    try:
        return handlers[command](args)
    except (ValueError, InspectError, OSError) as e:
        raise SystemExit(f"graphrunner inspect {command}: {e}") from None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sizes(text: str | None, what: str) -> tuple[int, ...] | None:
    if not text:
        return None
    from tools.bench.common import parse_int_list

    return parse_int_list(text, what)


def _built_table(args: argparse.Namespace):
    from tools.inspect.table import TableSpec, build_table

    return build_table(
        TableSpec(
            model=args.model,
            device=args.device,
            mode=args.mode,
            capture_sizes=_sizes(args.capture_sizes, "--cudagraph-capture-sizes"),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_speculative_tokens=args.num_speculative_tokens,
            attention_support=args.attention_support,
        )
    )


def _run_table(args: argparse.Namespace) -> int:
    from tools.inspect.render import print_json
    from tools.inspect.table import table_dict, table_text

    built = _built_table(args)
    if args.json:
        print_json(table_dict(built))
    else:
        print(table_text(built))
    return 0


def _run_explain(args: argparse.Namespace) -> int:
    from tools.inspect.explain import BatchShape, explain_batch, explanation_dict, explanation_text
    from tools.inspect.render import print_json

    built = _built_table(args)
    if args.query_lens is not None:
        if args.num_tokens is not None or args.uniform is not None:
            raise ValueError("give --query-lens, or --num-tokens with --uniform/--num-reqs, not both")
        lens = _sizes(args.query_lens, "--query-lens")
        shape = BatchShape.from_query_lens(lens or (), built.table.uniform_decode_query_len)
        if args.num_reqs is not None and args.num_reqs != shape.num_reqs:
            raise ValueError(f"--num-reqs={args.num_reqs} but --query-lens lists {shape.num_reqs} requests")
    elif args.num_tokens is not None:
        shape = BatchShape.from_sizes(args.num_tokens, uniform=args.uniform, num_reqs=args.num_reqs)
    else:
        raise ValueError("describe the batch with --query-lens L1,L2,... or --num-tokens T (--uniform Q | --num-reqs R)")
    exp = explain_batch(built.table, shape)
    if args.json:
        print_json(explanation_dict(built, shape, exp))
    else:
        print(explanation_text(built, shape, exp))
    return 0


def _run_capture(args: argparse.Namespace) -> int:
    from tools.inspect.capture_cmd import CaptureSpec, capture_text, run_capture
    from tools.inspect.render import print_json

    spec = CaptureSpec(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        mode=args.mode,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        capture_sizes=_sizes(args.capture_sizes, "--cudagraph-capture-sizes"),
        compile_backend=args.compile_backend,
        load_format=args.load_format,
        seed=args.seed,
        dot=tuple(args.dot) if args.dot else None,
        progress=args.progress,
    )
    result = run_capture(spec)
    if args.json:
        print_json(result.to_dict(args.top))
    else:
        print(capture_text(result, args.top))
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    from tools.inspect.render import print_json
    from tools.inspect.replay import ReplaySpec, replay_text, run_replay

    spec = ReplaySpec(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        mode=args.mode,
        sizes=_sizes(args.sizes, "--sizes") or (),
        context=args.context,
        steps=args.steps,
        warmup=args.warmup,
        block_size=args.block_size,
        compile_backend=args.compile_backend,
        load_format=args.load_format,
        seed=args.seed,
    )
    result = run_replay(spec, log=_log)
    if args.json:
        print_json(result.to_dict())
    else:
        print(replay_text(result))
    for err in result.errors:
        print(f"graphrunner inspect replay: mode {err}", file=sys.stderr)
    return 1 if result.errors else 0


def _run_simulate(args: argparse.Namespace) -> int:
    from tools.inspect.render import print_json
    from tools.inspect.simulate import read_trace, require_plot, shape_of_record, simulate, simulation_text
    from tools.inspect.table import header_lines

    if args.plot:
        require_plot()  # fail before the work, not after
    built = _built_table(args)
    q = built.table.uniform_decode_query_len
    if args.trace:
        if args.save_trace:
            raise ValueError("--save-trace writes a synthesised trace; it needs --workload, not --trace")
        shapes, source = read_trace(args.trace, q), args.trace
    else:
        from tools.inspect.workloads import synthesize

        records = synthesize(
            args.workload,
            num_requests=args.num_requests,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            uniform_decode_query_len=q,
        )
        if args.save_trace:
            import json
            from pathlib import Path

            Path(args.save_trace).write_text("".join(json.dumps(r) + "\n" for r in records))
        source = f"workload {args.workload} ({args.num_requests} requests, seed {args.seed})"
        shapes = [shape_of_record(r, q, f"{source}, step {i}") for i, r in enumerate(records)]
    result = simulate(built.table, shapes, source)
    if args.json:
        print_json(result.to_dict(args.top))
    else:
        print(simulation_text(result, header_lines(built), args.top))
    if args.plot:
        from tools.inspect.simulate import plot_simulation

        plot_simulation(result, args.plot)
    return 0


if __name__ == "__main__":  # pragma: no cover
    from graphrunner.cli import main

    sys.exit(main(["inspect", *sys.argv[1:]]))
