"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

One class covers them all because they differ only in flags carried by `ModelConfig`.
The forward pass is graph-safe: shapes depend only on the (padded) token count, there
is no host sync and no branching on tensor values, so the same code runs eagerly, under
torch.compile, and inside captured CUDA graphs. Attention is the only call into the
backend, in `Attention.attend`. In *op mode* (`LlamaForCausalLM.use_attention_op(True)`)
that call goes through the opaque custom op `graphrunner::unified_attention`, which
reads the per-step metadata, KV caches and backend from `forward_context`: the model is
then traceable by dynamo with fullgraph=True and splits at attention (PIECEWISE graphs).

Parallelism. With a `TPComm` of size > 1 the projections are column/row parallel
(heads, gate/up split; o/down all-reduced through `graphrunner::tp_all_reduce`) and the
embedding and head are vocab-parallel. With pp_size > 1 the model holds only its
stage's layers (`pp_layer_range`); the others are parameter-free placeholders, so
parameter names stay the global HF ones. The first stage embeds, the last one applies
the final norm and owns the head; a non-last stage returns `(hidden, residual)` for the
next one, and a non-first stage takes them as extra `forward` arguments.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from graphrunner.attention.base import AttentionBackend, AttentionMetadata, rope_attention
from graphrunner.attention.op import unified_attention  # noqa: F401  (importing registers the op)
from graphrunner.config import KernelConfig, ModelConfig, QuantConfig
from graphrunner.distributed.comm import TPComm
from graphrunner.layers.embedding import LMHead, VocabEmbedding
from graphrunner.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from graphrunner.layers.moe.layer import DOWN, GATE, UP, FusedMoE
from graphrunner.layers.norm import RMSNorm
from graphrunner.layers.rotary import MRotaryEmbedding, RotaryEmbedding, make_rotary
from graphrunner.models.registry import check_architecture
from graphrunner.models.stages import MissingLayer, pp_layer_range

logger = logging.getLogger("graphrunner.models")


