"""`graphrunner inspect {table,explain,capture,replay,simulate}`: argument parsing and output.

Every subcommand prints a readable table; `--json` prints machine JSON on stdout instead
(progress and warnings go to stderr). Bad arguments exit with a one-line message naming
the offending value, before anything is built. `table`, `explain` and `simulate` build
no model; `capture` and `replay` build a runner with dummy weights.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from graphrunner.cli_args import (
    CUDAGRAPH_MODES,
    add_command_group,
    add_graph_args,
    add_kv_cache_dtype_arg,
    add_limit_args,
    add_model_args,
    add_runner_args,
    add_speculative_args,
    add_subcommand,
    limit_kwargs,
    parse_int_list,
    runner_kwargs,
    speculative_kwargs,
)

_DESCRIPTION = (
    "What was captured, what it cost, and which graph a batch uses. Every subcommand prints a readable "
    "table, or JSON with --json. table, explain and simulate build no model; capture and replay build a "
    "runner with dummy weights. All run on a CPU (FULL graphs are emulated there)."
)
_DEFAULT_MODEL = "builtin:qwen2.5-0.5b"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `inspect` and its subcommands to the `graphrunner` parser."""
    sub = add_command_group(
        subparsers,
        "inspect",
        help="graph capture inspection: dispatch table, explain a batch, capture report, replay, simulate",
        description=_DESCRIPTION,
        metavar="SUBCOMMAND",
        run=run,
    )
    _register_table(sub)
    _register_explain(sub)
    _register_capture(sub)
    _register_replay(sub)
    _register_simulate(sub)
    _register_kernels(sub)


# ---- arguments ----------------------------------------------------------------------
def _parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    p = add_subcommand(sub, name, help)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    return p


def _table_args(p: argparse.ArgumentParser) -> None:
    """The inputs of a dispatch table (table, explain, simulate)."""
    from graphrunner_tools.inspect.table import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

    # The table does not depend on the model: --model only labels the output (and must exist).
    add_model_args(p, model=None)
    add_limit_args(p, max_num_seqs=DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    add_graph_args(p, mode=None, mode_help=f"{CUDAGRAPH_MODES}; unset = the runner's default")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="q = 1 + this for uniform decode (or give --speculative-config)")
    add_speculative_args(p)
    p.add_argument("--attention-support", default=None, choices=("NEVER", "UNIFORM_DECODE", "ALWAYS"),
                   type=str.upper,
                   help="what attention allows in FULL graphs; unset = what the backend on --device declares")
    p.add_argument("--enable-lora", action="store_true",
                   help="the table of a runner with LoRA on: graphs captured with adapters beside the plain ones")


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
    p.add_argument("--lora", action="store_true", help="the batch has LoRA adapter rows (implies --enable-lora)")
    p.add_argument("--prefill-context-parallel-size", "-pcp", dest="pcp_size", type=int, default=1, metavar="P",
                   help="with P > 1 also show how prefill context parallelism splits the batch per rank "
                        "(tokens, padding, work, chunks)")


def _register_capture(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "capture", "capture with node inspection; show the CaptureReport, nodes per layer, kernel "
                                "families and a kernel histogram")
    add_runner_args(p, model=_DEFAULT_MODEL)
    add_kv_cache_dtype_arg(p)
    add_graph_args(p, mode="FULL_AND_PIECEWISE", mode_help="cudagraph mode")
    add_limit_args(p, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)
    add_speculative_args(p)
    p.add_argument("--top", type=int, default=20, help="kernels shown in the histogram")
    p.add_argument("--all-graphs", action="store_true",
                   help="nodes per layer and kernel families of every graph (default: the smallest decode graph; "
                        "--json always has every graph)")
    p.add_argument("--dot", nargs=2, metavar=("DESC", "FILE"), default=None,
                   help="write one FULL graph as Graphviz DOT, e.g. "
                        '--dot "FULL(t=8,r=8,q=1)[greedy]" out.dot (CUDA only)')
    p.add_argument("--progress", action="store_true", help="show the capture progress bar")


