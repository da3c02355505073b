"""graphrunner: an LLM model runner built for CUDA graphs.

Engines import `ModelRunner` and the protocol types; `LLM` is the reference engine's
offline API, with vLLM's input and output types. Heavy modules load lazily (on first
attribute access) so that `import graphrunner` stays cheap; type checkers see every export
through the `TYPE_CHECKING` imports below.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING

from graphrunner.protocol import (
    CachedRequestData,
    Logprob,
    LoRARequest,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from graphrunner.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from graphrunner.engine.llm import LLM
    from graphrunner.engine.prompts import TextPrompt, TokensPrompt
    from graphrunner.engine.request import CompletionOutput, RequestMetrics, RequestOutput
    from graphrunner.runner import ModelRunner


def _version() -> str:
    """The installed distribution's version; pyproject.toml's when run from a bare checkout."""
    try:
        return metadata.version("graphrunner")
    except metadata.PackageNotFoundError:
        return "0.1.0"  # keep in step with pyproject.toml [project] version


__version__ = _version()

__all__ = [
    "LLM",
    "ModelRunner",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "TextPrompt",
    "TokensPrompt",
    "Logprob",
    "LoRARequest",
    "SchedulerOutput",
    "NewRequestData",
    "CachedRequestData",
    "ModelRunnerOutput",
]

# The lazily loaded names and their modules.
_LAZY = {
    "LLM": "graphrunner.engine.llm",
    "ModelRunner": "graphrunner.runner",
    "RequestOutput": "graphrunner.engine.request",
    "CompletionOutput": "graphrunner.engine.request",
    "RequestMetrics": "graphrunner.engine.request",
    "BeamSearchParams": "graphrunner.engine.beam_search",
    "BeamSearchOutput": "graphrunner.engine.beam_search",
    "BeamSearchSequence": "graphrunner.engine.beam_search",
    "TextPrompt": "graphrunner.engine.prompts",
    "TokensPrompt": "graphrunner.engine.prompts",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
