"""Speculative decoding in `inspect table` / `explain`: which descriptors verify drafts.

With k = num_speculative_tokens > 0 a decoding request is scheduled with q = 1 + k
tokens (its last sampled token and k draft slots), so the uniform-decode descriptors
have q = 1 + k tokens per request: those are the verifying descriptors. Every step of a
speculative runner verifies and drafts inside its step body, so a mixed FULL graph holds
both too (for the decodes of a mixed batch), while PIECEWISE graphs hold only the model's
pieces (verification and drafting run eagerly around them). Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capture.descriptor import BatchExecutionDescriptor
from capture.dispatch import DispatchTable, Explanation

_LISTED = 4  # verifying descriptors named one by one in a header line; more show as a range


@dataclass(frozen=True)
class Speculation:
    """k and, where known, the drafter (method None: only k was given)."""

    num_speculative_tokens: int = 0
    method: str | None = None
    draft_model: str | None = None

    @classmethod
    def from_config_text(cls, text: str | None) -> Speculation:
        """From `--speculative-config` JSON (checked by `SpeculativeConfig`); None: off."""
        if text is None:
            return cls()
        from graphrunner.config import SpeculativeConfig

        config = SpeculativeConfig.from_dict(text)
        return cls(config.num_speculative_tokens, config.method, config.model)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def q(self) -> int:
        """The uniform decode query length, 1 + k."""
        return 1 + self.k

    @property
    def label(self) -> str:
        if self.method is None:
            return f"k={self.k}"
        has_model = self.method in ("draft_model", "eagle", "eagle3")  # a draft model or an EAGLE head
        drafter = f"{self.method} {self.draft_model}" if has_model else self.method
        return f"{drafter}, k={self.k}"

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "draft_model": self.draft_model, "num_speculative_tokens": self.k,
                "uniform_decode_query_len": self.q, "draft_slots_per_decode": self.k}


def _decodes(n: int) -> str:
    return f"{n} decode" + ("" if n == 1 else "s")


def is_verifying(desc: BatchExecutionDescriptor, q: int) -> bool:
    """A uniform-decode descriptor whose every request verifies q - 1 > 0 drafts."""
    return q > 1 and desc.uniform_token_count == q


def descriptor_role(desc: BatchExecutionDescriptor, k: int) -> str:
    """What a descriptor's graph does with drafts ("" without speculation)."""
    if k == 0 or desc.is_eager:
        return ""
    if is_verifying(desc, 1 + k):
        assert desc.num_reqs is not None
        return f"verifying: {_decodes(desc.num_reqs)} x (1 + {k} draft slots); drafts the next {k} in the graph"
    if desc.is_full:
        return "mixed: verifies the drafts of its decodes; drafts in the graph"
    return "model pieces only: verification and drafting run eagerly"


def verifying_summary(table: DispatchTable, k: int) -> str:
    """Which descriptors verify drafts, or why none is dedicated to it."""
    q = 1 + k
    keys = [str(d) for d in table.descriptors if is_verifying(d, q)]
    if keys:
        shown = ", ".join(keys) if len(keys) <= _LISTED else f"{keys[0]} ... {keys[-1]}"
        return f"{len(keys)} descriptors (q={q}): {shown}"
    if any(d.is_full for d in table.descriptors):
        return (f"none dedicated: mode {table.mode.name} has no separate decode graphs; its mixed FULL graphs take "
                f"q={q} decode batches and verify in them")
    return f"none: mode {table.mode.name} captures no FULL graph, so verification and drafting run eagerly"


def table_lines(spec: Speculation, table: DispatchTable) -> list[str]:
    """The speculative lines of a table header (none without speculation)."""
    if spec.k == 0:
        return []
    return [
        f"speculative:    {spec.label}: uniform decode query length q = 1 + {spec.k} = {spec.q} "
        f"(a decode's last sampled token + {spec.k} draft slots)",
        f"verifying:      {verifying_summary(table, spec.k)}",
    ]


def table_summary(spec: Speculation, table: DispatchTable) -> dict[str, Any] | None:
    if spec.k == 0:
        return None
    return {**spec.to_dict(),
            "verifying_descriptors": [str(d) for d in table.descriptors if is_verifying(d, spec.q)]}


def explain_summary(spec: Speculation, exp: Explanation) -> dict[str, Any] | None:
    if spec.k == 0:
        return None
    verifying = exp.uniform_token_count == spec.q
    return {
        **spec.to_dict(),
        "decodes": exp.num_reqs if verifying else None,
        "draft_tokens_verified": exp.num_reqs * spec.k if verifying else None,
        "verifying_descriptor": is_verifying(exp.chosen, spec.q),
    }


def explain_lines(spec: Speculation, exp: Explanation) -> list[str]:
    """How a batch's drafts are verified: each decode carries k draft slots (none without speculation)."""
    k, q = spec.k, spec.q
    if k == 0:
        return []
    head = f"speculative:    {spec.label}: each decode carries 1 + {k} draft slots (q={q})"
    chosen = exp.chosen
    if exp.uniform_token_count == q:
        where = (f"the verifying graph {chosen}" if is_verifying(chosen, q)
                 else f"{chosen}" + (" (eager)" if chosen.is_eager else ""))
        return [f"{head}: {_decodes(exp.num_reqs)} verify {exp.num_reqs * k} draft tokens in {where}, "
                f"which also drafts the next {k} per decode"]
    lines = [f"{head}; not a uniform q={q} decode batch, so it runs as a mixed one: its decodes ({q} tokens "
             "each) verify their drafts there, prefill chunks carry none"]
    given = exp.uniform_token_count or (1 if exp.num_tokens == exp.num_reqs else None)
    if given is not None:  # every request has `given` tokens: decodes described without their drafts?
        lines.append(f"note:           with k={k} a decode is scheduled as {q} tokens, not {given}: describe "
                     f"decodes with --query-lens of {q} or --uniform {q}")
    return lines
