"""fp8 (e4m3) linear arithmetic: quantization and the exact torch reference."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _scales_of(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_weight_fp8(w: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    if block is None:
        scale = _scales_of(wf.abs().amax(dim=1))
        return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    n, k = wf.shape
    bn, bk = block
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, device=w.device)
    pad[:n, :k] = wf.abs()
    amax = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3))
    scale = _scales_of(amax)
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (wf / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_act_fp8(x: torch.Tensor, group: int | None = None,
                     static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if group is None:
        scale = _scales_of(xf.abs().amax(dim=1, keepdim=True))
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    t, k = xf.shape
    g = -(-k // group)
    pad = torch.zeros(t, g * group, device=x.device)
    pad[:, :k] = xf.abs()
    scale = _scales_of(pad.view(t, g, group).amax(dim=2))
    full = scale.repeat_interleave(group, 1)[:, :k]
    return (xf / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    qf = q.float()
    if scale.numel() == 1:
        return qf * scale.float().reshape(())
    if block is None:
        return qf * scale.float().reshape(-1, 1)
    n, k = q.shape
    return qf * scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def fp8_linear_reference(x, w_q, w_scale, bias=None, *, block=None, input_scale=None, out_dtype=None):
    group = block[1] if block else None
    x_q, x_scale = quantize_act_fp8(x, group, input_scale)
    xd = dequantize_fp8(x_q, x_scale, (1, group) if group else None)
    wd = dequantize_fp8(w_q, w_scale, block)
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def fp8_linear(x, w_q, w_scale, bias=None, *, block=None, input_scale=None, tile=None):
    return fp8_linear_reference(x, w_q, w_scale, bias, block=block, input_scale=input_scale)


def _op(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
        block: list[int], input_scale: torch.Tensor | None) -> torch.Tensor:
    return fp8_linear(x, w_q, w_scale, bias, block=tuple(block) or None, input_scale=input_scale)


fp8_linear_op = torch.library.custom_op("graphrunner::fp8_linear", _op, mutates_args=())


@fp8_linear_op.register_fake
def _fake(x, w_q, w_scale, bias, block, input_scale):
    return x.new_empty(x.shape[0], w_q.shape[0])
