"""Linear layers: the one seam where a projection picks its kernel, and its tensor-parallel split.

Every projection of a model owns a `LinearMethod`, chosen once when the layer is built from the
runner's `KernelConfig`, the device and the layer's shapes (`linear_method`); nothing is
re-decided per call. A method serves the three ways a decoder layer enters a projection:

  linear(x, W, b)                    y = x W^T + b
  add_norm_linear(norm, x, r, W, b)  (linear(RMSNorm(x + r)), x + r): a pre-norm half's entry
  swiglu_linear(gate_up, W, b)       linear(silu(gate) * up): the MLP's down projection

and `logits` for the LM head (fp32 out). The methods:

  LinearMethod   torch: F.linear, the norm's own add_norm, SiLU·mul in torch. CPU, meta, or
                 `decode_gemv` off.
  GemvMethod     CUDA with Triton: a single token row (decode at batch 1) runs as one GEMV launch
                 (layers/gemv.py), with the residual add + RMSNorm (`norm_gemv_max_k`) or SiLU·mul
                 (`swiglu_gemv_max_k`) folded in; several rows run cuBLAS (F.linear), after the
                 Triton add + RMSNorm or SiLU·mul kernel. The row count is known only at run time
                 under torch.compile (the compiled step's token count is an unbacked size), so the
                 choice is made inside opaque custom ops (`graphrunner::decode_linear`,
                 `graphrunner::add_norm_linear`, `graphrunner::swiglu_linear`) whose tiles are baked
                 in at construction: one compiled graph serves every size. Eagerly the same
                 functions run without the op dispatch.

Quantized weights attach here as further methods. LoRA adapters attach as `lora` (layers/lora/):
while its `active` flag is set (a forward run or captured for a batch with adapters), a projection
adds each token row's adapter to its output, the fused norm and SiLU·mul entries then run unfused
(the adapter reads the normed input). Unset, and for a runner without LoRA (`lora` None), nothing
of it runs.

Each layer class is a plain projection at tp_size=1, but already knows how its weight is split
across tensor-parallel ranks and how to load its share from a full Hugging Face tensor:

  ColumnLinear        output dim split across ranks (no communication)
  QKVLinear           fused q|k|v projection; loads q_proj/k_proj/v_proj into slices
  MergedColumnLinear  fused [gate|up] projection; loads each part into its slice
  RowLinear           input dim split across ranks; partial sums all-reduced

Checkpoint shapes (`checkpoint_shape`) are always the full, unsharded HF shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.config import KernelConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.device import DeviceProperties, device_properties
from graphrunner.kernels.pdl import pdl_max_rows
from graphrunner.layers.gemv import (
    GEMV_DTYPES,
    Tile,
    gemv_plan,
    gemv_triton,
    norm_gemv_plan,
    norm_gemv_triton,
    silu_mul_triton,
)
from graphrunner.layers.norm import add_rms_norm_triton

_HALF = (torch.bfloat16, torch.float16)


class LinearMethod:
    """Torch projections: F.linear for every row count (module docstring)."""

    name = "torch"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(torch: F.linear)"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)  # x [T, K] -> [T, N]

    def add_norm_linear(self, norm: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual), x and residual [T, K]; `norm` an RMSNorm."""
        normed, residual = norm.add_norm(x, residual)
        return self.linear(normed, weight, bias), residual

    def swiglu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:  # [T, 2K] -> [T, N]
        gate, up = gate_up.chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, weight, bias)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [R, H] x [V, H] -> [R, V] fp32
        """The sampler's fp32 logits.

        A half-precision head with several rows on CUDA: one GEMM that accumulates in fp32 and
        writes fp32 (`mm`'s `out_dtype`) instead of a half-precision [R, V] result and a cast
        kernel that reads it back and writes it again (at 256 rows x 151,936 that cast alone took
        121 us of a 2.97 ms qwen2.5-0.5b step on an H100). The logits are then the fp32
        accumulator itself, not its rounding to the model dtype (HF rounds; the difference is
        within that rounding). CPU and fp32 models: the model-dtype matmul, as HF.
        """
        if hidden.is_cuda and hidden.dtype in _HALF and weight.dtype == hidden.dtype and hidden.shape[0] > 1:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return self.linear(hidden, weight).float()


TORCH_LINEAR = LinearMethod()


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype and x.dtype in GEMV_DTYPES
            and x.stride(-1) == 1 and weight.stride(-1) == 1 and (bias is None or bias.dtype == x.dtype))


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Sequence[int],
                 pdl_rows: int) -> torch.Tensor:
    """F.linear, or `gemv_triton` with `tile` for a single row: chosen on the real shapes at run time."""
    if _gemv_fits(x, weight, bias):
        return gemv_triton(x, weight, bias, tuple(tile), pdl_rows=pdl_rows)  # type: ignore[arg-type]
    return F.linear(x, weight, bias)


