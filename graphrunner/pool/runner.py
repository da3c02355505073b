"""PoolingRunner: a `ModelRunner` whose steps pool instead of sampling (vLLM's `runner="pooling"`).

    runner = PoolingRunner(config, device)      # pooler_config: None reads the checkpoint's
    runner.load_model(); runner.initialize_kv_cache(runner.determine_num_kv_blocks()); runner.capture_model()
    runner.execute_model(scheduler_output)      # every new request carries `pooling_params`
    out = runner.sample_tokens()                # out.pooler_output[i]: entry i's tensor (None: prompt not done)

Everything up to the run is the generative runner's: validation, request states, planning,
dispatch, FULL / PIECEWISE graphs. The step body (`PoolingBody`) pools into `PoolBuffers.rows`
where a generative one samples, so each descriptor is captured once (no sampler variants).
`sample_tokens` copies the pooled rows of the requests whose prompt completed and applies each
request's `PoolingParams` on the host: Matryoshka truncation and L2 normalisation for embeddings,
softmax (sigmoid for one label) for class probabilities.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from graphrunner.config import RunnerConfig
from graphrunner.distributed.groups import ParallelGroups
from graphrunner.pool.body import PoolingBody
from graphrunner.pool.config import PoolerConfig, load_pooler_config
from graphrunner.pool.params import PoolingParams
from graphrunner.protocol import ModelRunnerOutput, SchedulerOutput
from graphrunner.runner import ModelRunner
from graphrunner.step.graphs import GREEDY
from graphrunner.step.output import AsyncOutput
from graphrunner.structured_outputs import GrammarOutput


@dataclass
class PoolBuffers:
    """rows: [max_num_reqs, pooled_size] float32, one pooled vector (or a classifier's logits)
    per batch entry; written in place by every pooling step, graphs included."""

    rows: torch.Tensor

    @classmethod
    def allocate(cls, max_num_reqs: int, pooled_size: int, device: torch.device) -> PoolBuffers:
        return cls(rows=torch.zeros(max_num_reqs, pooled_size, dtype=torch.float32, device=device))


class PoolingRunner(ModelRunner):
    """Runs pooling steps of one model (module docstring). `pooler_config`: how to pool; None
    reads it from the checkpoint folder (`graphrunner.pool.config.load_pooler_config`)."""

    body_class = PoolingBody
    is_pooling_model = True

    def __init__(self, config: RunnerConfig, device: torch.device | str, groups: ParallelGroups | None = None,
                 pooler_config: PoolerConfig | None = None) -> None:
        par = config.parallel
        if par.world_size != par.tensor_parallel_size:
            raise ValueError(f"pooling runs on one rank or with tensor parallelism; got a parallel world of "
                             f"{par.world_size} (tensor {par.tensor_parallel_size} x pipeline "
                             f"{par.pipeline_parallel_size} x data {par.data_parallel_size} x prefill context "
                             f"{par.prefill_context_parallel_size})")
        if config.speculative.num_speculative_tokens:
            raise ValueError("speculative decoding has nothing to speed up in a pooling runner (it samples no token)")
        super().__init__(config, device, groups)
        self.pooler_config = pooler_config or load_pooler_config(config.load.model)
        self._params: dict[str, PoolingParams] = {}

    def model_factory(self) -> Any:
        from graphrunner.models.registry import check_runner_kind
        from graphrunner.pool.model import LlamaForPooling

        check_runner_kind(self.model_config.architecture, "pooling")
        return functools.partial(LlamaForPooling, pooler=self.pooler_config)

    def load_model(self) -> None:
        """Build the decoder and its pooler (no LM head), load the weights, allocate the pooled rows."""
        super().load_model()
        self.buffers.pool = PoolBuffers.allocate(self.limits.max_num_reqs, self.model.pooled_size, self.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        super().initialize_kv_cache(num_blocks)
        assert self.graphs is not None
        # The step never samples: one FULL graph per descriptor serves every pooling batch.
        self.graphs.eager_variants = (GREEDY,)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """The `PoolingParams.task`s this model serves (vLLM's name)."""
        return self.pooler_config.tasks

    # ---- the step ---------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run one pooling step. ValueError, before any state changes, for a request without
        `pooling_params`, a task the model does not serve, `dimensions` past the embedding size,
        or (mean / CLS pooling) a prompt not scheduled whole."""
        so = scheduler_output
        for new in so.scheduled_new_reqs:
            self.check_pooling_request(new.req_id, new.pooling_params)
            if not self.pooler_config.chunkable:
                scheduled = so.num_scheduled_tokens.get(new.req_id, 0)
                if new.num_computed_tokens or scheduled != len(new.prompt_token_ids):
                    raise ValueError(
                        f"request {new.req_id!r}: {self.pooler_config.pooling_type} pooling needs its whole prompt "
                        f"({len(new.prompt_token_ids)} tokens) in one step; got {scheduled} tokens scheduled after "
                        f"{new.num_computed_tokens} computed (disable chunked prefill and prefix caching)")
        super().execute_model(so)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._params.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.pooling_params is not None
            self._params[new.req_id] = new.pooling_params

    def check_pooling_request(self, req_id: str, params: PoolingParams | None) -> None:
        """ValueError naming the request unless `params` is a task this model serves, within its sizes."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"request {req_id!r} has pooling_params={params!r}: a pooling runner serves pooling "
                             "requests only (NewRequestData.pooling_params, a PoolingParams)")
        tasks = self.supported_tasks
        if params.task is not None and params.task not in tasks:
            kind = "a classifier" if self.pooler_config.is_classifier else "an embedding model"
            raise ValueError(f"request {req_id!r}: task {params.task!r} is not served by {kind}; "
                             f"supported tasks: {list(tasks)}")
        if params.task == "score" and self.pooler_config.num_labels > 1:
            raise ValueError(f"request {req_id!r}: score needs a cross-encoder (one label); this classifier has "
                             f"{self.pooler_config.num_labels}")
        size = self.model_config.hidden_size
        if params.dimensions is not None and (self.pooler_config.is_classifier or params.dimensions > size):
            raise ValueError(f"request {req_id!r}: dimensions={params.dimensions} must be <= the embedding size "
                             f"{size} (and only embeddings have dimensions)")

    def sample_tokens(self, async_output: bool = False,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput | AsyncOutput:
        """The step's pooled outputs: `pooler_output[i]` for batch entry i, a float32 CPU tensor once
        its prompt is complete (None before); `sampled_token_ids[i]` is empty (nothing is sampled).
        One blocking copy; `async_output` wraps the finished output."""
        pending, self._pending = self._pending, None
        if pending is None:
            out = ModelRunnerOutput.empty()
        else:
            batch = pending.batch
            assert self.buffers.pool is not None
            rows = self.buffers.pool.rows[: batch.num_reqs].cpu()  # [R, pooled_size] float32
            req_ids = list(batch.req_ids)
            pooled = [self._finish(rows[i], self._params[req_id]) if pending.produces_token[i] else None
                      for i, req_id in enumerate(req_ids)]
            out = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [[] for _ in req_ids],
                                    pooler_output=pooled)
        return AsyncOutput.ready(out) if async_output else out

    def _finish(self, row: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """A pooled row as the request asked for it (module docstring)."""
        cfg = self.pooler_config
        if cfg.is_classifier:
            if params.activation is False:
                return row.clone()
            return torch.sigmoid(row) if cfg.num_labels == 1 else torch.softmax(row, dim=-1)
        if params.task == "encode":
            return row.clone()
        if params.dimensions is not None:
            row = row[: params.dimensions]
        normalize = cfg.normalize if params.normalize is None else params.normalize
        return F.normalize(row, dim=-1) if normalize else row.clone()


__all__ = ["PoolBuffers", "PoolingRunner"]
