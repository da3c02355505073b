"""Text in: a call's prompts (token-id lists, texts or vLLM's prompt dicts) checked and numbered
before any is queued, and each prompt's scheduler requests (one, or n / best_of for parallel sampling).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from graphrunner.engine.bad_words import bad_words_token_ids
from graphrunner.engine.options import per_prompt_params
from graphrunner.engine.request import RequestExtras
from graphrunner.protocol import LOGIT_BIAS_MAX, SEED_MAX, SEED_MIN, SamplingParams

if TYPE_CHECKING:
    from graphrunner.multimodal.inputs import InputProcessor

# The bias that bans a bad word's token: no logit comes near it, and it stays finite in float32.
BANNED_BIAS = -LOGIT_BIAS_MAX


class TextPrompt(TypedDict):
    """A text prompt as a dict (vLLM's `TextPrompt`): `{"prompt": "Hello"}`."""

    prompt: str


class TokensPrompt(TypedDict):
    """A token-id prompt as a dict (vLLM's `TokensPrompt`): `{"prompt_token_ids": [1, 2, 3]}`."""

    prompt_token_ids: list[int]


# A prompt: a text, token ids, or a prompt dict (LLM.chat's carry both keys; vLLM's `EmbedsPrompt`
# {"prompt_embeds": tensor}; a text or token-id prompt with "multi_modal_data": {"image": ...}).
PromptType = str | TextPrompt | TokensPrompt | Sequence[int] | Mapping[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_INPUT_KEYS = ("prompt_embeds", "multi_modal_data")  # handled by the model's input processor


@dataclass(frozen=True)
class PlannedRequests:
    """A call's checked requests, not queued yet: ids, token-id prompts and params, in prompt order."""

    all_ids: list[str]
    prompts: list[Sequence[int]]
    params: list[SamplingParams]
    texts: list[str | None]  # each prompt's text (None for token ids)
    # Per prompt, its scheduler requests: (id, params): one, or n (best_of) with derived seeds.
    children: list[list[tuple[str, SamplingParams]]]
    # Per prompt, what its requests hand the runner besides token ids (prompt embeddings, images).
    extras: list[RequestExtras] = field(default_factory=list)


def plan_requests(
    prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None, tokenizer: Any | None,
    first_id: int, check: Callable[[str, Sequence[int], SamplingParams], None],
    request_ids: list[str] | None = None, inputs: InputProcessor | None = None,
) -> PlannedRequests:
    """Tokenize the prompts, pair them with their params and ids (`first_id`, `first_id + 1`, ...:
    global prompt numbers, identical whatever the DP layout; or `request_ids`) and `check` every
    scheduler request before any is queued, so that a bad one raises here and never becomes live."""
    texts, token_prompts, extras = split_prompts_with_extras(prompts, tokenizer, inputs)
    params = per_prompt_params(sampling_params, len(token_prompts))
    all_ids = request_ids if request_ids is not None else [str(first_id + i) for i in range(len(token_prompts))]
    children = []
    for i, req_id in enumerate(all_ids):
        children.append(child_requests(req_id, params[i], tokenizer))
        for child_id, child_params in children[-1]:
            check(child_id, token_prompts[i], child_params)
    return PlannedRequests(all_ids, token_prompts, params, texts, children, extras)


def child_requests(request_id: str, params: SamplingParams, tokenizer: Any | None) -> list[tuple[str, SamplingParams]]:
    """A prompt's scheduler requests: itself (n == 1), or `best_of or n` children with ids
    "{i}_{request_id}", each with n=1 and, when `params.seed` is set, seed + i (vLLM's
    derivation, wrapped into int64), so child i equals a separate request with that seed.
    best_of > n computes the sampled tokens' logprobs (to rank the children)."""
    count = params.best_of or params.n
    base = dataclasses.replace(params, n=1, best_of=None, **_with_bad_words(params, tokenizer))
    if count > params.n and base.logprobs is None:
        base = dataclasses.replace(base, logprobs=0)
    if count == 1:
        return [(request_id, base)]
    return [(f"{i}_{request_id}", base if params.seed is None else dataclasses.replace(base, seed=derived_seed(
        params.seed, i))) for i in range(count)]


def derived_seed(seed: int, index: int) -> int:
    """Child `index`'s seed: seed + index, wrapped into the int64 range the runner keeps seeds in."""
    return (seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN


def _with_bad_words(params: SamplingParams, tokenizer: Any | None) -> dict[str, Any]:
    """The child fields that carry `bad_words` to the runner (engine/bad_words.py): a word of one
    token banned through `logit_bias`, one of several tokens through `bad_words_token_ids`."""
    if not params.bad_words:
        return {"bad_words": ()}
    if tokenizer is None:
        raise ValueError(f"bad_words={list(params.bad_words)} needs a tokenizer to find the words' tokens, "
                         "and this model has none")
    bias = dict(params.logit_bias or {})
    sequences = list(params.bad_words_token_ids)
    for seq in bad_words_token_ids(params.bad_words, tokenizer):
        if len(seq) == 1:
            bias[seq[0]] = BANNED_BIAS
        elif tuple(seq) not in sequences:
            sequences.append(tuple(seq))
    return {"bad_words": (), "logit_bias": bias or None, "bad_words_token_ids": tuple(sequences)}


def split_prompts(prompts: Any, tokenizer: Any | None) -> tuple[list[str | None], list[Sequence[int]]]:
    """(each prompt's text or None, its token ids) for `generate`'s prompts: a text or prompt dict
    (one prompt), or a list of texts, token-id lists and prompt dicts (see `tokenize_prompts`)."""
    texts, token_prompts, _ = split_prompts_with_extras(prompts, tokenizer, None)
    return texts, token_prompts


def split_prompts_with_extras(prompts: Any, tokenizer: Any | None, inputs: InputProcessor | None,
                              ) -> tuple[list[str | None], list[Sequence[int]], list[RequestExtras]]:
    """`split_prompts`, and each prompt's `RequestExtras`: prompt dicts with "prompt_embeds" or
    "multi_modal_data" go through `inputs` (the model's input processor), which gives their token
    ids (placeholders expanded) and what the runner receives besides; ValueError without one."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    prompts = prompt_list(prompts)
    texts: list[str | None] = []
    unwrapped: list[Any] = []
    special: dict[int, Mapping] = {}
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, Mapping):
            text = _dict_prompt(i, prompt)
            if any(key in prompt for key in _INPUT_KEYS):
                if inputs is None:
                    raise ValueError(f"prompt {i}: prompt_embeds needs LLM(..., enable_prompt_embeds=True)"
                                     if "prompt_embeds" in prompt else
                                     f"prompt {i}: multi_modal_data {sorted(prompt['multi_modal_data'])} given, but "
                                     "the model is text-only")
                special[i] = prompt
                unwrapped.append(prompt.get("prompt_token_ids", text if text is not None else []))
            else:
                unwrapped.append(prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else text)
        else:
            text = prompt if isinstance(prompt, str) else None
            unwrapped.append(prompt)
        texts.append(text)
    token_prompts = tokenize_prompts(unwrapped, tokenizer)
    extras = [RequestExtras()] * len(token_prompts)
    for i, prompt in special.items():
        assert inputs is not None
        token_prompts[i], extras[i] = inputs(i, prompt, list(token_prompts[i]))
    return texts, token_prompts, extras


def prompt_list(prompts: Any) -> list[Any]:
    """A call's prompts as a list: a list or tuple of prompts, or any other ordered iterable (a
    generator is read once, here). TypeError for None, an unordered set, bytes, or a flat list of
    token ids (one prompt's ids must come as a list of them)."""
    if isinstance(prompts, (set, frozenset, bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a prompt or a list of prompts (token-id lists, texts or prompt dicts), "
                        f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], numbers.Integral):
        raise TypeError("prompts must be a list of token-id lists (or of texts), one per prompt")
    return prompts


def _token_ids(i: int, prompt: Any) -> Any:
    """Prompt `i`'s token ids: a list, tuple, range or numpy array (an ordered sequence). Sets
    have no order, and bytes / bytearray are raw bytes, not token ids: TypeError."""
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise TypeError(f"prompt {i}: token ids must be a list (or tuple, or numpy array) of ints, "
                        f"got {type(prompt).__name__}")
    return prompt


def _dict_prompt(i: int, prompt: Mapping) -> str | None:
    """Check prompt dict `i` (vLLM's TextPrompt / TokensPrompt); its text, or None for token ids.
    A dict with both keys runs its token ids and reports its text (as `LLM.chat` builds them)."""
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS) - set(_INPUT_KEYS))
    if unknown:
        raise ValueError(f"prompt {i}: keys {unknown} are not supported; a prompt dict has 'prompt' (a text) "
                         "or 'prompt_token_ids' (token ids), maybe with 'multi_modal_data'; or 'prompt_embeds'")
    if "prompt_embeds" in prompt and ("prompt_token_ids" in prompt or "multi_modal_data" in prompt):
        raise ValueError(f"prompt {i}: 'prompt_embeds' replaces the prompt's token ids and images: give it alone")
    if "prompt" not in prompt and "prompt_token_ids" not in prompt and "prompt_embeds" not in prompt:
        raise ValueError(f"prompt {i}: a prompt dict needs 'prompt' (a text) or 'prompt_token_ids', got no key")
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise TypeError(f"prompt {i}: 'prompt' must be a text, got {type(prompt['prompt']).__name__}")
    if isinstance(prompt.get("prompt_token_ids"), str):
        raise TypeError(f"prompt {i}: 'prompt_token_ids' must be a list of token ids, got a text")
    return prompt.get("prompt")


def tokenize_prompts(prompts: Any, tokenizer: Any | None) -> list[Sequence[int]]:
    """`generate`'s prompts as token-id lists: a text (one prompt) or a list of texts and
    token-id lists; texts are encoded with the tokenizer (vLLM's `tokenizer.encode(text)`).

    TypeError for a flat list of ints or bytes; ValueError naming the prompt when a text
    comes without a tokenizer.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = prompt_list(prompts)
    out: list[Sequence[int]] = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            out.append(_token_ids(i, prompt))
        elif tokenizer is None:
            raise ValueError(f"prompt {i} is text ({prompt[:32]!r}), which needs a tokenizer, and this model has "
                             "none (builtin models never do): a prompt must be a list of token ids")
        else:
            out.append(list(tokenizer.encode(prompt)))
    return out
