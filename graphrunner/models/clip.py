"""CLIP vision tower (the image encoder of LLaVA): patch embedding, pre-norm transformer layers.

Parameter names follow transformers' `CLIPVisionTransformer` (`embeddings.patch_embedding`,
`pre_layrnorm`, `encoder.layers.N.self_attn.q_proj`, ...), so checkpoint tensors load by name.
It runs eagerly, once per image batch the scheduler lists (`EmbedInputs._encode`), outside the
decoder's graphs; every image has the same size (the processor crops to `image_size`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.config import VisionConfig

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    """The activation function named in a config; ValueError naming the supported ones."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; allowed: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class _Embeddings(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.class_embedding = nn.Parameter(torch.zeros(c.hidden_size, **kw), requires_grad=False)
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size, bias=False,
                                         **kw)
        self.position_embedding = nn.Embedding(c.num_patches + 1, c.hidden_size, **kw)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, 1 + P, D]
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        kw = dict(dtype=dtype, device=device)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(c.hidden_size, c.hidden_size, **kw) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, D]
        n, length, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, heads, L, D / heads]
            return t.view(n, length, self.num_heads, d // self.num_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(n, length, d))


class _MLP(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.act = activation(c.hidden_act)
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size, dtype=dtype, device=device)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        kw = dict(eps=c.layer_norm_eps, dtype=dtype, device=device)
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(c.hidden_size, **kw), nn.LayerNorm(c.hidden_size, **kw)
        self.self_attn = _Attention(c, dtype, device)
        self.mlp = _MLP(c, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c, dtype, device) for _ in range(c.num_hidden_layers))


class CLIPVisionTower(nn.Module):
    """pixels [N, C, S, S] -> the hidden states of `vision_feature_layer` [N, 1 + P, D]."""

    def __init__(self, config: VisionConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config, dtype, device)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype, device=device)
        self.encoder = _Encoder(config, dtype, device)
        # Checkpoints hold it; LLaVA's features come from inside the stack, before it.
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype, device=device)
        self.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        c = self.config
        # hidden_states[0] is the embedding's output, hidden_states[i] layer i's: run only what is read.
        layer = c.vision_feature_layer % (c.num_hidden_layers + 1)
        x = self.pre_layrnorm(self.embeddings(pixels))
        for block in self.encoder.layers[:layer]:
            x = block(x)
        return x
