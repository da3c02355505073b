"""Input preparation, block-table gather and slot mapping, and post-step bookkeeping:
graph-safe kernels over persistent row state.

Vocabulary (shared with the runner):
- row: a slot of persistent per-request state, `0..max_num_reqs-1`, plus one scratch row
  `max_num_reqs` that padded batch entries point at (never live).
- batch entry b in `[0, R_pad)`: `idx_mapping[b]` is its row; its query tokens are
  `[query_start_loc[b], query_start_loc[b+1])`. Padded entries repeat the real token
  count in `query_start_loc`, so their query length is 0.
- token t in `[0, T_pad)`: real iff `t < query_start_loc[R_pad]`; the rest is padding.

Row state (persistent tensors, indexed by row):
  num_computed_tokens [rows] int32   tokens whose KV is (or will be, this step) in cache
  prefill_len         [rows] int32   tokens known at admission (prompt + pre-preemption outputs)
  last_sampled        [rows] int32   last token sampled for the row (stays on the device)
  all_token_ids       [rows, max_model_len] int32   token history

Each public function writes every element of its outputs (padding included, docs/architecture.md
§4) and dispatches to the Triton kernel on CUDA or to the torch reference elsewhere;
the `_torch` / `_triton` variants are exported for tests. Neither implementation
synchronizes with the host or allocates value-dependent shapes.
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, use_triton
from graphrunner.state.counts import check_counts

_I32 = (torch.int32,)
_I64 = (torch.int64,)
_SAMPLED = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- helpers


def token_entries(query_start_loc: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map each token to its batch entry, without leaving the device.

    Returns `(entry [T] int64, offset [T] int64, is_real [T] bool)`: the batch entry of
    token t (clamped to the last entry for padded tokens, so it is always a valid
    index), t's index inside that entry's query, and whether t is a real token.
    """
    # query_start_loc: [R + 1] int32, non-decreasing, starting at 0
    num_reqs = query_start_loc.shape[0] - 1
    t = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    # Entries before t's own all end at or before t; empty entries are counted too,
    # which is what skips them.
    entry = torch.searchsorted(query_start_loc[1:], t, right=True).clamp_(max=num_reqs - 1)
    offset = (t - query_start_loc[entry]).long()
    is_real = t < query_start_loc[num_reqs]
    return entry, offset, is_real


def _query_lens(query_start_loc: torch.Tensor) -> torch.Tensor:
    return query_start_loc[1:] - query_start_loc[:-1]  # [R] int32


def _check_batch(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor) -> int:
    if idx_mapping.dim() != 1 or idx_mapping.shape[0] < 1:
        raise ValueError(f"idx_mapping has shape {tuple(idx_mapping.shape)}, expected [R_pad] with R_pad >= 1")
    num_reqs = idx_mapping.shape[0]
    check_tensor("idx_mapping", idx_mapping, (num_reqs,), _I32)
    check_tensor("query_start_loc", query_start_loc, (num_reqs + 1,), _I32)
    return num_reqs


# --------------------------------------------------------------------------- torch references


def prepare_positions_seq_lens_torch(
    idx_mapping: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    num_computed_tokens: torch.Tensor,  # [rows] int32
    positions_out: torch.Tensor,  # [T] int64
    seq_lens_out: torch.Tensor,  # [R] int32
) -> None:
    """Torch reference of `prepare_positions_seq_lens`."""
    computed = num_computed_tokens[idx_mapping.long()]  # [R] int32
    qlen = _query_lens(query_start_loc)
    seq_lens_out.copy_(torch.where(qlen > 0, computed + qlen, torch.zeros_like(qlen)))
    entry, offset, is_real = token_entries(query_start_loc, positions_out.shape[0])
    pos = computed[entry].long() + offset  # [T] int64
    positions_out.copy_(torch.where(is_real, pos, torch.zeros_like(pos)))


