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
  count carry whatever the draft row holds: they are never accepted. Nothing else of
  the history changes (padded entries and the scratch row included).
- writes `logits_indices [R, k + 1]`: slot j of a verifying entry scores the token after
  query token j (`query_start + min(j, q - 1)`); every slot of any other entry (prefill
  chunk, plain decode, padding) is its last query token, so slot 0 is the plain sample.
- writes `verify_num_draft [R]`: the draft slots verified, `min(num_draft[r], q - 1)` for
  a verifying entry (`q - 1` with `synthetic`: the benchmark aid verifies every slot), else 0;
- writes `sample_positions [R]`: the position of the token that slot 0 samples
  (`nc + 1` when verifying, `nc + q` = seq_len otherwise, which for padding is the
  scratch row's nc, 0 as that row never advances): the key of its stateless noise;
  slot j samples position `sample_positions + j`.
- writes `num_rejected [R]`: `q - 1` for a verifying entry, else 0; the step subtracts
  its accepted count after rejection sampling, and post-update advances
  num_computed_tokens by `q - num_rejected`.

Every output element is written (padding included); no host sync, no value-dependent
shapes. `prepare_verify` checks its arguments and dispatches, like the kernels of
`graphrunner.kernels`, to a Triton kernel (CUDA) or to the torch reference
`prepare_verify_torch` (elsewhere, and the tests' oracle); either runs inside a
captured CUDA graph.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, use_triton

_I32 = (torch.int32,)
_I64 = (torch.int64,)


# --------------------------------------------------------------------------- torch reference


def prepare_verify_torch(
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
    """Torch reference of `prepare_verify`."""
    num_reqs = idx_mapping.shape[0]
    k = draft_token_ids.shape[1]
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


# --------------------------------------------------------------------------- Triton kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=['num_reqs'])
    def _prepare_verify_kernel(
        idx_ptr, qsl_ptr, computed_ptr, prefill_len_ptr, draft_ptr, draft_stride, num_draft_ptr,
        tokens_ptr, tokens_stride, logits_ptr, logits_stride, verify_num_draft_ptr, sample_pos_ptr,
        num_rejected_ptr, num_reqs, num_spec, max_model_len,
        SYNTHETIC: tl.constexpr, BLOCK: tl.constexpr, SLOT_BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Vectorized over entries, a [BLOCK, SLOT_BLOCK] tile for the per-slot outputs. History
        # stores are masked to verifying entries, which are real and so have distinct rows:
        # padded entries sharing the scratch row never write it.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < num_reqs
        start = tl.load(qsl_ptr + offs, mask=valid, other=0).to(tl.int64)
        end = tl.load(qsl_ptr + offs + 1, mask=valid, other=0).to(tl.int64)
        qlen = end - start
        row = tl.load(idx_ptr + offs, mask=valid, other=0).to(tl.int64)
        computed = tl.load(computed_ptr + row, mask=valid, other=0).to(tl.int64)
        prefill = tl.load(prefill_len_ptr + row, mask=valid, other=0).to(tl.int64)
        verify = valid & (qlen > 1) & (computed >= prefill)
        slots = qlen - 1  # draft slots scheduled
        if SYNTHETIC:
            verified = slots
        else:
            verified = tl.minimum(tl.load(num_draft_ptr + row, mask=verify, other=0).to(tl.int64), slots)
        tl.store(verify_num_draft_ptr + offs, tl.where(verify, verified, 0).to(tl.int32), mask=valid)
        tl.store(num_rejected_ptr + offs, tl.where(verify, slots, 0).to(tl.int32), mask=valid)
        tl.store(sample_pos_ptr + offs, tl.where(verify, computed + 1, computed + qlen), mask=valid)

        j = tl.arange(0, SLOT_BLOCK)[None, :]  # [1, SLOT_BLOCK]
        last = tl.maximum(end - 1, 0)  # the entry's last token (padding: the last real one)
        base = tl.where(verify, start, last)
        logits = tl.minimum(base[:, None] + j, last[:, None])  # [BLOCK, SLOT_BLOCK]
        tl.store(logits_ptr + offs[:, None].to(tl.int64) * logits_stride + j, logits,
                 mask=valid[:, None] & (j <= num_spec))  # fmt: skip

        # Drafts into the history: column nc + 1 + j for j < min(q - 1, k); a valid batch keeps
        # those columns below max_model_len, the bound only keeps a bad one inside its row.
        col = computed[:, None] + 1 + j
        write = verify[:, None] & (j < slots[:, None]) & (j < num_spec) & (col < max_model_len)
        draft = tl.load(draft_ptr + row[:, None] * draft_stride + j, mask=write, other=0)
        tl.store(tokens_ptr + row[:, None] * tokens_stride + col, draft, mask=write)


_REQ_BLOCK = 128  # entries per program


def prepare_verify_triton(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    prefill_len: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    all_token_ids: torch.Tensor,
    logits_indices_out: torch.Tensor,
    verify_num_draft_out: torch.Tensor,
    sample_positions_out: torch.Tensor,
    num_rejected_out: torch.Tensor,
    *,
    synthetic: bool = False,
) -> None:
    """Triton implementation of `prepare_verify`: cdiv(R, 128) programs, no temporaries."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable; use the torch reference implementation")
    flat = dict(idx_mapping=idx_mapping, query_start_loc=query_start_loc, num_computed_tokens=num_computed_tokens,
                prefill_len=prefill_len, num_draft=num_draft, verify_num_draft_out=verify_num_draft_out,
                sample_positions_out=sample_positions_out, num_rejected_out=num_rejected_out)
    for name, t in flat.items():
        if not t.is_contiguous():
            raise ValueError(f"prepare_verify_triton needs a contiguous {name} (stride {t.stride()})")
    rows = dict(draft_token_ids=draft_token_ids, all_token_ids=all_token_ids, logits_indices_out=logits_indices_out)
    for name, t in rows.items():
        if t.stride(1) != 1 and t.shape[1] > 1:
            raise ValueError(f"prepare_verify_triton needs unit stride in the last dim of {name} ({t.stride()})")
    num_reqs, k = idx_mapping.shape[0], draft_token_ids.shape[1]
    # With k = 0 no draft is read; any int32 tensor stands in for the empty one.
    drafts = draft_token_ids if k > 0 else all_token_ids
    _prepare_verify_kernel[(triton.cdiv(num_reqs, _REQ_BLOCK),)](
        idx_mapping, query_start_loc, num_computed_tokens, prefill_len, drafts, drafts.stride(0), num_draft,
        all_token_ids, all_token_ids.stride(0), logits_indices_out, logits_indices_out.stride(0),
        verify_num_draft_out, sample_positions_out, num_rejected_out, num_reqs, k, all_token_ids.shape[1],
        SYNTHETIC=synthetic, BLOCK=_REQ_BLOCK, SLOT_BLOCK=triton.next_power_of_2(k + 1),
    )  # fmt: skip


# --------------------------------------------------------------------------- public API


def _check_arguments(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    prefill_len: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    all_token_ids: torch.Tensor,
    logits_indices_out: torch.Tensor,
    verify_num_draft_out: torch.Tensor,
    sample_positions_out: torch.Tensor,
    num_rejected_out: torch.Tensor,
) -> None:
    if idx_mapping.dim() != 1 or idx_mapping.shape[0] < 1:
        raise ValueError(f"idx_mapping has shape {tuple(idx_mapping.shape)}, expected [R_pad] with R_pad >= 1")
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, expected [rows, k]")
    if all_token_ids.dim() != 2 or all_token_ids.shape[1] < 1:
        raise ValueError(f"all_token_ids has shape {tuple(all_token_ids.shape)}, expected [rows, L] with L >= 1")
    num_reqs = idx_mapping.shape[0]
    rows_total, k = draft_token_ids.shape
    check_tensor("idx_mapping", idx_mapping, (num_reqs,), _I32)
    check_tensor("query_start_loc", query_start_loc, (num_reqs + 1,), _I32)
    for name, t in (("num_computed_tokens", num_computed_tokens), ("prefill_len", prefill_len),
                    ("num_draft", num_draft)):  # fmt: skip
        check_tensor(name, t, (rows_total,), _I32)
    check_tensor("draft_token_ids", draft_token_ids, (rows_total, k), _I32)
    check_tensor("all_token_ids", all_token_ids, (rows_total, all_token_ids.shape[1]), _I32)
    check_tensor("logits_indices_out", logits_indices_out, (num_reqs, k + 1), _I64)
    for name, t in (("verify_num_draft_out", verify_num_draft_out), ("num_rejected_out", num_rejected_out)):
        check_tensor(name, t, (num_reqs,), _I32)
    check_tensor("sample_positions_out", sample_positions_out, (num_reqs,), _I64)
    named = dict(idx_mapping=idx_mapping, query_start_loc=query_start_loc, num_computed_tokens=num_computed_tokens,
                 prefill_len=prefill_len, draft_token_ids=draft_token_ids, num_draft=num_draft,
                 logits_indices_out=logits_indices_out, verify_num_draft_out=verify_num_draft_out,
                 sample_positions_out=sample_positions_out, num_rejected_out=num_rejected_out)
    for name, t in named.items():
        if t.device != all_token_ids.device:
            raise ValueError(f"{name} is on {t.device}, all_token_ids on {all_token_ids.device}")


def prepare_verify(
    idx_mapping: torch.Tensor,  # [R_pad] int32, batch entry -> row (padded entries: the scratch row)
    query_start_loc: torch.Tensor,  # [R_pad + 1] int32
    num_computed_tokens: torch.Tensor,  # [rows] int32, before the step
    prefill_len: torch.Tensor,  # [rows] int32
    draft_token_ids: torch.Tensor,  # [rows, k] int32
    num_draft: torch.Tensor,  # [rows] int32
    all_token_ids: torch.Tensor,  # [rows, L] int32, written: the drafts placed
    logits_indices_out: torch.Tensor,  # [R_pad, k + 1] int64
    verify_num_draft_out: torch.Tensor,  # [R_pad] int32
    sample_positions_out: torch.Tensor,  # [R_pad] int64
    num_rejected_out: torch.Tensor,  # [R_pad] int32
    *,
    synthetic: bool = False,
) -> None:
    """Place the drafts of verifying entries in the history and write the verify outputs.

    The exact rule is in this module's docstring. Real entries must have distinct rows and
    a verifying entry's positions must stay below L (neither can be checked without
    reading the device). Graph-safe: host-side metadata checks only, then the Triton
    kernel (CUDA) or the torch reference (elsewhere).
    """
    args = (idx_mapping, query_start_loc, num_computed_tokens, prefill_len, draft_token_ids, num_draft,
            all_token_ids, logits_indices_out, verify_num_draft_out, sample_positions_out, num_rejected_out)
    _check_arguments(*args)
    impl = prepare_verify_triton if use_triton(all_token_ids) else prepare_verify_torch
    impl(*args, synthetic=synthetic)


__all__ = ["prepare_verify", "prepare_verify_torch", "prepare_verify_triton"]
