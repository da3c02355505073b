"""graphrunner: an LLM model runner built for CUDA graphs.

Engines import `ModelRunner` and the protocol types; `LLM` is the reference engine's
offline API. Heavy modules load lazily so that `import graphrunner` stays cheap.
"""

from importlib import metadata

from graphrunner.protocol import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)


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
