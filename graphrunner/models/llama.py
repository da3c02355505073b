"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

One class covers them all because they differ only in flags carried by `ModelConfig`.
The forward pass is graph-safe: shapes depend only on the (padded) token count, there
is no host sync and no branching on tensor values, so the same code runs eagerly, under
torch.compile, and inside captured CUDA graphs. Attention is the only call into the
backend, in `Attention.attend`. In *op mode* (`LlamaForCausalLM.use_attention_op(True)`)
that call goes through the opaque custom op `graphrunner::unified_attention`, which
reads the per-step metadata, KV caches and backend from `forward_context`: the model is
then traceable by dynamo with fullgraph=True and splits at attention (PIECEWISE graphs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.attention.base import AttentionBackend, AttentionMetadata
from graphrunner.attention.op import unified_attention  # noqa: F401  (importing registers the op)
from graphrunner.config import ModelConfig
from graphrunner.layers.embedding import LMHead, VocabEmbedding
from graphrunner.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from graphrunner.layers.norm import RMSNorm
from graphrunner.layers.rotary import RotaryEmbedding
from graphrunner.models.registry import check_architecture

logger = logging.getLogger("graphrunner.models")


class Attention(nn.Module):
    """q/k/v projection, optional q/k RMSNorm, rotary, backend attention, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        attn_backend: AttentionBackend,
        *,
        dtype,
        device,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        d = config.head_dim
        self.layer_index = layer_index  # which of the forward context's KV caches the op uses
        self.attention_op_mode = False  # set by LlamaForCausalLM.use_attention_op
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.scale = d**-0.5
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            d,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            dtype=dtype,
            device=device,
        )
        # HF Llama/Qwen3 put `attention_bias` on o_proj too; Qwen2's bias is on q/k/v only.
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowLinear(config.q_size, config.hidden_size, bias=o_bias, dtype=dtype, device=device)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None
        # Shared by every layer; a plain attribute list keeps it out of this module's tree
        # so that it is registered (and moved, and listed) once, by LlamaModel.
        self._rotary = [rotary]
        self.attn_backend = attn_backend

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))  # q: [T, H, D]; k, v: [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotary[0](positions, q, k)
        # The split leaves v a strided view of qkv; backends get contiguous inputs.
        out = self.attend(q, k, v.contiguous(), kv_cache, metadata)  # [T, H, D]
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        """The single call into the attention backend: the torch.compile split point.

        In op mode `kv_cache` and `metadata` are ignored (the op reads them from the
        forward context) and the output is allocated here, so that under PIECEWISE graphs
        it belongs to the preceding compiled piece and has a stable address.
        """
        if self.attention_op_mode:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D], contiguous for the reshape
            torch.ops.graphrunner.unified_attention(q, k, v, out, self.layer_index, self.scale)
            return out
        return self.attn_backend.forward(q, k, v, kv_cache, metadata, self.scale)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, *, dtype, device) -> None:
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [i, i], dtype=dtype, device=device)
        self.down_proj = RowLinear(i, config.hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream is carried separately so that each norm can
    fuse the preceding residual add (`RMSNorm.add_norm`)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        attn_backend: AttentionBackend,
        *,
        dtype,
        device,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, rotary, attn_backend, dtype=dtype, device=device, layer_index=layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = MLP(config, dtype=dtype, device=device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [T, hidden]: the previous block's output (embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]; None for the first layer
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (block output, residual), both [T, hidden]
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.add_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *, dtype, device) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary_emb, attn_backend, dtype=dtype, device=device, layer_index=i)
            for i in range(config.num_hidden_layers)
        )
        self.attention_op_mode = False  # set by LlamaForCausalLM.use_attention_op
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int32
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        if self.attention_op_mode:
            # The op takes each layer's cache from the forward context; not touching the
            # list here keeps it (and its guards) out of the compiled graph.
            kv_caches = [None] * len(self.layers)
        elif len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm.add_norm(hidden, residual)
        return hidden


@dataclass(frozen=True)
class _WeightTarget:
    """Where one checkpoint tensor goes: its expected (full HF) shape and the copy."""

    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM: `forward` gives final hidden states, `compute_logits` the logits.

    Parameters are created directly on `device` in `dtype` (no CPU staging) and are
    filled by `load_weights` (HF names) or `graphrunner.models.loader.init_dummy_weights`.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        check_architecture(config.architecture)
        self.config = config
        self.model = LlamaModel(config, attn_backend, dtype=dtype, device=device)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else LMHead(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int32
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per layer: [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def use_attention_op(self, enabled: bool) -> None:
        """Route attention through the custom op `graphrunner::unified_attention` (op mode).

        In op mode every forward call must run inside
        `graphrunner.attention.op.forward_context(metadata, kv_caches, backend)`; the
        `kv_caches` and `attn_metadata` arguments of `forward` are then ignored.
        """
        self.model.attention_op_mode = bool(enabled)
        for layer in self.model.layers:
            layer.self_attn.attention_op_mode = bool(enabled)

    @property
    def attention_op_enabled(self) -> bool:
        return self.model.attention_op_mode

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden)

    # ------------------------------------------------------------------ weight loading

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from (HF name, tensor) pairs; tensors are cast and moved.

        q/k/v and gate/up are copied into slices of the fused parameters as they arrive.
        Raises ValueError naming the tensor for a wrong shape or a duplicate, and naming
        every missing tensor once the stream ends. Unexpected tensors are skipped with a
        debug log (rotary `inv_freq` buffers, and `lm_head.weight` when tied, silently).
        """
        targets = self._weight_targets()
        loaded: set[str] = set()
        ignored: list[str] = []
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                if not name.endswith("rotary_emb.inv_freq") and not (name == "lm_head.weight" and self.lm_head is None):
                    ignored.append(name)
                continue
            if name in loaded:
                raise ValueError(f"checkpoint tensor {name!r} appears more than once")
            if tuple(tensor.shape) != target.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {target.shape}"
                )
            target.load(tensor)
            loaded.add(name)
        if ignored:
            logger.debug("ignored %d unexpected checkpoint tensors: %s", len(ignored), ignored)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = missing[:8] + (["..."] if len(missing) > 8 else [])
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _weight_targets(self) -> dict[str, _WeightTarget]:
        """HF tensor name -> target, covering every parameter of this model exactly once."""
        targets: dict[str, _WeightTarget] = {}

        def plain(name: str, param: nn.Parameter) -> None:
            targets[name] = _WeightTarget(tuple(param.shape), param.copy_)

        def sharded(name: str, layer, param: str, shard_id=None) -> None:
            targets[name] = _WeightTarget(
                layer.checkpoint_shape(param, shard_id),
                lambda t, layer=layer, param=param, shard_id=shard_id: layer.load_shard(param, t, shard_id),
            )

        m = self.model
        plain("model.embed_tokens.weight", m.embed_tokens.weight)
        plain("model.norm.weight", m.norm.weight)
        if self.lm_head is not None:
            plain("lm_head.weight", self.lm_head.weight)
        for i, layer in enumerate(m.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            plain(p + "input_layernorm.weight", layer.input_layernorm.weight)
            plain(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            params = ["weight"] + (["bias"] if attn.qkv_proj.bias is not None else [])
            for shard in ("q", "k", "v"):
                for param in params:
                    sharded(f"{p}self_attn.{shard}_proj.{param}", attn.qkv_proj, param, shard)
            for param in ["weight"] + (["bias"] if attn.o_proj.bias is not None else []):
                sharded(f"{p}self_attn.o_proj.{param}", attn.o_proj, param)
            if attn.q_norm is not None:
                plain(p + "self_attn.q_norm.weight", attn.q_norm.weight)
                plain(p + "self_attn.k_norm.weight", attn.k_norm.weight)
            sharded(p + "mlp.gate_proj.weight", mlp.gate_up_proj, "weight", 0)
            sharded(p + "mlp.up_proj.weight", mlp.gate_up_proj, "weight", 1)
            sharded(p + "mlp.down_proj.weight", mlp.down_proj, "weight")
        return targets
