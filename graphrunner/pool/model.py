"""LlamaForPooling: a Llama-family decoder without its LM head, pooled per prompt.

The decoder is `LlamaForCausalLM`'s (the same layers, kernels, attention op and compiled pieces);
only the head differs. An embedder pools the final hidden states (`pool.pooler`); a classifier
(`*ForSequenceClassification`) projects the pooled state through its `score` head [labels, hidden].
Checkpoints saved from a bare decoder (`Qwen3Model`: Qwen3-Embedding) name their tensors without
the `model.` prefix; both forms load. An LM head in the checkpoint is ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from graphrunner.attention.base import AttentionBackend
from graphrunner.config import KernelConfig, ModelConfig
from graphrunner.distributed.comm import TPComm
from graphrunner.models.llama import LlamaForCausalLM, _WeightTarget
from graphrunner.pool.config import PoolerConfig
from graphrunner.pool.pooler import pool_hidden

_DECODER_PREFIXES = ("layers.", "embed_tokens.", "norm.")


class LlamaForPooling(LlamaForCausalLM):
    """`forward` gives the final hidden states; `pool` writes one vector per batch entry."""

    is_pooling_model = True

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype, device,
                 tp: TPComm | None = None, pp_rank: int = 0, pp_size: int = 1, kernel: KernelConfig | None = None,
                 pooler: PoolerConfig | None = None) -> None:
        if pp_size != 1:  # tensor parallelism: every rank ends with the whole hidden state, and pools it
            raise ValueError(f"pooling models run on one rank or with tensor parallelism; got "
                             f"pipeline_parallel_size={pp_size}")
        # Tied: no LM head is built, and a checkpoint's `lm_head.weight` is skipped.
        super().__init__(dataclasses.replace(config, tie_word_embeddings=True), attn_backend, dtype=dtype,
                         device=device, tp=tp, kernel=kernel)
        self.pooler_config = pooler = pooler or PoolerConfig()
        self.score = None
        if pooler.is_classifier:
            self.score = nn.Linear(config.hidden_size, pooler.num_labels, bias=False, dtype=dtype, device=device)
            self.score.requires_grad_(False)

    @property
    def pooled_size(self) -> int:
        """Columns of a pooled row: the labels of a classifier, else the hidden size."""
        return self.pooler_config.num_labels or self.config.hidden_size

    def pool(self, hidden: torch.Tensor, query_start_loc: torch.Tensor, last_indices: torch.Tensor,
             out: torch.Tensor) -> None:
        """hidden [T_pad, H] -> out [R_pad, pooled_size] float32 (a classifier's logits)."""
        pooled = pool_hidden(hidden, self.pooler_config.pooling_type, query_start_loc, last_indices)  # [R_pad, H]
        if self.score is not None:
            pooled = self.score(pooled)  # [R_pad, labels], in the model dtype as HF computes it
        out.copy_(pooled)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pooling model has no LM head: it pools (runner='pooling'), it does not sample")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_with_prefix(weights))

    def _weight_targets(self) -> tuple[dict[str, _WeightTarget], dict[str, _WeightTarget]]:
        targets, alternates = super()._weight_targets()
        if self.score is not None:
            targets["score.weight"] = _WeightTarget(tuple(self.score.weight.shape), self.score.weight.copy_)
        return targets, alternates

    def checkpoint_names(self) -> set[str]:
        """Every tensor name a checkpoint of this model may hold (with or without `model.`)."""
        targets, alternates = self._weight_targets()
        names = set(targets) | set(alternates)
        return names | {n.removeprefix("model.") for n in names if n.startswith("model.")}


def _with_prefix(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield ("model." + name if name.startswith(_DECODER_PREFIXES) else name), tensor
