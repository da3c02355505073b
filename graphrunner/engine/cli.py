"""`graphrunner generate`: offline generation through the reference engine, with throughput.

Prompts are random token ids drawn from `--seed`, or text given with `--prompt` when the
model folder has a tokenizer.json (needs the optional `tokenizers` package).

With --tp/--pp/--dp > 1 and no WORLD_SIZE in the environment, the command re-launches
itself as tp*pp*dp ranks through `graphrunner launch` (torchrun works too); every rank
runs the engine (SPMD), DP replicas split the prompts, and only global rank 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphrunner.cli_args import (
    CUDAGRAPH_MODES,
    DefaultsHelpFormatter,
    add_dbo_args,
    add_graph_args,
    add_kv_cache_dtype_arg,
    add_limit_args,
    add_quantization_arg,
    add_runner_args,
    add_speculative_args,
    dbo_cli_kwargs,
    limit_kwargs,
    parse_int_list,
    runner_kwargs,
    speculative_kwargs,
)

if TYPE_CHECKING:
    from graphrunner.engine.llm import LLM
    from graphrunner.engine.request import RequestOutput
    from graphrunner.protocol import LoRARequest, SamplingParams

NUM_SHOWN_OUTPUTS = 3
TOKENIZER_FILE = "tokenizer.json"


class StrictParser(argparse.ArgumentParser):
    """A subcommand's parser that reports an unknown option itself, with its own usage (argparse
    would leave it to the top-level parser, whose usage says nothing of the subcommand's options)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, []