def _swiglu_rows(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Sequence[int],
                 fused: bool, pdl_rows: int) -> torch.Tensor:
    """One row (with `fused`): the GEMV forms silu(gate) * up while it loads x. Otherwise the Triton
    SiLU·mul kernel, then `_linear_rows`."""
    if fused and _gemv_fits(gate_up, weight, bias):
        return gemv_triton(gate_up, weight, bias, tuple(tile), swiglu=True, pdl_rows=pdl_rows)  # type: ignore[arg-type]
    return _linear_rows(silu_mul_triton(gate_up), weight, bias, tile, pdl_rows)


def _add_norm_rows(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   weight: torch.Tensor, bias: torch.Tensor | None, norm_tile: Sequence[int], tile: Sequence[int],
                   pdl_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row (with a `norm_tile`): `norm_gemv_triton`, one launch. Otherwise the Triton add + RMSNorm
    kernel, then `_linear_rows`. The normalized row is bit-identical either way."""
    if (norm_tile and _gemv_fits(x, weight, bias) and residual.dtype == norm_weight.dtype == x.dtype
            and residual.stride(-1) == 1):
        return norm_gemv_triton(x, residual, norm_weight, eps, weight, bias, tuple(norm_tile),  # type: ignore[arg-type]
                                pdl_rows=pdl_rows)
    normed, residual = add_rms_norm_triton(x, residual, norm_weight, eps, pdl_rows)
    return _linear_rows(normed, weight, bias, tile, pdl_rows), residual


decode_linear = torch.library.custom_op("graphrunner::decode_linear", _linear_rows, mutates_args=())
swiglu_linear = torch.library.custom_op("graphrunner::swiglu_linear", _swiglu_rows, mutates_args=())
add_norm_linear = torch.library.custom_op("graphrunner::add_norm_linear", _add_norm_rows, mutates_args=())


@decode_linear.register_fake
def _decode_linear_fake(x, weight, bias, tile, pdl_rows) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@swiglu_linear.register_fake
def _swiglu_linear_fake(gate_up, weight, bias, tile, fused, pdl_rows) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape[0], weight.shape[0])


@add_norm_linear.register_fake
def _add_norm_linear_fake(x, residual, norm_weight, eps, weight, bias, norm_tile, tile,
                          pdl_rows) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], weight.shape[0]), torch.empty(x.shape, dtype=x.dtype, device=x.device)


class GemvMethod(LinearMethod):
    """CUDA with Triton: the one-launch GEMV for a single row, cuBLAS for several (module docstring).

    `tile` is the GEMV's (BLOCK_N, BLOCK_K, num_warps) (`gemv_plan`; the SwiGLU GEMV uses it too),
    `norm_tile` the fused add + RMSNorm GEMV's (`norm_gemv_plan`; empty: that entry runs the norm
    kernel, then the projection), `fuse_swiglu` whether SiLU·mul folds into the single-row GEMV,
    `pdl_rows` the largest launch that uses PDL."""

    name = "gemv"

    def __init__(self, tile: Tile, norm_tile: Tile | tuple[()], fuse_swiglu: bool, pdl_rows: int) -> None:
        self.tile, self.norm_tile, self.fuse_swiglu, self.pdl_rows = tile, norm_tile, fuse_swiglu, pdl_rows

    def __repr__(self) -> str:
        return (f"GemvMethod(tile={self.tile}, norm_tile={self.norm_tile}, fuse_swiglu={self.fuse_swiglu}, "
                f"pdl_rows={self.pdl_rows})")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return decode_linear(x, weight, bias, self.tile, self.pdl_rows)
        return _linear_rows(x, weight, bias, self.tile, self.pdl_rows)

    def add_norm_linear(self, norm: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return add_norm_linear(x, residual, norm.weight, norm.eps, weight, bias, self.norm_tile, self.tile,
                               self.pdl_rows)

    def swiglu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return swiglu_linear(gate_up, weight, bias, self.tile, self.fuse_swiglu, self.pdl_rows)
        return _swiglu_rows(gate_up, weight, bias, self.tile, self.fuse_swiglu, self.pdl_rows)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One half-precision row: the GEMV writing fp32 (its accumulator, no cast kernel), so batch 1
        and larger batches round alike."""
        if hidden.dtype in _HALF and _gemv_fits(hidden, weight, None) and not torch.compiler.is_compiling():
            return gemv_triton(hidden, weight, None, self.tile, out_dtype=torch.float32, pdl_rows=self.pdl_rows)
        return super().logits(hidden, weight)


