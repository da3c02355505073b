"""Speculative decoding, graph-safe: drafters (n-gram, a draft model) propose k tokens per request and
rejection sampling verifies them, inside the step body and its graph (`step.SpeculativeStep`)."""

from graphrunner.spec_decode.ngram import propose_ngram, propose_ngram_torch, propose_ngram_triton
from graphrunner.spec_decode.rejection import PAD_TOKEN_ID, rejection_sample

__all__ = ["PAD_TOKEN_ID", "propose_ngram", "propose_ngram_torch", "propose_ngram_triton", "rejection_sample"]