def prepare_input_ids_torch(
    idx_mapping: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    positions: torch.Tensor,  # [T] int64
    all_token_ids: torch.Tensor,  # [rows, L] int32
    prefill_len: torch.Tensor,  # [rows] int32
    last_sampled: torch.Tensor,  # [rows] int32
    input_ids_out: torch.Tensor,  # [T] int32
) -> None:
    """Torch reference of `prepare_input_ids`."""
    max_model_len = all_token_ids.shape[1]
    entry, offset, is_real = token_entries(query_start_loc, input_ids_out.shape[0])
    row = idx_mapping.long()[entry]  # [T] int64
    # Clamped so that the gather stays in bounds for every token; only positions
    # below max_model_len are used.
    col = positions.clamp(0, max_model_len - 1)
    known = all_token_ids[row, col]  # [T] int32
    from_history = (positions < prefill_len[row]) | (offset > 0)
    tok = torch.where(from_history, known, last_sampled[row])
    input_ids_out.copy_(torch.where(is_real, tok, torch.zeros_like(tok)))


def compute_logits_indices_torch(
    query_start_loc: torch.Tensor,  # [R + 1] int32
    out: torch.Tensor,  # [R] int64
) -> None:
    """Torch reference of `compute_logits_indices`."""
    out.copy_((query_start_loc[1:].long() - 1).clamp_(min=0))


def post_update_torch(
    idx_mapping: torch.Tensor,  # [R] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    sampled: torch.Tensor,  # [R] int32 | int64
    num_computed_tokens: torch.Tensor,  # [rows] int32
    prefill_len: torch.Tensor,  # [rows] int32
    last_sampled: torch.Tensor,  # [rows] int32
    all_token_ids: torch.Tensor,  # [rows, L] int32
    num_rejected: torch.Tensor | None = None,  # [R] int32
    token_counts: torch.Tensor | None = None,  # [rows, V] int16 | int32 (state/counts.py)
    max_new_tokens: int = 1,
) -> None:
    """Torch reference of `post_update`.

    Duplicate rows in `idx_mapping` (padded entries sharing the scratch row) would make
    a scatter nondeterministic if their values differed. So every entry writes back,
    for each location it touches, either its update or the value already there; all
    padded entries therefore write identical values and the result is deterministic.
    Real entries have distinct rows, so their read-then-write never races.
    """
    max_model_len = all_token_ids.shape[1]
    row = idx_mapping.long()  # [R]
    qlen = _query_lens(query_start_loc)
    real = qlen > 0
    rejected = torch.zeros_like(qlen) if num_rejected is None else torch.where(real, num_rejected, 0)
    computed = num_computed_tokens[row]  # [R] before the step's advance
    num_computed_tokens[row] = computed + qlen - rejected  # padded: + 0, same value

    # Only a chunk that reaches the end of the known tokens sampled a real token.
    new_token = real & (seq_lens >= prefill_len[row])
    tok = sampled.to(torch.int32)
    last_sampled[row] = torch.where(new_token, tok, last_sampled[row])

    end = seq_lens - rejected  # [R]: where the new token sits (after the accepted run)
    in_range = new_token & (end < max_model_len)
    col = end.long().clamp(0, max_model_len - 1)
    all_token_ids[row, col] = torch.where(in_range, tok, all_token_ids[row, col])
    if token_counts is not None:
        verify = (qlen > 1) & (computed >= prefill_len[row]) if num_rejected is not None else torch.zeros_like(real)
        num_new = torch.where(verify, qlen - rejected, 1)  # [R]: accepted drafts + the new token
        _count_appended_torch(token_counts, all_token_ids, row, end, new_token, num_new, max_new_tokens)


def _count_appended_torch(
    token_counts: torch.Tensor,  # [rows, V] int16 | int32 (state/counts.py), updated in place
    all_token_ids: torch.Tensor,  # [rows, L] int32, the new tokens already written
    row: torch.Tensor,  # [R] int64
    end: torch.Tensor,  # [R] position of each entry's new token
    new_token: torch.Tensor,  # [R] bool: the entry appended tokens
    num_new: torch.Tensor,  # [R]: tokens appended, ending at `end`
    max_new_tokens: int,
) -> None:
    """+1 output count per appended token in the history (positions end - num_new + 1 .. end)."""
    max_model_len = all_token_ids.shape[1]
    j = torch.arange(max_new_tokens, device=row.device)  # [K]
    pos = end.long()[:, None] - j  # [R, K]
    use = new_token[:, None] & (j < num_new[:, None]) & (pos >= 0) & (pos < max_model_len)
    rows2 = row[:, None].expand(pos.shape)
    tok = all_token_ids[rows2, pos.clamp(0, max_model_len - 1)].long()  # [R, K]
    # accumulate=True: duplicate (row, token) pairs (padded entries add 0) sum deterministically.
    token_counts.index_put_((rows2, tok), use.to(token_counts.dtype), accumulate=True)