def linear_method(kernel: KernelConfig, weight: torch.Tensor) -> LinearMethod:
    """The method of a projection with `weight` [N, K] (this rank's share, on the device it runs on)."""
    n, k = weight.shape
    return choose_linear_method(kernel, device_properties(weight.device), n, k)


def choose_linear_method(kernel: KernelConfig, device: DeviceProperties | None, n: int, k: int) -> LinearMethod:
    """The method of an [N, K] projection under `kernel` on a GPU with properties `device` (None:
    not a GPU, the torch method): the GEMV tiles, the fused entries that `kernel` allows, PDL."""
    if not (kernel.decode_gemv and HAS_TRITON and device is not None):
        return TORCH_LINEAR
    norm_tile = norm_gemv_plan(n, k, device) if k <= kernel.norm_gemv_max_k else ()
    return GemvMethod(gemv_plan(n, k, device), norm_tile, k <= kernel.swiglu_gemv_max_k, pdl_max_rows(kernel, device))


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
        kernel: KernelConfig | None,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_local, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.method = linear_method(kernel or KernelConfig(), self.weight)
        self.lora: Any = None  # layers.lora.weights.LoraWeights, attached by the runner with LoRA on

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_local] -> [T, out_local]
        out = self.method.linear(x, self.weight, self.bias)
        lora = self.lora
        if lora is not None and lora.active:
            lora.apply(x, out)
        return out

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
        kernel: KernelConfig | None = None,
    ) -> None:
        self.in_features, self.out_features = in_features, out_features
        out_local = _split(out_features, tp_size, "out_features")
        super().__init__(
            in_features, out_local, bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank,
            kernel=kernel,
        )

    # A shard is one fused part (q/k/v, gate/up); plain ColumnLinear has one, `None`.
    def _shard_layout(self, shard_id) -> tuple[int, int, int]:
        """(full size, local offset, local size) of `shard_id` along the output dim."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        return self.out_features, 0, self.weight.shape[0]

    def add_norm_forward(self, norm: Any, x: torch.Tensor,
                         residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), x and residual [T, in_features]: a decoder
        half's entry (`norm` an RMSNorm); one launch at one row on CUDA (`GemvMethod`)."""
        lora = self.lora
        if lora is not None and lora.active:  # the adapter reads the normed rows
            normed, residual = norm.add_norm(x, residual)
            return self(normed), residual
        return self.method.add_norm_linear(norm, x, residual, self.weight, self.bias)

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
        kernel: KernelConfig | None = None,
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
                             device=device, tp_size=tp_size, tp_rank=tp_rank, kernel=kernel)

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
        kernel: KernelConfig | None = None,
    ) -> None:
        self.out_sizes = tuple(out_sizes)
        self.local_sizes = tuple(_split(s, tp_size, f"out_sizes[{i}]") for i, s in enumerate(self.out_sizes))
        super().__init__(
            in_features, sum(self.out_sizes), bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank,
            kernel=kernel,
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
        kernel: KernelConfig | None = None,
    ) -> None:
        if tp_size > 1 and all_reduce is None:
            raise ValueError(f"RowLinear with tp_size={tp_size} needs an all_reduce function")
        self.in_features, self.out_features = in_features, out_features
        in_local = _split(in_features, tp_size, "in_features")
        super().__init__(
            in_local, out_features, bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank,
            kernel=kernel,
        )
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_local] -> [T, out]
        return self._reduced(self.method.linear, x)

    def forward_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * in_local] -> [T, out]
        """forward(silu(gate) * up) of gate_up's [gate | up] halves (`LinearMethod.swiglu_linear`: one
        GEMV launch for a single row on CUDA, else one SiLU·mul kernel and the GEMM)."""
        lora = self.lora
        if lora is not None and lora.active:  # the adapter reads the activation
            gate, up = gate_up.chunk(2, dim=-1)
            return self._reduced(self.method.linear, F.silu(gate) * up)
        return self._reduced(self.method.swiglu_linear, gate_up)

    def _reduced(self, project: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """project(x, weight[, bias]) summed over the TP ranks; the bias is added once, after the sum.
        An active adapter adds its share to this rank's partial sum, before the reduction."""
        lora = self.lora
        if lora is not None and lora.active:
            out = project(x, self.weight, self.bias if self.tp_size == 1 else None)
            lora.apply(x, out)
            if self.tp_size == 1:
                return out
        elif self.tp_size == 1:
            return project(x, self.weight, self.bias)
        else:
            out = project(x, self.weight)
        assert self.all_reduce is not None, "checked in __init__: tp_size > 1 needs all_reduce"
        out = self.all_reduce(out)
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
