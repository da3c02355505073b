"""Text in: a call's prompts (token-id lists or texts) checked and numbered before any is queued."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from graphrunner.engine.options import per_prompt_params
from graphrunner.protocol import SamplingParams


@dataclass(frozen=True)
class PlannedRequests:
    """A call's checked requests, not queued yet: ids, token-id prompts and params, in prompt order."""

    all_ids: list[str]
    prompts: list[Sequence[int]]
    params: list[SamplingParams]


def plan_requests(
    prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None, tokenizer: Any | None,
    first_id: int, check: Callable[[str, Sequence[int], SamplingParams], None],
) -> PlannedRequests:
    """Tokenize the prompts, pair them with their params and ids (`first_id`, `first_id + 1`, ...:
    global prompt numbers, identical whatever the DP layout) and `check` every one before any
    is queued, so that a bad request raises here and never becomes live."""
    token_prompts = tokenize_prompts(prompts, tokenizer)
    params = per_prompt_params(sampling_params, len(token_prompts))
    all_ids = [str(first_id + i) for i in range(len(token_prompts))]
    for i, req_id in enumerate(all_ids):
        check(req_id, token_prompts[i], params[i])
    return PlannedRequests(all_ids, token_prompts, params)


def tokenize_prompts(prompts: Any, tokenizer: Any | None) -> list[Sequence[int]]:
    """`generate`'s prompts as token-id lists: a text (one prompt) or a list of texts and
    token-id lists; texts are encoded with the tokenizer (vLLM's `tokenizer.encode(text)`).

    TypeError for a flat list of ints or bytes; ValueError naming the prompt when a text
    comes without a tokenizer.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, bytes) or (len(prompts) and isinstance(prompts[0], numbers.Integral)):
        raise TypeError("prompts must be a list of token-id lists (or of texts), one per prompt")
    out: list[Sequence[int]] = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            out.append(prompt)
        elif tokenizer is None:
            raise ValueError(f"prompt {i} is text ({prompt[:32]!r}), which needs a tokenizer, and this model has "
                             "none (builtin models never do): a prompt must be a list of token ids")
        else:
            out.append(list(tokenizer.encode(prompt)))
    return out
