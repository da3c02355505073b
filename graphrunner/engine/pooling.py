"""The pooling side of `LLM` (vLLM's names): `embed`, `classify`, `score`, `encode` and their outputs.

    llm = LLM("/models/Qwen3-Embedding-0.6B", runner="pooling")
    llm.embed(["hello", "world"])[0].outputs.embedding          # list[float], L2-normalised
    llm.classify(prompts)[0].outputs.probs                       # a *ForSequenceClassification model
    llm.score("query", ["doc 1", "doc 2"])[0].outputs.score      # cosine, or a cross-encoder's sigmoid

Each prompt is one scheduler request whose whole life is its prefill: the engine schedules it,
the pooling runner pools it, and the request ends in the step its prompt completes. A bad prompt or
parameter raises ValueError before anything is queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from graphrunner.engine.admission import cache_filled_blocks
from graphrunner.engine.prompts import split_prompts_with_extras
from graphrunner.engine.request import RequestStatus
from graphrunner.pool.params import PoolingParams
from graphrunner.protocol import SamplingParams

# A pooling request samples nothing; the scheduler still wants sampling params: one greedy token's.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class PoolingOutput:
    """The raw pooled vector (vLLM's `PoolingOutput`)."""

    data: torch.Tensor


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's `ClassificationOutput`)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's `ScoringOutput`): cosine similarity, or a cross-encoder's probability."""

    score: float


T = TypeVar("T")


@dataclass
class PoolingRequestOutput(Generic[T]):
    """A pooling prompt's result (vLLM's `PoolingRequestOutput`)."""

    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]


