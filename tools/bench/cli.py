"""`graphrunner bench {latency,kernels,capture,throughput,host,sampler,soak,spec,serve,disagg,offload}`:
argument parsing and output.

Outputs: a readable table on stdout always; `--json PATH` (or `-` for stdout),
`--markdown PATH`, and for latency `--png PATH` (needs matplotlib). Exit status 0 when
everything measured, 1 when a mode failed (its error is printed; the other modes'
numbers are still written). Bad arguments exit with a one-line message naming the
offending value, before anything is measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphrunner.cli_args import (
    COMPILE_BACKENDS,
    add_command_group,
    add_graph_args,
    add_kv_cache_dtype_arg,
    add_limit_args,
    add_quantization_arg,
    add_runner_args,
    add_subcommand,
    limit_kwargs,
    parse_int_list,
    runner_kwargs,
)
from graphrunner_tools.bench import disagg_bench, offload_bench, serve_load

_DESCRIPTION = __doc__


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench` and its subcommands to the `graphrunner` parser."""
    sub = add_command_group(
        subparsers,
        "bench",
        help="benchmarks: decode latency vs roofline, capture cost, offline throughput",
        description=_DESCRIPTION,
        metavar="BENCHMARK",
        run=run,
    )
    _register_latency(sub)
    _register_kernels(sub)
    _register_capture(sub)
    _register_throughput(sub)
    _register_host(sub)
    _register_sampler(sub)
    _register_soak(sub)
    _register_spec(sub)
    serve_load.register(sub)  # `bench serve`: its own parser and run (graphrunner_tools/bench/serve_load.py)
    disagg_bench.register(sub)  # `bench disagg`: its own parser and run, two processes a layout
    offload_bench.register(sub)  # `bench offload`: its own parser and run


def _common(p: argparse.ArgumentParser, *, model: str = "builtin:qwen2.5-0.5b") -> None:
    add_runner_args(p, model=model)
    _output_args(p)


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", default=None, help="write results as JSON ('-' = stdout)")
    p.add_argument("--markdown", metavar="PATH", default=None, help="write a markdown table")


def _register_latency(sub: argparse._SubParsersAction) -> None:
    p = add_subcommand(sub, "latency", "decode step time per mode and batch size, beside the memory-bandwidth roofline")
    _common(p)
    add_kv_cache_dtype_arg(p)
    p.add_argument("--batch-sizes", default="1,8,32,128,256", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each request's KV cache")
    p.add_argument("--modes", default="NONE,PIECEWISE,FULL", help="comma-separated cudagraph modes (one runner each)")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=5, help="untimed decode steps before the timed ones")
    p.add_argument(
        "--capture-sizes",
        default="batch",
        help="'batch' = exactly the batch sizes, 'default' = the runner's ladder, or a comma-separated list",
    )
    _copy_mib_arg(p)
    p.add_argument("--no-random-kv", action="store_true", help="leave the KV cache zero-filled (not recommended)")
    p.add_argument("--png", metavar="PATH", default=None, help="plot ms/step and %% of roofline (needs matplotlib)")
    add_quantization_arg(p)
    p.add_argument("--num-loras", type=int, default=0,
                   help="also time each batch with this many distinct dummy LoRA adapters (all seven projections)")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the dummy LoRA adapters")


def _register_kernels(sub: argparse._SubParsersAction) -> None:
    add_kernels_args(add_subcommand(sub, "kernels", "GPU time per kernel and kernel family of a decode step "
                                                    "(torch.profiler over graph replays)"))