def _register_replay(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "replay", "FULL-graph replay latency vs the same batch run eagerly, per size")
    add_runner_args(p, model=_DEFAULT_MODEL)
    add_graph_args(p, mode="FULL_DECODE_ONLY", capture_sizes=False,
                   mode_help="a mode with FULL graphs: FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE")
    p.add_argument("--sizes", default="1,8,32", help="comma-separated decode batch sizes (= captured sizes)")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each request's KV cache")
    p.add_argument("--steps", type=int, default=20, help="timed steps per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")


def _register_simulate(sub: argparse._SubParsersAction) -> None:
    from graphrunner_tools.inspect.workloads import WORKLOADS

    p = _parser(sub, "simulate", "dispatch hit rates and padding waste over a recorded or synthesised batch trace")
    _table_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", default=None, help="JSONL from `graphrunner generate --record-batches`")
    src.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                     help="synthesise a trace with the reference scheduler: "
                          + "; ".join(f"{k}: {w.description}" for k, w in WORKLOADS.items()))
    p.add_argument("--num-requests", type=int, default=200, help="requests in a synthesised workload")
    p.add_argument("--seed", type=int, default=0, help="seeds a synthesised workload")
    p.add_argument("--block-size", type=int, default=16, help="KV block size of the synthesising scheduler")
    add_limit_args(
        p,
        max_model_len=2048,
        num_kv_blocks=None,
        help={
            "max_model_len": "synthesised requests fit in it",
            "num_kv_blocks": "the synthesising scheduler's; unset = room for every request (no preemption)",
        },
    )
    p.add_argument("--save-trace", metavar="FILE", default=None, help="write the synthesised trace as JSONL")
    p.add_argument("--top", type=int, default=10, help="descriptors listed")
    p.add_argument(
        "--plot", metavar="PNG", default=None, help="plot mode shares and tokens per step (needs matplotlib)"
    )
    p.add_argument("--pipeline-parallel-size", "-pp", dest="pp_size", type=int, default=1, metavar="P",
                   help="with P > 1 also model a P-stage pipeline running the trace's steps: a step's work "
                        "(its padded tokens + --step-overhead-tokens) splits evenly over the P stages; shows "
                        "the bubble fraction (1 - busy / (P * makespan)) of the synchronous schedule (one batch "
                        "in flight: (P-1)/P) and of the pipelined one (up to P batches in flight: stage s+1 runs "
                        "batch t-1 while stage s runs batch t, and batch t enters stage 0 once batch t-P has left "
                        "the last stage), and the speed-up. Pipelining needs "
                        "consecutive steps to use disjoint requests; the trace's steps are taken as-is")
    p.add_argument("--step-overhead-tokens", type=int, default=0, metavar="N",
                   help="fixed work of every step, in tokens, added to its padded tokens (with -pp P > 1)")
    p.add_argument("--num-experts", type=int, default=0, metavar="E",
                   help="with E > 0, also route the trace's tokens over E experts and report the per-rank expert "
                        "load (max/mean) of --ep-size ranks with the static placement and with EPLB's")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (with --num-experts)")
    p.add_argument("--ep-size", type=int, default=2, help="expert-parallel ranks (with --num-experts)")
    p.add_argument("--num-redundant-experts", type=int, default=0,
                   help="EPLB's extra physical expert slots (with --num-experts)")
    p.add_argument("--router-skew", type=float, default=1.0,
                   help="Zipf exponent of expert popularity (0: uniform; with --num-experts)")


def _register_kernels(sub: argparse._SubParsersAction) -> None:
    p = _parser(sub, "kernels", "the runner's kernel choices (KernelConfig), the device's properties and the plan "
                                "each projection gets")
    add_model_args(p, model=_DEFAULT_MODEL)
    p.add_argument("--kernel-config", default=None, metavar="JSON",
                   help='KernelConfig fields as JSON, e.g. \'{"pdl": false}\'; unset = the defaults')


