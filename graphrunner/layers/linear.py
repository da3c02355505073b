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
runs through `lora.project`, which adds each token row's adapter to its output (under the one-row
GEMV, the adapter's shrink rides in the GEMV's launch); the fused norm and SiLU·mul entries then run
unfused (the adapter reads the normed input). Unset, and for a runner without LoRA (`lora` None), nothing
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

from graphrunner.config import KernelConfig, QuantConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.kernels.device import DeviceProperties, device_properties
from graphrunner.kernels.pdl import pdl_max_rows
from graphrunner.layers.fp8 import fp8_gemv_plan, fp8_linear, quantize_weight_fp8
from graphrunner.layers.gemv import (
    Tile,
    gemv_fits,
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


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Sequence[int],
                 pdl_rows: int) -> torch.Tensor:
    """F.linear, or `gemv_triton` with `tile` for a single row: chosen on the real shapes at run time."""
    if gemv_fits(x, weight, bias):
        return gemv_triton(x, weight, bias, tuple(tile), pdl_rows=pdl_rows)  # type: ignore[arg-type]
    return F.linear(x, weight, bias)


def _swiglu_rows(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Sequence[int],
                 fused: bool, pdl_rows: int) -> torch.Tensor:
    """One row (with `fused`): the GEMV forms silu(gate) * up while it loads x. Otherwise the Triton
    SiLU·mul kernel, then `_linear_rows`."""
    if fused and gemv_fits(gate_up, weight, bias):
        return gemv_triton(gate_up, weight, bias, tuple(tile), swiglu=True, pdl_rows=pdl_rows)  # type: ignore[arg-type]
    return _linear_rows(silu_mul_triton(gate_up), weight, bias, tile, pdl_rows)


