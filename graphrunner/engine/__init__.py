"""Reference engine: block allocator, continuous-batching scheduler, offline `LLM` API.

It drives `graphrunner.ModelRunner` only through the runner's public API, as an outside
engine would; it doubles as the runner's end-to-end test harness and example.

The names load on first use, so that importing a submodule (`graphrunner.engine.cli`, which
`graphrunner --help` builds) does not import torch; type checkers see them through the
`TYPE_CHECKING` imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graphrunner.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from graphrunner.engine.block_allocator import BlockAllocator
    from graphrunner.engine.llm import LLM
    from graphrunner.engine.prompts import TextPrompt, TokensPrompt
    from graphrunner.engine.request import (
        CompletionOutput,
        Request,
        RequestMetrics,
        RequestOutput,
        RequestStatus,
    )
    from graphrunner.engine.scheduler import Scheduler

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "BlockAllocator",
           "CompletionOutput", "Request", "RequestMetrics", "RequestOutput", "RequestStatus", "Scheduler",
           "TextPrompt", "TokensPrompt"]

_HOME = {
    "LLM": "graphrunner.engine.llm",
    "BeamSearchOutput": "graphrunner.engine.beam_search",
    "BeamSearchParams": "graphrunner.engine.beam_search",
    "BeamSearchSequence": "graphrunner.engine.beam_search",
    "BlockAllocator": "graphrunner.engine.block_allocator",
    "CompletionOutput": "graphrunner.engine.request",
    "Request": "graphrunner.engine.request",
    "RequestMetrics": "graphrunner.engine.request",
    "RequestOutput": "graphrunner.engine.request",
    "RequestStatus": "graphrunner.engine.request",
    "Scheduler": "graphrunner.engine.scheduler",
    "TextPrompt": "graphrunner.engine.prompts",
    "TokensPrompt": "graphrunner.engine.prompts",
}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'graphrunner.engine' has no attribute {name!r}")