class PoolingAPI:
    """`LLM`'s pooling calls; they need `LLM(model, runner="pooling")` (`LLM` supplies the attributes)."""

    runner: Any
    scheduler: Any
    tokenizer: Any
    _inputs: Any  # multimodal.inputs.InputProcessor, or None
    _next_req_id: int

    def embed(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              use_tqdm: bool = False) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """One embedding per prompt (texts, token-id lists or prompt dicts), in order; `PoolingParams`
        may truncate (`dimensions`) or skip the normalisation (`normalize=False`)."""
        pooled = self._pool(prompts, pooling_params, "embed")
        return [PoolingRequestOutput(rid, EmbeddingOutput(data.tolist()), ids) for rid, ids, data in pooled]

    def classify(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[PoolingRequestOutput[ClassificationOutput]]:
        """Class probabilities per prompt (a `*ForSequenceClassification` checkpoint): softmax over its
        labels (sigmoid for one label); `PoolingParams(activation=False)` gives the logits."""
        pooled = self._pool(prompts, pooling_params, "classify")
        return [PoolingRequestOutput(rid, ClassificationOutput(data.tolist()), ids) for rid, ids, data in pooled]

    def encode(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               use_tqdm: bool = False) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The raw pooled vector per prompt (a classifier's logits), no normalisation or activation."""
        pooled = self._pool(prompts, pooling_params, "encode")
        return [PoolingRequestOutput(rid, PoolingOutput(data), ids) for rid, ids, data in pooled]

    def score(self, data_1: Any, data_2: Any, pooling_params: PoolingParams | None = None, *,
              use_tqdm: bool = False) -> list[PoolingRequestOutput[ScoringOutput]]:
        """Scores of text pairs (vLLM's `LLM.score`): `data_1` one item scored against each of `data_2`,
        or two lists of one length scored pairwise. An embedder scores by the cosine similarity of the
        two embeddings; a cross-encoder (a classifier with one label) by its probability for the pair,
        given as one prompt: the tokenizer's pair encoding for texts, the two lists joined for token ids."""
        firsts, seconds = _score_pairs(data_1, data_2)
        if self.runner.pooler_config.is_classifier:
            pairs = [self._pair_prompt(a, b) for a, b in zip(firsts, seconds, strict=True)]
            params = dataclasses.replace(pooling_params or PoolingParams(), task="score")
            pooled = self._pool(pairs, params, "score")
            return [PoolingRequestOutput(rid, ScoringOutput(float(data[0])), ids) for rid, ids, data in pooled]
        params = dataclasses.replace(pooling_params or PoolingParams(), task="score", normalize=True)
        left = self._pool(firsts, params, "score")
        right = self._pool(seconds, params, "score")
        return [PoolingRequestOutput(b[0], ScoringOutput(float(F.cosine_similarity(a[2], b[2], dim=0))), a[1] + b[1])
                for a, b in zip(left, right, strict=True)]

    # ---- the loop ---------------------------------------------------------------------
    def _pool(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None,
              task: str) -> list[tuple[str, list[int], torch.Tensor]]:
        """Queue the prompts as pooling requests of `task`, run steps until each is pooled; returns
        (request id, prompt token ids, pooled tensor) in prompt order."""
        self._require_pooling(task)
        _, token_prompts, extras = split_prompts_with_extras(prompts, self.tokenizer, self._inputs)
        n = len(token_prompts)
        if isinstance(pooling_params, Sequence):
            if len(pooling_params) != n:
                raise ValueError(f"got {len(pooling_params)} pooling_params for {n} prompts")
            params_list = list(pooling_params)
        else:
            params_list = [pooling_params or PoolingParams()] * n
        ids = [str(self._next_req_id + i) for i in range(n)]
        prompts_ids = [[int(t) for t in p] for p in token_prompts]
        params_list = [dataclasses.replace(self._check_params(p), task=task) for p in params_list]
        for req_id, prompt, params in zip(ids, prompts_ids, params_list, strict=True):
            self.runner.check_pooling_request(req_id, params)
            self.scheduler.check_request(req_id, prompt, POOLING_SAMPLING)
        self._next_req_id += n
        for req_id, prompt, params, extra in zip(ids, prompts_ids, params_list, extras, strict=True):
            self.scheduler.add_request(req_id, prompt, POOLING_SAMPLING,
                                       extras=dataclasses.replace(extra, pooling_params=params))
        results: dict[str, torch.Tensor] = {}
        try:
            while self.scheduler.has_unfinished_requests():
                self._pooling_step(results)
        except BaseException:
            self.runner.sample_tokens()  # a launched step's output, discarded
            self.scheduler.abort_after_failure()
            raise
        return [(req_id, prompt, results[req_id]) for req_id, prompt in zip(ids, prompts_ids, strict=True)]

    def _pooling_step(self, results: dict[str, torch.Tensor]) -> None:
        """Schedule, run and pool one step; requests whose prompt completed end with their output."""
        sched = self.scheduler
        so = sched.schedule()
        if so.total_num_scheduled_tokens == 0:
            free = f"{sched.block_allocator.num_free}/{sched.num_blocks}"
            raise RuntimeError(f"scheduler planned no tokens with {sched.num_unfinished_requests} unfinished "
                               f"pooling requests (free KV blocks: {free})")
        self.runner.execute_model(so)
        out = self.runner.sample_tokens()
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            sched.requests[req_id].num_computed_tokens += num_tokens
        cache_filled_blocks(sched, so)  # a later prompt with the same prefix starts after it
        for req_id in so.num_scheduled_tokens:
            data = out.pooler_output[out.req_id_to_index[req_id]]
            if data is not None:
                results[req_id] = data
                sched.finish_request(req_id, RequestStatus.FINISHED_STOPPED)

    def _require_pooling(self, task: str) -> None:
        if not self.runner.is_pooling_model:
            raise ValueError(f"{task}() needs a pooling runner: LLM(model, runner='pooling'); this LLM generates")
        tasks = self.runner.supported_tasks
        if task not in tasks:
            kind = "a classifier" if self.runner.pooler_config.is_classifier else "an embedding model"
            raise ValueError(f"{task}() is not served by {kind}; supported tasks: {list(tasks)}")

    @staticmethod
    def _check_params(params: Any) -> PoolingParams:
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        return params

    def _pair_prompt(self, a: Any, b: Any) -> list[int]:
        if isinstance(a, str) and isinstance(b, str):
            if self.tokenizer is None or not callable(self.tokenizer):
                raise ValueError("scoring text pairs needs the model's tokenizer, and this model has none: "
                                 "give token-id lists")
            return list(self.tokenizer(a, text_pair=b)["input_ids"])
        if isinstance(a, str) or isinstance(b, str):
            raise ValueError("a score pair is two texts or two token-id lists, not one of each")
        return [int(t) for t in a] + [int(t) for t in b]


def _score_pairs(data_1: Any, data_2: Any) -> tuple[list[Any], list[Any]]:
    """(firsts, seconds) of vLLM's score inputs: 1 x N or N x N (a token-id list is one item)."""
    def items(data: Any) -> list[Any]:
        if isinstance(data, str) or (isinstance(data, Sequence) and data and isinstance(data[0], int)):
            return [data]
        return list(data)

    firsts, seconds = items(data_1), items(data_2)
    if len(firsts) == 1 and len(seconds) > 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not firsts:
        raise ValueError(f"score pairs data_1 ({len(items(data_1))} items) with data_2 ({len(seconds)}): "
                         "one against N, or N against N")
    return firsts, seconds


def pooling_engine_options(model: str, pooler_config: Any, async_scheduling: bool | None,
                           enable_prefix_caching: bool, max_model_len: int | None,
                           max_num_batched_tokens: int | None, device: Any) -> tuple[Any, bool, bool, int | None,
                                                                                     int | None]:
    """`LLM`'s options for runner="pooling": (pooler config, async scheduling, prefix caching,
    max_model_len, max_num_batched_tokens). Steps sample nothing to overlap, so scheduling is
    synchronous; mean and CLS pooling read every prompt position in one step, so their prompts are
    never chunked nor served from the prefix cache, and a prompt must fit one step's token budget."""
    from graphrunner.config import resolve_device
    from graphrunner.engine.options import default_limits
    from graphrunner.models.loader import load_model_config
    from graphrunner.pool.config import PoolerConfig, load_pooler_config

    if pooler_config is not None and not isinstance(pooler_config, PoolerConfig):
        raise ValueError(f"pooler_config must be a PoolerConfig, got {type(pooler_config).__name__}")
    config = pooler_config or load_pooler_config(model)
    if async_scheduling:
        raise ValueError("async_scheduling=True with runner='pooling': a pooling step samples no token for the "
                         "next step to wait on; leave async_scheduling unset")
    if config.chunkable:
        return config, False, enable_prefix_caching, max_model_len, max_num_batched_tokens
    budget = max_num_batched_tokens or default_limits(resolve_device(device), None, None)[1]
    if max_model_len is None:
        max_model_len = min(load_model_config(model).max_position_embeddings, budget)
    elif max_model_len > budget:
        if max_num_batched_tokens is not None:
            raise ValueError(f"max_model_len={max_model_len} > max_num_batched_tokens={max_num_batched_tokens}: "
                             f"{config.pooling_type} pooling needs each prompt whole in one step")
        max_num_batched_tokens = max_model_len
    return config, False, False, max_model_len, max_num_batched_tokens