def add_kernels_args(p: argparse.ArgumentParser) -> None:
    """The options of `bench kernels` (graphrunner_tools.bench.kernel_times)."""
    p.add_argument("--model", default="builtin:qwen2.5-0.5b", help="builtin:NAME or a checkpoint folder")
    p.add_argument("--batch-sizes", default="1,256", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each request's KV cache")
    p.add_argument("--modes", default="FULL", help="comma-separated cudagraph modes")
    p.add_argument("--steps", type=int, default=10, help="profiled decode steps per batch size")
    p.add_argument("--top", type=int, default=15, help="kernels listed per batch size")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the tables here")
    p.add_argument("--pdl", action="store_true",
                   help="launch with programmatic dependent launch (off by default: kernels then overlap)")
    add_quantization_arg(p)
    add_kv_cache_dtype_arg(p)


def _run_kernels(args: argparse.Namespace) -> int:
    from graphrunner_tools.bench.kernel_times import run_args

    return run_args(args)


def _copy_mib_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--copy-mib", type=int, default=None, help="copy-bandwidth buffer size; default 2048 (CUDA), 128 (CPU)"
    )


def _register_capture(sub: argparse._SubParsersAction) -> None:
    p = add_subcommand(sub, "capture", "capture time and pool memory for the default capture sizes")
    _common(p)
    add_graph_args(p, mode="FULL_AND_PIECEWISE", mode_help="cudagraph mode to capture")
    add_limit_args(
        p,
        max_num_seqs=256,
        max_num_batched_tokens=512,
        max_model_len=1024,
        num_kv_blocks=None,
        help={"max_num_seqs": "sizes the default capture ladder (2 x this, <= 512)",
              "num_kv_blocks": "unset = one request's worth"},
    )
    p.add_argument("--inspect-nodes", action="store_true", help="record graph node counts and kernel names (CUDA)")
    p.add_argument("--progress", action="store_true", help="show the capture progress bar")


def _register_throughput(sub: argparse._SubParsersAction) -> None:
    p = add_subcommand(
        sub, "throughput", "offline LLM.generate output tokens/s and its ratio to the bandwidth-bound ideal"
    )
    _common(p)
    add_kv_cache_dtype_arg(p)
    p.add_argument("--runner", default="generate", choices=("generate", "pooling"),
                   help="pooling: LLM.embed prompts/s beside the generative prefill rate (prompts only)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (mean, with --dist uniform)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens (mean, with --dist uniform)")
    p.add_argument("--dist", default="fixed", choices=("fixed", "uniform"), help="uniform: lengths in [L/2, 3L/2]")
    add_graph_args(p, mode="FULL_AND_PIECEWISE", mode_help="cudagraph mode (NONE = eager)", capture_sizes=False)
    add_limit_args(p, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=None,
                   help={"num_kv_blocks": "unset = sized from a profile run"})
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule and launch step N+1 while step N runs (the engine's default; same tokens)")
    _copy_mib_arg(p)
    add_quantization_arg(p)
    p.add_argument("--num-loras", type=int, default=0,
                   help="prompt i runs dummy LoRA adapter i mod N (all seven projections); 0: the base model")
    p.add_argument("--max-loras", type=int, default=8, help="distinct adapters in flight (the rest queue)")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the dummy LoRA adapters")
    p.add_argument("--images", type=int, default=0,
                   help="images per prompt (a vision-language model, e.g. builtin:llava-1.5-7b or "
                   "builtin:qwen2.5-vl-7b): random pixels")
    p.add_argument("--distinct-images", type=int, default=None,
                   help="the pool the prompts' images come from (fewer than the images: encoder cache hits)")
    p.add_argument("--image-size", type=int, default=None,
                   help="side of the square random images in px (default: LLaVA's tower size; Qwen2.5-VL: 336)")
    p.add_argument(
        "--peer",
        action="store_true",
        help="also run Hugging Face transformers generate on the same weights and prompts (needs transformers, "
        "--dist fixed, --num-prompts <= --max-num-seqs)",
    )
    p.add_argument(
        "--peer-variants",
        default="hf-eager,hf-static-compile",
        help="comma-separated peer variants; hf-static-compile compiles with --compile-backend",
    )


def _register_host(sub: argparse._SubParsersAction) -> None:
    p = add_subcommand(sub, "host", "host CPU time per decode step (execute_model + sample_tokens), sync vs async")
    _common(p)
    p.add_argument("--batch-sizes", default="1,64,256", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=128, help="tokens already in each request's KV cache")
    add_graph_args(p, mode="FULL", mode_help="cudagraph mode (graphs captured at exactly the batch sizes)",
                   capture_sizes=False)
    p.add_argument("--schedulings", default="sync,async", help="comma-separated: sync, async")
    p.add_argument("--steps", type=int, default=100, help="timed decode steps per batch size and loop")
    p.add_argument("--repeats", type=int, default=3, help="runner loops per batch size and scheduling (pooled)")
    p.add_argument("--wait", choices=("poll", "block"), default="poll",
                   help="how the loop waits for the previous output: poll is_ready() (default) or block in wait()")
    p.add_argument("--settle-s", type=float, default=None,
                   help="untimed decode loops before measuring (default: 20 s on CUDA, 0 on CPU)")
    p.add_argument("--warmup", type=int, default=10, help="untimed decode steps before the timed ones")
    p.add_argument("--noop-step", action="store_true",
                   help="replace the step body and graph replay with a no-op: the host path alone (for CPUs)")


def _register_sampler(sub: argparse._SubParsersAction) -> None:
    p = add_subcommand(sub, "sampler", "sampler GPU time: greedy-only vs every feature on, eager and in a CUDA graph")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--num-reqs", default="1,64,256", help="comma-separated batch sizes")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (151936 = Qwen2.5)")
    p.add_argument("--max-model-len", type=int, default=4096, help="token history length the penalties scan")
    p.add_argument("--iters", type=int, default=50, help="timed calls per row")
    p.add_argument("--variants", default="greedy,sampled,all,all_on",
                   help="comma-separated: greedy, sampled (temperature/top-k/top-p/min-p only), all (a batch's "
                        "exact features), all_on (the all-features graph)")
    p.add_argument("--no-graphs", action="store_true", help="eager timings only")
    p.add_argument("--graph-calls", type=int, default=8,
                   help="sampler calls captured in one graph for the in-graph time per call (0: skip it)")
    _output_args(p)