def projection_quant(config: ModelConfig, prefix: str | None, parts: Sequence[str]) -> QuantConfig | None:
    """The fp8 config of a (fused) projection whose checkpoint modules are `prefix` + each of `parts`
    (None: not quantized: the prefix is None for layers outside the checkpoint, e.g. an EAGLE head).
    Fused parts share one weight, so they are quantized together or not at all."""
    quant = config.quant
    if quant is None or prefix is None:
        return None
    flags = {quant.quantizes(prefix + part) for part in parts}
    if len(flags) > 1:
        raise ValueError(f"quantization_config ignores some but not all of {[prefix + p for p in parts]}; "
                         "they are fused into one fp8 weight, so list all of them or none")
    return quant if flags.pop() else None


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
        tp: TPComm | None = None,
        kernel: KernelConfig | None = None,
        quant_prefix: str | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPComm()
        d = config.head_dim
        p = None if quant_prefix is None else quant_prefix + "self_attn."
        self.layer_index = layer_index  # which of the forward context's KV caches the op uses (stage-local)
        self.attention_op_mode = False  # set by LlamaForCausalLM.use_attention_op
        self.scale = d**-0.5
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            d,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            dtype=dtype,
            device=device,
            tp_size=tp.size,
            tp_rank=tp.rank,
            kv_tp_size=tp.kv_shards[0],
            kv_tp_rank=tp.kv_shards[1],
            kernel=kernel,
            quant=projection_quant(config, p, ("q_proj", "k_proj", "v_proj")),
        )
        # Heads of this TP rank.
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        # HF Llama/Qwen3 put `attention_bias` on o_proj too; Qwen2's bias is on q/k/v only.
        o_bias = config.attention_bias and config.architecture not in (
            "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen2_5_VLForConditionalGeneration")
        self.o_proj = RowLinear(
            config.q_size, config.hidden_size, bias=o_bias, dtype=dtype, device=device,
            tp_size=tp.size, tp_rank=tp.rank, all_reduce=tp.all_reduce if tp.size > 1 else None, kernel=kernel,
            quant=projection_quant(config, p, ("o_proj",)),
        )
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None
        # Shared by every layer; a plain attribute list keeps it out of this module's tree
        # so that it is registered (and moved, and listed) once, by LlamaModel.
        self._rotary = [rotary]
        self.attn_backend = attn_backend
        self._rope_attend = rope_attention(attn_backend)  # the backend's rotary + KV write + attention
        # (k_scale, v_scale) of an fp8 KV cache: 1.0 unless the checkpoint has this layer's scales
        # (graphrunner.attention.kv_scales). A buffer, so every graph reads one persistent address.
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32, device=device), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, Hkv, D]; None in op mode
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.forward_qkv(positions, self.qkv_proj(hidden), kv_cache, metadata)

    def forward_qkv(
        self,
        positions: torch.Tensor,  # [T] int64
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) D]: qkv_proj's output (DecoderLayer fuses the norm into it)
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        rope_table: torch.Tensor | None = None,  # M-RoPE: [T, D] per-token cos | sin, read at `positions`
    ) -> torch.Tensor:  # [T, hidden]
        q, k, v = self.qkv_proj.split_qkv(qkv)  # q: [T, H, D]; k, v: [T, Hkv, D] (views)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attend(positions, q, k, v, kv_cache, metadata, rope_table)  # [T, H, D]
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))

    def attend(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H, D], not yet rotated
        k: torch.Tensor,  # [T, Hkv, D], not yet rotated
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
        rope_table: torch.Tensor | None = None,  # M-RoPE: [T, D] per-token cos | sin instead of the model's table
    ) -> torch.Tensor:  # [T, H, D]
        """Rotary embedding, KV write and attention: the torch.compile split point.

        The rotation happens in the backend, with the KV write, so that its kernels can fuse
        them (`graphrunner.attention.base.rope_attention`). In op mode `kv_cache` and `metadata` are ignored
        (the op reads them from the forward context) and the output is allocated here, so
        that under PIECEWISE graphs it belongs to the preceding compiled piece and has a
        stable address.
        """
        cos_sin = self._rotary[0].cos_sin_cache if rope_table is None else rope_table  # [rows, D] float32
        if self.attention_op_mode:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D], contiguous for the reshape
            torch.ops.graphrunner.unified_attention(q, k, v, positions, cos_sin, out, self.layer_index, self.scale,
                                                    self.kv_scale)
            return out
        assert kv_cache is not None, "outside op mode every layer gets its KV cache"
        return self._rope_attend(q, k, v, positions, cos_sin, kv_cache, metadata, self.scale, kv_scale=self.kv_scale)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig, *, dtype, device, tp: TPComm | None = None,
                 kernel: KernelConfig | None = None, quant_prefix: str | None = None) -> None:
        super().__init__()
        tp = tp or TPComm()
        i = config.intermediate_size
        p = None if quant_prefix is None else quant_prefix + "mlp."
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size, [i, i], dtype=dtype, device=device, tp_size=tp.size, tp_rank=tp.rank, kernel=kernel,
            quant=projection_quant(config, p, ("gate_proj", "up_proj")),
        )
        self.down_proj = RowLinear(
            i, config.hidden_size, dtype=dtype, device=device, tp_size=tp.size, tp_rank=tp.rank,
            all_reduce=tp.all_reduce if tp.size > 1 else None, kernel=kernel,
            quant=projection_quant(config, p, ("down_proj",)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.forward_gate_up(self.gate_up_proj(x))

    def forward_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] (gate_up_proj's) -> [T, hidden]
        # At batch 1 SiLU·mul happens inside the down GEMV (layers/linear.py).
        return self.down_proj.forward_swiglu(gate_up)


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
        global_index: int = 0,
        tp: TPComm | None = None,
        kernel: KernelConfig | None = None,
        quant_prefix: str | None = None,
    ) -> None:
        """`quant_prefix`: the layer's checkpoint name (`model.layers.N.`) when its projections follow the
        model's fp8 config; None keeps them in the model dtype (a layer of no checkpoint's decoder)."""
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype, device=device, kernel=kernel)
        self.self_attn = Attention(
            config, rotary, attn_backend, dtype=dtype, device=device, layer_index=layer_index, tp=tp, kernel=kernel,
            quant_prefix=quant_prefix,
        )
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype, device=device, kernel=kernel)
        self.mlp: MLP | FusedMoE = (
            FusedMoE(config, dtype=dtype, device=device, tp=tp, kernel=kernel)
            if config.is_sparse_layer(global_index)
            else MLP(config, dtype=dtype, device=device, tp=tp, kernel=kernel, quant_prefix=quant_prefix)
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [T, hidden]: the previous block's output (embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]; None for the first layer
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rope_table: torch.Tensor | None = None,  # M-RoPE: [T, D] per-token cos | sin (LlamaModel.forward)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (block output, residual), both [T, hidden]
        # Each half enters through its first projection's add_norm_forward: residual add, RMSNorm
        # and the projection, one launch at one row on CUDA (layers/linear.py).
        attn = self.self_attn
        if residual is None:
            residual, qkv = hidden, attn.qkv_proj(self.input_layernorm(hidden))
        else:
            qkv, residual = attn.qkv_proj.add_norm_forward(self.input_layernorm, hidden, residual)
        hidden = attn.forward_qkv(positions, qkv, kv_cache, metadata, rope_table)
        mlp = self.mlp
        if isinstance(mlp, FusedMoE):
            hidden, residual = self.post_attention_layernorm.add_norm(hidden, residual)
            return mlp(hidden), residual
        gate_up, residual = mlp.gate_up_proj.add_norm_forward(self.post_attention_layernorm, hidden, residual)
        return mlp.forward_gate_up(gate_up), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix), or one PP stage of them."""

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        *,
        dtype,
        device,
        tp: TPComm | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        kernel: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        kernel = kernel or KernelConfig()
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers, pp_size, pp_rank)
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        # The last stage keeps the embedding too when the head is tied to it.
        needs_embed = self.is_first_stage or (self.is_last_stage and config.tie_word_embeddings)
        self.embed_tokens = (
            VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device, tp=tp, kernel=kernel)
            if needs_embed else None
        )
        self.rotary_emb = make_rotary(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                config, self.rotary_emb, attn_backend, dtype=dtype, device=device,
                layer_index=i - self.start_layer, global_index=i, tp=tp, kernel=kernel,
                quant_prefix=f"model.layers.{i}.",
            )
            if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.attention_op_mode = False  # set by LlamaForCausalLM.use_attention_op
        # EAGLE-3: the layers whose input (the residual stream) `forward` also returns (set_aux_hidden_state_layers).
        self.aux_hidden_state_layers: frozenset[int] = frozenset()
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device, kernel=kernel)
            if self.is_last_stage else None
        )

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def local_aux_layers(self) -> tuple[int, ...]:
        """The feature layers of this stage, in the order `forward` returns their inputs."""
        return tuple(i for i in range(self.start_layer, self.end_layer) if i in self.aux_hidden_state_layers)

    @property
    def local_layers(self) -> list[DecoderLayer]:
        """This stage's decoder layers (the other entries of `layers` are `MissingLayer`s)."""
        # Iterated, not sliced or indexed: a slice of a ModuleList builds a new one and an index goes
        # through its string keys, both traced by torch.compile (for qwen2.5-0.5b 17,047 instructions
        # traced with the slice, 15,888 indexed, 14,866 iterated).
        return [layer for i, layer in enumerate(self.layers)
                if self.start_layer <= i < self.end_layer and isinstance(layer, DecoderLayer)]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int32
        positions: torch.Tensor,  # [T] int64; M-RoPE: [T, 3] (t, h, w)
        kv_caches: list[torch.Tensor],  # this stage's layers only
        attn_metadata: AttentionMetadata,
        hidden_in: torch.Tensor | None = None,  # [T, hidden]: from the previous stage (non-first stages)
        residual_in: torch.Tensor | None = None,  # [T, hidden]
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: the first stage reads these, not input_ids
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Last stage: [T, hidden] after the final norm. Other stages: (hidden, residual). With feature
        layers set, each output is a tuple followed by their inputs ([T, hidden] each, `local_aux_layers`)."""
        local_layers = self.local_layers
        caches: Sequence[torch.Tensor | None]
        if self.attention_op_mode:
            # The op takes each layer's cache from the forward context; not touching the
            # list here keeps it (and its guards) out of the compiled graph.
            caches = [None] * len(local_layers)
        elif len(kv_caches) != len(local_layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(local_layers)} layers")
        else:
            caches = kv_caches
        residual: torch.Tensor | None
        if self.is_first_stage and inputs_embeds is not None:
            hidden, residual = inputs_embeds, None
        elif self.is_first_stage:
            assert self.embed_tokens is not None, "the first stage holds the embedding"
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            if hidden_in is None or residual_in is None:
                raise ValueError("a non-first pipeline stage needs hidden_in and residual_in")
            hidden, residual = hidden_in, residual_in
        rope_table = None
        if positions.dim() == 2:  # M-RoPE: each token's cos | sin row gathered once, read by every layer
            assert isinstance(self.rotary_emb, MRotaryEmbedding), "[T, 3] positions need rope_type 'mrope'"
            positions, rope_table = self.rotary_emb.per_token(positions)
        aux: list[torch.Tensor] = []
        if not self.aux_hidden_state_layers:  # the plain loop: no per-layer test when no features are read
            for layer, kv_cache in zip(local_layers, caches, strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata, rope_table)
        else:
            for i, (layer, kv_cache) in enumerate(zip(local_layers, caches, strict=True), start=self.start_layer):
                if i in self.aux_hidden_state_layers:  # the residual stream entering layer i
                    aux.append(hidden if residual is None else hidden + residual)
                hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata, rope_table)
        assert residual is not None, "every stage runs at least one layer"
        if not self.is_last_stage:
            return (hidden, residual, *aux)
        assert self.norm is not None, "the last stage holds the final norm"
        hidden, _ = self.norm.add_norm(hidden, residual)
        return (hidden, *aux) if self.aux_hidden_state_layers else hidden


_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")


@runtime_checkable
class ShardedModule(Protocol):
    """A layer whose parameters are split across TP ranks (linear layers, vocab embedding
    and head): it knows a parameter's full checkpoint shape and loads its own share."""

    def checkpoint_shape(self, param: str, shard_id: int | str | None = None) -> tuple[int, ...]: ...

    def load_shard(self, param: str, tensor: torch.Tensor, shard_id: int | str | None = None) -> None: ...


