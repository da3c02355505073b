"""Structured outputs at the runner's boundary, in vLLM's shapes (no dependency on a grammar library).

`StructuredOutputsParams` is what a request asks for (`SamplingParams.structured_outputs`): exactly
one of a JSON schema, a regular expression, a list of choices or an EBNF grammar. The engine
compiles it (graphrunner.engine.structured, through xgrammar) and, every step, hands the runner a
`GrammarOutput`: the ids of the step's requests that follow a grammar and their packed bitmask rows,
`[num_rows, ceil(vocab / 32)]` int32, bit `v % 32` of word `v // 32` set where token v is allowed.
Without speculative decoding that is one row per id. With it (vLLM's layout) a request takes
`1 + len(scheduled_spec_decode_tokens[req_id])` consecutive rows, in the order of the ids: row j is
the mask of the token sampled after its drafts 0..j-1 (the grammar state once they are accepted).
The runner applies them to the logits before sampling, inside every graph variant.
"""

from __future__ import annotations

import json as _json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["GrammarOutput", "StructuredOutputsParams", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one packed bitmask row for `vocab_size` tokens."""
    return -(-vocab_size // 32)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names): `json` (a JSON schema, dict or text), `regex`,
    `choice` (the output is one of these strings) or `grammar` (EBNF). ValueError otherwise."""

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, str):  # a dict schema: kept as canonical text
            object.__setattr__(self, "json", _json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            choice = tuple(self.choice) if not isinstance(self.choice, str) else None
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"structured_outputs choice={self.choice!r} must be a non-empty list of non-empty "
                                 "strings")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name}={value!r} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice" or "grammar"."""
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


@dataclass
class GrammarOutput:
    """One step's grammar masks (vLLM's `GrammarOutput`): the rows of `grammar_bitmask` belong to
    `structured_output_request_ids` in order, 1 + (the request's scheduled drafts) rows each (one
    without speculation; the runner checks the count); requests of the step not listed are
    unconstrained."""

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray  # [sum over ids of (1 + drafts), ceil(V / 32)] int32
    # The torch tensor whose memory `grammar_bitmask` is, when the engine filled it in a pinned host
    # block (`graphrunner.state.staging.host_buffer`): the runner uploads it as is, without a copy.
    pinned: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        mask = np.asarray(self.grammar_bitmask)
        if self.pinned is not None and (tuple(self.pinned.shape) != mask.shape or mask.size and
                                        self.pinned.data_ptr() != mask.__array_interface__["data"][0]):
            raise ValueError("GrammarOutput.pinned must be the tensor whose memory grammar_bitmask is")
        if mask.ndim != 2 or mask.shape[0] < len(self.structured_output_request_ids):
            raise ValueError(f"grammar_bitmask has shape {mask.shape}; expected [>= "
                             f"{len(self.structured_output_request_ids)}, words] (at least one row per request id)")
        if mask.dtype != np.int32:
            raise ValueError(f"grammar_bitmask has dtype {mask.dtype}; expected int32 (packed bits)")
        self.grammar_bitmask = mask
