"""PoolingParams: what a pooling request asks of its pooled vector (vLLM's names and meaning).

Plain host data, no torch: the engine builds one per request and the runner applies it to the
request's pooled vector after the step (`graphrunner.pool.runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

# The tasks a pooling request names (vLLM's): an embedding, class probabilities, a cross-encoder
# score, or the raw pooled vector.
POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass(frozen=True)
class PoolingParams:
    """Per-request pooling settings (vLLM's `PoolingParams`).

    dimensions: keep the first `dimensions` components of the embedding (Matryoshka models),
        before normalisation; None keeps them all.
    normalize: L2-normalise the embedding; None takes the model's default (its `modules.json`
        `Normalize` module, or True when it has no such file).
    activation: classification and scores: softmax over the labels (sigmoid for one label);
        None or True applies it, False returns the raw logits.
    task: set by the engine ("embed", "classify", "score" or "encode"); None: the model's own.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions={d!r} must be None or an int >= 1")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be None or a bool")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task={self.task!r}; allowed: {list(POOLING_TASKS)}")

    def clone(self) -> PoolingParams:
        """A copy (vLLM's name); the params are immutable, so this is the same value."""
        return PoolingParams(self.dimensions, self.normalize, self.activation, self.task)
