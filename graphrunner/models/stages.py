"""Which decoder layers a pipeline stage holds, and what stands for the others."""

from __future__ import annotations

from torch import nn

__all__ = ["MissingLayer", "pp_layer_range"]


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` holds: an even split, the remainder on
    the first stages (the last one also runs the norm and the head)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size={pp_size})")
    if num_layers < pp_size:
        raise ValueError(f"num_hidden_layers={num_layers} < pipeline_parallel_size={pp_size}: a stage would be empty")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class MissingLayer(nn.Module):
    """Stands for a decoder layer another pipeline stage holds (no parameters)."""

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("a layer of another pipeline stage was called")