# ---- running ------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Run the chosen subcommand; returns the exit status."""
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "table": _run_table,
        "explain": _run_explain,
        "capture": _run_capture,
        "replay": _run_replay,
        "simulate": _run_simulate,
        "kernels": _run_kernels,
    }
    from graphrunner_tools.inspect.render import InspectError

    command = args.inspect_command
    try:
        return handlers[command](args)
    except (ValueError, InspectError, OSError) as e:
        raise SystemExit(f"graphrunner inspect {command}: {e}") from None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sizes(text: str | None, what: str) -> tuple[int, ...] | None:
    return parse_int_list(text, what) if text else None


def _speculation(args: argparse.Namespace):
    """--speculative-config (checked as `LLM` checks it) reconciled with --num-speculative-tokens."""
    from graphrunner_tools.inspect.speculation import Speculation

    text = speculative_kwargs(args, f"graphrunner inspect {args.inspect_command}").get("speculative_config")
    spec = Speculation.from_config_text(text)
    given = getattr(args, "num_speculative_tokens", 0)
    if text is None:
        return Speculation(given)
    if given and given != spec.k:
        raise ValueError(f"--num-speculative-tokens={given} disagrees with --speculative-config's "
                         f"num_speculative_tokens={spec.k}; give one of them")
    return spec


def _check_model(model: str | None) -> None:
    """The table does not depend on --model, but a name that `generate` would refuse is refused
    here too: ValueError listing the builtins, FileNotFoundError naming a missing folder."""
    if model is not None:
        from graphrunner.models.loader import load_model_config

        load_model_config(model)


def _built_table(args: argparse.Namespace):
    from graphrunner_tools.inspect.table import TableSpec, build_table

    _check_model(args.model)
    spec = _speculation(args)
    return build_table(
        TableSpec(
            model=args.model,
            device=args.device,
            mode=args.mode,
            capture_sizes=_sizes(args.capture_sizes, "--cudagraph-capture-sizes"),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_speculative_tokens=spec.k,
            attention_support=args.attention_support,
            speculative_method=spec.method,
            draft_model=spec.draft_model,
            enable_lora=args.enable_lora or getattr(args, "lora", False),
        )
    )


def _run_table(args: argparse.Namespace) -> int:
    from graphrunner_tools.inspect.render import print_json
    from graphrunner_tools.inspect.table import table_dict, table_text

    built = _built_table(args)
    if args.json:
        print_json(table_dict(built))
    else:
        print(table_text(built))
    return 0


def _run_explain(args: argparse.Namespace) -> int:
    from graphrunner_tools.inspect.explain import (
        BatchShape,
        PCPSplit,
        check_pcp_size,
        explain_batch,
        explanation_dict,
        explanation_text,
        pcp_query_lens,
    )
    from graphrunner_tools.inspect.render import print_json

    check_pcp_size(args.pcp_size)
    built = _built_table(args)
    lens = None
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
        raise ValueError(
            "describe the batch with --query-lens L1,L2,... or --num-tokens T (--uniform Q | --num-reqs R)"
        )
    exp = explain_batch(built.table, shape, args.lora)
    q = built.table.uniform_decode_query_len
    pcp = PCPSplit.build(pcp_query_lens(shape, lens), q, args.pcp_size) if args.pcp_size > 1 else None
    if args.json:
        print_json(explanation_dict(built, shape, exp, pcp))
    else:
        print(explanation_text(built, shape, exp, pcp))
    return 0


