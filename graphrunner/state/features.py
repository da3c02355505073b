"""Which parts of the sampling pipeline a batch needs, decided on the host.

`SamplingFeatures` selects code paths, so it is static per captured graph; the three
captured variants (greedy, sampled, all) are three values of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Logprob counts are rounded up to one of these, so a batch's K takes few values and
# graphs stay few. Counts above the last bucket round up to `max_logprobs`.
LOGPROB_BUCKETS = (0, 1, 5, 20)
DEFAULT_MAX_LOGPROBS = 20
NO_LOGPROBS = -1


def round_logprobs(k: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> int:
    """The bucket a logprob count runs at: the smallest bucket >= k (or max_logprobs)."""
    if k < 0:
        return NO_LOGPROBS
    for bucket in LOGPROB_BUCKETS:
        if k <= bucket:
            return max(k, min(bucket, max_logprobs))
    return max(k, max_logprobs)


@dataclass(frozen=True)
class SamplingFeatures:
    """Which parts of the pipeline a batch needs (decided on the host from mirrors).

    They select code paths, so they are static per captured graph. Every stage is
    neutral for a row that does not use it, so `all_on()` gives the same tokens (and
    logprobs, for the k a row asked for) as the exact features of any batch.
    `SamplingFeatures()` is plain greedy: argmax of the raw logits and nothing else.
    """

    any_random: bool = False  # some row has temperature > 0
    any_top_k: bool = False  # a random row has 0 < top_k < V
    any_top_p: bool = False  # a random row has top_p < 1
    any_min_p: bool = False  # a random row has min_p > 0
    any_penalties: bool = False  # repetition / frequency / presence on some row
    any_logit_bias: bool = False  # logit_bias or allowed_token_ids on some row
    any_min_tokens: bool = False  # min_tokens > 0 (with ids to mask) on some row
    num_logprobs: int = NO_LOGPROBS  # bucketed max k of the batch; -1 = no logprobs
    # Derived tests a step reads on its host path, as attributes (no Python call each; not part of the key).
    is_plain_greedy: bool = field(init=False, repr=False, compare=False)  # argmax of the raw logits is all
    wants_logprobs: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        flags = (self.any_random, self.any_top_k, self.any_top_p, self.any_min_p, self.any_penalties,
                 self.any_logit_bias, self.any_min_tokens)
        object.__setattr__(self, "wants_logprobs", self.num_logprobs >= 0)
        object.__setattr__(self, "is_plain_greedy", not any(flags) and self.num_logprobs == NO_LOGPROBS)

    @classmethod
    def all_on(cls, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplingFeatures:
        """A superset of every batch's features (the ALL_FEATURES graph variant)."""
        return cls(True, True, True, True, True, True, True, round_logprobs(max_logprobs, max_logprobs))

    @classmethod
    def sampled_only(cls) -> SamplingFeatures:
        """Temperature, top-k, top-p and min-p with seeds, nothing else: the SAMPLED graph
        variant, which serves plain random sampling without paying for penalties, logit
        bias, allowed ids, min_tokens or logprobs (several [R, V] passes each)."""
        return cls(True, True, True, True)

    @property
    def needs_history(self) -> bool:
        """Whether the sampler reads the token history (penalties) or output counts."""
        return self.any_penalties or self.any_min_tokens

    @property
    def is_plain_sampling(self) -> bool:
        """Only temperature / top-k / top-p / min-p (the SAMPLED graph variant serves it)."""
        return not (self.any_penalties or self.any_logit_bias or self.any_min_tokens or self.wants_logprobs)

    def graph_variant(self, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> SamplingFeatures:
        """The captured variant that serves this batch: GREEDY, SAMPLED or ALL_FEATURES."""
        if self.is_plain_greedy:
            return SamplingFeatures()
        if self.is_plain_sampling:
            return SamplingFeatures.sampled_only()
        return SamplingFeatures.all_on(max_logprobs)
