"""Token sampling (graph-safe): settings per row, processors, filters, Gumbel-max, logprobs."""

from graphrunner.sample.logprobs import LogprobsTensors, PromptLogprobsCollector, compute_logprobs, prompt_logprobs
from graphrunner.sample.sampler import Sampler
from graphrunner.sample.states import SamplingFeatures, SamplingStates, default_seed

__all__ = [
    "LogprobsTensors",
    "PromptLogprobsCollector",
    "Sampler",
    "SamplingFeatures",
    "SamplingStates",
    "compute_logprobs",
    "default_seed",
    "prompt_logprobs",
]