def _run_capture(args: argparse.Namespace) -> int:
    from graphrunner_tools.inspect.capture_cmd import CaptureSpec, capture_text, run_capture
    from graphrunner_tools.inspect.render import print_json

    spec = CaptureSpec(
        **runner_kwargs(args),
        mode=args.mode,
        **limit_kwargs(args),
        capture_sizes=_sizes(args.capture_sizes, "--cudagraph-capture-sizes"),
        speculative_config=speculative_kwargs(args, "graphrunner inspect capture").get("speculative_config"),
        kv_cache_dtype=args.kv_cache_dtype,
        dot=tuple(args.dot) if args.dot else None,
        progress=args.progress,
    )
    result = run_capture(spec)
    if args.json:
        print_json(result.to_dict(args.top))
    else:
        print(capture_text(result, args.top, all_graphs=args.all_graphs))
    return 0


def _run_replay(args: argparse.Namespace) -> int:
    from graphrunner_tools.inspect.render import print_json
    from graphrunner_tools.inspect.replay import ReplaySpec, replay_text, run_replay

    spec = ReplaySpec(
        **runner_kwargs(args),
        mode=args.mode,
        sizes=_sizes(args.sizes, "--sizes") or (),
        context=args.context,
        steps=args.steps,
        warmup=args.warmup,
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
    from graphrunner_tools.inspect.pipeline import check_pipeline_args, pipeline_text, simulate_pipeline
    from graphrunner_tools.inspect.render import print_json
    from graphrunner_tools.inspect.simulate import read_trace, require_plot, shape_of_record, simulate, simulation_text
    from graphrunner_tools.inspect.table import header_lines

    check_pipeline_args(args.pp_size, args.step_overhead_tokens)
    if args.num_experts:
        from graphrunner_tools.inspect.experts import check_expert_args

        check_expert_args(args.num_experts, args.top_k, args.ep_size, args.num_redundant_experts, args.router_skew)
    if args.plot:
        require_plot()  # fail before the work, not after
    built = _built_table(args)
    q = built.table.uniform_decode_query_len
    if args.trace:
        if args.save_trace:
            raise ValueError("--save-trace writes a synthesised trace; it needs --workload, not --trace")
        shapes, source = read_trace(args.trace, q), args.trace
    else:
        from graphrunner_tools.inspect.workloads import synthesize

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
    pipe = (simulate_pipeline([s.run_tokens for s in result.steps], args.pp_size, args.step_overhead_tokens)
            if args.pp_size > 1 else None)
    experts = None
    if args.num_experts:
        from graphrunner_tools.inspect.experts import expert_load_text, simulate_expert_load

        experts = simulate_expert_load([s.real_tokens for s in result.steps], args.num_experts, args.top_k,
                                       args.ep_size, args.num_redundant_experts, args.router_skew, args.seed)
    if args.json:
        print_json(result.to_dict(args.top) | ({"pipeline": pipe.to_dict()} if pipe else {})
                   | ({"expert_load": experts.to_dict()} if experts else {}))
    else:
        print(simulation_text(result, header_lines(built), args.top) + (f"\n\n{pipeline_text(pipe)}" if pipe else "")
              + (f"\n\n{expert_load_text(experts)}" if experts else ""))
    if args.plot:
        from graphrunner_tools.inspect.simulate import plot_simulation

        plot_simulation(result, args.plot)
    return 0


if __name__ == "__main__":  # pragma: no cover
    from graphrunner.cli import main

    sys.exit(main(["inspect", *sys.argv[1:]]))


def _run_kernels(args: argparse.Namespace) -> int:
    import json

    import torch

    from graphrunner.config import KernelConfig
    from graphrunner_tools.inspect.kernels import kernel_report, kernel_text
    from graphrunner_tools.inspect.render import print_json

    try:
        values = json.loads(args.kernel_config) if args.kernel_config else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--kernel-config is not JSON ({e}): {args.kernel_config!r}") from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = kernel_report(args.model, KernelConfig.from_dict(values), device)
    if args.json:
        print_json(report)
    else:
        print(kernel_text(report))
    return 0
