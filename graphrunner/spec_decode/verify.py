"""Input preparation of a verifying step (speculative decoding), graph-safe.

A verifying batch entry b (row r) is a decode whose query holds the last sampled token
and d draft slots behind it: `q_b = 1 + d` tokens at positions `nc .. nc + d` with
`nc = num_computed_tokens[r]` (before the step) and `nc >= prefill_len[r]`. Its drafts
live in the row state `draft_token_ids[r, :num_draft[r]]` (the drafter's proposals of
the step before, or ids the scheduler placed). This module, run before the forward:

- places the d draft ids in the token history, `all_token_ids[r, nc + 1 + j] = draft[r, j]`
  for j < d: `prepare_input_ids` reads them there as the query's input ids, and the
  sampler's penalties count the drafts before a verified position as earlier tokens of
  the same request (they are, if that position is reached). Slots past the drafter's
  count carry whatever the draft row holds: they are never accepted.
- writes `logits_indices [R, k + 1]`: slot j of a verifying entry scores the token after
  query token j (`query_start + min(j, q - 1)`); every slot of any other entry (prefill
  chunk, plain decode, padding) is its last query token, so slot 0 is the plain sample.
- writes `verify_num_draft [R]`: the draft slots verified, `min(num_draft[r], q - 1)` for
  a verifying entry (`q - 1` with `synthetic`: the benchmark aid verifies every slot), else 0;
- writes `sample_positions [R]`: the position of the token that slot 0 samples
  (`nc + 1` when verifying, `nc + q` = seq_len otherwise; 0 for padding): the key of its
  stateless noise; slot j samples position `sample_positions + j`.
- writes `num_rejected [R]`: `q - 1` for a verifying entry, else 0; the step subtracts
  its accepted count after rejection sampling, and post-update advances
  num_computed_tokens by `q - num_rejected`.

Every output element is written (padding included); no host sync, no value-dependent
shapes: the torch ops here run unchanged inside a captured CUDA graph.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import check_tensor

_I32 = (torch.int32,)
_I64 = (torch.int64,)


def prepare_verify(
    idx_mapping: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    num_computed_tokens: torch.Tensor,  # [rows] int32, before the step
    prefill_len: torch.Tensor,  # [rows] int32
    draft_token_ids: torch.Tensor,  # [rows, k] int32
    num_draft: torch.Tensor,  # [rows] int32
    all_token_ids: torch.Tensor,  # [rows, L] int32, written: the drafts placed
    logits_indices_out: torch.Tensor,  # [R, k + 1] int64
    verify_num_draft_out: torch.Tensor,  # [R] int32
    sample_positions_out: torch.Tensor,  # [R] int64
    num_rejected_out: torch.Tensor,  # [R] int32
    *,
    synthetic: bool = False,
) -> None:
    """See the module docstring."""
    num_reqs = idx_mapping.shape[0]
    rows_total, k = draft_token_ids.shape
    check_tensor("idx_mapping", idx_mapping, (num_reqs,), _I32)
    check_tensor("query_start_loc", query_start_loc, (num_reqs + 1,), _I32)
    check_tensor("logits_indices_out", logits_indices_out, (num_reqs, k + 1), _I64)
    for name, t in (("verify_num_draft_out", verify_num_draft_out), ("num_rejected_out", num_rejected_out)):
        check_tensor(name, t, (num_reqs,), _I32)
    check_tensor("sample_positions_out", sample_positions_out, (num_reqs,), _I64)
    check_tensor("num_draft", num_draft, (rows_total,), _I32)

    max_model_len = all_token_ids.shape[1]
    row = idx_mapping.long()  # [R]
    start = query_start_loc[:-1].long()  # [R]
    end = query_start_loc[1:].long()  # [R]
    qlen = end - start  # [R]
    computed = num_computed_tokens[row].long()  # [R]
    verify = (qlen > 1) & (computed >= prefill_len[row].long())  # [R]
    slots = qlen - 1  # [R]: draft slots scheduled
    verified = slots if synthetic else torch.minimum(num_draft[row].long(), slots)
    verify_num_draft_out.copy_(torch.where(verify, verified, 0))
    num_rejected_out.copy_(torch.where(verify, slots, 0))
    sample_positions_out.copy_(torch.where(verify, computed + 1, computed + qlen))

    j = torch.arange(k + 1, device=row.device)  # [k + 1]
    last = (end - 1).clamp(min=0)  # [R]: the entry's last token (padding: the last real one)
    base = torch.where(verify, start, last)  # [R]
    logits_indices_out.copy_(torch.minimum(base[:, None] + j, last[:, None]))

    if k == 0:
        return
    # Drafts into the history. Real entries have distinct rows and distinct columns; a slot
    # that writes nothing rewrites the value at column nc (which no slot writes), so duplicate
    # indices (padding on the scratch row, unwritten slots) always carry identical values.
    write = verify[:, None] & (j[None, :k] < slots[:, None])  # [R, k]
    keep_col = computed.clamp(max=max_model_len - 1)[:, None].expand(num_reqs, k)  # [R, k]
    col = torch.where(write, (computed[:, None] + 1 + j[None, :k]).clamp(max=max_model_len - 1), keep_col)
    rows2 = row[:, None].expand(num_reqs, k)  # [R, k]
    old = all_token_ids[rows2, col]  # [R, k]
    all_token_ids[rows2, col] = torch.where(write, draft_token_ids[row], old)


__all__ = ["prepare_verify"]