def _register_soak(sub: argparse._SubParsersAction) -> None:
    p = add_subcommand(sub, "soak", "reference-engine loop under request churn: memory, graphs, preemptions over "
                       "time; exit 1 on memory growth, a recapture, a probe mismatch or a bad output "
                       "(--model unset = builtin:qwen2.5-0.5b on CUDA, builtin:tiny-llama on CPU)")
    add_runner_args(p, model="builtin:qwen2.5-0.5b")
    p.set_defaults(model=None)  # chosen by device in run_soak
    p.add_argument("--minutes", type=float, default=10.0, help="how long to soak (fractions allowed)")
    p.add_argument("--report-every-s", type=float, default=60.0, help="seconds between rows (the first closes warm-up)")
    p.add_argument("--max-growth-mib", type=float, default=64.0,
                   help="fail when allocated device memory exceeds the first row's by more than this (MiB)")
    p.add_argument("--abort-fraction", type=float, default=0.1,
                   help="share of requests aborted at a random step after submission")
    add_graph_args(p, mode="FULL_AND_PIECEWISE", mode_help="cudagraph mode (NONE = eager)")
    add_limit_args(p, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024, num_kv_blocks=None,
                   help={"num_kv_blocks": "unset = a quarter of max-num-seqs max-length requests (forces preemption)"})
    p.add_argument("--async-scheduling", action="store_true", help="drive the engine with async scheduling")
    _output_args(p)


