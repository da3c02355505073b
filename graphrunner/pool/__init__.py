"""Pooling models: embeddings, classification and cross-encoder scores (vLLM's `runner="pooling"`).

A pooling step is a prefill without the sampler: the step body forwards the prompt, pools one
vector per request (`pooler`) into a persistent buffer, and the runner hands it back as
`ModelRunnerOutput.pooler_output`. It runs through the same dispatch table, FULL and PIECEWISE
graphs as a generative step. Heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from graphrunner.pool.params import POOLING_TASKS, PoolingParams

if TYPE_CHECKING:
    from graphrunner.pool.config import PoolerConfig
    from graphrunner.pool.runner import PoolingRunner

__all__ = ["POOLING_TASKS", "PoolerConfig", "PoolingParams", "PoolingRunner"]

_HOME = {"PoolerConfig": "graphrunner.pool.config", "PoolingRunner": "graphrunner.pool.runner"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'graphrunner.pool' has no attribute {name!r}")