@dataclass(frozen=True)
class _WeightTarget:
    """Where one checkpoint tensor goes: its expected (full HF) shape and the copy. `covers`:
    for a tensor that is another form of several required ones (a fused experts tensor for
    the per-expert ones), the names it stands for."""

    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], object]
    covers: tuple[str, ...] = ()


Renames = Sequence[tuple[str, str]]  # (a checkpoint layout's prefix, this model's prefix)


def renamed_weights(weights: Iterable[tuple[str, torch.Tensor]],
                    renames: Renames) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` with each name's first matching old prefix replaced by this model's."""
    for name, tensor in weights:
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor


def names_in_every_layout(names: set[str], renames: Renames) -> set[str]:
    """`names` (this model's) plus each under every old prefix that maps onto it."""
    out = set(names)
    for old, new in renames:
        out |= {old + n[len(new):] for n in names if n.startswith(new)}
    return out


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM: `forward` gives final hidden states, `compute_logits` the logits.

    Parameters are created directly on `device` in `dtype` (no CPU staging) and are
    filled by `load_weights` (HF names) or `graphrunner.models.loader.init_dummy_weights`.
    `kernel` (default `KernelConfig()`) picks every layer's kernels, once, for that device.
    """

    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        *,
        dtype: torch.dtype,
        device,
        tp: TPComm | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        kernel: KernelConfig | None = None,
    ) -> None:
        super().__init__()
        kernel = kernel or KernelConfig()
        check_architecture(config.architecture)
        self.config = config
        self.tp = tp or TPComm()
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.model = LlamaModel(
            config, attn_backend, dtype=dtype, device=device, tp=self.tp, pp_rank=pp_rank, pp_size=pp_size,
            kernel=kernel,
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings or not self.model.is_last_stage
            else LMHead(config.vocab_size, config.hidden_size, dtype=dtype, device=device, tp=self.tp, kernel=kernel)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int32
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per local layer: [2, num_blocks, block_size, Hkv_local, D]
        attn_metadata: AttentionMetadata,
        hidden_in: torch.Tensor | None = None,  # non-first PP stages: [T, hidden]
        residual_in: torch.Tensor | None = None,  # non-first PP stages: [T, hidden]
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: read instead of input_ids' embeddings
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:  # [T, hidden], or (hidden, residual) off the last stage
        if inputs_embeds is not None:
            return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds)
        if hidden_in is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, hidden_in, residual_in)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """The token embeddings of `input_ids` (vLLM's name; first stage only)."""
        assert self.model.embed_tokens is not None, "the first stage holds the embedding"
        return self.model.embed_tokens(input_ids)

    @property
    def num_local_layers(self) -> int:
        """Decoder layers (and so KV caches) of this pipeline stage."""
        return self.model.num_local_layers

    def set_aux_hidden_state_layers(self, layers: Iterable[int]) -> None:
        """EAGLE-3 features: `forward` also returns the residual stream entering each of these
        layers (those of this stage, in layer order: `model.local_aux_layers`). Empty: off."""
        ids = frozenset(int(i) for i in layers)
        bad = sorted(i for i in ids if not 0 <= i < self.config.num_hidden_layers)
        if bad:
            raise ValueError(f"aux hidden state layers {bad} outside the model's {self.config.num_hidden_layers} "
                             "layers")
        self.model.aux_hidden_state_layers = ids

    def use_attention_op(self, enabled: bool) -> None:
        """Route attention through the custom op `graphrunner::unified_attention` (op mode).

        In op mode every forward call must run inside
        `graphrunner.attention.op.forward_context(metadata, kv_caches, backend)`; the
        `kv_caches` and `attn_metadata` arguments of `forward` are then ignored.
        """
        self.model.attention_op_mode = bool(enabled)
        for layer in self.model.local_layers:
            layer.self_attn.attention_op_mode = bool(enabled)
            if isinstance(layer.mlp, FusedMoE):  # its kernels, too, behind an op torch.compile does not trace
                layer.mlp.op_mode = bool(enabled)

    def allocate_workspace(self, max_num_tokens: int) -> None:
        """Allocate the buffers layers share across a step of up to `max_num_tokens` tokens (the
        MoE kernels' one `MoEWorkspace`), before any graph is captured; nothing for a dense model."""
        sparse = [layer.mlp for layer in self.model.local_layers if isinstance(layer.mlp, FusedMoE)]
        workspace = sparse[0].new_workspace(max_num_tokens) if sparse else None
        for moe in sparse:
            moe.workspace = workspace

    @property
    def attention_op_enabled(self) -> bool:
        return self.model.attention_op_mode

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        """Full-vocabulary logits on every TP rank (last PP stage only)."""
        return self._head("compute_logits").logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> out [R]
        """The argmax of the logits, without writing them where the head allows (sample/greedy_head.py)."""
        return self._head("greedy_tokens").greedy(hidden, out)

    def _head(self, caller: str) -> VocabEmbedding | LMHead:
        if not self.model.is_last_stage:
            raise RuntimeError(f"{caller} on pipeline stage {self.pp_rank} of {self.pp_size}: only the last has a head")
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        assert head is not None, "a tied head keeps the embedding on the last stage"
        return head

    # ------------------------------------------------------------------ weight loading

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from (HF name, tensor) pairs; tensors are cast and moved.

        q/k/v and gate/up are copied into slices of the fused parameters as they arrive.
        Raises ValueError naming the tensor for a wrong shape or a duplicate, and naming
        every missing tensor once the stream ends. Unexpected tensors are skipped with a
        debug log (rotary `inv_freq` buffers, and `lm_head.weight` when tied, silently).
        """
        targets, alternates = self._weight_targets()
        loaded: set[str] = set()
        ignored: list[str] = []
        for name, tensor in weights:
            target = targets.get(name) or alternates.get(name)
            if target is None:
                if not name.endswith("rotary_emb.inv_freq") and not (name == "lm_head.weight" and self.lm_head is None):
                    ignored.append(name)
                continue
            stands_for = target.covers or (name,)
            if not loaded.isdisjoint(stands_for):
                again = name if name in loaded else f"{name} (another form of {sorted(loaded & set(stands_for))[0]})"
                raise ValueError(f"checkpoint tensor {again!r} appears more than once")
            if name.endswith(_SCALE_SUFFIXES) and tensor.numel() == math.prod(target.shape):
                tensor = tensor.reshape(target.shape)  # [N, 1], [1] and scalar scale forms alike
            if tuple(tensor.shape) != target.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {target.shape}"
                )
            target.load(tensor)
            loaded.update(stands_for)
        if ignored:
            logger.debug("ignored %d unexpected checkpoint tensors: %s", len(ignored), ignored)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = missing[:8] + (["..."] if len(missing) > 8 else [])
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")

    def _weight_targets(self) -> tuple[dict[str, _WeightTarget], dict[str, _WeightTarget]]:
        """(HF tensor name -> target, covering every parameter of this model exactly once;
        other accepted forms of some of them -> target, each naming what it covers)."""
        targets: dict[str, _WeightTarget] = {}
        alternates: dict[str, _WeightTarget] = {}

        def plain(name: str, param: nn.Parameter) -> None:
            targets[name] = _WeightTarget(tuple(param.shape), param.copy_)

        def sharded(name: str, layer: ShardedModule, param: str, shard_id: int | str | None = None) -> None:
            def load(tensor: torch.Tensor, param: str = param) -> None:
                layer.load_shard(param, tensor, shard_id)

            targets[name] = _WeightTarget(layer.checkpoint_shape(param, shard_id), load)
            # A pre-quantized fp8 projection's scales sit beside its weight (`q_proj.weight_scale`, ...).
            quant = getattr(layer, "quant", None)
            if param == "weight" and quant is not None and quant.prequantized:
                stem = name[: -len("weight")]
                for scale, key in ((quant.scale_name, "weight_scale"), ("input_scale", "input_scale")):
                    if getattr(layer, key) is not None:
                        targets[stem + scale] = _WeightTarget(layer.checkpoint_shape(key, shard_id),
                                                              functools.partial(load, param=key))

        m = self.model
        if m.embed_tokens is not None:
            sharded("model.embed_tokens.weight", m.embed_tokens, "weight")
        if m.norm is not None:
            plain("model.norm.weight", m.norm.weight)
        if self.lm_head is not None:
            sharded("lm_head.weight", self.lm_head, "weight")
        for i, layer in enumerate(m.local_layers, start=m.start_layer):
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
            if attn.q_norm is not None and attn.k_norm is not None:
                plain(p + "self_attn.q_norm.weight", attn.q_norm.weight)
                plain(p + "self_attn.k_norm.weight", attn.k_norm.weight)
            if isinstance(mlp, FusedMoE):
                self._expert_targets(p, mlp, targets, alternates, plain, sharded)
                continue
            sharded(p + "mlp.gate_proj.weight", mlp.gate_up_proj, "weight", 0)
            sharded(p + "mlp.up_proj.weight", mlp.gate_up_proj, "weight", 1)
            sharded(p + "mlp.down_proj.weight", mlp.down_proj, "weight")
        return targets, alternates

    def _expert_targets(self, p: str, moe: FusedMoE, targets: dict[str, _WeightTarget],
                        alternates: dict[str, _WeightTarget], plain: Callable, sharded: Callable) -> None:
        """A sparse layer's tensors, as `save_pretrained` writes them (one key set per expert:
        Mixtral `block_sparse_moe.experts.N.w1|w3|w2`, Qwen `mlp.experts.N.gate|up|down_proj`),
        or as transformers 5 holds them in memory (`mlp.experts.gate_up_proj` [E, 2I, H] and
        `mlp.experts.down_proj` [E, H, I], the router at `mlp.gate`): either form loads."""
        mixtral = self.config.architecture == "MixtralForCausalLM"
        block = p + ("block_sparse_moe." if mixtral else "mlp.")
        names = {GATE: "w1", UP: "w3", DOWN: "w2"} if mixtral else {
            GATE: "gate_proj", UP: "up_proj", DOWN: "down_proj"}
        plain(block + "gate.weight", moe.gate.weight)
        gate_up: list[str] = []
        down: list[str] = []
        for e in range(moe.num_experts):
            for part in (GATE, UP, DOWN):
                name = f"{block}experts.{e}.{names[part]}.weight"
                sharded(name, moe, "w2" if part == DOWN else "w13", (e, part))
                (down if part == DOWN else gate_up).append(name)
        for param, fused, covered in (("w13", "gate_up_proj", gate_up), ("w2", "down_proj", down)):
            alternates[f"{p}mlp.experts.{fused}"] = _WeightTarget(
                moe.checkpoint_shape(param), functools.partial(moe.load_full, param), tuple(covered))
        if mixtral:
            router = block + "gate.weight"
            alternates[p + "mlp.gate.weight"] = _WeightTarget(targets[router].shape, targets[router].load, (router,))
        if moe.shared_gate_up is not None:
            assert moe.shared_down is not None and moe.shared_expert_gate is not None, "built together"
            sharded(block + "shared_expert.gate_proj.weight", moe.shared_gate_up, "weight", 0)
            sharded(block + "shared_expert.up_proj.weight", moe.shared_gate_up, "weight", 1)
            sharded(block + "shared_expert.down_proj.weight", moe.shared_down, "weight")
            plain(block + "shared_expert_gate.weight", moe.shared_expert_gate.weight)

    # ------------------------------------------------------------------ sharded dummy weights

    @torch.no_grad()
    def load_full_parameter(self, name: str, tensor: torch.Tensor) -> bool:
        """Load this rank's share of `tensor`, the full (unsharded) value of the parameter
        `name` of the single-process model (fused names: `qkv_proj`, `gate_up_proj`).

        Returns False when the parameter lives on another pipeline stage. Used to shard
        dummy weights so that a TP/PP model equals the single-process one exactly.
        """
        module_name, _, param = name.rpartition(".")
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return False
        if isinstance(module, MissingLayer) or getattr(module, param, None) is None:
            return False
        if isinstance(module, QKVLinear):
            q, kv = self.config.q_size, self.config.kv_size
            for shard, part in zip(("q", "k", "v"), tensor.split([q, kv, kv], dim=0), strict=True):
                module.load_shard(param, part, shard)
        elif isinstance(module, MergedColumnLinear):
            for i, part in enumerate(tensor.split(list(module.out_sizes), dim=0)):
                module.load_shard(param, part, i)
        elif isinstance(module, ShardedModule):
            module.load_shard(param, tensor)
        else:
            getattr(module, param).copy_(tensor)
        return True
