"""Torch reference for routing and the expert computation.

Static shapes throughout: the expert sum is computed densely over every local expert with a
[T, E] combine matrix that is zero where a token did not choose the expert, so the same code
runs eagerly, under torch.compile (no data-dependent shape) and inside CUDA graphs. It costs
E / top_k times the routed work, which is what a reference (and a tiny CPU model) can afford;
the Triton path (`kernels.py`) reads only the experts that received tokens.

Weight layout, shared with the Triton kernels:

  w13  [E_local, 2 * I, H]   rows [0, I) the gate projection, [I, 2 I) the up projection
  w2   [E_local, H, I]       the down projection

`expert_map` ([E_global] int32, or None) gives each global expert's local index on this rank
or -1 when another rank holds it (expert parallelism); a slot whose expert is elsewhere
contributes nothing here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_reference(
    router_logits: torch.Tensor,  # [T, E] any float dtype
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k] float32, ids [T, k] int32)
    """Softmax over the experts in float32, the top-k, and (optionally) their renormalisation
    to sum 1: the routing of Mixtral (always renormalised), Qwen2-MoE and Qwen3-MoE
    (`norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E_local, 2I, H]
    w2: torch.Tensor,  # [E_local, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32, global expert ids
    expert_map: torch.Tensor | None = None,  # [E_global] int32: local index or -1
    w13_scale: torch.Tensor | None = None,  # [E_local, 2I] float32: fp8 experts' row scales
    w2_scale: torch.Tensor | None = None,  # [E_local, H] float32
) -> torch.Tensor:  # [T, H] in x's dtype
    """sum over the chosen experts e of weight(t, e) * down_e(silu(gate_e(x_t)) * up_e(x_t)).

    Each expert's output is rounded to x's dtype before it is weighted (in float32) and
    summed, as the Hugging Face implementations do. fp8 experts (float8_e4m3fn w13 / w2 with
    their row scales) are dequantized first, code * scale in float32, then rounded to x's dtype.
    """
    if w13_scale is not None and w2_scale is not None:
        w13 = (w13.float() * w13_scale.unsqueeze(-1)).to(x.dtype)
        w2 = (w2.float() * w2_scale.unsqueeze(-1)).to(x.dtype)
    num_local = w13.shape[0]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]  # -1 where another rank holds the expert
    # combine[t, e]: the routing weight of local expert e for token t (0 when not chosen here).
    # A slot mapped to -1 scatters into an extra column that is dropped.
    combine = torch.zeros(x.shape[0], num_local + 1, dtype=torch.float32, device=x.device)
    combine.scatter_add_(1, torch.where(ids < 0, num_local, ids), topk_weights.float())
    combine = combine[:, :num_local]
    gate_up = torch.einsum("th,eih->eti", x, w13)  # [E, T, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(x.dtype)
    out = torch.einsum("eti,ehi->eth", act, w2).to(x.dtype)  # [E, T, H], each expert's output
    return torch.einsum("eth,te->th", out.float(), combine).to(x.dtype)
