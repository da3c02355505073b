"""`LLM`'s arguments, checked and turned into the runner's configs or per-prompt lists.

Each helper raises the error Python or vLLM would for a bad argument (TypeError for an
unknown keyword or a wrong type, ValueError naming the value and what is allowed), before
any process group, model or cache exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from graphrunner.cli_args import DBO_FIELDS
from graphrunner.config import CompilationConfig, ParallelConfig, SpeculativeConfig
from graphrunner.protocol import SamplingParams

_COMPILATION_FIELDS = frozenset(f.name for f in dataclasses.fields(CompilationConfig)) - {"enforce_eager"}
EPLB_FIELDS = ("enable_eplb", "num_redundant_experts", "eplb_window_size", "eplb_step_interval")
# ParallelConfig fields LLM takes as extra keywords
PARALLEL_EXTRA_FIELDS = (*DBO_FIELDS, *EPLB_FIELDS, "pp_token_placeholders")


def check_compilation_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse `LLM`'s extra keywords that are neither `CompilationConfig` fields nor DBO's
    (TypeError, as Python would)."""
    unknown = set(kwargs) - _COMPILATION_FIELDS - set(PARALLEL_EXTRA_FIELDS)
    if unknown:
        raise TypeError(
            f"LLM() got unexpected keyword arguments {sorted(unknown)}; extra keywords must be "
            f"CompilationConfig fields {sorted(_COMPILATION_FIELDS)} or ParallelConfig's {list(PARALLEL_EXTRA_FIELDS)}"
        )


def parallel_config(
    tensor_parallel_size: int, pipeline_parallel_size: int, data_parallel_size: int, collective_timeout_s: float,
    async_scheduling: bool, extra: dict[str, Any] | None = None, **context_parallel: Any,
) -> ParallelConfig:
    """The `ParallelConfig` of `LLM`'s layout arguments (`context_parallel`: vLLM's
    prefill_context_parallel_size, decode_context_parallel_size, cp_kv_cache_interleave_size,
    data_parallel_lockstep, enable_expert_parallel; `extra`: LLM's extra keywords, whose `PARALLEL_EXTRA_FIELDS` (DBO's,
    pp_token_placeholders) are taken out); refuses async scheduling over several processes."""
    taken = {name: extra.pop(name) for name in PARALLEL_EXTRA_FIELDS if name in extra} if extra else {}
    parallel = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size,
        collective_timeout_s=collective_timeout_s,
        **context_parallel, **taken,
    )
    if async_scheduling or parallel.pipeline_parallel_size > 1:
        check_async_layout(parallel, async_scheduling)
    return parallel


def check_async_layout(parallel: ParallelConfig, async_scheduling: bool) -> None:
    """The async loop (async scheduling, and pipelined PP, which runs through it) needs every
    rank of a replica to know its step's tokens on its own (TP, DCP, DP, PP through the broadcast
    FIFO). Lockstep DP runs it with every rank stepping once per loop iteration, an idle one a
    dummy step (`LLM._step_async`); not with pipelined PP, whose several batches in flight would
    each need their own agreement. PCP needs exact host counts of decoding rows."""
    lockstep = parallel.data_parallel_lockstep and parallel.data_parallel_size > 1
    blockers = [f"{name}={value}" for name, value, bad in (
        ("prefill_context_parallel_size", parallel.prefill_context_parallel_size,
         parallel.prefill_context_parallel_size > 1 and async_scheduling),
        ("data_parallel_lockstep", True, lockstep and parallel.pipeline_parallel_size > 1),
    ) if bad]
    if blockers:
        what = "async_scheduling=True" if async_scheduling else \
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} (pipelined through the async loop)"
        raise ValueError(f"{what} does not run with {', '.join(blockers)} yet; it runs with tensor, pipeline and "
                         "decode context parallelism, independent data parallelism, and lockstep data parallelism "
                         "without pipeline parallelism")