# --------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.state.counts import add_count

    @triton.jit(do_not_specialize=['num_reqs', 'num_tokens'])
    def _positions_seq_lens_kernel(
        idx_ptr, qsl_ptr, computed_ptr, pos_ptr, seq_lens_ptr, num_reqs, num_tokens, BLOCK: tl.constexpr
    ):
        # One program per batch entry, plus one (pid == num_reqs) for the padded token tail.
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if pid < num_reqs:
            start = tl.load(qsl_ptr + pid)
            qlen = tl.load(qsl_ptr + pid + 1) - start
            computed = tl.load(computed_ptr + tl.load(idx_ptr + pid))
            tl.store(seq_lens_ptr + pid, tl.where(qlen > 0, computed + qlen, 0))
            for i in range(0, qlen, BLOCK):
                o = i + offs
                tl.store(pos_ptr + start + o, (computed + o).to(tl.int64), mask=o < qlen)
        else:
            tail = tl.load(qsl_ptr + num_reqs)
            for i in range(tail, num_tokens, BLOCK):
                o = i + offs
                tl.store(pos_ptr + o, tl.zeros([BLOCK], dtype=tl.int64), mask=o < num_tokens)

    @triton.jit(do_not_specialize=['num_reqs', 'num_tokens'])
    def _input_ids_kernel(
        idx_ptr,
        qsl_ptr,
        pos_ptr,
        tokens_ptr,
        tokens_stride,
        prefill_len_ptr,
        last_sampled_ptr,
        out_ptr,
        num_reqs,
        num_tokens,
        max_model_len,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if pid < num_reqs:
            start = tl.load(qsl_ptr + pid)
            qlen = tl.load(qsl_ptr + pid + 1) - start
            row = tl.load(idx_ptr + pid).to(tl.int64)
            prefill = tl.load(prefill_len_ptr + row)
            last = tl.load(last_sampled_ptr + row)
            row_ptr = tokens_ptr + row * tokens_stride
            for i in range(0, qlen, BLOCK):
                o = i + offs
                m = o < qlen
                p = tl.load(pos_ptr + start + o, mask=m, other=0)
                known = (p < prefill) | (o > 0)
                # Same clamp as the torch reference: the gather index always stays in bounds.
                col = tl.minimum(tl.maximum(p, 0), max_model_len - 1)
                tok = tl.load(row_ptr + col, mask=m & known, other=0)
                tl.store(out_ptr + start + o, tl.where(known, tok, last), mask=m)
        else:
            tail = tl.load(qsl_ptr + num_reqs)
            for i in range(tail, num_tokens, BLOCK):
                o = i + offs
                tl.store(out_ptr + o, tl.zeros([BLOCK], dtype=tl.int32), mask=o < num_tokens)

    @triton.jit(do_not_specialize=['num_reqs'])
    def _logits_indices_kernel(qsl_ptr, out_ptr, num_reqs, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < num_reqs
        end = tl.load(qsl_ptr + offs + 1, mask=m, other=0).to(tl.int64)
        tl.store(out_ptr + offs, tl.maximum(end - 1, 0), mask=m)

    @triton.jit(do_not_specialize=['num_reqs'])
    def _post_update_kernel(
        idx_ptr,
        qsl_ptr,
        seq_lens_ptr,
        sampled_ptr,
        computed_ptr,
        prefill_len_ptr,
        last_sampled_ptr,
        tokens_ptr,
        tokens_stride,
        rejected_ptr,
        counts_ptr,
        counts_stride,
        num_reqs,
        max_model_len,
        HAS_REJECTED: tl.constexpr,
        HAS_COUNTS: tl.constexpr,
        MAX_NEW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Vectorized over entries. Stores are masked to real entries, whose rows are
        # distinct, so padded entries sharing the scratch row never write at all.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < num_reqs
        start = tl.load(qsl_ptr + offs, mask=valid, other=0)
        qlen = tl.load(qsl_ptr + offs + 1, mask=valid, other=0) - start
        real = valid & (qlen > 0)
        row = tl.load(idx_ptr + offs, mask=real, other=0).to(tl.int64)
        computed = tl.load(computed_ptr + row, mask=real, other=0)
        if HAS_REJECTED:
            rejected = tl.load(rejected_ptr + offs, mask=real, other=0)
        else:
            rejected = tl.zeros([BLOCK], dtype=tl.int32)
        tl.store(computed_ptr + row, computed + qlen - rejected, mask=real)
        seq_len = tl.load(seq_lens_ptr + offs, mask=real, other=0) - rejected
        prefill = tl.load(prefill_len_ptr + row, mask=real, other=0)
        new_token = real & (seq_len >= prefill)
        tok = tl.load(sampled_ptr + offs, mask=new_token, other=0).to(tl.int32)
        tl.store(last_sampled_ptr + row, tok, mask=new_token)
        in_range = new_token & (seq_len < max_model_len)
        tl.store(tokens_ptr + row * tokens_stride + seq_len, tok, mask=in_range)
        if HAS_COUNTS:  # +1 per appended token: the accepted drafts (in the history) and `tok`
            num_new = tl.full([BLOCK], 1, dtype=tl.int32)
            if HAS_REJECTED:
                verify = (qlen > 1) & (computed >= prefill)
                num_new = tl.where(verify, qlen - rejected, 1)
            for j in tl.static_range(MAX_NEW):
                p = seq_len - j
                use = new_token & (j < num_new) & (p >= 0) & (p < max_model_len)
                if j == 0:
                    t = tok
                else:
                    t = tl.load(tokens_ptr + row * tokens_stride + p, mask=use, other=0)
                add_count(counts_ptr + row * counts_stride, t, use)


_TOKEN_BLOCK = 1024  # tokens per loop iteration of the per-entry kernels
_REQ_BLOCK = 128  # entries per program of the vectorized-over-entries kernels


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable; use the torch reference implementation")


def _check_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() == 1 and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton kernel (stride {t.stride()})")
        if t.dim() == 2 and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim for the Triton kernel ({t.stride()})")


def prepare_positions_seq_lens_triton(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    positions_out: torch.Tensor,
    seq_lens_out: torch.Tensor,
) -> None:
    """Triton implementation of `prepare_positions_seq_lens` (R_pad + 1 programs)."""
    _require_triton()
    _check_contiguous(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        num_computed_tokens=num_computed_tokens,
        positions_out=positions_out,
        seq_lens_out=seq_lens_out,
    )
    num_reqs = idx_mapping.shape[0]
    _positions_seq_lens_kernel[(num_reqs + 1,)](
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        positions_out,
        seq_lens_out,
        num_reqs,
        positions_out.shape[0],
        BLOCK=_TOKEN_BLOCK,
    )


def prepare_input_ids_triton(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    all_token_ids: torch.Tensor,
    prefill_len: torch.Tensor,
    last_sampled: torch.Tensor,
    input_ids_out: torch.Tensor,
) -> None:
    """Triton implementation of `prepare_input_ids` (R_pad + 1 programs)."""
    _require_triton()
    _check_contiguous(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        positions=positions,
        all_token_ids=all_token_ids,
        prefill_len=prefill_len,
        last_sampled=last_sampled,
        input_ids_out=input_ids_out,
    )
    num_reqs = idx_mapping.shape[0]
    _input_ids_kernel[(num_reqs + 1,)](
        idx_mapping,
        query_start_loc,
        positions,
        all_token_ids,
        all_token_ids.stride(0),
        prefill_len,
        last_sampled,
        input_ids_out,
        num_reqs,
        input_ids_out.shape[0],
        all_token_ids.shape[1],
        BLOCK=_TOKEN_BLOCK,
    )


def compute_logits_indices_triton(query_start_loc: torch.Tensor, out: torch.Tensor) -> None:
    """Triton implementation of `compute_logits_indices`."""
    _require_triton()
    _check_contiguous(query_start_loc=query_start_loc, out=out)
    num_reqs = out.shape[0]
    _logits_indices_kernel[(triton.cdiv(num_reqs, _REQ_BLOCK),)](query_start_loc, out, num_reqs, BLOCK=_REQ_BLOCK)


def post_update_triton(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sampled: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    prefill_len: torch.Tensor,
    last_sampled: torch.Tensor,
    all_token_ids: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
    token_counts: torch.Tensor | None = None,
    max_new_tokens: int = 1,
) -> None:
    """Triton implementation of `post_update`."""
    _require_triton()
    _check_contiguous(
        idx_mapping=idx_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        sampled=sampled,
        num_computed_tokens=num_computed_tokens,
        prefill_len=prefill_len,
        last_sampled=last_sampled,
        all_token_ids=all_token_ids,
    )
    num_reqs = idx_mapping.shape[0]
    if num_rejected is not None:
        _check_contiguous(num_rejected=num_rejected)
    _post_update_kernel[(triton.cdiv(num_reqs, _REQ_BLOCK),)](
        idx_mapping,
        query_start_loc,
        seq_lens,
        sampled,
        num_computed_tokens,
        prefill_len,
        last_sampled,
        all_token_ids,
        all_token_ids.stride(0),
        num_rejected if num_rejected is not None else seq_lens,
        token_counts if token_counts is not None else seq_lens,
        token_counts.stride(0) if token_counts is not None else 0,
        num_reqs,
        all_token_ids.shape[1],
        HAS_REJECTED=num_rejected is not None,
        HAS_COUNTS=token_counts is not None,
        MAX_NEW=max_new_tokens,
        BLOCK=_REQ_BLOCK,
    )


# --------------------------------------------------------------------------- public API


def _check_rows(num_computed_tokens=None, prefill_len=None, last_sampled=None, all_token_ids=None) -> None:
    rows = None
    for name, t in (
        ("num_computed_tokens", num_computed_tokens),
        ("prefill_len", prefill_len),
        ("last_sampled", last_sampled),
    ):
        if t is None:
            continue
        rows = t.shape[0] if rows is None else rows
        check_tensor(name, t, (rows,), _I32)
    if all_token_ids is not None:
        rows = all_token_ids.shape[0] if rows is None else rows
        if all_token_ids.dim() != 2:
            raise ValueError(f"all_token_ids has shape {tuple(all_token_ids.shape)}, expected [rows, max_model_len]")
        check_tensor("all_token_ids", all_token_ids, (rows, all_token_ids.shape[1]), _I32)


def prepare_positions_seq_lens(
    idx_mapping: torch.Tensor,  # [R_pad] int32
    query_start_loc: torch.Tensor,  # [R_pad + 1] int32
    num_computed_tokens: torch.Tensor,  # [rows] int32
    positions_out: torch.Tensor,  # [T_pad] int64
    seq_lens_out: torch.Tensor,  # [R_pad] int32
) -> None:
    """Write token positions and per-entry sequence lengths.

    The i-th query token of entry b (row r) sits at position `num_computed[r] + i`;
    `seq_lens[b] = num_computed[r] + qlen_b` (0 for an empty, i.e. padded, entry).
    Padded tokens get position 0.
    """
    num_reqs = _check_batch(idx_mapping, query_start_loc)
    _check_rows(num_computed_tokens=num_computed_tokens)
    check_tensor("positions_out", positions_out, (positions_out.shape[0],), _I64)
    check_tensor("seq_lens_out", seq_lens_out, (num_reqs,), _I32)
    impl = prepare_positions_seq_lens_triton if use_triton(positions_out) else prepare_positions_seq_lens_torch
    impl(idx_mapping, query_start_loc, num_computed_tokens, positions_out, seq_lens_out)


def prepare_input_ids(
    idx_mapping: torch.Tensor,  # [R_pad] int32
    query_start_loc: torch.Tensor,  # [R_pad + 1] int32
    positions: torch.Tensor,  # [T_pad] int64
    all_token_ids: torch.Tensor,  # [rows, max_model_len] int32
    prefill_len: torch.Tensor,  # [rows] int32
    last_sampled: torch.Tensor,  # [rows] int32
    input_ids_out: torch.Tensor,  # [T_pad] int32
) -> None:
    """Write the input token id of every token.

    The token at position p of row r is `all_token_ids[r, p]` when `p < prefill_len[r]`
    (known at admission) or p is not the first token of its entry's query (the draft
    slots of a verifying entry, placed in the history by `spec_decode.verify`), else
    `last_sampled[r]`: a decode reads the token sampled last step straight from the
    device, never round-tripped through the host. Padded tokens get id 0.
    """
    _check_batch(idx_mapping, query_start_loc)
    _check_rows(prefill_len=prefill_len, last_sampled=last_sampled, all_token_ids=all_token_ids)
    num_tokens = input_ids_out.shape[0]
    check_tensor("positions", positions, (num_tokens,), _I64)
    check_tensor("input_ids_out", input_ids_out, (num_tokens,), _I32)
    impl = prepare_input_ids_triton if use_triton(input_ids_out) else prepare_input_ids_torch
    impl(idx_mapping, query_start_loc, positions, all_token_ids, prefill_len, last_sampled, input_ids_out)


def compute_logits_indices(
    query_start_loc: torch.Tensor,  # [R_pad + 1] int32
    out: torch.Tensor,  # [R_pad] int64
) -> None:
    """Write the index of each entry's last token: `query_start_loc[b+1] - 1`, clamped to >= 0.

    Padded entries point at the last real token; harmless, their logits are discarded.
    """
    check_tensor("out", out, (out.shape[0],), _I64)
    check_tensor("query_start_loc", query_start_loc, (out.shape[0] + 1,), _I32)
    impl = compute_logits_indices_triton if use_triton(out) else compute_logits_indices_torch
    impl(query_start_loc, out)


def post_update(
    idx_mapping: torch.Tensor,  # [R_pad] int32
    query_start_loc: torch.Tensor,  # [R_pad + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32, this step's (from prepare_positions_seq_lens)
    sampled: torch.Tensor,  # [R_pad] int32 | int64
    num_computed_tokens: torch.Tensor,  # [rows] int32, updated in place
    prefill_len: torch.Tensor,  # [rows] int32
    last_sampled: torch.Tensor,  # [rows] int32, updated in place
    all_token_ids: torch.Tensor,  # [rows, max_model_len] int32, updated in place
    num_rejected: torch.Tensor | None = None,  # [R_pad] int32: speculative decoding
    token_counts: torch.Tensor | None = None,  # [rows, V] int16 | int32 packed penalty counts (state/counts.py)
    max_new_tokens: int = 1,  # the most tokens an entry appends (1 + num_speculative_tokens)
) -> None:
    """Advance row state after a step, on the device.

    For each real entry b (query length > 0) of row r: `num_computed[r] += qlen - j`
    with j = `num_rejected[b]` (0 without it: the rejected draft positions of a verifying
    entry, whose KV is overwritten later); if the chunk reached the end of the known
    tokens (`seq_lens[b] >= prefill_len[r]`), `sampled[b]` is a real new token: it
    becomes `last_sampled[r]` and, when `e = seq_lens[b] - j < max_model_len`, is
    written at `all_token_ids[r, e]` (the accepted drafts before it are already there).
    Padded entries (query length 0, all on the scratch row) change nothing.

    With `token_counts` (SamplingStates.counts), each appended token adds 1 to its row's
    count: `sampled[b]` at position e, and for a verifying entry (q > 1 from
    num_computed >= prefill_len) also its accepted drafts at positions e - a .. e - 1
    (a = q - 1 - num_rejected), never the rejected ones; only positions < max_model_len.
    """
    num_reqs = _check_batch(idx_mapping, query_start_loc)
    _check_rows(
        num_computed_tokens=num_computed_tokens,
        prefill_len=prefill_len,
        last_sampled=last_sampled,
        all_token_ids=all_token_ids,
    )
    check_tensor("seq_lens", seq_lens, (num_reqs,), _I32)
    check_tensor("sampled", sampled, (num_reqs,), _SAMPLED)
    if num_rejected is not None:
        check_tensor("num_rejected", num_rejected, (num_reqs,), _I32)
    if token_counts is not None:
        if token_counts.dim() != 2 or token_counts.shape[0] != all_token_ids.shape[0]:
            raise ValueError(
                f"token_counts has shape {tuple(token_counts.shape)}, expected [{all_token_ids.shape[0]}, V]"
            )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    impl = post_update_triton if use_triton(all_token_ids) else post_update_torch
    if token_counts is not None and impl is post_update_triton:
        check_counts(token_counts)  # the kernel's 32-bit atomics need the packed, aligned form
    impl(idx_mapping, query_start_loc, seq_lens, sampled, num_computed_tokens, prefill_len, last_sampled, all_token_ids,
         num_rejected, token_counts, max_new_tokens)


# =========================================================================== block table
# The per-step gather of a batch's block-table rows and its slot mapping.



def gather_block_table(table: torch.Tensor, idx_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """`out[b, :] = table[idx_mapping[b], :]` for every batch entry b (graph-safe)."""
    # table: [rows, M] int32; idx_mapping: [R_pad] int32; out: [R_pad, M] int32
    num_reqs = idx_mapping.shape[0]
    check_tensor("idx_mapping", idx_mapping, (num_reqs,), _I32)
    check_tensor("out", out, (num_reqs, table.shape[1]), _I32)
    impl = gather_block_table_triton if use_triton(out) else gather_block_table_torch
    impl(table, idx_mapping, out)


# --------------------------------------------------------------------------- torch references


def gather_block_table_torch(table: torch.Tensor, idx_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """Torch reference of `BlockTables.gather`: `out[b] = table[idx_mapping[b]]`."""
    # copy_ rather than index_select(out=...): `out` may be any view of a persistent buffer.
    out.copy_(table.index_select(0, idx_mapping))


def compute_slot_mapping_torch(
    block_table: torch.Tensor,  # [R, M] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    positions: torch.Tensor,  # [T] int64
    block_size: int,
    out: torch.Tensor,  # [T] int64
) -> None:
    """Torch reference of `compute_slot_mapping`."""
    max_blocks = block_table.shape[1]
    entry, _, is_real = token_entries(query_start_loc, out.shape[0])
    # Clamped so that padded tokens' gather stays in bounds; real tokens are in range.
    col = torch.div(positions, block_size, rounding_mode="floor").clamp_(0, max_blocks - 1)
    block = block_table[entry, col].long()  # [T]
    slot = block * block_size + torch.remainder(positions, block_size)
    out.copy_(torch.where(is_real, slot, torch.full_like(slot, -1)))


# --------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_kernel(table_ptr, table_stride, idx_ptr, out_ptr, out_stride, width, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        row = tl.load(idx_ptr + b).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        for i in range(0, width, BLOCK):
            o = i + offs
            m = o < width
            tl.store(out_ptr + b * out_stride + o, tl.load(table_ptr + row * table_stride + o, mask=m), mask=m)

    @triton.jit(do_not_specialize=['num_reqs', 'num_tokens'])
    def _slot_mapping_kernel(
        bt_ptr,
        bt_stride,
        qsl_ptr,
        pos_ptr,
        out_ptr,
        num_reqs,
        num_tokens,
        max_blocks,
        block_size,
        BLOCK: tl.constexpr,
    ):
        # One program per batch entry, plus one (pid == num_reqs) for the padded token tail.
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if pid < num_reqs:
            start = tl.load(qsl_ptr + pid)
            qlen = tl.load(qsl_ptr + pid + 1) - start
            row_ptr = bt_ptr + pid.to(tl.int64) * bt_stride
            for i in range(0, qlen, BLOCK):
                o = i + offs
                m = o < qlen
                pos = tl.load(pos_ptr + start + o, mask=m, other=0)
                col = tl.minimum(tl.maximum(pos // block_size, 0), max_blocks - 1)
                block = tl.load(row_ptr + col, mask=m, other=0).to(tl.int64)
                tl.store(out_ptr + start + o, block * block_size + pos % block_size, mask=m)
        else:
            tail = tl.load(qsl_ptr + num_reqs)
            for i in range(tail, num_tokens, BLOCK):
                o = i + offs
                tl.store(out_ptr + o, tl.full([BLOCK], -1, dtype=tl.int64), mask=o < num_tokens)


_COL_BLOCK = 256  # block-table columns per loop iteration


def gather_block_table_triton(table: torch.Tensor, idx_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """Triton implementation of `BlockTables.gather` (one program per batch entry)."""
    _require_triton()
    if table.stride(1) != 1 or out.stride(1) != 1 or not idx_mapping.is_contiguous():
        raise ValueError("gather_block_table_triton needs unit-stride rows and a contiguous idx_mapping")
    _gather_kernel[(idx_mapping.shape[0],)](
        table, table.stride(0), idx_mapping, out, out.stride(0), table.shape[1], BLOCK=_COL_BLOCK
    )


def compute_slot_mapping_triton(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> None:
    """Triton implementation of `compute_slot_mapping` (R_pad + 1 programs)."""
    _require_triton()
    if block_table.stride(1) != 1 or not (
        query_start_loc.is_contiguous() and positions.is_contiguous() and out.is_contiguous()
    ):
        raise ValueError("compute_slot_mapping_triton needs unit-stride block-table rows and contiguous 1-D tensors")
    num_reqs = block_table.shape[0]
    _slot_mapping_kernel[(num_reqs + 1,)](
        block_table,
        block_table.stride(0),
        query_start_loc,
        positions,
        out,
        num_reqs,
        out.shape[0],
        block_table.shape[1],
        block_size,
        BLOCK=_TOKEN_BLOCK,
    )


# --------------------------------------------------------------------------- public API


def compute_slot_mapping(
    block_table: torch.Tensor,  # [R_pad, M] int32, the batch's gathered rows
    query_start_loc: torch.Tensor,  # [R_pad + 1] int32
    positions: torch.Tensor,  # [T_pad] int64
    block_size: int,
    out: torch.Tensor,  # [T_pad] int64
) -> None:
    """Write each token's KV-cache slot: `block_table[b, pos // bs] * bs + pos % bs`.

    Padded tokens (`t >= query_start_loc[R_pad]`) get slot -1, which the KV-write
    kernel skips (docs/architecture.md §4).
    """
    if block_table.dim() != 2 or block_table.shape[0] < 1:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}, expected [R_pad, M] with R_pad >= 1")
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    num_reqs = block_table.shape[0]
    num_tokens = out.shape[0]
    check_tensor("block_table", block_table, tuple(block_table.shape), _I32)
    check_tensor("query_start_loc", query_start_loc, (num_reqs + 1,), _I32)
    check_tensor("positions", positions, (num_tokens,), _I64)
    check_tensor("out", out, (num_tokens,), _I64)
    impl = compute_slot_mapping_triton if use_triton(out) else compute_slot_mapping_torch
    impl(block_table, query_start_loc, positions, block_size, out)


__all__ = [
    "token_entries",
    "prepare_positions_seq_lens",
    "prepare_input_ids",
    "compute_logits_indices",
    "post_update",
    "prepare_positions_seq_lens_torch",
    "prepare_input_ids_torch",
    "compute_logits_indices_torch",
    "post_update_torch",
    "prepare_positions_seq_lens_triton",
    "prepare_input_ids_triton",
    "compute_logits_indices_triton",
    "post_update_triton",
    "gather_block_table",
    "compute_slot_mapping",
    "compute_slot_mapping_torch",
    "compute_slot_mapping_triton",
    "gather_block_table_torch",
    "gather_block_table_triton",
]
