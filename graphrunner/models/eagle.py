"""EAGLE and EAGLE-3 speculator heads: one decoder layer fed by the target's own features.

Both heads predict the token two positions ahead of a target hidden state. At position p
the head reads the target's features at p and the embedding of the token at p + 1, and
its logits propose the token at p + 2; a drafting pass then feeds the head's own output
back as the next position's features.

* EAGLE (`method="eagle"`): `x = fc([embed(t_{p+1}); h_p])` with h_p the target's final
  (normed) hidden state, then one Llama decoder layer without its input norm; the output
  (`hidden + residual`, no final norm) goes through the target's LM head.
* EAGLE-3 (`method="eagle3"`): the target's residual stream at the input of a few layers
  (default: vLLM's low / middle / high `(2, L // 2, L - 3)`, or the head config's
  `eagle_aux_hidden_state_layer_ids`) concatenated, fused by `fc` ([3 H_target] -> H). The
  layer normalizes the embedding (`input_layernorm`) and the features (`hidden_norm`), and
  attends over their concatenation ([2 H] into q|k|v); the residual is the features
  (`norm_before_residual`: the normed ones). Its own `norm` and `lm_head` score a draft
  vocabulary, mapped to target ids by `d2t` (target id = draft id + d2t[draft id]).

Heads load from the folders their authors publish (config.json + safetensors; EAGLE:
`fc`, `layers.0.*`; EAGLE-3: `fc`, `midlayer.*` or `layers.0.*`, `norm`, `lm_head`, `d2t`;
either may carry its own `embed_tokens`, else the target's is shared), or are built-in
dummies for each built-in target: `builtin:eagle-NAME`, `builtin:eagle3-NAME`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphrunner.attention.base import AttentionMetadata
from graphrunner.config import ModelConfig
from graphrunner.layers.embedding import LMHead, VocabEmbedding
from graphrunner.layers.linear import ColumnLinear, QKVLinear
from graphrunner.layers.norm import RMSNorm
from graphrunner.layers.rotary import RotaryEmbedding
from graphrunner.models.registry import BUILTIN_PREFIX

EAGLE_METHODS = ("eagle", "eagle3")
# vLLM's draft vocabulary of the published EAGLE-3 heads for Llama 3 (32k of 128k ids); built-in
# heads of smaller targets take half their vocabulary, so that the id map is never the identity.
BUILTIN_DRAFT_VOCAB = 32000


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 feature layers of an L-layer target: low, middle, high."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class EagleHeadConfig:
    """A head's shapes. `layer` describes its decoder layer (and rotary) as a one-layer Llama;
    `vocab_size` is the target vocabulary its embedding reads, `draft_vocab_size` the one its
    LM head scores (EAGLE-3; EAGLE scores with the target's head)."""

    method: str
    layer: ModelConfig
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None = None  # EAGLE-3; None: default_aux_layers(target)
    norm_before_residual: bool = False
    fc_bias: bool = False  # EAGLE: some published heads have a bias on fc
    name: str = "head"

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    def aux_layers_for(self, target: ModelConfig) -> tuple[int, ...]:
        """EAGLE-3's feature layers of `target` (empty for EAGLE)."""
        if self.method != "eagle3":
            return ()
        return self.aux_layer_ids if self.aux_layer_ids is not None else default_aux_layers(target.num_hidden_layers)

    def check_target(self, target: ModelConfig) -> None:
        """ValueError naming both values where the head does not fit `target`."""
        who = f"speculator head {self.name!r}"
        if self.hidden_size != target.hidden_size:
            raise ValueError(f"{who} has hidden_size={self.hidden_size}, the target {target.name!r} "
                             f"{target.hidden_size}: a head reads the target's embeddings and features")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"{who} has vocab_size={self.vocab_size}, the target {target.name!r} "
                             f"{target.vocab_size}: a head must share the target's vocabulary")
        if self.draft_vocab_size > target.vocab_size:
            raise ValueError(f"{who} has draft_vocab_size={self.draft_vocab_size}, larger than the target's "
                             f"vocab_size={target.vocab_size}")
        if self.method == "eagle3" and self.target_hidden_size != target.hidden_size:
            raise ValueError(f"{who} has target_hidden_size={self.target_hidden_size}, the target {target.name!r} "
                             f"{target.hidden_size}")
        layers = self.aux_layers_for(target)
        bad = [i for i in layers if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(f"{who} reads the target's layers {list(layers)}; the target {target.name!r} has "
                             f"{target.num_hidden_layers} layers (ids in [0, {target.num_hidden_layers}))")


# ----------------------------------------------------------------------------- configs


def is_builtin_head(model: str) -> bool:
    return model.startswith(BUILTIN_PREFIX + "eagle-") or model.startswith(BUILTIN_PREFIX + "eagle3-")


def builtin_head_config(model: str) -> EagleHeadConfig:
    """`builtin:eagle-NAME` / `builtin:eagle3-NAME`: a dummy head shaped for `builtin:NAME`."""
    from graphrunner.models import registry

    body = model.removeprefix(BUILTIN_PREFIX)
    method, _, target_name = body.partition("-")
    target = registry.BUILTIN_MODELS.get(BUILTIN_PREFIX + target_name)
    if method not in EAGLE_METHODS or target is None:
        heads = sorted(f"{BUILTIN_PREFIX}{m}-{n.removeprefix(BUILTIN_PREFIX)}" for m in EAGLE_METHODS
                       for n in registry.BUILTIN_MODELS)
        raise ValueError(f"unknown builtin speculator head {model!r}; available: {heads}")
    layer = dataclasses.replace(target, num_hidden_layers=1, name=model, architecture="LlamaForCausalLM",
                                moe=None, qk_norm=False, attention_bias=False, tie_word_embeddings=False)
    draft_vocab = min(BUILTIN_DRAFT_VOCAB, target.vocab_size // 2) if method == "eagle3" else target.vocab_size
    return EagleHeadConfig(method=method, layer=layer, vocab_size=target.vocab_size, draft_vocab_size=draft_vocab,
                           target_hidden_size=target.hidden_size, name=model)


def head_config_from_dict(raw: dict[str, Any], method: str, *, name: str = "head") -> EagleHeadConfig:
    """A head folder's config.json (a one-layer LlamaConfig plus EAGLE-3's keys)."""
    from graphrunner.models import loader

    if method not in EAGLE_METHODS:
        raise ValueError(f"speculator method={method!r}; heads serve {EAGLE_METHODS}")
    archs = raw.get("architectures") or []
    if method == "eagle" and any("eagle3" in str(a).lower() for a in archs):
        raise ValueError(f"head {name!r} is an EAGLE-3 head (architectures {archs}); use method 'eagle3'")
    if raw.get("add_para_norm"):
        raise ValueError(f"head {name!r}: add_para_norm=true (HASS heads) is not supported")
    layers = loader._positive_int(raw, "num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"head {name!r} has num_hidden_layers={layers}; single-layer heads only (1)")
    heads = loader._positive_int(raw, "num_attention_heads")
    hidden = loader._positive_int(raw, "hidden_size")
    max_pos = loader._positive_int(raw, "max_position_embeddings", 2048)
    rope_theta, rope_scaling = loader._rope(raw, max_pos)
    vocab = loader._positive_int(raw, "vocab_size")
    bias = loader._bool(raw, "attention_bias", False)
    layer = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=loader._positive_int(raw, "intermediate_size"),
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=loader._positive_int(raw, "num_key_value_heads", heads),
        head_dim=loader._positive_int(raw, "head_dim", hidden // heads),
        rms_norm_eps=loader._positive_float(raw, "rms_norm_eps", 1e-6), rope_theta=rope_theta,
        rope_scaling=rope_scaling, max_position_embeddings=max_pos, attention_bias=bias, name=name,
    )
    nested = raw.get("eagle_config")
    eagle_config: dict[str, Any] = nested if isinstance(nested, dict) else {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids", eagle_config.get("eagle_aux_hidden_state_layer_ids"))
    if ids is not None and (not isinstance(ids, list) or not ids or not all(loader._is_int(i) for i in ids)):
        raise loader._bad_field("eagle_aux_hidden_state_layer_ids", ids, "a non-empty list of layer ids")
    return EagleHeadConfig(
        method=method, layer=layer, vocab_size=vocab,
        draft_vocab_size=loader._positive_int(raw, "draft_vocab_size", vocab) if method == "eagle3" else vocab,
        target_hidden_size=loader._positive_int(raw, "target_hidden_size", hidden),
        aux_layer_ids=tuple(ids) if ids is not None else None,
        norm_before_residual=loader._bool(raw, "norm_before_residual", False),
        fc_bias=loader._bool(raw, "bias", False) if method == "eagle" else False, name=name,
    )


def load_head_config(model: str, method: str) -> EagleHeadConfig:
    """`builtin:eagle[3]-NAME` or a head folder -> its config; ValueError for a head of the other method."""
    if is_builtin_head(model):
        config = builtin_head_config(model)
        if config.method != method:
            raise ValueError(f"speculator head {model!r} is a {config.method!r} head, the method is {method!r}")
        return config
    from graphrunner.models import loader

    folder = Path(model)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in speculator head folder {str(folder)!r} (or {model!r} is not "
                                "'builtin:eagle-NAME' / 'builtin:eagle3-NAME')")
    raw = loader._read_json_object(path)
    try:
        config = head_config_from_dict(raw, method, name=str(folder))
    except KeyError as e:
        raise loader.CheckpointError(f"{str(path)!r}: required key {e} is missing") from e
    # A checkpoint's fc says whether EAGLE's has a bias; config.json rarely does.
    names = head_checkpoint_names(folder)
    if method == "eagle" and "fc.bias" in names:
        config = dataclasses.replace(config, fc_bias=True)
    return config


def head_checkpoint_names(folder: Path) -> set[str]:
    """The tensor names of a head folder, normalized (`model.` dropped, `midlayer.` -> `layers.0.`)."""
    from graphrunner.models import loader

    names: set[str] = set()
    for file in loader._checkpoint_files(folder):
        with loader._open_safetensors(file) as f:
            names.update(_normalize(n) for n in f.keys())
    return names


def _normalize(name: str) -> str:
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


# ----------------------------------------------------------------------------- the module


class EagleHead(nn.Module):
    """One decoder layer over the target's features: `forward` gives (normed, pre-norm) hidden
    states; the normed ones score the next token (`greedy`), the pre-norm ones are the next
    pass's features. Runs unsharded on every TP rank (the shared target embedding and LM
    head keep their own sharding). Graph-safe like the target: shapes from the token count
    only, attention through the backend (`use_attention_op` for the compiled path)."""

    def __init__(self, config: EagleHeadConfig, attn_backend: Any, *, dtype: torch.dtype, device,
                 own_embedding: bool, num_aux: int = 3) -> None:
        from graphrunner.models.llama import DecoderLayer

        super().__init__()
        self.config = config
        c, h = config.layer, config.hidden_size
        self.eagle3 = config.method == "eagle3"
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling,
                                          device=device)
        self.layer = DecoderLayer(c, self.rotary_emb, attn_backend, dtype=dtype, device=device)
        self.embed_tokens = VocabEmbedding(config.vocab_size, h, dtype=dtype, device=device) if own_embedding else None
        self._shared: list[Any] = []  # [target embedding, target model]: out of this module's tree
        if self.eagle3:
            # q|k|v read [embedding; features]: twice the hidden width.
            self.layer.self_attn.qkv_proj = QKVLinear(2 * h, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                                      bias=c.attention_bias, dtype=dtype, device=device)
            self.hidden_norm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
            self.fc = ColumnLinear(num_aux * config.target_hidden_size, h, dtype=dtype, device=device)
            self.norm = RMSNorm(h, c.rms_norm_eps, dtype=dtype, device=device)
            self.lm_head = LMHead(config.draft_vocab_size, h, dtype=dtype, device=device)
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size, device=device),
                                 persistent=False)  # [Vd] int64: target id of each draft id
        else:
            self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]  # EAGLE skips it
            self.fc = ColumnLinear(2 * h, h, bias=config.fc_bias, dtype=dtype, device=device)

    def share(self, embedding: nn.Module, target: Any) -> None:
        """The target's embedding (unless the head has its own) and the target (its LM head)."""
        self._shared = [self.embed_tokens if self.embed_tokens is not None else embedding, target]

    def use_attention_op(self, enabled: bool) -> None:
        self.layer.self_attn.attention_op_mode = bool(enabled)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:  # EAGLE-3: [T, n H_target] -> [T, H]
        return self.fc(aux)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int32: the token after each position
        positions: torch.Tensor,  # [T] int64
        features: torch.Tensor,  # [T, H]: target features (EAGLE: final hidden; EAGLE-3: fc'd aux) or the head's
        kv_caches: list[torch.Tensor],  # [the head's one cache]; ignored in op mode
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], pre-norm [T, H])
        embed = self._shared[0](input_ids)  # [T, H]
        layer, attn = self.layer, self.layer.self_attn
        kv = None if attn.attention_op_mode else kv_caches[0]
        if not self.eagle3:
            hidden, residual = layer(positions, self.fc(torch.cat([embed, features], dim=-1)), None, kv, metadata)
            out = hidden + residual
            return out, out
        normed = self.hidden_norm(features)
        residual = normed if self.config.norm_before_residual else features
        x = torch.cat([layer.input_layernorm(embed), normed], dim=-1)  # [T, 2H]
        hidden = attn.forward_qkv(positions, attn.qkv_proj(x), kv, metadata)
        hidden, residual = layer.post_attention_layernorm.add_norm(hidden, residual)
        hidden = layer.mlp(hidden)
        return self.norm.add_norm(hidden, residual)

    def greedy(self, normed: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R] int32 target ids
        """The argmax of the head's logits, as a target token id."""
        if not self.eagle3:
            return self._shared[1].compute_logits(normed).argmax(dim=-1).to(torch.int32)
        draft = self.lm_head.logits(normed).argmax(dim=-1)  # [R] draft ids
        return self._draft_map()[draft].to(torch.int32)

    def _draft_map(self) -> torch.Tensor:
        mapping = self.draft_to_target
        assert isinstance(mapping, torch.Tensor)
        return mapping

    # ---- weights ------------------------------------------------------------------
    def weight_targets(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Checkpoint name (normalized) -> (full shape, load function) for every parameter."""
        targets: dict[str, tuple[tuple[int, ...], Any]] = {}

        def plain(name: str, param: torch.Tensor) -> None:
            targets[name] = (tuple(param.shape), param.copy_)

        def sharded(name: str, module: Any, param: str, shard: Any = None) -> None:
            targets[name] = (module.checkpoint_shape(param, shard),
                             lambda t, m=module, p=param, s=shard: m.load_shard(p, t, s))

        layer, attn, p = self.layer, self.layer.self_attn, "layers.0."
        sharded("fc.weight", self.fc, "weight")
        if self.fc.bias is not None:
            sharded("fc.bias", self.fc, "bias")
        params = ["weight"] + (["bias"] if attn.qkv_proj.bias is not None else [])
        for shard in ("q", "k", "v"):
            for param in params:
                sharded(f"{p}self_attn.{shard}_proj.{param}", attn.qkv_proj, param, shard)
        sharded(f"{p}self_attn.o_proj.weight", attn.o_proj, "weight")
        if attn.o_proj.bias is not None:
            sharded(f"{p}self_attn.o_proj.bias", attn.o_proj, "bias")
        plain(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        sharded(p + "mlp.gate_proj.weight", mlp.gate_up_proj, "weight", 0)
        sharded(p + "mlp.up_proj.weight", mlp.gate_up_proj, "weight", 1)
        sharded(p + "mlp.down_proj.weight", mlp.down_proj, "weight")
        if self.embed_tokens is not None:
            sharded("embed_tokens.weight", self.embed_tokens, "weight")
        if self.eagle3:
            plain(p + "input_layernorm.weight", layer.input_layernorm.weight)
            plain(p + "hidden_norm.weight", self.hidden_norm.weight)
            plain("norm.weight", self.norm.weight)
            sharded("lm_head.weight", self.lm_head, "weight")
        return targets

    @torch.no_grad()
    def set_draft_map(self, d2t: torch.Tensor) -> None:
        """EAGLE-3's `d2t` [Vd] (offsets: target id = draft id + d2t); ValueError naming a bad one."""
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if tuple(d2t.shape) != (vd,) or d2t.dtype.is_floating_point:
            raise ValueError(f"d2t has shape {tuple(d2t.shape)} and dtype {d2t.dtype}, expected [{vd}] integers "
                             "(draft_vocab_size)")
        target = torch.arange(vd) + d2t.long().cpu()
        if vd and not (0 <= int(target.min()) and int(target.max()) < v):
            raise ValueError(f"d2t maps draft ids to target ids in [{int(target.min())}, {int(target.max())}], "
                             f"outside the target vocabulary [0, {v})")
        self._draft_map().copy_(target)


def dummy_draft_map(config: EagleHeadConfig, seed: int) -> torch.Tensor:
    """A built-in head's `d2t`: a sorted random subset of the target's ids (offsets per draft id)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(config.vocab_size, generator=gen)[: config.draft_vocab_size].sort().values
    return ids - torch.arange(config.draft_vocab_size)


def read_head_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head folder by normalized name (heads are one layer: a few hundred MB)."""
    from graphrunner.models import loader

    return {_normalize(name): tensor for name, tensor in loader.iter_checkpoint_weights(folder)}


def load_head_weights(head: EagleHead, folder: Path) -> None:
    """Fill `head` from its folder; CheckpointError naming the folder and tensor at fault."""
    from graphrunner.models.loader import CheckpointError

    tensors = read_head_weights(folder)
    where = f"speculator head folder {str(folder)!r}"
    targets = head.weight_targets()
    ignored = {"t2d", "lm_head.weight"} if not head.eagle3 else {"t2d"}
    for name, tensor in tensors.items():
        if name in targets:
            shape, load = targets[name]
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            load(tensor)
        elif name != "d2t" and name not in ignored and not name.endswith("rotary_emb.inv_freq"):
            raise CheckpointError(f"{where}: unexpected tensor {name!r}; an {head.config.method} head has no such "
                                  "weight")
    missing = sorted(set(targets) - set(tensors))
    if missing:
        raise CheckpointError(f"{where} is missing {len(missing)} tensor(s): {missing[:8]}")
    if head.eagle3:
        c = head.config
        if "d2t" in tensors:
            try:
                head.set_draft_map(tensors["d2t"])
            except ValueError as e:
                raise CheckpointError(f"{where}: {e}") from None
        elif c.draft_vocab_size != c.vocab_size:
            raise CheckpointError(f"{where} has no 'd2t' tensor: its draft vocabulary ({c.draft_vocab_size} ids) "
                                  f"needs the map to the target's {c.vocab_size} ids")


__all__ = [
    "EAGLE_METHODS",
    "EagleHead",
    "EagleHeadConfig",
    "builtin_head_config",
    "default_aux_layers",
    "dummy_draft_map",
    "head_checkpoint_names",
    "head_config_from_dict",
    "is_builtin_head",
    "load_head_config",
    "load_head_weights",
]


def build_head(config: EagleHeadConfig, model: str, target: Any, target_config: ModelConfig, target_load: Any,
               seed: int, num_aux: int, attn_backend: Any, dtype: torch.dtype, device) -> EagleHead:
    """Build a head beside `target` and fill it: dummy weights from `seed` (built-in heads), else
    the head folder `model`. It shares the target's embedding, unless its folder
    has one or this pipeline stage holds none (then a copy of the target's is made here)."""
    from graphrunner.models import loader

    dummy = is_builtin_head(model)  # a head folder always loads its weights (a dummy target included)
    names = set() if dummy else head_checkpoint_names(Path(model))
    target_embedding = target.model.embed_tokens
    own = "embed_tokens.weight" in names or target_embedding is None
    head = EagleHead(config, attn_backend, dtype=dtype, device=device, own_embedding=own, num_aux=num_aux)
    if dummy:
        # The embedding is the target's (a copy of it on a stage without one): it draws nothing, so the
        # head's weights are the same on every pipeline stage.
        loader.init_dummy_weights(head, seed=seed, exclude=("embed_tokens.",))
        if head.eagle3:
            head.set_draft_map(dummy_draft_map(config, seed))
    else:
        load_head_weights(head, Path(model))
    if head.embed_tokens is not None and "embed_tokens.weight" not in names:
        # A pipeline stage without the target's embedding: the target's own values, drawn or read.
        head.embed_tokens.load_shard("weight", loader.full_parameter(target_config, target_load,
                                                                    "model.embed_tokens.weight", dtype, device))
    head.share(target_embedding, target)
    head.eval()
    return head
