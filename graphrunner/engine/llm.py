"""`LLM`: the offline API of the reference engine, in vLLM's shape.

    llm = LLM("builtin:tiny-llama")
    outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))
    outputs[0].outputs[0].token_ids
    for delta in llm.generate_stream(["Hello"], SamplingParams(stop=["."])):  # text: a folder with a tokenizer
        print(delta.outputs[0].text, end="")      # new tokens as they are sampled; llm.abort_request(id)

It drives a `ModelRunner` only through the runner's public API, the way an outside
engine would: build a `RunnerConfig`, load, size and allocate the KV cache, then loop
schedule -> execute_model -> sample_tokens -> update_from_output.

With `async_scheduling=True` the loop runs one step ahead of the device:
schedule(N+1) -> execute_model(N+1) -> sample_tokens(async_output=True) -> resolve
step N's output (`AsyncOutput.get()`, which waits for its copy only) ->
update_from_output(N). The host never waits for the step it just launched, so it
prepares the next one while the device runs. Tokens are exactly those of the
synchronous loop (see `Scheduler` for the placeholder bookkeeping).
Parallel runs (tensor_parallel_size / pipeline_parallel_size / data_parallel_size > 1)
are SPMD: every rank, started by torchrun or `graphrunner launch`, constructs the same
`LLM` and calls the same `generate`. The ranks of one DP replica run identical
schedulers over identical requests (deterministic), so they agree on every step
without talking; DP replicas each take a round-robin share of the prompts, run on their own
(with `data_parallel_lockstep=True`: step together, idle replicas running dummy steps)
and gather the outputs, so `generate` returns the full, identical result list on every rank.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch

from graphrunner.config import (
    DRAFTER_METHODS,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SpeculativeConfig,
    resolve_device,
    resolve_dtype,
)
from graphrunner.engine.batch_trace import append_record
from graphrunner.engine.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from graphrunner.engine.chat import ChatMessages, render_chat
from graphrunner.engine.data_parallel import any_replica, gather_replicas
from graphrunner.engine.detokenizer import load_text_tokenizer
from graphrunner.engine.options import (
    async_scheduling_default,
    check_compilation_kwargs,
    check_model_source,
    default_limits,
    parallel_config,
    resolve_speculative_config,
)
from graphrunner.engine.outputs import OutputProcessor
from graphrunner.engine.pooling import PoolingAPI
from graphrunner.engine.prompts import PlannedRequests, PromptType, plan_requests
from graphrunner.engine.request import RequestOutput, SequenceOutput
from graphrunner.engine.runner_config import build_runner_config, fit_max_model_len
from graphrunner.engine.scheduler import Scheduler, SchedulerStats
from graphrunner.engine.structured import can_compile_grammars, make_structured_outputs
from graphrunner.engine.workers import WorkerLLM, wants_workers
from graphrunner.protocol import LoRARequest, ModelRunnerOutput, SamplingParams, SchedulerOutput

logger = logging.getLogger("graphrunner.engine")
# How long an engine with nothing runnable waits per step for KV arriving from another instance
# (`KVConnectorScheduler.wait_for_kv`; it returns early when a block arrives).
_KV_WAIT_S = 0.05


class LLM(PoolingAPI):
    """Offline batch generation over one `ModelRunner` (or pooling over a `PoolingRunner`).

    Args:
        model: "builtin:NAME" (dummy weights) or a Hugging Face checkpoint folder.
        dtype: "auto" (bf16 on CUDA, fp32 on CPU), "float32", "float16", "bfloat16".
        device: defaults to CUDA when available, else CPU.
        max_num_seqs, max_num_batched_tokens: per-step batch limits; None: vLLM's defaults for the
            device (256 requests; 16384 tokens on CUDA, 4096 on a CPU).
        max_model_len: prompt + output tokens of one request; None: the model's
            max_position_embeddings, or less when the KV cache cannot hold that many (logged).
        block_size: tokens per KV block.
        kv_cache_dtype: how the KV cache stores keys and values (vLLM's name): "auto" (the model's
            dtype) or "fp8" / "fp8_e4m3" (float8_e4m3fn, divided by each layer's k_scale / v_scale
            from the checkpoint, else 1.0; twice the tokens in the same memory as bf16). See
            docs/quantization.md.
        seed: seeds dummy weights and sampling; equal seeds give equal outputs.
        num_kv_blocks: KV blocks to allocate; None sizes the cache from a profile run.
        gpu_memory_utilization: fraction of GPU memory the runner may use (CUDA only).
        load_format: "auto" (safetensors; builtins use dummy weights) or "dummy".
        enforce_eager: run every step eagerly; False captures graphs after the cache is allocated.
            None (default): graphs on CUDA, eager on a CPU (where graphs are only emulated).
        record_batches: a file to append one JSON line per executed step to (see
            `batch_record`): the batch trace `graphrunner inspect simulate --trace` reads.
            None records nothing. Also a public attribute, so recording can start or stop
            between `generate` calls.
        async_scheduling: schedule and launch step N + 1 before step N's tokens are
            resolved (module docstring); same tokens, less host time on the critical path.
            None (default): on, as in vLLM, unless the layout cannot run the async loop
            (prefill context parallelism, lockstep DP with PP, PP with speculation), which is logged.
        tensor_parallel_size, pipeline_parallel_size, data_parallel_size: the parallel
            layout; their product must equal WORLD_SIZE (run under torchrun or
            `graphrunner launch`). `device` then names the device type; each rank takes
            cuda:LOCAL_RANK.
        prefill_context_parallel_size: PCP, vLLM's name: each prefill's tokens split over this
            many ranks (DualChunkSwap; decodes run whole on each), K/V all-gathered per layer.
        decode_context_parallel_size, cp_kv_cache_interleave_size: DCP, inside TP: the D ranks of
            a group hold the same KV heads and each caches every D-th run of that many tokens.
        data_parallel_lockstep: False (default): DP replicas run independently (a dense model
            shares nothing across them); True: they step together, agreeing on each step's
            descriptor (one CPU all-reduce) with dummy steps on idle replicas.
        enable_expert_parallel: a mixture-of-experts model's layers split their experts over the TP
            ranks (E / TP whole experts each) instead of every expert's width (vLLM's name); with
            data_parallel_size > 1 over all DP x TP ranks, the replicas then stepping in lockstep.
        collective_timeout_s: a dead or stalled peer makes collectives raise after this long.
        speculative_config: speculative decoding in vLLM's shape, e.g. {"method": "ngram",
            "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
            (`SpeculativeConfig`; a dict, its JSON text, or None: off). Every decode then
            verifies k drafts the runner proposed; greedy tokens are those without it.
        skip_tokenizer_init: do not load the model folder's tokenizer (vLLM's name): token ids
            in and out only. Otherwise a folder with tokenizer files takes text prompts, fills
            `RequestOutput.text` and honours `SamplingParams.stop` (transformers.AutoTokenizer).
        enable_prefix_caching: reuse the KV blocks of earlier requests' identical prefixes (vLLM's default).
        tokenizer: a folder to load the tokenizer from instead of the model's.
        revision, tokenizer_revision: hub revisions (vLLM's names); graphrunner loads local folders,
            which have none, so only None is accepted.
        trust_remote_code: refused when True: graphrunner runs no code from a model folder.
        enable_lora, max_loras, max_lora_rank, max_cpu_loras: multi-LoRA serving (vLLM's names):
            requests may name a PEFT adapter (`generate(..., lora_request=LoRARequest(...))`); at most
            `max_loras` distinct adapters run at once (more queue), each of rank <= `max_lora_rank`,
            and `max_cpu_loras` (default max_loras) stay read in host memory. See docs/lora.md.
        runner: "generate" (default) or "pooling" (vLLM's name): a pooling runner serves `embed`,
            `classify`, `score` and `encode` (docs/pooling.md) and no `generate`.
        pooler_config: a pooling runner's `PoolerConfig`; None reads the checkpoint's (modules.json).
        enable_prompt_embeds: accept `{"prompt_embeds": tensor}` prompts (vLLM's name): [len, hidden]
            embeddings the first layer reads instead of token embeddings (docs/multimodal.md).
        kv_transfer_config: a KV connector (vLLM's shape), e.g. {"kv_connector": "SharedStorageConnector",
            "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config":
            {"shared_storage_path": DIR}} or {"kv_connector": "CpuOffloadConnector", "kv_connector_extra_config":
            {"cpu_bytes": N}} (`KVTransferConfig`; None: off). Loaded prompt tokens count in
            `RequestOutput.num_cached_tokens`. See docs/kv_transfer.md.
        quantization: "fp8" quantizes the decoder's linear weights to e4m3 at load (per output channel,
            dynamic per-token activations; vLLM's name); None (default) keeps the checkpoint's own: a
            pre-quantized fp8 checkpoint (compressed-tensors or block-wise fp8) loads as published.
            See docs/quantization.md.
        **kwargs: fields of `CompilationConfig` (e.g. cudagraph_mode) or DBO's and EPLB's of `ParallelConfig`
            (enable_dbo, ..., enable_eplb, num_redundant_experts, eplb_window_size, eplb_step_interval).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A plain process asking for several ranks gets a `WorkerLLM` that starts and drives them."""
        world = 1
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "prefill_context_parallel_size"):
            world *= int(kwargs.get(name, 1))
        return WorkerLLM(world, cls, args, kwargs) if wants_workers(world) else super().__new__(cls)

    def __init__(
        self,
        model: str = "builtin:tiny-llama",
        *,
        dtype: str = "auto",
        device: torch.device | str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        seed: int = 0,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        load_format: str = "auto",
        enforce_eager: bool | None = None,
        record_batches: str | os.PathLike | None = None,
        async_scheduling: bool | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        prefill_context_parallel_size: int = 1,
        decode_context_parallel_size: int = 1,
        cp_kv_cache_interleave_size: int = 1,
        data_parallel_lockstep: bool = False,
        enable_expert_parallel: bool = False,
        collective_timeout_s: float = 60.0,
        speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None,
        skip_tokenizer_init: bool = False,
        enable_prefix_caching: bool = True,
        tokenizer: str | None = None,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        trust_remote_code: bool = False,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        runner: str = "generate",
        pooler_config: Any = None,
        enable_prompt_embeds: bool = False,
        kv_transfer_config: KVTransferConfig | Mapping[str, Any] | None = None,
        quantization: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_compilation_kwargs(kwargs)
        check_model_source(model, tokenizer, revision, tokenizer_revision, trust_remote_code)
        self.runner_kind, self.enable_prompt_embeds = runner, enable_prompt_embeds
        self.pooler_config = pooler_config
        if runner == "pooling":
            from graphrunner.engine.pooling import pooling_engine_options

            self.pooler_config, async_scheduling, enable_prefix_caching, max_model_len, max_num_batched_tokens = \
                pooling_engine_options(model, pooler_config, async_scheduling, enable_prefix_caching, max_model_len,
                                       max_num_batched_tokens, device)
        # Before the model: a bad tokenizer fails fast.
        self.tokenizer = None if skip_tokenizer_init else load_text_tokenizer(tokenizer or model,
                                                                              required=tokenizer is not None)
        speculative = resolve_speculative_config(speculative_config)
        if async_scheduling is None:
            probe = ParallelConfig(
                pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
                prefill_context_parallel_size=prefill_context_parallel_size,
                data_parallel_lockstep=data_parallel_lockstep, enable_expert_parallel=enable_expert_parallel)
            async_scheduling, blocker = async_scheduling_default(probe, speculative)
            if blocker is not None:
                logger.info("async scheduling off: the async loop does not run with %s", blocker)
        parallel = parallel_config(
            tensor_parallel_size, pipeline_parallel_size, data_parallel_size, collective_timeout_s, async_scheduling,
            prefill_context_parallel_size=prefill_context_parallel_size, data_parallel_lockstep=data_parallel_lockstep,
            decode_context_parallel_size=decode_context_parallel_size, enable_expert_parallel=enable_expert_parallel,
            extra=kwargs,
            cp_kv_cache_interleave_size=cp_kv_cache_interleave_size)
        lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
        kv_transfer = KVTransferConfig.coerce(kv_transfer_config)
        kwargs.setdefault("structured_output_graphs", can_compile_grammars(self.tokenizer))  # step/split.py
        self._init_distributed(parallel, device, dtype)
        max_num_seqs, max_num_batched_tokens = default_limits(self.device, max_num_seqs, max_num_batched_tokens)
        self.config = build_runner_config(
            model, parallel, self.device, dtype=dtype, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, block_size=block_size,
            seed=seed, num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
            load_format=load_format, enforce_eager=enforce_eager, compilation_kwargs=kwargs, speculative=speculative,
            lora=lora, enable_prompt_embeds=enable_prompt_embeds, kv_transfer=kv_transfer, quantization=quantization,
            kv_cache_dtype=kv_cache_dtype)
        self._inputs = None  # prompt embeddings and images -> token ids and RequestExtras
        if enable_prompt_embeds or self.config.model.vision is not None:
            from graphrunner.multimodal.inputs import InputProcessor

            self._inputs = InputProcessor(self.config.model, model)
        self._init_runner()
        # Pipelined PP (no speculation), through the async loop: P + 1 batches in flight, a request's token
        # applied on the device P steps later (engine/pipeline_rule.py); or P disjoint ones, resolved first.
        pipelined = parallel.pipeline_parallel_size > 1 and not speculative.num_speculative_tokens
        if async_scheduling and parallel.pipeline_parallel_size > 1 and not pipelined:
            raise ValueError("async_scheduling=True with pipeline_parallel_size > 1 and speculative decoding: the "
                             "stages exchange a speculative step's outcome within the step; use one of them")
        self.scheduler = self._make_scheduler(async_scheduling, pipelined, enable_prefix_caching)
        vision = self.config.model.vision
        if vision is not None:  # an encoder budget and cache of a step's tokens, at least one image each
            from graphrunner.multimodal.scheduling import EncoderScheduler

            room = max(self.config.scheduler.max_num_batched_tokens, vision.num_image_tokens)
            self.scheduler.encoder = EncoderScheduler(budget=room, cache_size=room)
        fit_max_model_len(self.scheduler, self.config, explicit=max_model_len is not None)
        self._outputs = OutputProcessor(self.scheduler, self.tokenizer)
        self._structured = make_structured_outputs(self.tokenizer, self.runner.vocab_size)  # grammar matchers
        self.async_scheduling = async_scheduling or pipelined
        self._keep_in_flight = parallel.pipeline_parallel_size - 1 + parallel.pp_token_placeholders if pipelined else 1
        self._in_flight: deque[tuple[SchedulerOutput, Any]] = deque()  # launched, not applied yet; oldest first
        self._next_req_id = 0
        # The deltas of each open `generate_stream` iterator, by request id: whichever call runs a
        # step (another stream, a generate, step()), a stream's deltas wait here for their reader.
        self._stream_boxes: dict[str, deque[RequestOutput]] = {}
        self.record_batches: str | os.PathLike | None = record_batches

    def _init_distributed(self, parallel: ParallelConfig, device: torch.device | str | None, dtype: str) -> None:
        """Join the process groups of `parallel`; sets `device` (this rank's), `groups` and `dtype`."""
        # Imported here (as in the helpers below) so that the engine package imports without the model stack.
        from graphrunner.distributed.groups import init_distributed

        self.device = resolve_device(device)  # None: cuda when a GPU is available, else cpu
        self.groups = init_distributed(parallel, self.device)
        self.device = self.groups.device
        self.dtype = resolve_dtype(dtype, self.device)

    def _init_runner(self) -> None:
        """Build the `ModelRunner`, load the weights, allocate the KV cache, then capture graphs unless eager."""
        from graphrunner.models.registry import check_runner_kind
        from graphrunner.runner import ModelRunner

        check_runner_kind(self.config.model.architecture, self.runner_kind)
        if self.runner_kind == "pooling":
            from graphrunner.pool.runner import PoolingRunner

            self.runner = PoolingRunner(self.config, self.device, self.groups, self.pooler_config)
        else:
            self.runner = ModelRunner(self.config, self.device, self.groups)
        self.runner.load_model()
        num_kv_blocks = self.config.cache.num_blocks
        num_blocks = num_kv_blocks if num_kv_blocks is not None else self.runner.determine_num_kv_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        if not self.config.compilation.enforce_eager:
            self.runner.capture_model()

    def _make_scheduler(self, async_scheduling: bool, pipelined: bool = False,
                        prefix_caching: bool = False) -> Scheduler:
        """The `Scheduler` over the runner's KV cache, under the configured batch limits."""
        limits, spec = self.config.scheduler, self.config.speculative
        return Scheduler(
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_model_len=self.runner.max_model_len,
            block_size=self.config.tokens_per_block,  # under DCP a block serves block_size x D positions
            num_blocks=self.runner.num_kv_blocks,
            # Mean and CLS pooling read every prompt position in one step.
            enable_chunked_prefill=not self.runner.is_pooling_model or self.runner.pooler_config.chunkable,
            vocab_size=self.runner.vocab_size,
            eos_token_ids=self.runner.eos_token_ids,
            async_scheduling=async_scheduling,
            pipeline_depth=self.config.parallel.pipeline_parallel_size if pipelined else 0,
            disjoint_in_flight=not self.config.parallel.pp_token_placeholders, enable_prefix_caching=prefix_caching,
            # Each decode verifies k draft slots: the runner's uniform decode query is 1 + k.
            num_speculative_tokens=self.runner.uniform_decode_query_len - 1,
            # A draft model or EAGLE head writes KV for its drafts past each decode: blocks for them too.
            num_lookahead_tokens=spec.num_speculative_tokens if spec.method in DRAFTER_METHODS else 0,
            max_loras=self.config.lora.max_loras if self.config.lora is not None else 0,
            kv_connector=self._make_kv_connector(prefix_caching),
        )

    def _make_kv_connector(self, prefix_caching: bool) -> Any:
        """The scheduler's side of the configured KV connector (None: off)."""
        kv_transfer = self.config.kv_transfer
        if kv_transfer is None:
            return None
        if kv_transfer.kv_connector == "CpuOffloadConnector" and not prefix_caching:
            raise ValueError("kv_connector='CpuOffloadConnector' offloads blocks the prefix cache evicts: it needs "
                             "enable_prefix_caching=True")
        from graphrunner.kv_transfer import make_scheduler_connector, model_identity

        return make_scheduler_connector(kv_transfer, self.runner.kv_cache_shape,
                                        model_identity(self.config), self.runner.device)

    def _check_request(self, req_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        """Every check a request passes before it is queued; raises ValueError and changes nothing.

        The sampling params' own field checks (again: they may have been changed since
        they were built), the prompt (token ids are ints within the vocabulary, length
        within max_model_len, fits the KV cache) and the runner-dependent sampling limits
        (vocabulary, slot counts).
        """
        self.scheduler.check_request(req_id, prompt, params)
        self._structured.check(req_id, params.structured_outputs)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {req_id!r}: stop={list(params.stop)} needs a tokenizer to match decoded text, "
                             f"and model {self.config.load.model!r} has none (use stop_token_ids)")
        try:
            params.validate()
            self.runner.sampling_states.validate(params, self.vocab_size, self.runner.eos_token_ids,
                                                 prompt_len=len(prompt))
        except ValueError as e:
            raise ValueError(f"request {req_id!r}: {e}") from None
        # `validate` checks stop ids against the vocabulary only when min_tokens masks them;
        # an id outside it could never be sampled, so it is a caller's mistake either way.
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"request {req_id!r}: stop_token_ids contains token id {bad} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def get_tokenizer(self) -> Any:
        """The tokenizer (transformers' when installed), or None when the model has none (vLLM's name)."""
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name): later requests compute their prompts anew. True."""
        self.scheduler.reset_prefix_cache()
        return True

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished `RequestOutput` per prompt, in input order.

        A prompt is a list of token ids, a text when the model has a tokenizer, or vLLM's prompt
        dict (`{"prompt": text}` / `{"prompt_token_ids": ids}`). `sampling_params` is one setting
        for all prompts, one per prompt, or None for the defaults; `n` > 1 gives each prompt n
        completions (`outputs[i]`). A bad prompt raises ValueError before any step runs and
        leaves no trace. `use_tqdm` shows a progress bar (stderr) over the prompts. `lora_request`:
        the adapter of every prompt, or one per prompt (None: the base model); a missing or
        malformed adapter folder raises ValueError naming it before any step runs.
        """
        self._require_generative("generate")
        all_ids, req_ids = self._add_requests(prompts, sampling_params, stream=False, lora_request=lora_request)
        results: dict[str, RequestOutput] = {}
        progress = _progress_bar(len(req_ids)) if use_tqdm else None
        try:
            while self._any_unfinished():
                for out in self.step():
                    results[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
            # A step launched after the last request's end holds only discarded tokens.
            self._resolve_in_flight()
        except BaseException:
            # A failed step (or an interrupt) must not leave this call's requests live:
            # every later generate would run them, and fail, again.
            self._abort_after_failure()
            raise
        finally:
            if progress is not None:
                progress.close()
        if self.groups.dp_size > 1:
            results = self._gather_results(results)
        return [results[req_id] for req_id in all_ids]

    def generate_stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Generate for every prompt, yielding each request's news as its tokens are sampled.

        Each yielded `RequestOutput` is a delta: its `outputs` hold the completions with news,
        each with its new `token_ids` (and `text`, and `logprobs`) since its previous one; the
        last one per request is `finished` (each completion's last delta has its
        `finish_reason`). `out.request_id` names the request (the prompt's global number, as
        a string). `abort_request(request_id)` inside the loop ends that request: its last
        delta comes next, with finish_reason "abort". Leaving the loop early aborts the rest.
        Bad prompts raise here, before the first iteration; the requests are queued when
        it starts. Under DP each replica yields its own share of the prompts. best_of > n
        cannot stream (the best are known only at the end).
        """
        planned = self._plan_requests(prompts, sampling_params)
        for request_id, params in zip(planned.all_ids, planned.params, strict=True):
            if params.best_of is not None and params.best_of > params.n:
                raise ValueError(f"request {request_id!r}: best_of={params.best_of} > n={params.n} cannot stream: "
                                 "the best completions are known only when all have finished")
        return self._stream(planned)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                    stream: bool = True, lora_request: LoRARequest | None = None) -> None:
        """Queue one prompt under `request_id` (vLLM's LLMEngine.add_request), for a caller that
        drives the steps itself (`step_outputs`); ValueError, with nothing queued, for a bad one.
        Under DP the request runs on the replica of the ranks it is added on: a driver sends it to
        one replica's ranks (`WorkerLLM` does), unlike `generate`, which shares its prompts out."""
        self._require_open()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        planned = plan_requests([prompt], params, self.tokenizer, 0, self._check_request, request_ids=[request_id],
                                inputs=self._inputs)
        loras = self._check_loras(lora_request, 1)
        self._queue_requests(planned, stream, share_out=False, loras=loras)

    def step_outputs(self) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """One engine step: (the requests that finished in it, the stream deltas of streamed requests).
        A no-op returning the outputs of requests aborted since the last step when none is live
        (under lockstep DP: when no replica has one; every rank must call it, as every rank steps).
        A failed step aborts every live request before its error propagates, so the next call
        starts clean."""
        self._require_open()
        try:
            busy = self.scheduler.has_unfinished_requests()
            if self.groups.dp_lockstep:
                busy = self._any_unfinished()  # a replica with nothing to do joins the others' step
            if busy:
                return self._step_outputs()
            return self._process(self._resolve_in_flight())
        except BaseException:
            self._abort_after_failure()
            raise

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's counts at this moment (running, waiting, KV blocks used, preemptions,
        prefix-cache hits): what the server's /metrics reports."""
        return self.scheduler.stats()

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens one request may hold (the model's length unless lowered; see `LLM`)."""
        return self.scheduler.max_model_len

    def has_unfinished_requests(self) -> bool:
        """Whether any queued or running request remains (vLLM's name)."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight) or self._outputs.has_pending

    def _stream(self, planned: PlannedRequests) -> Iterator[RequestOutput]:
        """Yield this call's deltas, running steps while it has none. The steps also serve the other
        live requests (another stream's deltas go to its box; a generate's outputs wait in the
        scheduler's requests), and other calls' steps fill this one's box: interleaved streams and
        generates each get every token and finish_reason of their own requests."""
        req_ids = self._queue_requests(planned, stream=True)
        live = set(req_ids)
        box: deque[RequestOutput] = deque()
        self._stream_boxes.update(dict.fromkeys(req_ids, box))
        try:
            # Lockstep DP: every replica steps until no replica has work (the check is collective).
            while live or self.groups.dp_size > 1:
                if not box and self._outputs.has_pending:
                    self._process([])  # aborted since the last step
                if not box:
                    if not self._any_unfinished():
                        break
                    self._step_outputs()
                while box:
                    out = box.popleft()
                    if out.finished:
                        live.discard(out.request_id)
                    yield out
            if not live and not self.scheduler.has_unfinished_requests():
                self._resolve_in_flight()  # a step launched after the last request's end: discarded tokens
        except GeneratorExit:  # the caller left the loop: nothing of this call stays live
            for request_id in live:
                for child_id in self._outputs.child_ids(request_id):
                    self.scheduler.abort_request(child_id)
            self._outputs.forget(set(req_ids))
            raise
        except BaseException:
            self._abort_after_failure()
            raise
        finally:
            for request_id in req_ids:
                if self._stream_boxes.get(request_id) is box:
                    del self._stream_boxes[request_id]
        if live:  # never end a stream silently: its requests were ended elsewhere without a word
            raise RuntimeError(f"requests {sorted(live)} of this stream ended without their last output (a step "
                               "of another call failed, and the engine aborted every live request)")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """End live requests (vLLM's name; every completion of each); unknown or finished ids are
        ignored. The runner frees their rows with the next step; an aborted request's output
        ("abort", with the tokens it had) comes from the next `step()` (or the stream), its tokens
        still in flight are dropped. TypeError for an id that is not a str."""
        ids = [request_id] if isinstance(request_id, str) else None
        if ids is None and isinstance(request_id, Iterable) and not isinstance(request_id, (bytes, bytearray)):
            ids = list(request_id)
        if ids is None or not all(isinstance(one, str) for one in ids):
            raise TypeError(f"request_id must be a request id (a str) or an iterable of them, got {request_id!r}")
        for one in ids:
            for child_id in self._outputs.child_ids(one):
                out = self.scheduler.abort_request(child_id)
                if out is not None:
                    self._outputs.add_finished(out)

    def _add_requests(
        self, prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, stream: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> tuple[list[str], list[str]]:
        """Check and queue a call's prompts: (every request id, those of this DP replica)."""
        planned = self._plan_requests(prompts, sampling_params)
        loras = self._check_loras(lora_request, len(planned.all_ids))
        return planned.all_ids, self._queue_requests(planned, stream, loras=loras)

    def _check_loras(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                     num_prompts: int) -> list[LoRARequest | None] | None:
        """One adapter (or None) per prompt, each folder read and checked against the model (the runner's
        host cache keeps it); ValueError naming the adapter and the file, before anything is queued."""
        if lora_request is None:
            return None
        loras: list[LoRARequest | None] = (
            [lora_request] * num_prompts if isinstance(lora_request, LoRARequest) else list(lora_request))
        if len(loras) != num_prompts:
            raise ValueError(f"lora_request has {len(loras)} entries for {num_prompts} prompts")
        manager = self.runner.lora
        for lora in loras:
            if lora is None:
                continue
            if not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request entries must be LoRARequest or None, got {type(lora).__name__}")
            if manager is None:
                raise ValueError(f"lora_request={lora} needs LLM(enable_lora=True)")
            manager.adapter(lora)
        return loras

    def _plan_requests(
        self, prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> PlannedRequests:
        """A call's requests, every one checked (on every rank, so DP ranks fail alike) before any is queued."""
        self._require_open()
        planned = plan_requests(prompts, sampling_params, self.tokenizer, self._next_req_id, self._check_request,
                                inputs=self._inputs)
        self._next_req_id += len(planned.all_ids)
        return planned

    def _queue_requests(self, planned: PlannedRequests, stream: bool, share_out: bool = True,
                        loras: Sequence[LoRARequest | None] | None = None) -> list[str]:
        """Queue this DP replica's share of checked requests (`share_out=False`: all of them); returns their ids."""
        req_ids: list[str] = []
        added: list[str] = []
        first, stride = (self.groups.dp_rank, self.groups.dp_size) if share_out else (0, 1)
        try:
            for i in range(first, len(planned.all_ids), stride):
                children = planned.children[i]
                for j, (child_id, child_params) in enumerate(children):
                    # Siblings wait for the first child's prompt blocks (prefix cache) instead of computing them.
                    req = self.scheduler.add_request(child_id, planned.prompts[i], child_params,
                                                     wait_for=children[0][0] if j else None,
                                                     lora_request=loras[i] if loras is not None else None,
                                                     extras=planned.extras[i] if planned.extras else None)
                    added.append(req.req_id)
                    self._structured.add(req.req_id, child_params.structured_outputs, child_params.bad_words_token_ids,
                                         child_params.allowed_token_ids)
                self._outputs.add_request(planned.all_ids[i], planned.texts[i], list(map(int, planned.prompts[i])),
                                          planned.params[i], children, stream)
                req_ids.append(planned.all_ids[i])
        except BaseException:
            for req_id in added:
                self.scheduler.abort_request(req_id)
            self._outputs.forget(set(req_ids))
            raise
        return req_ids

    def _abort_after_failure(self) -> None:
        """Recover from a step that raised: abort the live requests (those of the failed
        `generate` call) so that the next call starts clean.

        The runner may hold a launched step (execute_model without sample_tokens) or an
        unresolved async output (holding a slot of its output ring): both are drained and
        their tokens dropped. The scheduler frees the requests' blocks and announces them
        as finished in the next SchedulerOutput, which makes the runner free their rows.
        Best effort: an error while draining is suppressed, the step's error is what the
        caller sees.
        """
        in_flight, self._in_flight = self._in_flight, deque()
        for _, pending in in_flight:
            try:
                pending.get()  # releases its output slot; the tokens are discarded
            except Exception:
                pass
        try:
            self.runner.sample_tokens()  # a no-op unless a launched step was never sampled
        except Exception:
            pass
        self.scheduler.abort_after_failure()
        self._outputs.clear()

    def _any_unfinished(self) -> bool:
        """Whether this replica (lockstep DP: any replica) still has work (one tiny CPU all-reduce)."""
        return any_replica(self.scheduler.has_unfinished_requests(), self.groups)

    def _gather_results(self, results: dict[str, RequestOutput]) -> dict[str, RequestOutput]:
        return gather_replicas(results, self.groups)

    def _require_generative(self, call: str) -> None:
        if self.runner.is_pooling_model:
            raise ValueError(f"{call}() needs a generative runner; this LLM was built with runner='pooling' "
                             "(call embed() / classify() / score() / encode())")

    def _require_open(self) -> None:
        if getattr(self, "_shut_down", False):
            raise RuntimeError("this LLM was shut down (its graphs, KV cache and process groups are released): "
                               "create a new LLM to generate again")

    def shutdown(self) -> None:
        """Release graphs, pool and cache, then the process groups (in that order). Idempotent; the
        LLM refuses every later call that would run a step (RuntimeError)."""
        self._shut_down = True
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()
        groups = getattr(self, "groups", None)
        if groups is not None:
            groups.destroy()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (none when idle),
        and those aborted since the last step.

        With async scheduling, the requests whose end became known in it: the output
        resolved in a step is the previous step's. Under DP an idle replica still runs the
        step (a dummy one) under lockstep DP: call it only while `_any_unfinished()` says
        some replica has work, as `generate` does.
        """
        self._require_open()
        return self._step_outputs()[0]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (vLLM's `LLM.chat`): each conversation (a list of
        `{"role": ..., "content": ...}` messages, or a list of such lists) is rendered with the
        tokenizer's chat template (or `chat_template`), then generated from like a prompt
        (`lora_request` as in `generate`)."""
        prompts = render_chat(self.tokenizer, messages, chat_template=chat_template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message,
                              chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): per prompt, the `beam_width` best sequences by
        length-penalised cumulative logprob (`BeamSearchOutput.sequences`, best first). Each step
        extends every live beam by one token through `generate` (the prefix cache keeps the
        beams' shared prefixes), keeping the `beam_width` best of 2 x beam_width candidates."""
        return run_beam_search(self, prompts, params, use_tqdm=use_tqdm)

    def _step_outputs(self) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """One step: (the finished requests' outputs, the stream deltas); see `OutputProcessor`."""
        try:
            finished = self._step_async() if self.async_scheduling else self._step_sync()
        except BaseException:
            self.scheduler.step_failed()  # the next plan carries this one's finished ids again
            raise
        return self._process(finished)

    def _process(self, finished: list[SequenceOutput]) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """The outputs of a step (`OutputProcessor.process`); the deltas of open streams go to their boxes."""
        finals, deltas = self._outputs.process(finished)
        if self._stream_boxes:
            rest = []
            for out in deltas:
                box = self._stream_boxes.get(out.request_id)
                if box is None:
                    rest.append(out)
                else:
                    box.append(out)
            deltas = rest
        return finals, deltas

    def _wait_for_kv(self) -> bool:
        """An empty plan because the waiting requests' KV is still arriving through the connector:
        wait a little for it (True), instead of spinning or calling the scheduler stuck."""
        if not self.scheduler.waiting_for_kv or self.scheduler.kv_connector is None:
            return False
        self.scheduler.kv_connector.wait_for_kv(_KV_WAIT_S)
        return True

    def _step_sync(self) -> list[SequenceOutput]:
        """Schedule, execute and sample one step, and apply its output."""
        if not self.scheduler.has_unfinished_requests():
            if self.groups.dp_lockstep:
                # An empty plan (it still carries the ids of requests finished last step).
                self.runner.execute_model(self.scheduler.schedule())
                self.runner.sample_tokens()
            return []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            if self._wait_for_kv():
                self.runner.execute_model(scheduler_output)  # finished or preempted requests still leave it
                return []
            # Every request fits the cache on its own (checked on add), so an empty plan
            # with live requests means the scheduler is stuck: fail instead of spinning.
            raise RuntimeError(
                f"scheduler planned no tokens with {self.scheduler.num_unfinished_requests} unfinished requests "
                f"(free KV blocks: {self.scheduler.block_allocator.num_free}/{self.scheduler.num_blocks})"
            )
        self._structured.place_drafts(self.runner, scheduler_output, self.scheduler)  # speculation: grammar drafts
        self.runner.execute_model(scheduler_output)
        if self.record_batches is not None:
            append_record(self.record_batches, scheduler_output, self.runner)
        runner_output = cast(ModelRunnerOutput, self._structured.sample(self.runner, scheduler_output))
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        return finished + self._structured.after_output(runner_output, self.scheduler)

    def _step_async(self) -> list[SequenceOutput]:
        """Launch the next step, then apply the previous one's output (one step late; before it: grammar drafts)."""
        launched, early = None, self._resolve_in_flight() if self._structured.wants_drafts(self.scheduler) else []
        # Lockstep DP: every rank calls execute_model once per iteration (its one DP agreement), with an
        # empty plan when it has nothing to launch: the runner then runs a dummy step if a peer runs one.
        lockstep = self.groups.dp_lockstep
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            self._structured.place_drafts(self.runner, scheduler_output, self.scheduler)
            scheduled = scheduler_output.total_num_scheduled_tokens > 0
            if not scheduled and not self._in_flight and not self._wait_for_kv():
                raise RuntimeError(
                    f"scheduler planned no tokens with {self.scheduler.num_unfinished_requests} unfinished requests "
                    f"and no step in flight (free KV blocks: {self.scheduler.block_allocator.num_free}/"
                    f"{self.scheduler.num_blocks})"
                )
            # An empty plan (every running request waits on an in-flight token) still
            # tells the runner about finished and preempted requests.
            if scheduled or scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids or lockstep:
                self.runner.execute_model(scheduler_output)
            if scheduled:
                if self.record_batches is not None:
                    append_record(self.record_batches, scheduler_output, self.runner)
                if self._structured.constrains(scheduler_output):  # its masks need every earlier token
                    early += self._resolve_in_flight()
                launched = (scheduler_output, self._structured.sample(self.runner, scheduler_output, True))
        elif lockstep:
            self.runner.execute_model(self.scheduler.schedule())
        if launched is not None:
            self._in_flight.append(launched)
        # Resolve the oldest steps beyond the depth (all but the newest P - 1 under pipelined PP),
        # or the oldest one when nothing could be launched (every request waits on a token).
        keep = self._keep_in_flight if launched is not None else len(self._in_flight) - 1
        finished: list[SequenceOutput] = early
        while len(self._in_flight) > max(keep, 0):
            finished += self._resolve_oldest()
        return finished

    def _resolve_in_flight(self) -> list[SequenceOutput]:
        """Wait for every in-flight step's output and apply them in order (async scheduling)."""
        finished: list[SequenceOutput] = []
        while self._in_flight:
            finished += self._resolve_oldest()
        return finished

    def _resolve_oldest(self) -> list[SequenceOutput]:
        """Wait for the oldest in-flight step's output (its copy, or a PP stage's broadcast) and apply it."""
        scheduler_output, pending = self._in_flight[0]
        runner_output: ModelRunnerOutput = pending.get()
        self._in_flight.popleft()  # after get(): a failed one stays for `_abort_after_failure` to drain
        finished = self.scheduler.update_from_output(scheduler_output, runner_output)
        return finished + self._structured.after_output(runner_output, self.scheduler)



def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
