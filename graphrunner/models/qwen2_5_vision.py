"""Qwen2.5-VL's vision tower: patch embedding, 2D rotary, windowed attention blocks, patch merger.

Parameter names follow transformers' `Qwen2_5_VisionTransformerPretrainedModel` (`patch_embed.proj`,
`blocks.N.attn.qkv`, `blocks.N.mlp.gate_proj`, `merger.ln_q`, `merger.mlp.0`, ...), so checkpoint
tensors load by name. It runs eagerly, once per image batch the scheduler lists, outside the decoder's
graphs: images differ in size, so every shape here follows the batch's grids.

Layout. The processor lays each image's patches out block by block (`spatial_merge_size`² neighbours
in a row), so the merger's groups of consecutive rows are those blocks. The blocks then attend within
windows of `window_size` pixels: the tower reorders blocks window by window (`window_order`), runs
every layer on that order (full-attention layers see each image frame whole, windowed ones each
window) and restores the processor's order after the merger.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.config import Qwen2_5_VisionConfig
from graphrunner.models.clip import activation

_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu")
_NORM_EPS = 1e-6  # transformers hard-codes the tower's RMSNorm epsilon


def _vision_activation(name: str):
    if name == "silu":
        return F.silu
    return activation(name)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _NORM_EPS)
        return self.weight * xf.to(x.dtype)


class _PatchEmbed(nn.Module):
    """A Conv3d whose stride equals its kernel: one linear map over each patch's C·T·P² values."""

    def __init__(self, c: Qwen2_5_VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel, stride=kernel, bias=False, dtype=dtype,
                              device=device)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, C·T·P²] -> [N, D]
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.view(w.shape[0], -1))


class _Attention(nn.Module):
    def __init__(self, c: Qwen2_5_VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, dtype=dtype, device=device)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, heads, hd] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segments.attend(q, k, v).reshape(n, -1))


class _MLP(nn.Module):
    def __init__(self, c: Qwen2_5_VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, **kw)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, **kw)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, **kw)
        self.act = _vision_activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, c: Qwen2_5_VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.norm1, self.norm2 = _RMSNorm(c.hidden_size, dtype, device), _RMSNorm(c.hidden_size, dtype, device)
        self.attn = _Attention(c, dtype, device)
        self.mlp = _MLP(c, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate each block's merge² patches, then linear -> GELU -> linear."""

    def __init__(self, c: Qwen2_5_VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        width = c.hidden_size * c.spatial_merge_size ** 2
        self.ln_q = _RMSNorm(c.hidden_size, dtype, device)
        self.mlp = nn.Sequential(nn.Linear(width, width, dtype=dtype, device=device), nn.GELU(),
                                 nn.Linear(width, c.out_hidden_size, dtype=dtype, device=device))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N / merge², out_hidden]
        return self.mlp(self.ln_q(x).view(-1, self.width))


class _Segments:
    """Attention within runs of consecutive rows (`lengths`, host ints): the runs are gathered into a
    padded [runs, longest] batch and masked, one SDPA call for all of them."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        lens = torch.tensor(lengths, device=device)
        starts = torch.cumsum(lens, 0) - lens
        col = torch.arange(max(lengths), device=device)
        self.valid = col[None, :] < lens[:, None]  # [runs, longest]
        self.index = torch.where(self.valid, starts[:, None] + col[None, :], 0)  # [runs, longest]
        self.mask = self.valid[:, None, None, :]  # keys of each run: [runs, 1, 1, longest]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [N, heads, hd] each
        def runs(t: torch.Tensor) -> torch.Tensor:  # [N, heads, hd] -> [runs, heads, longest, hd]
            return t[self.index].transpose(1, 2)

        out = F.scaled_dot_product_attention(runs(q), runs(k), runs(v), attn_mask=self.mask)
        return out.transpose(1, 2)[self.valid]  # [N, heads, hd], rows back in order


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation in float32 (as transformers' vision rotary), back in x's dtype. cos, sin: [N, hd]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def window_order(grids: list[tuple[int, int, int]], merge: int, window_blocks: int) -> tuple[torch.Tensor, list[int]]:
    """(order [blocks] int64, window lengths in patches): the merge blocks of every image, window by
    window (frames first, then windows of `window_blocks`² blocks in row-major order, each window's
    blocks in row-major order), as global block indices; empty windows are left out."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    first = 0
    for t, h, w in grids:
        bh, bw = h // merge, w // merge
        rows = torch.arange(bh).view(1, bh, 1).expand(t, bh, bw)
        cols = torch.arange(bw).view(1, 1, bw).expand(t, bh, bw)
        frames = torch.arange(t).view(t, 1, 1).expand(t, bh, bw)
        nh, nw = -(-bh // window_blocks), -(-bw // window_blocks)
        window = ((frames * nh + rows // window_blocks) * nw + cols // window_blocks).reshape(-1)
        # A stable sort keeps each window's blocks in the row-major order they were numbered in.
        order.append(torch.sort(window, stable=True).indices + first)
        counts = torch.bincount(window, minlength=t * nh * nw)
        lengths.extend(int(n) * merge * merge for n in counts.tolist() if n)
        first += t * bh * bw
    return torch.cat(order), lengths


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of every patch in the processor's block-by-block order."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        hw = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


class Qwen2_5_VisionTower(nn.Module):
    """patches [N, C·T·P²] of images with grids [(t, h, w), ...] -> decoder embeddings [N / merge², out_hidden],
    image after image, each image's rows in the processor's block order."""

    inv_freq: torch.Tensor

    def __init__(self, config: Qwen2_5_VisionConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {config.hidden_act!r} is not supported; allowed: {list(_ACTIVATIONS)}")
        self.config = config
        self.patch_embed = _PatchEmbed(config, dtype, device)
        self.blocks = nn.ModuleList(_Block(config, dtype, device) for _ in range(config.depth))
        self.merger = _PatchMerger(config, dtype, device)
        quarter = config.head_dim // 4  # h and w each rotate half of the rotated half
        exponent = torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=device) / (2 * quarter)
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** exponent, persistent=False)
        self.requires_grad_(False)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        c = self.config
        unit = c.spatial_merge_size ** 2
        n = patches.shape[0]
        expected = sum(t * h * w for t, h, w in grids)
        if n != expected:
            raise ValueError(f"{n} patches for image grids {grids} ({expected} patches)")
        device = patches.device
        order, window_lengths = window_order(grids, c.spatial_merge_size,
                                             c.window_size // c.spatial_merge_size // c.patch_size)
        order = order.to(device)

        def windowed(x: torch.Tensor) -> torch.Tensor:  # rows in block order -> rows window by window
            return x.view(n // unit, unit, -1)[order].reshape(n, -1)

        x = windowed(self.patch_embed(patches))  # [N, D]
        angles = patch_positions(grids, c.spatial_merge_size).to(device)[..., None] * self.inv_freq  # [N, 2, hd/4]
        angles = windowed(angles.reshape(n, -1))  # [N, hd/2]: the row's angles, then the column's
        cos, sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([angles.sin(), angles.sin()], -1)
        frames = _Segments([h * w for t, h, w in grids for _ in range(t)], device)
        windows = _Segments(window_lengths, device)
        full = set(c.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in full else windows)
        merged = self.merger(x)  # [N / merge², out_hidden], window by window
        return merged[torch.argsort(order)]
