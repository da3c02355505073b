"""Sort-free min-p / top-k / top-p filters: one per-row threshold, found by bisection.

Each filter keeps the tokens whose (temperature-scaled) logit is >= a per-row
threshold, so together they keep `x >= max(t_min_p, t_top_k, t_top_p)`:
- min-p: `t = max(x) + log(min_p)` (p >= min_p * p_max, in logit space; min_p = 0 gives -inf).
- top-k: the k-th largest value (ties at the boundary are all kept, as in vLLM).
- top-p: the largest t whose kept mass `sum(softmax(x)[x >= t])` still reaches top_p,
  over what min-p and top-k kept (the smallest high-probability set, renormalised).

The k-th value and the top-p threshold are found by bisection over the 32-bit
order-preserving integer keys of float32 values: 32 fixed iterations pin the exact
threshold (a float32 has 2**32 bit patterns), with no [R, V] sort (whose buffers cost
~1.6 GiB of graph pool at 256 x 152k) and no value-dependent shapes, so it is
graph-safe. Each iteration is one masked count/sum over [R, V].

Rows whose filter is off get a -inf threshold, bit-identical to skipping the filter;
that is what makes the all-features graph match a batch's exact features.
"""

from __future__ import annotations

import torch

_SIGN_FREE = 0x7FFFFFFF
BISECT_ITERS = 32  # exact for float32: the key range spans at most 2**32 values


def ordered_key(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 key with the same order (-inf lowest). [..] -> [..] int64."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ _SIGN_FREE, bits)


def key_to_float(key: torch.Tensor) -> torch.Tensor:
    """Inverse of `ordered_key` (key in int32 range) -> float32."""
    bits = torch.where(key < 0, key ^ _SIGN_FREE, key).to(torch.int32)
    return bits.view(torch.float32)


def _bisect(x: torch.Tensor, holds) -> torch.Tensor:
    """Largest threshold t (a float32) with `holds(keys >= key(t))` true, per row.

    Binary lifting over the int32 order keys: starting from the lowest key, try adding
    2**bit for bit = 31..0 and keep the step where `holds` stays true. 32 fixed steps of
    ~5 kernels, two of them [R, V] passes; exact. holds(keep [R, V] bool) -> [R] bool
    must be monotone (true for the lowest key, i.e. keeping everything).
    Returns [R] float32.
    """
    keys = ordered_key(x).to(torch.int32)  # [R, V]: compared in place of the floats
    t = torch.full((x.shape[0],), -(1 << 31), dtype=torch.int64, device=x.device)  # [R]
    for bit in range(BISECT_ITERS - 1, -1, -1):
        cand = t + (1 << bit)
        t = torch.where(holds(keys >= cand[:, None]), cand, t)
    return key_to_float(t)


def top_k_threshold(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The k-th largest value per row; -inf where top_k is off (<= 0 or >= V).

    x: [R, V] float32, top_k: [R] int -> [R] float32.
    """
    vocab_size = x.shape[-1]
    on = (top_k > 0) & (top_k < vocab_size)
    k = top_k.clamp(1, vocab_size).to(torch.int64)  # [R]
    t = _bisect(x, lambda keep: keep.sum(dim=-1) >= k)
    return torch.where(on, t, float("-inf"))


def top_p_threshold(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-p threshold per row over softmax(x); -inf where top_p >= 1.

    x: [R, V] float32 (already filtered: -inf = dropped), top_p: [R] float32 -> [R].
    """
    on = top_p < 1.0
    peak = x.amax(dim=-1, keepdim=True)  # [R, 1]
    # A row of only -inf (never a real row: allowed ids are non-empty) must not turn NaN.
    e = torch.exp(x - torch.where(torch.isfinite(peak), peak, 0.0))  # [R, V], unnormalised probs
    need = top_p * e.sum(dim=-1)  # [R]
    t = _bisect(x, lambda keep: torch.where(keep, e, 0.0).sum(dim=-1) >= need)
    return torch.where(on, t, float("-inf"))


def min_p_threshold(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """max(x) + log(min_p) per row (-inf where min_p = 0). x: [R, V], min_p: [R] -> [R]."""
    return x.amax(dim=-1) + torch.log(min_p)


def apply_filters(
    x: torch.Tensor,  # [R, V] float32, temperature-scaled logits
    top_k: torch.Tensor,  # [R] int32, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1 = off
    min_p: torch.Tensor,  # [R] float32, 0 = off
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
) -> torch.Tensor:  # [R, V] with filtered-out entries at -inf
    """min-p, then top-k, then top-p (vLLM's order), sort-free and graph-safe."""
    if not (use_min_p or use_top_k or use_top_p):
        return x
    t = filter_threshold(x, top_k, top_p, min_p, use_top_k, use_top_p, use_min_p)  # [R]
    # masked_fill with a Python scalar: no host-to-device constant (illegal while capturing).
    return x.masked_fill(x < t[:, None], float("-inf"))


def filter_threshold(
    x: torch.Tensor,  # [R, V] float32, temperature-scaled logits
    top_k: torch.Tensor,  # [R] int32, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1 = off
    min_p: torch.Tensor,  # [R] float32, 0 = off
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
) -> torch.Tensor:  # [R] float32
    """The one threshold of `apply_filters`: it keeps exactly the tokens with `x >= t`.

    The max of the min-p, top-k and top-p thresholds, each computed (as in `apply_filters`)
    on what the previous filters kept; -inf where every filter is off. The torch reference
    of the fused Triton threshold kernel (triton_sampling.py).
    """
    t = torch.full((x.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)  # [R]
    if use_min_p:
        t_min_p = min_p_threshold(x, min_p)
        x = x.masked_fill(x < t_min_p[:, None], float("-inf"))
        t = torch.maximum(t, t_min_p)
    if use_top_k:
        t_top_k = top_k_threshold(x, top_k)
        x = x.masked_fill(x < t_top_k[:, None], float("-inf"))
        t = torch.maximum(t, t_top_k)
    if use_top_p:
        t = torch.maximum(t, top_p_threshold(x, top_p))
    return t