def async_scheduling_default(parallel: ParallelConfig, speculative: SpeculativeConfig) -> tuple[bool, str | None]:
    """`LLM(async_scheduling=None)`: on (vLLM's default) unless the layout cannot run the async loop;
    (on, the reason it is off or None)."""
    if parallel.prefill_context_parallel_size > 1:
        return False, f"prefill_context_parallel_size={parallel.prefill_context_parallel_size}"
    if parallel.data_parallel_lockstep and parallel.data_parallel_size > 1 and parallel.pipeline_parallel_size > 1:
        return False, "data_parallel_lockstep=True with pipeline_parallel_size > 1"
    if parallel.pipeline_parallel_size > 1 and speculative.num_speculative_tokens:
        return False, "pipeline_parallel_size > 1 with speculative decoding"
    return True, None


# vLLM's default batch limits of its offline `LLM` class, per device type: (max_num_seqs, max_num_batched_tokens).
DEFAULT_LIMITS = {"cuda": (256, 16384), "cpu": (256, 4096)}


def default_limits(device: Any, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> tuple[int, int]:
    """`LLM`'s batch limits, each None replaced by vLLM's default for the device type."""
    seqs, tokens = DEFAULT_LIMITS.get(getattr(device, "type", str(device)), DEFAULT_LIMITS["cpu"])
    return (seqs if max_num_seqs is None else max_num_seqs,
            tokens if max_num_batched_tokens is None else max_num_batched_tokens)


def check_model_source(model: str, tokenizer: str | None, revision: str | None, tokenizer_revision: str | None,
                       trust_remote_code: bool) -> None:
    """Refuse what graphrunner cannot honour about where the model comes from (ValueError with the reason)."""
    if trust_remote_code:
        raise ValueError("trust_remote_code=True is refused: graphrunner runs no Python code from a model folder; "
                         "its architectures are built in (graphrunner.models.registry)")
    for name, value in (("revision", revision), ("tokenizer_revision", tokenizer_revision)):
        if value is not None:
            raise ValueError(f"{name}={value!r}: graphrunner loads local folders ({model!r}), which have no hub "
                             f"revisions; check out the revision into a folder and pass that")
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise ValueError(f"tokenizer={tokenizer!r} must be a folder path (a string)")


def resolve_speculative_config(value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig:
    """`speculative_config=` as vLLM takes it: a dict, its JSON text (`--speculative-config`),
    a `SpeculativeConfig`, or None (off). Errors name the value and the allowed set."""
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        import json

        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None  # SpeculativeConfig.from_dict reports it
        value = parsed if isinstance(parsed, dict) else value
    if isinstance(value, Mapping):
        value = dict(value)
        if "method" not in value and value.get("model") is not None:
            value["method"] = infer_speculative_method(str(value["model"]))
    try:
        return SpeculativeConfig.from_dict(value)
    except TypeError as e:  # e.g. a bool or a list: not a dict, a JSON text or None
        raise ValueError(f"speculative_config={value!r}: {e}") from None


def infer_speculative_method(model: str) -> str:
    """The speculative method vLLM infers from a draft `model` given without `method`: "ngram" for
    "[ngram]" / "ngram", EAGLE-3 or EAGLE when the name (or the folder's architectures) says so,
    else a draft model."""
    import json
    from pathlib import Path

    name = model.lower()
    if name in ("ngram", "[ngram]"):
        return "ngram"
    config = Path(model) / "config.json"
    if config.is_file():
        try:
            name += " " + " ".join(json.loads(config.read_text()).get("architectures") or []).lower()
        except (OSError, ValueError, AttributeError):
            pass  # the loader reports a broken config.json, naming it
    if "eagle3" in name:
        return "eagle3"
    if "eagle" in name:
        return "eagle"
    return "draft_model"


def per_prompt_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt from `generate`'s argument: one for all, one each, or None (defaults)."""
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, (str, bytes, Mapping)):
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
        )
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling_params for {num_prompts} prompts; pass one or one per prompt")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params
