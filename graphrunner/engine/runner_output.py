"""Reading one step's `ModelRunnerOutput` against the plan it answers.

The scheduler applies an output only after these checks pass for the request at hand: a
runner that disagrees with the plan is a bug on one side, reported as RuntimeError
naming the request, what the runner sent and what the plan allows.
"""

from __future__ import annotations

from graphrunner.engine.request import Request
from graphrunner.protocol import ModelRunnerOutput


def output_entry(req: Request, runner_output: ModelRunnerOutput) -> tuple[int, list[int]]:
    """The request's index in the output and the tokens it emitted; keeps its prompt logprobs."""
    index = runner_output.req_id_to_index.get(req.req_id)
    if index is None:
        raise RuntimeError(f"runner output has no entry for scheduled request {req.req_id!r}")
    req.take_prompt_logprobs(runner_output)
    return index, runner_output.sampled_token_ids[index]


def check_partial_prefill(req: Request, sampled: list[int]) -> None:
    """A prefill chunk that did not reach the end of the known tokens samples nothing."""
    if sampled:
        raise RuntimeError(
            f"runner sampled {sampled} for request {req.req_id!r} whose prefill is partial "
            f"({req.num_computed_tokens}/{req.num_tokens} tokens computed)"
        )


def check_num_sampled(req: Request, sampled: list[int], most: int) -> None:
    """A chunk that reached the end of the known tokens emits 1..`most` tokens: 1 for a
    prefill chunk, 1 + its draft slots (the accepted drafts and one more) for a decode."""
    if not sampled:
        raise RuntimeError(
            f"runner sampled no token for request {req.req_id!r} although its chunk reached the end "
            f"of its {req.num_tokens} known tokens"
        )
    if len(sampled) > most:
        raise RuntimeError(
            f"runner emitted {len(sampled)} tokens {sampled} for request {req.req_id!r}; "
            f"its chunk can emit at most {most} (1 + its {most - 1} draft slots)"
        )


def token_logprobs(runner_output: ModelRunnerOutput, index: int, j: int) -> dict | None:
    """The logprobs of entry `index`'s j-th emitted token, if the step returned any."""
    if runner_output.logprobs is None:
        return None
    per_entry = runner_output.logprobs[index]
    return per_entry[j] if j < len(per_entry) else None