def _add_norm_rows(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   weight: torch.Tensor, bias: torch.Tensor | None, norm_tile: Sequence[int], tile: Sequence[int],
                   pdl_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row (with a `norm_tile`): `norm_gemv_triton`, one launch. Otherwise the Triton add + RMSNorm
    kernel, then `_linear_rows`. The normalized row is bit-identical either way."""
    if (norm_tile and gemv_fits(x, weight, bias) and residual.dtype == norm_weight.dtype == x.dtype
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
        if hidden.dtype in _HALF and gemv_fits(hidden, weight, None) and not torch.compiler.is_compiling():
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


class Fp8LinearMethod(LinearMethod):
    """fp8 (e4m3) weights with fp32 scales (layers/fp8.py): each token row is quantized to fp8 at
    run time (per row, or per `block[1]` columns with block scales; `input_scale`: the checkpoint's
    static scale), the product accumulates in fp32 and both scales multiply it. CPU: the exact
    dequantized arithmetic in torch; CUDA: the fp8 GEMV for one row (half the bytes of a bf16
    weight), scaled GEMMs for several. Under torch.compile one opaque op serves every row count.
    The fused norm entry runs its torch/Triton form first, then this projection; SiLU·mul folds into
    the one-row GEMV (`swiglu_linear`).

    `weight_scale` [N] per output row, or [ceil(N / block[0]), ceil(K / block[1])] per tile; the
    tensors are the layer's own parameters, bound once they hold their final values."""

    name = "fp8"

    def __init__(self, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                 block: tuple[int, int] | None, tile: tuple[int, int, int] | None) -> None:
        self.weight_scale, self.input_scale, self.block, self.tile = weight_scale, input_scale, block, tile

    def __repr__(self) -> str:
        scales = f"block {self.block}" if self.block else "per channel"
        return f"Fp8LinearMethod({scales}, {'static' if self.input_scale is not None else 'dynamic'} activations)"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, weight, self.weight_scale, bias, block=self.block, input_scale=self.input_scale,
                          tile=self.tile)

    def swiglu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up, then this projection; one launch at one row on CUDA (the GEMV forms the product
        as it loads x), so a decode step's down projection needs no SiLU·mul kernel of its own."""
        return fp8_linear(gate_up, weight, self.weight_scale, bias, block=self.block, input_scale=self.input_scale,
                          tile=self.tile, swiglu=True)


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
        quant: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.quant = quant
        prequantized = quant is not None and quant.prequantized
        weight_dtype = torch.float8_e4m3fn if prequantized else dtype
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=weight_dtype, device=device),
                                   requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_local, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.weight_scale: nn.Parameter | None = None
        self.input_scale: nn.Parameter | None = None
        self.method = linear_method(kernel or KernelConfig(), self.weight)
        if prequantized:
            assert quant is not None
            self.weight_scale = nn.Parameter(torch.ones(self._scale_shape(out_local, in_local), device=device),
                                             requires_grad=False)
            if quant.activation_scheme == "static":  # fused parts take the largest of their scales, as vLLM
                self.input_scale = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)
            self._bind_fp8()
        self.lora: Any = None  # layers.lora.weights.LoraWeights, attached by the runner with LoRA on

    def _scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The local weight scale's shape: [rows] per output channel (a per-tensor scale is held per row,
        so fused parts keep theirs exactly), or one per block tile."""
        assert self.quant is not None
        if self.quant.block_size is None:
            return (rows,)
        bn, bk = self.quant.block_size
        return (-(-rows // bn), -(-cols // bk))

    def _bind_fp8(self) -> None:
        assert self.quant is not None and self.weight_scale is not None
        device = device_properties(self.weight.device)
        n, k = self.weight.shape
        tile = fp8_gemv_plan(n, k) if device is not None else None
        self.method = Fp8LinearMethod(self.weight_scale, self.input_scale, self.quant.block_size, tile)

    @torch.no_grad()
    def quantize_weights(self) -> None:
        """Online fp8: replace the loaded model-dtype weight by its e4m3 values and fp32 scales (per output
        channel, or per block tile). Nothing for a layer without quantization or already in fp8."""
        if self.quant is None or self.weight.dtype == torch.float8_e4m3fn:
            return
        weight, scale = quantize_weight_fp8(self.weight, self.quant.block_size)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float(), requires_grad=False)
        self._bind_fp8()

    def _check_block_aligned(self, what: str, offset: int, size: int, block: int) -> None:
        """A block-scaled weight's tiles cannot straddle two fused parts or two ranks' shares."""
        if offset % block or (size % block and offset + size != self._local_extent(what)):
            raise ValueError(
                f"{type(self).__name__}: {what} [{offset}, {offset + size}) of this rank is not aligned to the "
                f"fp8 weight block of {block}; block-wise scales need every fused part and tensor-parallel share "
                "to start on a block boundary"
            )

    def _local_extent(self, what: str) -> int:
        return self.weight.shape[0] if what == "rows" else self.weight.shape[1]

    @torch.no_grad()
    def _load_scale(self, param: str, tensor: torch.Tensor, rows: tuple[int, int, int] | None,
                    cols: tuple[int, int] | None) -> None:
        """Copy a checkpoint scale into place. `rows`: (full-tensor row offset of this rank's share, local
        offset, size) of a column-parallel part (None: every local row); `cols`: (full-tensor column offset,
        size) of this rank's input share (None: every column)."""
        assert self.quant is not None
        if param == "input_scale":
            assert self.input_scale is not None
            self.input_scale.copy_(torch.maximum(self.input_scale, tensor.reshape(1).float()))
            return
        scale = self.weight_scale
        assert scale is not None
        src_row, local_row, size = rows if rows is not None else (0, 0, self.weight.shape[0])
        block = self.quant.block_size
        if block is None:
            target = scale.narrow(0, local_row, size)
            if self.quant.weight_scale == "tensor":
                target.copy_(tensor.reshape(()).float().expand(size))
            else:
                target.copy_(tensor.reshape(-1).narrow(0, src_row, size).float())
            return
        bn, bk = block
        self._check_block_aligned("rows", local_row, size, bn)
        self._check_block_aligned("rows", src_row, 0, bn)  # this rank's share of the checkpoint tensor
        src = tensor.float().narrow(0, src_row // bn, -(-size // bn))
        if cols is not None:
            if cols[0] % bk or (cols[1] % bk and self.tp_size > 1):
                raise ValueError(f"{type(self).__name__}: this rank's input columns [{cols[0]}, {cols[0] + cols[1]}) "
                                 f"are not aligned to the fp8 weight block of {bk} columns; choose a tensor-parallel "
                                 "size that splits the input on block boundaries")
            src = src.narrow(1, cols[0] // bk, -(-cols[1] // bk))
        scale.narrow(0, local_row // bn, -(-size // bn)).copy_(src)

    def _scale_checkpoint_shape(self, param: str, rows: int, cols: int) -> tuple[int, ...]:
        """The full checkpoint shape of a scale of an [rows, cols] weight (a per-tensor scale is a scalar;
        [N, 1] and [1] forms load too: `load_weights` reshapes a scale of the same size)."""
        assert self.quant is not None
        if param == "input_scale" or self.quant.weight_scale == "tensor":
            return ()
        if self.quant.block_size is None:
            return (rows,)
        bn, bk = self.quant.block_size
        return (-(-rows // bn), -(-cols // bk))

    def _check_weight_dtype(self, param: str, tensor: torch.Tensor) -> None:
        if param == "weight" and self.weight.dtype == torch.float8_e4m3fn and tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{type(self).__name__}: the checkpoint's fp8 format expects float8_e4m3fn weights, "
                             f"got {tensor.dtype}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_local] -> [T, out_local]
        lora = self.lora
        if lora is not None and lora.active:
            return lora.project(self.method, x, self.weight, self.bias)
        return self.method.linear(x, self.weight, self.bias)

    def _param(self, name: str) -> nn.Parameter:
        param = getattr(self, name, None)
        if name not in ("weight", "bias", "weight_scale", "input_scale") or param is None:
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
        quant: QuantConfig | None = None,
    ) -> None:
        self.in_features, self.out_features = in_features, out_features
        out_local = _split(out_features, tp_size, "out_features")
        super().__init__(
            in_features, out_local, bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank,
            kernel=kernel, quant=quant,
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

    def _shard_rank(self, shard_id) -> int:
        """Which share of `shard_id`'s full tensor this rank holds."""
        return self.tp_rank

    def checkpoint_shape(self, param: str, shard_id=None) -> tuple[int, ...]:
        full, _, _ = self._shard_layout(shard_id)
        self._param(param)
        if param in ("weight_scale", "input_scale"):
            return self._scale_checkpoint_shape(param, full, self.in_features)
        return (full, self.in_features) if param == "weight" else (full,)

    @torch.no_grad()
    def load_shard(self, param: str, tensor: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full HF `tensor` (a weight, bias or fp8 scale) into the slice of
        `shard_id`."""
        _, offset, size = self._shard_layout(shard_id)
        start = self._shard_rank(shard_id) * size
        if param in ("weight_scale", "input_scale"):
            self._param(param)
            self._load_scale(param, tensor, (start, offset, size), None)
            return
        self._check_weight_dtype(param, tensor)
        self._param(param).narrow(0, offset, size).copy_(tensor.narrow(0, start, size))


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
        quant: QuantConfig | None = None,
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
                             device=device, tp_size=tp_size, tp_rank=tp_rank, kernel=kernel, quant=quant)

    def _shard_layout(self, shard_id) -> tuple[int, int, int]:
        q, kv = self.q_size, self.kv_size
        layout = {"q": (q * self.tp_size, 0, q), "k": (kv * self.kv_tp_size, q, kv),
                  "v": (kv * self.kv_tp_size, q + kv, kv)}
        if shard_id not in layout:
            raise ValueError(f"QKVLinear shard must be one of {sorted(layout)}, got {shard_id!r}")
        return layout[shard_id]

    def _shard_rank(self, shard_id) -> int:
        return self.tp_rank if shard_id == "q" else self.kv_tp_rank

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
        quant: QuantConfig | None = None,
    ) -> None:
        self.out_sizes = tuple(out_sizes)
        self.local_sizes = tuple(_split(s, tp_size, f"out_sizes[{i}]") for i, s in enumerate(self.out_sizes))
        super().__init__(
            in_features, sum(self.out_sizes), bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank,
            kernel=kernel, quant=quant,
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
        quant: QuantConfig | None = None,
    ) -> None:
        if tp_size > 1 and all_reduce is None:
            raise ValueError(f"RowLinear with tp_size={tp_size} needs an all_reduce function")
        self.in_features, self.out_features = in_features, out_features
        in_local = _split(in_features, tp_size, "in_features")
        super().__init__(
            in_local, out_features, bias=bias, dtype=dtype, device=device, tp_size=tp_size, tp_rank=tp_rank,
            kernel=kernel, quant=quant,
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
        if lora is not None and lora.active:  # `project` is the plain projection then (the entries run unfused)
            out = lora.project(self.method, x, self.weight, self.bias if self.tp_size == 1 else None)
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
        if param in ("weight_scale", "input_scale"):
            return self._scale_checkpoint_shape(param, self.out_features, self.in_features)
        return (self.out_features, self.in_features) if param == "weight" else (self.out_features,)

    @torch.no_grad()
    def load_shard(self, param: str, tensor: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's columns of the full HF weight (the whole bias, the scales of its columns) into
        place."""
        if shard_id is not None:
            raise ValueError(f"RowLinear has no shard {shard_id!r}")
        if param in ("weight_scale", "input_scale"):
            self._param(param)
            size = self.weight.shape[1]
            self._load_scale(param, tensor, None, (self.tp_rank * size, size))
            return
        self._check_weight_dtype(param, tensor)
        if param == "weight":
            size = self.weight.shape[1]
            tensor = tensor.narrow(1, self.tp_rank * size, size)
        self._param(param).copy_(tensor)


def quantize_linear_layers(model: nn.Module) -> int:
    """Quantize every linear layer built for online fp8 (`QuantConfig`, not pre-quantized) once its
    weights are loaded; returns how many layers hold fp8 weights afterwards."""
    count = 0
    for module in model.modules():
        if isinstance(module, _LinearBase) and module.quant is not None:
            module.quantize_weights()
            count += 1
    return count
