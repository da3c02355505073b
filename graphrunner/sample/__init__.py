"""Token sampling (graph-safe): processors, filters, Gumbel-max, logprobs.

Per-row settings and the features a batch needs live in `graphrunner.state`.
"""

from graphrunner.sample.logprobs import LogprobsTensors, PromptLogprobsCollector, compute_logprobs, prompt_logprobs
from graphrunner.sample.sampler import Sampler

__all__ = [
    "LogprobsTensors",
    "PromptLogprobsCollector",
    "Sampler",
    "compute_logprobs",
    "prompt_logprobs",
]
