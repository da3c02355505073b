"""graphrunner: an LLM model runner built for CUDA graphs.

Engines import `ModelRunner` and the protocol types; `LLM` is the reference engine's
offline API. Heavy modules load lazily so that `import graphrunner` stays cheap.
"""

from graphrunner.protocol import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

__all__ = [
    "LLM",
    "ModelRunner",
    "RequestOutput",
    "SamplingParams",
    "SchedulerOutput",
    "NewRequestData",
    "CachedRequestData",
    "ModelRunnerOutput",
]


def __getattr__(name: str):
    if name == "LLM":
        from graphrunner.engine.llm import LLM

        return LLM
    if name == "RequestOutput":
        from graphrunner.engine.request import RequestOutput

        return RequestOutput
    if name == "ModelRunner":
        from graphrunner.runner import ModelRunner

        return ModelRunner
    raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
