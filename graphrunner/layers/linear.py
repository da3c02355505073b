"""Linear layers with a tensor-parallel seam.

Each class is a plain linear (`decode_linear.linear`: F.linear, or a one-launch GEMV for a
single token row on CUDA) at tp_size=1, but already knows how its weight is
split across tensor-parallel ranks and how to load its share from a full Hugging Face
tensor. Turning on tensor parallelism later means passing `tp_size`/`tp_rank` and an
`all_reduce` for `RowLinear`; the model file does not change.

  ColumnLinear        output dim split across ranks (no communication)
  QKVLinear           fused q|k|v projection; loads q_proj/k_proj/v_proj into slices
  MergedColumnLinear  fused [gate|up] projection; loads each part into its slice
  RowLinear           input dim split across ranks; partial sums all-reduced

Checkpoint shapes (`checkpoint_shape`) are always the full, unsharded HF shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from graphrunner.layers.decode_linear import linear
from graphrunner.layers.swiglu import swiglu_linear


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what}={size} is not divisible by tp_size={tp_size}")
    return size // tp_size


class _LinearBase(nn.Module):
    """Owns `weight` [out_local, in_local] and optional `bias`; inference only."""

    def __init__(
        self,
        in_local: int,
        out_local: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device,
        tp_size: int,
        tp_rank: int,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_local, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_local] -> [T, out_local]
        return linear(x, self.weight, self.bias)  # a one-launch GEMV for T = 1 on CUDA (decode_linear.py)

    def _param(self, name: str) -> nn.Parameter:
        param = getattr(self, name, None)
        if name not in ("weight", "bias") or param is None:
            raise ValueError(f"{type(self).__name__} has no parameter {name!r}")
        return param


class ColumnLinear(_LinearBase):
    """y = x W^T + b with W's output rows split evenly across tensor-parallel ranks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device=None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.in_features, self.out_features = in_features, out_features
        out_local = _split(out_features, tp_size, "out_features")
        super().__init__(
            in_features, out_local, bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank
        )

    # A shard is one fused part (q/k/v, gate/up); plain ColumnLinear has one, `None`.
    def _shard_layout(self, shard_id) -> tuple[int, int, int]:
        """(full size, local offset, local size) of `shard_id` along the output dim."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        return self.out_features, 0, self.weight.shape[0]

    def checkpoint_shape(self, param: str, shard_id=None) -> tuple[int, ...]:
        full, _, _ = self._shard_layout(shard_id)
        self._param(param)
        return (full, self.in_features) if param == "weight" else (full,)

    @torch.no_grad()
    def load_shard(self, param: str, tensor: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full HF `tensor` into the slice of `shard_id`."""
        _, offset, size = self._shard_layout(shard_id)
        src = tensor.narrow(0, self.tp_rank * size, size)
        self._param(param).narrow(0, offset, size).copy_(src)


