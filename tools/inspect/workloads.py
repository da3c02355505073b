"""Synthetic batch traces: the reference scheduler driven by a model-less runner.

A named workload fixes the distributions of prompt and output lengths and the arrival
rate; `synthesize` feeds requests to the real `Scheduler` (chunked prefill, preemption,
token budget, max_num_seqs — the batches an engine would really form) and answers each
step with `TokenlessRunner`, which samples random tokens instead of running a model.
Each step becomes one trace record in the format of `generate --record-batches`.

The module imports only the standard library and graphrunner's protocol types at the
top: the CLI reads `WORKLOADS` while it builds its parser, on every `graphrunner` call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from graphrunner.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Workload:
    """Lengths are drawn uniformly from inclusive ranges; arrivals are Poisson per step."""

    description: str
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    arrivals_per_step: float


WORKLOADS: Mapping[str, Workload] = MappingProxyType(
    {
        "decode-heavy": Workload(
            "short prompts, long outputs: mostly uniform decode steps", (16, 128), (128, 512), 0.25
        ),
        "prefill-heavy": Workload(
            "long prompts, short outputs: mostly (chunked) prefill steps", (256, 1024), (1, 16), 0.5
        ),
        "mixed": Workload("medium prompts and outputs: prefills interleaved with decodes", (32, 512), (32, 256), 0.5),
    }
)


class TokenlessRunner:
    """Answers `SchedulerOutput`s like a `ModelRunner` would, without a model.

    It tracks, per request, how many tokens are known, so that it samples a token exactly
    when a scheduled chunk reaches the end of them (the runner's rule); the token is random.
    """

    def __init__(self, vocab_size: int, rng: np.random.Generator):
        self.vocab_size = vocab_size
        self.rng = rng
        self.known: dict[str, int] = {}  # req_id -> tokens known (prompt + sampled)

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.known.pop(req_id, None)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.known[new.req_id] = len(new.all_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        out = ModelRunnerOutput()
        for i, (req_id, n) in enumerate(so.num_scheduled_tokens.items()):
            out.req_ids.append(req_id)
            out.req_id_to_index[req_id] = i
            if computed[req_id] + n >= self.known[req_id]:
                out.sampled_token_ids.append([int(self.rng.integers(self.vocab_size))])
                self.known[req_id] += 1
            else:
                out.sampled_token_ids.append([])
        return out


def _workload(name: str, num_requests: int, max_model_len: int) -> Workload:
    """The workload `name`, once the arguments of `synthesize` are known to make sense."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; allowed: {sorted(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if max_model_len < 2:
        raise ValueError(f"max_model_len={max_model_len} must be >= 2 (one prompt token and one output token)")
    return WORKLOADS[name]


def synthesize(
    name: str,
    *,
    num_requests: int,
    seed: int = 0,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int = 2048,
    block_size: int = 16,
    num_blocks: int | None = None,
    uniform_decode_query_len: int = 1,
    vocab_size: int = 32000,
) -> list[dict]:
    """Trace records of running workload `name` to completion through the reference scheduler.

    num_blocks None gives every running request room for max_model_len (no preemption);
    fewer blocks make the scheduler preempt, as a full cache would.
    """
    import numpy as np

    # The engine package imports the model stack (torch); only synthesis needs it.
    from graphrunner.engine.batch_trace import batch_record
    from graphrunner.engine.scheduler import Scheduler

    wl = _workload(name, num_requests, max_model_len)
    rng = np.random.default_rng(seed)
    if num_blocks is None:
        num_blocks = max_num_seqs * -(-max_model_len // block_size)
    scheduler = Scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        vocab_size=vocab_size,
        # Decodes of q = 1 + k tokens; the tokenless runner rejects every draft (one token
        # per step), which changes how long requests run, not the shape of a step.
        num_speculative_tokens=uniform_decode_query_len - 1,
    )
    runner = TokenlessRunner(vocab_size, rng)
    pending = [_request(wl, rng, max_model_len, vocab_size) for _ in range(num_requests)]
    pending.reverse()  # pop() from the end takes them in order
    records: list[dict] = []
    next_id = 0
    while pending or scheduler.has_unfinished_requests():
        # The first request arrives at step 0 so that the trace never starts idle.
        arrivals = max(int(rng.poisson(wl.arrivals_per_step)), 0 if next_id else 1)
        for _ in range(min(arrivals, len(pending))):
            prompt, params = pending.pop()
            scheduler.add_request(f"r{next_id}", prompt, params)
            next_id += 1
        if not scheduler.has_unfinished_requests():
            continue  # idle until the next arrival: an engine runs no step
        so = scheduler.schedule()
        if so.total_num_scheduled_tokens == 0:
            raise RuntimeError(f"workload {name!r}: the scheduler planned no tokens with requests live")
        records.append(batch_record(so, uniform_decode_query_len, None))
        scheduler.update_from_output(so, runner.step(so))
    return records


def _request(wl: Workload, rng: np.random.Generator, max_model_len: int, vocab_size: int):
    out_len = int(rng.integers(wl.output_len[0], wl.output_len[1] + 1))
    out_len = min(out_len, max_model_len - 1)
    prompt_len = int(rng.integers(wl.prompt_len[0], wl.prompt_len[1] + 1))
    prompt_len = max(1, min(prompt_len, max_model_len - out_len))
    prompt = rng.integers(0, vocab_size, size=prompt_len).tolist()
    return prompt, SamplingParams(max_tokens=out_len, ignore_eos=True)
