"""Token embedding and LM head, vocab-parallel under tensor parallelism.

Both own a [vocab, hidden] weight. With tied embeddings the model reuses the
`VocabEmbedding` as its head (`VocabEmbedding.logits`), so there is one tensor.

Vocab-parallel sharding (tp_size > 1): the vocabulary is padded up to a multiple of
tp_size and rank r holds rows [r * Vp, (r + 1) * Vp) with Vp = ceil(vocab / tp_size)
(padding rows are zero). The embedding looks up only its own rows (others read as 0)
and all-reduces; the head computes its [R, Vp] slice of the logits and all-gathers
them, so every TP rank holds the full [R, vocab] logits and samples the same tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.config import KernelConfig
from graphrunner.distributed.comm import TPComm
from graphrunner.layers.linear import linear_method
from graphrunner.sample.argmax import argmax_rows
from graphrunner.sample.greedy_head import greedy_head_fits, greedy_head_serves, greedy_head_triton


class _VocabParallel(nn.Module):
    """Owns this rank's [Vp, hidden] slice of a [vocab, hidden] matrix."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device, tp: TPComm | None,
                 kernel: KernelConfig | None) -> None:
        super().__init__()
        self.tp = tp or TPComm()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.rows_per_rank = -(-vocab_size // self.tp.size)
        self.vocab_start = self.tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        kernel = kernel or KernelConfig()
        self.method = linear_method(kernel, self.weight)  # the head's projection
        # KernelConfig.greedy_head, where the fused kernel can serve this head (one rank, CUDA, half precision)
        self.fused_greedy = kernel.greedy_head and self.tp.size == 1 and greedy_head_fits(self.weight)

    def checkpoint_shape(self, param: str = "weight", shard_id=None) -> tuple[int, int]:
        if param != "weight" or shard_id is not None:
            raise ValueError(f"{type(self).__name__} has only 'weight', got {param!r}/{shard_id!r}")
        return (self.vocab_size, self.hidden_size)

    @torch.no_grad()
    def load_shard(self, param: str, tensor: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full [vocab, hidden] tensor; zero the padding rows."""
        self.checkpoint_shape(param, shard_id)
        n = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        if n:
            self.weight[:n].copy_(tensor.narrow(0, self.vocab_start, n))
        self.weight[n:].zero_()

    def greedy(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> out [R]
        """out = argmax of `logits(hidden)`: one rank holding the whole head fuses the argmax into
        the head's GEMM (no logits written: sample/greedy_head.py); TP ranks gather logits first."""
        if self.fused_greedy and greedy_head_serves(hidden, self.weight):
            return greedy_head_triton(hidden, self.weight, out)
        return argmax_rows(self.logits(hidden), out=out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        """Project onto the (gathered) vocabulary: every TP rank gets the full logits."""
        if self.tp.size == 1:
            return self.method.logits(hidden, self.weight)
        local = self.method.linear(hidden, self.weight)  # [R, Vp] in the model dtype, as HF
        return self.tp.gather_last_dim(local)[:, : self.vocab_size].float()


class VocabEmbedding(_VocabParallel):
    """input_ids [T] (int32 or int64) -> embeddings [T, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device=None,
                 tp: TPComm | None = None, kernel: KernelConfig | None = None) -> None:
        super().__init__(vocab_size, hidden_size, dtype=dtype, device=device, tp=tp, kernel=kernel)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        # Masked lookup: ids outside this rank's rows read row 0 and are zeroed; the
        # all-reduce then sums exactly one non-zero contribution per token.
        local = input_ids.long() - self.vocab_start  # [T]
        mine = (local >= 0) & (local < self.rows_per_rank)
        emb = F.embedding(local * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(emb)


class LMHead(_VocabParallel):
    """Untied LM head: hidden [R, hidden] -> logits [R, vocab] float32."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device=None,
                 tp: TPComm | None = None, kernel: KernelConfig | None = None) -> None:
        super().__init__(vocab_size, hidden_size, dtype=dtype, device=device, tp=tp, kernel=kernel)


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [R, H] x [V, H] -> [R, V] fp32
    """The fp32 logits of a single-rank head with `weight` under the default `KernelConfig`
    (`LinearMethod.logits`)."""
    return linear_method(KernelConfig(), weight).logits(hidden, weight)