def _register_spec(sub: argparse._SubParsersAction) -> None:
    p = add_subcommand(sub, "spec", "speculative decoding (FULL graphs): verifying vs plain decode step, tokens per "
                       "step, tokens/s with and without speculation (n-gram, draft-model and EAGLE drafters), the "
                       "drafter's time, real n-gram acceptance")
    p.add_argument("--models", default="builtin:llama-3.1-8b,builtin:qwen2.5-0.5b",
                   help="comma-separated models (dummy weights); one runner at a time")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16")
    p.add_argument("--batch-sizes", default="1,8,64", help="comma-separated decode batch sizes")
    p.add_argument("--num-spec", default="2,4",
                   help="comma-separated k (draft tokens per step) of the synthetic and draft runs")
    p.add_argument("--acceptance", default="0.8",
                   help="comma-separated synthetic acceptance rates (n-gram and draft runs)")
    p.add_argument("--ngram-k", type=int, default=4, help="k of the strict n-gram run (repetitive prompts); 0 skips")
    p.add_argument("--draft-model", default="auto",
                   help="draft model of the draft-model runs (synthetic acceptance, each k and rate): auto = "
                        "builtin:llama-3.2-1b for builtin:llama-3.1-8b, builtin:tiny-llama for itself, none for "
                        "other models; none = no draft runs; a model = for every target sharing its vocabulary")
    p.add_argument("--heads", default="auto",
                   help="EAGLE heads of the head runs (synthetic acceptance, each k and rate): auto = "
                        "builtin:eagle3-NAME for a builtin target; none = no head runs; else comma-separated heads "
                        "(builtin:eagle-NAME, builtin:eagle3-NAME or head folders), each for every target it fits")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps before the timed ones")
    p.add_argument("--gpu-steps", type=int, default=20, help="decode steps timed with CUDA events (CUDA only)")
    p.add_argument("--drafter-repeats", type=int, default=100, help="timed calls of the drafter alone")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (prefilled, untimed)")
    add_graph_args(p, mode="FULL_DECODE_ONLY", capture_sizes=False,
                   mode_help="decode steps replay FULL graphs captured at exactly the batch sizes x (1 + k)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--compile-backend", default=None, choices=COMPILE_BACKENDS,
                   help="compiles the model for the graphs; unset = inductor on CUDA, eager on CPU")
    p.add_argument("--seed", type=int, default=0, help="seeds dummy weights and prompts")
    p.add_argument("--out", metavar="PATH", default=None,
                   help="write the JSON here and the markdown beside it (suffix .md)")


def _run_spec(args: argparse.Namespace) -> int:
    from graphrunner_tools.bench.report import write_json
    from graphrunner_tools.bench.spec_bench import SpecBenchSpec, run_spec_bench, spec_markdown

    def write(result) -> None:  # after every runner, so that a killed run keeps what it measured
        write_json(result.to_dict(), args.out)
        Path(args.out).with_suffix(".md").write_text(spec_markdown(result))

    try:
        spec = SpecBenchSpec(
            models=tuple(m.strip() for m in args.models.split(",") if m.strip()), device=args.device,
            dtype=args.dtype, batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"),
            num_spec=parse_int_list(args.num_spec, "--num-spec"), acceptance=_float_list(args.acceptance),
            ngram_k=args.ngram_k, draft_model=args.draft_model, heads=args.heads, steps=args.steps, warmup=args.warmup,
            gpu_steps=args.gpu_steps, drafter_repeats=args.drafter_repeats, prompt_len=args.prompt_len, mode=args.mode,
            block_size=args.block_size, compile_backend=args.compile_backend, seed=args.seed,
        )
        result = run_spec_bench(spec, log=_log, checkpoint=write if args.out else None)
    except ValueError as e:
        raise _fail("spec", e) from None
    print(spec_markdown(result))
    for err in result.errors:
        print(f"graphrunner bench spec: {err}", file=sys.stderr)
    return 1 if result.errors else 0


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--acceptance={text!r} must be a comma-separated list of numbers in [0, 1]") from None


def _run_soak(args: argparse.Namespace) -> int:
    from graphrunner_tools.bench.soak import SoakSpec, run_soak, soak_markdown, verdict

    try:
        spec = SoakSpec(**runner_kwargs(args), **limit_kwargs(args), minutes=args.minutes,
                        report_every_s=args.report_every_s, max_growth_mib=args.max_growth_mib,
                        abort_fraction=args.abort_fraction, mode=args.mode, async_scheduling=args.async_scheduling,
                        capture_sizes=parse_int_list(args.capture_sizes, "--capture-sizes") if args.capture_sizes
                        else None)
    except ValueError as e:
        raise _fail("soak", e) from None
    result = run_soak(spec, log=lambda msg: print(msg, file=sys.stderr if args.json == "-" else sys.stdout, flush=True))
    _emit(args, result.to_dict(), verdict(result), soak_markdown(result))
    for reason in result.failures:
        print(f"graphrunner bench soak: {reason}", file=sys.stderr)
    return 1 if result.failures else 0


