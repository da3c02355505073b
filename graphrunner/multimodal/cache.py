"""EncoderCache: the runner's encoder outputs, keyed by the input's content hash (vLLM's name).

An image is encoded once, when the scheduler lists it in `scheduled_encoder_inputs`, and its
output ([num_tokens, hidden] on the device, in the decoder's dtype) stays until the scheduler
names its hash in `free_encoder_mm_hashes`: every request showing the same image, in the same
step or later ones, reads that one entry. `num_encoded` counts encoder runs (inputs encoded).
"""

from __future__ import annotations

import torch


class EncoderCache:
    """mm_hash -> encoder output [num_tokens, hidden]."""

    def __init__(self) -> None:
        self._outputs: dict[str, torch.Tensor] = {}
        self.num_encoded = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._outputs

    def __len__(self) -> int:
        return len(self._outputs)

    def get(self, mm_hash: str) -> torch.Tensor:
        out = self._outputs.get(mm_hash)
        if out is None:
            raise KeyError(f"encoder output {mm_hash!r} is not cached: the scheduler must list the input in "
                           "scheduled_encoder_inputs before (or in) the first step that reads its placeholders")
        return out

    def put(self, mm_hash: str, output: torch.Tensor) -> None:
        self._outputs[mm_hash] = output
        self.num_encoded += 1

    def free(self, mm_hashes: list[str]) -> None:
        """Drop entries (vLLM's `free_encoder_mm_hashes`); unknown hashes are ignored."""
        for h in mm_hashes:
            self._outputs.pop(h, None)