def strict_subparser(subparsers: argparse._SubParsersAction, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """`subparsers.add_parser(name, ...)` as a `StrictParser`."""
    p = subparsers.add_parser(name, formatter_class=DefaultsHelpFormatter, **kwargs)
    p.__class__ = StrictParser
    return p


def add_engine_args(p: argparse.ArgumentParser, *, model: str | None) -> None:
    """The options that build an `LLM` (vLLM's flag names), shared by `generate` and `serve`;
    `engine_kwargs` hands them on."""
    add_runner_args(p, model=model, compile_backend="inductor")  # type: ignore[arg-type]  # serve: None
    add_kv_cache_dtype_arg(p)
    add_limit_args(
        p,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        max_model_len=None,
        num_kv_blocks=None,
        help={"max_num_seqs": "unset = 256 (vLLM's default)",
              "max_num_batched_tokens": "unset = 16384 on CUDA, 4096 on a CPU (vLLM's defaults)",
              "max_model_len": "unset = the model's max_position_embeddings, lowered (with a notice) to what the "
                               "KV cache holds",
              "num_kv_blocks": "unset = sized from a profile run"},
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the runner may use (weights, activations, KV cache)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run every step eagerly (default: graphs on CUDA, eager on CPU)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="refused: graphrunner runs no code from a model folder (its architectures are built in)")
    p.add_argument("--tokenizer", default=None, help="a folder to load the tokenizer from (default: the model's)")
    add_graph_args(p, mode=None, mode_help=f"{CUDAGRAPH_MODES} (unset = FULL_AND_PIECEWISE)")
    p.add_argument("--debug-cudagraphs", action="store_true", help="check addresses and padding on every replay")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch step N+1 while step N runs (same tokens, less host time per step); "
                        "unset = on unless the layout cannot run it (-pcp, lockstep DP, PP with speculation)")
    add_speculative_args(p)
    p.add_argument("-tp", "--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks")
    p.add_argument("-pp", "--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1, help="pipeline stages")
    p.add_argument("-dp", "--dp", "--data-parallel-size", dest="dp", type=int, default=1,
                   help="data-parallel replicas")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of identical prompt prefixes (vLLM's default: on)")
    p.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None, metavar="JSON",
                   help='a KV connector as JSON (vLLM\'s option), e.g. \'{"kv_connector": "SharedStorageConnector", '
                        '"kv_role": "kv_consumer", "kv_connector_extra_config": {"shared_storage_path": "/kv"}}\'')
    add_quantization_arg(p)
    p.add_argument("--data-parallel-lockstep", action="store_true",
                   help="DP replicas step together (per-step agreement, dummy steps on idle replicas); "
                        "default: each replica runs on its own")
    add_dbo_args(p)
    p.add_argument("-ep", "--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts layers split their experts over the TP ranks instead of each "
                        "expert's width")
    p.add_argument("-pcp", "--prefill-context-parallel-size", dest="pcp", type=int, default=1,
                   help="prefill context-parallel ranks: each prefill's tokens split over them")
    p.add_argument("-dcp", "--decode-context-parallel-size", dest="dcp", type=int, default=1,
                   help="decode context-parallel ranks (inside TP): the KV cache sharded over them")
    p.add_argument("--collective-timeout", type=float, default=60.0,
                   help="seconds before a collective with a dead or stalled rank raises")
    add_lora_args(p)


def _kv_transfer_config(text: str) -> dict[str, Any]:
    """`--kv-transfer-config`: a JSON object (checked by `KVTransferConfig` when the LLM is built)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--kv-transfer-config {text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--kv-transfer-config {text!r} must be a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """`LLM`'s keyword arguments from `add_engine_args`' options; SystemExit for a refused one."""
    if args.trust_remote_code:
        raise SystemExit(f"graphrunner {command}: --trust-remote-code is refused: graphrunner runs no Python code "
                         "from a model folder; its architectures are built in (graphrunner.models.registry)")
    return dict(
        **runner_kwargs(args),
        **limit_kwargs(args),
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        cudagraph_mode=args.mode,
        cudagraph_capture_sizes=_sizes(args.capture_sizes),
        debug_cudagraphs=args.debug_cudagraphs,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        data_parallel_size=args.dp,
        prefill_context_parallel_size=args.pcp,
        decode_context_parallel_size=args.dcp,
        data_parallel_lockstep=args.data_parallel_lockstep,
        enable_expert_parallel=args.enable_expert_parallel,
        **dbo_cli_kwargs(args),
        enable_prefix_caching=args.enable_prefix_caching,
        kv_transfer_config=args.kv_transfer_config,
        quantization=args.quantization,
        collective_timeout_s=args.collective_timeout,
        tokenizer=args.tokenizer,
        **speculative_kwargs(args, f"graphrunner {command}"),
        **lora_kwargs(args),
    )


# ---------------------------------------------------------------- LoRA (vLLM's flag names; docs/lora.md)


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """The multi-LoRA options of `LLM` (vLLM's names); `lora_kwargs` hands them on."""
    p.add_argument("--enable-lora", action="store_true",
                   help="let requests run on PEFT LoRA adapters (default: off; the runner allocates nothing for it)")
    p.add_argument("--max-loras", type=int, default=1,
                   help="distinct adapters in one step (device slots); requests for more queue")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank accepted (up to 256); every slot is padded to it")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept read in host memory (unset = --max-loras)")


def lora_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM`'s LoRA keyword arguments from `add_lora_args`' options (checked by `LoRAConfig`)."""
    return dict(enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras)


def check_adapter_folder(what: str, path: str, max_lora_rank: int) -> None:
    """ValueError naming `what` (the flag or module) and `path` unless `path` is a folder with a readable
    adapter_config.json whose rank fits `max_lora_rank`: a cheap check before the model loads (the
    weights are checked against the model when the adapter is first read)."""
    from graphrunner.layers.lora.peft import read_adapter_config  # the model stack: at run time, not parsing

    config = read_adapter_config(Path(path), what)
    pattern = config.get("rank_pattern")
    ranks = [config.get("r"), *(pattern.values() if isinstance(pattern, dict) else ())]
    worst = max((r for r in ranks if isinstance(r, int) and not isinstance(r, bool)), default=0)
    if worst > max_lora_rank:
        raise ValueError(f"{what}: {path!r} has rank {worst}, above --max-lora-rank={max_lora_rank}")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand to the `graphrunner` parser."""
    p = strict_subparser(subparsers, "generate", help="generate from random or text prompts and report throughput",
                         description=__doc__)
    add_engine_args(p, model="builtin:tiny-llama")
    p.add_argument("--num-prompts", type=int, default=8, help="random prompts to generate for (ignored with --prompt)")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per random prompt")
    p.add_argument("--prompt", nargs="+", metavar="TEXT", default=None, help="text prompts (needs tokenizer.json)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=1.0, help="1 disables top-p")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a stop string (repeatable; needs a tokenizer)")
    p.add_argument("--stop-token-ids", default=None, metavar="IDS", help="comma-separated token ids that end a request")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="return the sampled token's logprob and the top K (shown for the first outputs)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--launch-timeout", type=float, default=None,
                   help="when re-launching as several ranks: kill them all after this many seconds")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run the workload once untimed first (JIT compiles stay out of the figure)")
    p.add_argument("--record-batches", metavar="FILE", default=None,
                   help="write one JSON line per step of the timed run (num_reqs, num_tokens, query_lens, "
                        "uniform, descriptor): the trace `graphrunner inspect simulate --trace` reads; "
                        "FILE is overwritten")
    p.add_argument("--lora-path", metavar="DIR", default=None,
                   help="a PEFT LoRA adapter folder every prompt runs on (needs --enable-lora)")
    p.set_defaults(func=run)


def _sizes(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return parse_int_list(text, "--cudagraph-capture-sizes")
    except ValueError as e:
        raise SystemExit(f"graphrunner generate: {e}") from None


def run(args: argparse.Namespace) -> int:
    """Run `generate` with parsed arguments; prints a summary and returns the exit status.

    Bad arguments raise SystemExit with a one-line message, as argparse does."""
    import os

    _check_device(args.device)
    _check_lora_path(args)
    world = args.tp * args.pp * args.dp * args.pcp
    if world < 1 or min(args.tp, args.pp, args.dp, args.pcp, args.dcp) < 1:
        raise SystemExit(f"graphrunner generate: --tp={args.tp} --pp={args.pp} --dp={args.dp} -pcp={args.pcp} "
                         f"-dcp={args.dcp} must all be >= 1")
    if world > 1 and "WORLD_SIZE" not in os.environ:
        from graphrunner.distributed.launch import launch

        argv = list(getattr(args, "argv", None) or sys.argv[1:])
        return launch([sys.executable, "-m", "graphrunner.cli", *argv], world, timeout=args.launch_timeout)
    is_printer = int(os.environ.get("RANK", "0")) == 0
    speculative_kwargs(args, "graphrunner generate")  # a bad --speculative-config fails before the model loads

    # Load the tokenizer before the model so that a missing one fails fast.
    tokenizer = _load_tokenizer(args.model) if args.prompt else None
    params = _sampling_params(args)
    if args.record_batches:
        try:  # fail before loading the model, and start from an empty trace
            Path(args.record_batches).write_text("")
        except OSError as e:
            raise SystemExit(f"graphrunner generate: --record-batches={args.record_batches!r}: {e}") from None

    progress = _progress(is_printer)
    progress(f"loading {args.model} ...")
    load_start = time.perf_counter()
    llm = _build_llm(args)
    lora = _lora_request(args)
    load_seconds = time.perf_counter() - load_start
    progress(f"ready in {load_seconds:.1f} s ({llm.runner.startup_times})")

    if tokenizer is not None:
        prompts = [tokenizer.encode(text).ids for text in args.prompt]
    else:
        prompts = _random_prompts(args.num_prompts, args.prompt_len, llm.vocab_size, args.seed)

    if args.warmup:
        progress("warm-up run (untimed, up to 4 tokens per prompt; --no-warmup skips it) ...")
        try:
            llm.generate(prompts, dataclasses.replace(params, max_tokens=min(params.max_tokens, 4)), use_tqdm=False,
                         lora_request=lora)
        except ValueError:
            pass  # the timed run below reports the error
        llm.scheduler.reset_prefix_cache()  # the timed run must prefill its prompts, not hit the warm-up's
    # Recording starts after the warmup so that the trace is exactly the timed workload.
    llm.record_batches = args.record_batches
    progress(f"timed run: {len(prompts)} prompts x {params.max_tokens} tokens")
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=is_printer, lora_request=lora)
    except ValueError as e:  # e.g. a prompt longer than max_model_len
        raise SystemExit(f"graphrunner generate: {e}") from None
    elapsed = time.perf_counter() - start
    graphs = llm.runner.graphs
    mode_name = graphs.mode.name if graphs is not None and graphs.captured else "NONE (eager)"  # before shutdown
    llm.shutdown()
    if is_printer and args.json:
        print(json.dumps(_summary(args, llm, prompts, outputs, load_seconds=load_seconds, elapsed=elapsed,
                                  mode_name=mode_name)))
    elif is_printer:
        _print_summary(args, llm, prompts, outputs, tokenizer, load_seconds=load_seconds, elapsed=elapsed,
                       mode_name=mode_name)
    return 0


def _check_lora_path(args: argparse.Namespace) -> None:
    """SystemExit for a --lora-path without --enable-lora, or one that is no adapter folder (before any
    rank starts or the model loads)."""
    if args.lora_path is None:
        return
    if not args.enable_lora:
        raise SystemExit(f"graphrunner generate: --lora-path {args.lora_path!r} needs --enable-lora")
    try:
        check_adapter_folder("--lora-path", args.lora_path, args.max_lora_rank)
    except ValueError as e:
        raise SystemExit(f"graphrunner generate: {e}") from None


def _lora_request(args: argparse.Namespace) -> LoRARequest | None:
    """The adapter of --lora-path, shared by every prompt (one id: the folder is read once)."""
    from graphrunner.protocol import LoRARequest

    return LoRARequest("cli", 1, args.lora_path) if args.lora_path else None


def _progress(enabled: bool):
    """A function printing one progress line to stderr (stdout keeps the summary, or the JSON)."""
    def say(message: str) -> None:
        if enabled:
            print(f"graphrunner generate: {message}", file=sys.stderr, flush=True)
    return say


def _summary(args: argparse.Namespace, llm: LLM, prompts: list[list[int]], outputs: list[RequestOutput], *,
             load_seconds: float, elapsed: float, mode_name: str) -> dict[str, Any]:
    """The run's figures as one JSON-ready dict (`--json`)."""
    num_generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "kind": "generate", "model": args.model, "device": str(llm.device), "cudagraph_mode": mode_name,
        "dtype": str(llm.dtype).removeprefix("torch."), "kv_blocks": llm.scheduler.num_blocks,
        "kv_cache_dtype": str(llm.runner.kv_cache_dtype).removeprefix("torch."),
        "block_size": args.block_size, "max_model_len": llm.scheduler.max_model_len,
        "max_num_seqs": llm.scheduler.max_num_seqs, "max_num_batched_tokens": llm.scheduler.max_num_batched_tokens,
        "lora_path": args.lora_path, "load_seconds": round(load_seconds, 3),
        "startup_seconds": {k: round(v, 3) for k, v in llm.runner.startup_times.to_dict().items()},
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": num_generated,
        "preemptions": llm.scheduler.num_preemptions,
        "prefix_cache_hit_rate": getattr(llm.scheduler.block_allocator, "hit_rate", None),
        "kv_external_hit_rate": (llm.scheduler.kv_connector.external_hit_rate
                                 if llm.scheduler.kv_connector is not None else None),
        "scheduling": "async" if llm.async_scheduling else "sync", "elapsed_seconds": round(elapsed, 4),
        "output_tokens_per_s": num_generated / elapsed if elapsed > 0 else None,
        "outputs": [{"request_id": o.request_id, "completions": [
            {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
             "token_ids": c.token_ids, "text": c.text, "cumulative_logprob": c.cumulative_logprob}
            for c in o.outputs]} for o in outputs[:NUM_SHOWN_OUTPUTS]],
    }


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of the command line; SystemExit naming a bad value."""
    from graphrunner.protocol import SamplingParams

    try:
        stop_ids = parse_int_list(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids else ()
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            ignore_eos=args.ignore_eos,
            stop=tuple(args.stop or ()),
            stop_token_ids=stop_ids,
            logprobs=args.logprobs,
            n=args.n,
        )
    except ValueError as e:
        raise SystemExit(f"graphrunner generate: {e}") from None
    if args.prompt is None and (args.num_prompts < 1 or args.prompt_len < 1):
        raise SystemExit(
            f"graphrunner generate: --num-prompts={args.num_prompts} and --prompt-len={args.prompt_len} must be >= 1"
        )
    return params


def _build_llm(args: argparse.Namespace) -> LLM:
    """The engine the command line describes; SystemExit on a bad model name, folder or limit."""
    from graphrunner.engine.llm import LLM

    try:
        return LLM(**engine_kwargs(args, "generate"))
    except (ValueError, FileNotFoundError) as e:  # no traceback needed
        raise SystemExit(f"graphrunner generate: {e}") from None


def _print_summary(
    args: argparse.Namespace,
    llm: LLM,
    prompts: list[list[int]],
    outputs: list[RequestOutput],
    tokenizer: Any,
    *,
    load_seconds: float,
    elapsed: float,
    mode_name: str,
) -> None:
    num_generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"model:            {args.model}")
    weights = _random_weights_reason(args)
    if weights:
        print(f"weights:          random ({weights}; tokens are meaningless)")
    if args.lora_path:
        print(f"lora adapter:     {args.lora_path}")
    print(f"device:           {llm.device}")
    print(f"cudagraph mode:   {mode_name}")
    print(f"dtype:            {str(llm.dtype).removeprefix('torch.')}")
    if args.tp * args.pp * args.dp * args.pcp > 1:
        print(f"tensor parallel:  {args.tp}")
        if args.pcp > 1:
            print(f"prefill context parallel: {args.pcp}")
        print(f"pipeline stages:  {args.pp}")
        print(f"data parallel:    {args.dp}")
    print(f"kv blocks:        {llm.scheduler.num_blocks} x {args.block_size} tokens "
          f"({str(llm.runner.kv_cache_dtype).removeprefix('torch.')})")
    print(f"load seconds:     {load_seconds:.2f} ({llm.runner.startup_times})")
    print(f"num prompts:      {len(prompts)}")
    print(f"prompt tokens:    {sum(len(p) for p in prompts)}")
    print(f"generated tokens: {num_generated}")
    print(f"preemptions:      {llm.scheduler.num_preemptions}")
    hit_rate = getattr(llm.scheduler.block_allocator, "hit_rate", None)
    if hit_rate is not None:
        print(f"prefix cache:     {hit_rate:.1%} of prompt tokens hit")
    connector, kv_transfer = llm.scheduler.kv_connector, llm.config.kv_transfer
    if connector is not None and kv_transfer is not None:
        print(f"kv connector:     {kv_transfer.kv_connector}, {connector.external_hit_rate:.1%} of prompt "
              "tokens loaded (external hits)")
    print(f"scheduling:       {'async' if llm.async_scheduling else 'sync'}")
    spec = llm.config.speculative
    if spec.num_speculative_tokens:
        print(f"speculative:      {spec.method}, k={spec.num_speculative_tokens}")
    print(f"elapsed seconds:  {elapsed:.3f}")
    print(f"output tokens/s:  {num_generated / elapsed if elapsed > 0 else float('inf'):.1f}")
    for i, out in enumerate(outputs[:NUM_SHOWN_OUTPUTS]):
        for c in out.outputs:
            shown = repr(tokenizer.decode(c.token_ids)) if tokenizer is not None else c.token_ids
            name = f"output {i}" if len(out.outputs) == 1 else f"output {i}.{c.index}"
            print(f"{name} ({c.finish_reason}, {len(c.token_ids)} tokens): {shown}")
            if c.logprobs:
                first = c.logprobs[0]
                print("  logprobs of its first token: "
                      + ", ".join(f"{t}: {lp.logprob:.3f}" for t, lp in list(first.items())[:6]))


def _random_weights_reason(args: argparse.Namespace) -> str | None:
    """Why the model's weights are random, or None when they come from a checkpoint."""
    from graphrunner.models.registry import is_builtin

    if is_builtin(args.model):
        return f"{args.model} has no checkpoint"
    if args.load_format == "dummy":
        return "--load-format dummy"
    return None


def _random_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num_prompts, prompt_len)).tolist()


def _check_device(device: str | None) -> None:
    """SystemExit naming a --device that is not cpu, cuda or an existing cuda:N (before any rank starts)."""
    from graphrunner.config import resolve_device

    try:
        resolve_device(device)
    except ValueError as e:
        raise SystemExit(f"graphrunner generate: --device: {e}") from None


def _load_tokenizer(model: str):
    """The `tokenizers.Tokenizer` of a model folder; SystemExit with the reason when there is
    none, the package is missing, or the file cannot be parsed (naming the file)."""
    from graphrunner.models.loader import load_tokenizer

    try:
        return load_tokenizer(model)
    except FileNotFoundError as e:
        raise SystemExit(
            f"graphrunner generate: --prompt needs {TOKENIZER_FILE} in the model folder: {e} "
            f"(builtin models have no tokenizer; omit --prompt for random prompts)"
        ) from None
    except ImportError:
        raise SystemExit(
            "graphrunner generate: --prompt needs the `tokenizers` package: pip install 'graphrunner[text]'"
        ) from None
    except ValueError as e:
        raise SystemExit(f"graphrunner generate: {e}") from None