def _run_sampler(args: argparse.Namespace) -> int:
    import json

    import torch

    from graphrunner_tools.bench.sampler_bench import bench_sampler, markdown_table

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.inference_mode():
        rows = bench_sampler(device, [int(n) for n in args.num_reqs.split(",")], args.vocab, args.iters,
                             max_model_len=args.max_model_len,
                             variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
                             graphs=not args.no_graphs, graph_calls=args.graph_calls)
    table = markdown_table(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; returns the exit status."""
    handlers = {"latency": _run_latency, "kernels": _run_kernels, "capture": _run_capture,
                "throughput": _run_throughput, "host": _run_host, "sampler": _run_sampler, "soak": _run_soak,
                "spec": _run_spec}
    return handlers[args.bench_command](args)


def _fail(command: str, error: Exception) -> SystemExit:
    return SystemExit(f"graphrunner bench {command}: {error}")


def _copy_bytes(args: argparse.Namespace) -> int | None:
    return None if args.copy_mib is None else args.copy_mib << 20


def _log(msg: str) -> None:
    # Progress goes to stderr so that `--json -` leaves stdout machine-readable.
    print(msg, file=sys.stderr, flush=True)


def _emit(args: argparse.Namespace, data: dict, text: str, markdown: str) -> None:
    """Print the table (to stderr when JSON owns stdout), then write the requested files."""
    print(text, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        from graphrunner_tools.bench.report import write_json

        write_json(data, args.json)
    if args.markdown:
        Path(args.markdown).write_text(markdown)


def _run_latency(args: argparse.Namespace) -> int:
    from graphrunner_tools.bench.latency import LatencySpec, run_latency
    from graphrunner_tools.bench.report import (
        MissingDependency,
        latency_markdown,
        latency_png,
        latency_table,
        require_pyplot,
    )

    if args.png:
        try:  # fail before an hour of benchmarking, not after
            require_pyplot()
        except MissingDependency as e:
            raise _fail("latency", e) from None
    try:
        sizes = args.capture_sizes
        capture_sizes = (
            None if sizes == "batch" else "default" if sizes == "default" else parse_int_list(sizes, "--capture-sizes")
        )
        spec = LatencySpec(
            **runner_kwargs(args),
            batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"),
            context=args.context,
            modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
            steps=args.steps,
            warmup=args.warmup,
            capture_sizes=capture_sizes,
            copy_bytes=_copy_bytes(args),
            random_kv=not args.no_random_kv,
            quantization=args.quantization,
            num_loras=args.num_loras,
            lora_rank=args.lora_rank,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        result = run_latency(spec, log=_log)
    except ValueError as e:
        raise _fail("latency", e) from None
    _emit(args, result.to_dict(), latency_table(result), latency_markdown(result))
    if args.png and result.rows:
        latency_png(result, args.png)
    for err in result.errors:
        print(f"graphrunner bench latency: mode {err}", file=sys.stderr)
    return 1 if result.errors else 0


def _run_capture(args: argparse.Namespace) -> int:
    from graphrunner_tools.bench.capture_bench import CaptureSpec, run_capture
    from graphrunner_tools.bench.report import capture_markdown, capture_text

    try:
        spec = CaptureSpec(
            **runner_kwargs(args),
            mode=args.mode,
            **limit_kwargs(args),
            capture_sizes=parse_int_list(args.capture_sizes, "--capture-sizes") if args.capture_sizes else None,
            inspect_nodes=args.inspect_nodes,
            progress=args.progress,
        )
        result = run_capture(spec)
    except ValueError as e:
        raise _fail("capture", e) from None
    _emit(args, result.to_dict(), capture_text(result), capture_markdown(result))
    return 0


def _run_throughput(args: argparse.Namespace) -> int:
    if args.runner == "pooling":
        return _run_pooling_throughput(args)
    from graphrunner_tools.bench.report import throughput_markdown, throughput_text
    from graphrunner_tools.bench.throughput import ThroughputSpec, run_throughput

    try:
        spec = ThroughputSpec(
            **runner_kwargs(args),
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            dist=args.dist,
            mode=args.mode,
            **limit_kwargs(args),
            gpu_memory_utilization=args.gpu_memory_utilization,
            async_scheduling=args.async_scheduling,
            copy_bytes=_copy_bytes(args),
            peer=args.peer,
            peer_variants=tuple(v.strip() for v in args.peer_variants.split(",") if v.strip()),
            quantization=args.quantization,
            num_loras=args.num_loras,
            max_loras=args.max_loras,
            lora_rank=args.lora_rank,
            kv_cache_dtype=args.kv_cache_dtype,
            images=args.images,
            distinct_images=args.distinct_images,
            image_size=args.image_size,
        )
        result = run_throughput(spec, log=_log)
    except ValueError as e:
        raise _fail("throughput", e) from None
    text, markdown = throughput_text(result), throughput_markdown(result)
    if result.peer is not None:
        from graphrunner_tools.bench.peer import peer_markdown, peer_text

        text, markdown = f"{text}\n\n{peer_text(result.peer)}", markdown + peer_markdown(result.peer)
    _emit(args, result.to_dict(), text, markdown)
    if result.peer is not None:
        # A peer failure is reported, not fatal: our numbers are what this command measures.
        for err in result.peer.errors + ([result.peer.skipped] if result.peer.skipped else []):
            print(f"graphrunner bench throughput: peer {err}", file=sys.stderr)
    if result.output_tokens != result.expected_output_tokens:
        print(
            f"graphrunner bench throughput: generated {result.output_tokens} tokens, "
            f"expected {result.expected_output_tokens} (ignore_eos)",
            file=sys.stderr,
        )
        return 1
    return 0


def _run_pooling_throughput(args: argparse.Namespace) -> int:
    from graphrunner_tools.bench.pooling_throughput import PoolingThroughputSpec, run_pooling_throughput

    try:
        if args.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype={args.kv_cache_dtype} is not supported with --runner pooling "
                             "(its benchmark builds the cache in the model's dtype); use auto")
        limits = limit_kwargs(args)
        spec = PoolingThroughputSpec(
            model=args.model, num_prompts=args.num_prompts, input_len=args.input_len, mode=args.mode,
            dtype=args.dtype, device=args.device, max_num_seqs=limits["max_num_seqs"],
            max_num_batched_tokens=limits["max_num_batched_tokens"], num_kv_blocks=limits.get("num_kv_blocks"),
            compile_backend=getattr(args, "compile_backend", None))
        result = run_pooling_throughput(spec)
    except ValueError as e:
        raise _fail("throughput", e) from None
    text = result.text()
    _emit(args, result.to_dict(), text, f"```\n{text}\n```\n")
    return 0


def _run_host(args: argparse.Namespace) -> int:
    from graphrunner_tools.bench.host_overhead import HostSpec, host_markdown, host_text, run_host

    try:
        spec = HostSpec(
            **runner_kwargs(args),
            batch_sizes=parse_int_list(args.batch_sizes, "--batch-sizes"),
            context=args.context,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            settle_s=args.settle_s,
            wait=args.wait,
            mode=args.mode,
            schedulings=tuple(s.strip() for s in args.schedulings.split(",") if s.strip()),
            noop_step=args.noop_step,
        )
        from capture.modes import CUDAGraphMode

        CUDAGraphMode.parse(spec.mode)  # raises naming the value and the allowed set
        result = run_host(spec, log=_log)
    except ValueError as e:
        raise _fail("host", e) from None
    _emit(args, result.to_dict(), host_text(result), host_markdown(result))
    if result.error:
        print(f"graphrunner bench host: {result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    from graphrunner.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