class QKVLinear(ColumnLinear):
    """Fused q|k|v projection: output [T, (H + 2 * Hkv) * D] on one rank, heads split across ranks.

    q heads are split over the `tp_size` ranks. k/v heads are split over `kv_tp_size` shards
    (default: the TP ranks); decode context parallelism passes T / D, so that the D ranks of a
    DCP group compute and hold the same KV heads (`kv_tp_rank` = tp_rank // D).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device=None,
        tp_size: int = 1,
        tp_rank: int = 0,
        kv_tp_size: int | None = None,
        kv_tp_rank: int | None = None,
    ) -> None:
        self.kv_tp_size = tp_size if kv_tp_size is None else kv_tp_size
        self.kv_tp_rank = tp_rank if kv_tp_rank is None else kv_tp_rank
        # KV heads are split, not replicated: kv_tp_size must divide num_kv_heads.
        self.num_heads = _split(num_heads, tp_size, "num_heads")
        self.num_kv_heads = _split(num_kv_heads, self.kv_tp_size, "num_kv_heads")
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim  # per rank
        self.in_features, self.out_features = hidden_size, (num_heads + 2 * num_kv_heads) * head_dim
        _LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype,
                             device=device, tp_size=tp_size, tp_rank=tp_rank)

    def _shard_layout(self, shard_id) -> tuple[int, int, int]:
        q, kv = self.q_size, self.kv_size
        layout = {"q": (q * self.tp_size, 0, q), "k": (kv * self.kv_tp_size, q, kv),
                  "v": (kv * self.kv_tp_size, q + kv, kv)}
        if shard_id not in layout:
            raise ValueError(f"QKVLinear shard must be one of {sorted(layout)}, got {shard_id!r}")
        return layout[shard_id]

    @torch.no_grad()
    def load_shard(self, param: str, tensor: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full HF q/k/v `tensor` into the slice of `shard_id`."""
        _, offset, size = self._shard_layout(shard_id)
        rank = self.tp_rank if shard_id == "q" else self.kv_tp_rank
        self._param(param).narrow(0, offset, size).copy_(tensor.narrow(0, rank * size, size))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q+2kv] -> q [T, H, D], k [T, Hkv, D], v [T, Hkv, D] (views of `qkv`)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )


class MergedColumnLinear(ColumnLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (e.g. gate and up of a gated MLP); each part is split across ranks separately."""

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device=None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.out_sizes = tuple(out_sizes)
        self.local_sizes = tuple(_split(s, tp_size, f"out_sizes[{i}]") for i, s in enumerate(self.out_sizes))
        super().__init__(
            in_features, sum(self.out_sizes), bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank
        )

    def _shard_layout(self, shard_id) -> tuple[int, int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.out_sizes):
            raise ValueError(f"MergedColumnLinear shard must be in [0, {len(self.out_sizes)}), got {shard_id!r}")
        return self.out_sizes[shard_id], sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]


class RowLinear(_LinearBase):
    """y = x W^T + b with W's input columns split across ranks; each rank holds a partial
    sum that `all_reduce` (injected by the caller) combines. The bias is added once,
    after the reduction."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device=None,
        tp_size: int = 1,
        tp_rank: int = 0,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if tp_size > 1 and all_reduce is None:
            raise ValueError(f"RowLinear with tp_size={tp_size} needs an all_reduce function")
        self.in_features, self.out_features = in_features, out_features
        in_local = _split(in_features, tp_size, "in_features")
        super().__init__(
            in_local, out_features, bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank
        )
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_local] -> [T, out]
        return self._reduced(linear, x)

    def forward_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * in_local] -> [T, out]
        """forward(silu(gate) * up) of gate_up's [gate | up] halves (layers/swiglu.py: one GEMV launch
        for a single row on CUDA, else one SiLU·mul kernel and the GEMM)."""
        return self._reduced(swiglu_linear, gate_up)

    def _reduced(self, project: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """project(x, weight[, bias]) summed over the TP ranks; the bias is added once, after the sum."""
        if self.tp_size == 1:
            return project(x, self.weight, self.bias)
        assert self.all_reduce is not None, "checked in __init__: tp_size > 1 needs all_reduce"
        out = self.all_reduce(project(x, self.weight))
        return out if self.bias is None else out + self.bias

    def checkpoint_shape(self, param: str, shard_id=None) -> tuple[int, ...]:
        if shard_id is not None:
            raise ValueError(f"RowLinear has no shard {shard_id!r}")
        self._param(param)
        return (self.out_features, self.in_features) if param == "weight" else (self.out_features,)

    @torch.no_grad()
    def load_shard(self, param: str, tensor: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's columns of the full HF weight (the whole bias) into place."""
        if shard_id is not None:
            raise ValueError(f"RowLinear has no shard {shard_id!r}")
        if param == "weight":
            size = self.weight.shape[1]
            tensor = tensor.narrow(1, self.tp_rank * size, size)
        self._param(param).copy_(tensor)
