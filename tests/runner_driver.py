"""A minimal hand-driven scheduler for runner tests: builds SchedulerOutputs directly."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphrunner.config import (
    CacheConfig,
    CompilationConfig,
    KernelConfig,
    LoadConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from graphrunner.models.loader import load_model_config
from graphrunner.protocol import NewRequestData, SamplingParams, SchedulerOutput
from graphrunner.runner import ModelRunner


def make_runner(model: str = "builtin:tiny-llama", *, max_num_seqs=4, max_num_batched_tokens=64,
                max_model_len=128, block_size=8, num_blocks=96, device="cpu", dtype="float32",
                load_format="dummy", speculative: dict | None = None,
                compilation: CompilationConfig | None = None, kernel: KernelConfig | None = None) -> ModelRunner:
    config = RunnerConfig(
        model=load_model_config(model),
        load=LoadConfig(model=model, load_format=load_format, seed=0),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len),
        speculative=SpeculativeConfig.from_dict(speculative),
        # Default: the eager compile backend. Uncaptured steps still run the PIECEWISE path,
        # compiled at the first step: inductor's codegen there cost ~10 s (cold) for what every
        # such test checks; inductor has its own test (test_piecewise.test_inductor_backend).
        compilation=compilation if compilation is not None else CompilationConfig(compile_backend="eager"),
        kernel=kernel if kernel is not None else KernelConfig(),
        dtype=dtype,
    )
    runner = ModelRunner(config, device)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_kv_blocks())
    return runner


@dataclass
class _Req:
    tokens: list[int]
    params: SamplingParams
    blocks: list[int]
    computed: int = 0
    outputs: list[int] = field(default_factory=list)


class Driver:
    """Schedules requests as whole prefills then decodes, one block range per request."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.reqs: dict[str, _Req] = {}
        self._new: list[str] = []

    def add(self, req_id: str, prompt: list[int], params: SamplingParams | None = None, max_len: int | None = None):
        bs = self.runner.limits.block_size
        n_blocks = -(-(max_len or self.runner.max_model_len) // bs)
        # Blocks no live request holds (a request's blocks are its own), nor one this driver admits next.
        pending = {b for rid in self._new for b in self.reqs[rid].blocks}
        free = [b for b in np.flatnonzero(self.runner.state.tables.holders == 0).tolist() if b not in pending]
        blocks = free[:n_blocks]
        self.reqs[req_id] = _Req(list(prompt), params or SamplingParams(temperature=0.0), blocks)
        self._new.append(req_id)

    def step(self, chunk: int | None = None, grammar=None) -> dict[str, list[int]]:
        """One step; `grammar(so)` (optional) gives the step's GrammarOutput for sample_tokens."""
        so = SchedulerOutput()
        for rid in self._new:
            r = self.reqs[rid]
            so.scheduled_new_reqs.append(NewRequestData(rid, r.tokens, r.params, r.blocks, 0))
        for rid, r in self.reqs.items():
            if rid not in self._new:
                so.scheduled_cached_reqs.req_ids.append(rid)
                so.scheduled_cached_reqs.new_block_ids.append(None)
                so.scheduled_cached_reqs.num_computed_tokens.append(r.computed)
            known = len(r.tokens) + len(r.outputs)
            decoding = r.computed >= len(r.tokens)
            # A decode takes 1 token plus up to k draft slots (placeholders), within max_model_len.
            q = min(self.runner.uniform_decode_query_len, self.runner.max_model_len - r.computed)
            n = known - r.computed if not decoding else q
            if chunk is not None:
                n = min(n, chunk)
            so.num_scheduled_tokens[rid] = n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self._new = []
        self.runner.execute_model(so)
        out = self.runner.sample_tokens(grammar_output=grammar(so) if grammar is not None else None)
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            r = self.reqs[rid]
            n = so.num_scheduled_tokens[rid]
            # A verifying decode computed its last token and the accepted drafts: len(toks).
            r.computed += len(toks) if r.computed >= len(r.tokens) and n > 1 else n
            r.outputs += toks
        return dict(zip(out.req_ids, out.sampled_token_ids, strict=True))

    def finish(self, req_id: str) -> None:
        del self.reqs[req_id]
        self.runner.execute_model(SchedulerOutput(finished_req_ids={req_id}))
        self.runner.sample_tokens()
