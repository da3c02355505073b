"""Poolers over a padded step: one vector per batch entry from the step's hidden states.

Graph-safe: shapes come from the padded sizes only, indices from the step's persistent
`query_start_loc` / `logits_indices`, no host sync. Padded entries (query length 0) and padded
tokens pool garbage into rows nobody reads (a padded token's segment is the spare row R_pad).
"""

from __future__ import annotations

import torch


def pool_hidden(hidden: torch.Tensor, pooling_type: str, query_start_loc: torch.Tensor,
                last_indices: torch.Tensor) -> torch.Tensor:
    """[T_pad, H] hidden -> [R_pad, H] (hidden's dtype; MEAN averages in float32).

    query_start_loc: [R_pad + 1] int32, non-decreasing, padded entries equal to the real token
    count; last_indices: [R_pad] each entry's last token (`compute_logits_indices`)."""
    if pooling_type == "LAST":
        return hidden[last_indices]
    num_tokens = hidden.shape[0]
    if pooling_type == "CLS":
        # A padded entry starts at the real token count, which may equal T_pad.
        return hidden[query_start_loc[:-1].long().clamp(max=num_tokens - 1)]
    if pooling_type == "MEAN":
        ends = query_start_loc[1:]  # [R_pad]
        tokens = torch.arange(num_tokens, device=hidden.device, dtype=ends.dtype)
        # Token t belongs to entry i with start_i <= t < end_i: the number of ends <= t.
        segment = torch.searchsorted(ends, tokens, right=True)  # [T_pad] in [0, R_pad]
        sums = torch.zeros(ends.shape[0] + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segment, hidden.float())
        lens = (ends - query_start_loc[:-1]).clamp(min=1).unsqueeze(1)  # [R_pad, 1]
        return (sums[:-1] / lens).to(hidden.dtype)
    raise ValueError(f"pooling_type={pooling_type!r}; allowed: ['LAST', 'MEAN', 'CLS']")
