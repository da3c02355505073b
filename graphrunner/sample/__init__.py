"""Token sampling (graph-safe)."""

from graphrunner.sample.sampler import Sampler, SamplingFeatures, SamplingStates

__all__ = ["Sampler", "SamplingFeatures", "SamplingStates"]
