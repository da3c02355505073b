"""Token embedding and LM head.

Both own a [vocab, hidden] weight. With tied embeddings the model reuses the
`VocabEmbedding` as its head (`VocabEmbedding.logits`), so there is one tensor.
Vocab-parallel sharding is the tensor-parallel seam here; only tp_size=1 exists today.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_tp(tp_size: int, what: str) -> None:
    if tp_size != 1:
        raise NotImplementedError(f"{what} with tp_size={tp_size}: vocab-parallel sharding is not implemented (only 1)")


class VocabEmbedding(nn.Module):
    """input_ids [T] (int32 or int64) -> embeddings [T, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device=None, tp_size: int = 1) -> None:
        super().__init__()
        _check_tp(tp_size, "VocabEmbedding")
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        """Tied LM head: project onto the embedding matrix."""
        return lm_logits(hidden, self.weight)


class LMHead(nn.Module):
    """Untied LM head: hidden [R, hidden] -> logits [R, vocab] float32."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device=None, tp_size: int = 1) -> None:
        super().__init__()
        _check_tp(tp_size, "LMHead")
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        return lm_logits(hidden, self.weight)


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the model dtype (as HF); the sampler gets fp32 logits.
    return F.linear(hidden, weight).float()
