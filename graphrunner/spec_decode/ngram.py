"""N-gram prompt-lookup drafter for speculative decoding, graph-safe.

For each batch entry the drafter looks for the end of the entry's token history earlier in
that history and proposes the tokens that followed it there. Both implementations write
every element of their outputs (padding included), never synchronize with the host and
allocate no value-dependent shapes, so either can run inside a captured CUDA graph: a torch
reference of vectorized ops (CPU, and the tests' oracle) and a Triton kernel (CUDA), chosen
by `propose_ngram` like the kernels of `graphrunner.kernels`.

Matching rule (vLLM's `NgramProposer`, `_find_longest_matched_ngram_and_propose_tokens`).
Let `tokens = all_token_ids[idx_mapping[b], :s]` with `s = seq_lens[b]` (clamped to `[0, L]`),
`L = all_token_ids.shape[1]` (`max_model_len`). An n-gram match at start j is

    tokens[j : j + n] == tokens[s - n : s]   with   0 <= j   and   j + n <= s - 1,

i.e. an occurrence of the length-n suffix with at least one token after it (it may overlap
the suffix itself). Take the LONGEST n in `[min_n, max_n]` that has a match; for that n the
LEFTMOST (earliest) match j. The draft is then

    tokens[j + n : j + n + num_draft],   num_draft = min(num_spec, s - (j + n), L - s),

and no match (or `s == 0`, a padded entry) gives `num_draft = 0`. `out_draft[b, num_draft:]`
is written as 0.

Two choices, both vLLM's:
- The leftmost occurrence, not the rightmost: vLLM's KMP keeps, among the longest matches, the
  one earliest in the history (its `prev_lps >= longest_ngram` update), and so did its older
  unfold-based worker (`matches.max` gives the first match). Besides parity, the earliest
  occurrence has the most tokens after it, so its draft is never shorter than another's.
- `num_draft <= L - s`: drafts never run past `max_model_len`, so they always fit behind the
  history in a row of `all_token_ids` (vLLM's `k = min(k, max_model_len - total_token)`).
"""

from __future__ import annotations

import torch

from graphrunner.kernels import HAS_TRITON, check_tensor, use_triton

_I32 = (torch.int32,)


# --------------------------------------------------------------------------- torch reference


def _longest_match_torch(
    hist: torch.Tensor, lens: torch.Tensor, min_n: int, max_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per entry: the longest matched n (0 when none) and the index after its leftmost match."""
    # hist: [R, L] the gathered histories; lens: [R, 1] int64, clamped to [0, L]
    num_reqs, max_len = hist.shape
    device = hist.device
    best_n = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    best_start = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    # n <= L - 1: a match needs n + 1 <= s <= L tokens (static bound, no data involved).
    for n in range(min_n, min(max_n, max_len - 1) + 1):
        span = torch.arange(n, device=device)
        suffix = hist.gather(1, (lens - n + span).clamp_(min=0))  # [R, n]
        windows = hist.unfold(1, n, 1)  # [R, L - n + 1, n], a view
        starts = torch.arange(max_len - n + 1, device=device)  # [L - n + 1]
        hit = (windows == suffix[:, None, :]).all(dim=2) & (starts + n <= lens - 1)  # [R, L - n + 1]
        first = torch.where(hit, starts, max_len).amin(dim=1)  # leftmost match, L when none
        found = first < max_len
        best_n = torch.where(found, n, best_n)  # n ascends: the longest match wins
        best_start = torch.where(found, first + n, best_start)
    return best_n, best_start


def propose_ngram_torch(
    all_token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    num_spec: int,
    min_n: int,
    max_n: int,
    out_draft: torch.Tensor,
    out_num_draft: torch.Tensor,
) -> None:
    """Torch reference of `propose_ngram`.

    Memory: O(R_pad * L * max_n) temporaries (each n compares all L - n + 1 windows at once).
    """
    max_len = all_token_ids.shape[1]
    device = all_token_ids.device
    hist = all_token_ids.index_select(0, idx_mapping)  # [R, L]
    lens = seq_lens.to(torch.int64).clamp(0, max_len)[:, None]  # [R, 1]
    best_n, start = _longest_match_torch(hist, lens, min_n, max_n)
    lens = lens[:, 0]
    num = torch.minimum(torch.minimum(lens - start, max_len - lens), torch.full_like(lens, num_spec))
    num = torch.where(best_n > 0, num.clamp(min=0), 0)  # [R]
    k = torch.arange(num_spec, device=device)
    pos = (start[:, None] + k).clamp_(max=max_len - 1)  # [R, num_spec], in bounds
    draft = torch.where(k < num[:, None], hist.gather(1, pos), 0)
    out_draft.copy_(draft)
    out_num_draft.copy_(num)


# --------------------------------------------------------------------------- Triton kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _ngram_kernel(
        tok_ptr, tok_s0, tok_s1, idx_ptr, lens_ptr, draft_ptr, draft_s0, draft_s1, num_ptr,
        max_len, num_spec, min_n, MAX_N: tl.constexpr, BLOCK: tl.constexpr, SPEC_BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One program per batch entry. For each end position e <= s - 2 of a candidate match,
        # c(e) = how many tokens ending at e equal the history's last ones (capped at MAX_N):
        # the longest n is max c(e), its leftmost match the smallest e reaching it.
        b = tl.program_id(0)
        row_ptr = tok_ptr + tl.load(idx_ptr + b).to(tl.int64) * tok_s0
        s = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 0), max_len)
        offs = tl.arange(0, BLOCK)
        best_n = tl.full((), 0, tl.int32)
        best_end = tl.full((), 0, tl.int32)
        for i in range(0, s - 1, BLOCK):
            e = i + offs
            alive = e < s - 1
            c = tl.zeros([BLOCK], dtype=tl.int32)
            for t in tl.static_range(MAX_N):
                p = e - t
                q = s - 1 - t  # the suffix token compared at this depth
                sfx = tl.load(row_ptr + q.to(tl.int64) * tok_s1, mask=q >= 0, other=0)
                alive = alive & (p >= 0)
                tok = tl.load(row_ptr + p.to(tl.int64) * tok_s1, mask=alive, other=0)
                alive = alive & (tok == sfx)
                c += alive.to(tl.int32)
            block_n = tl.max(c, axis=0)
            block_end = tl.min(tl.where(c == block_n, e, max_len), axis=0)
            better = block_n > best_n  # strict: an earlier block keeps ties (leftmost)
            best_end = tl.where(better, block_end, best_end)
            best_n = tl.maximum(best_n, block_n)
        start = best_end + 1
        num = tl.minimum(tl.minimum(s - start, max_len - s), num_spec)
        num = tl.where(best_n >= min_n, tl.maximum(num, 0), 0)
        k = tl.arange(0, SPEC_BLOCK)
        draft = tl.load(row_ptr + (start + k).to(tl.int64) * tok_s1, mask=k < num, other=0)
        tl.store(draft_ptr + b.to(tl.int64) * draft_s0 + k * draft_s1, draft, mask=k < num_spec)
        tl.store(num_ptr + b, num)


_POS_BLOCK = 256  # candidate match ends per loop iteration


def propose_ngram_triton(
    all_token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    num_spec: int,
    min_n: int,
    max_n: int,
    out_draft: torch.Tensor,
    out_num_draft: torch.Tensor,
) -> None:
    """Triton implementation of `propose_ngram`: R_pad programs, each scanning its history once.

    Memory: no temporaries. Work per entry: O(seq_len * max_n) token loads, at most O(L * max_n).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable; use the torch reference implementation")
    for name, t in (("idx_mapping", idx_mapping), ("seq_lens", seq_lens), ("out_num_draft", out_num_draft)):
        if not t.is_contiguous():
            raise ValueError(f"propose_ngram_triton needs a contiguous {name}")
    max_len = all_token_ids.shape[1]
    _ngram_kernel[(idx_mapping.shape[0],)](
        all_token_ids, all_token_ids.stride(0), all_token_ids.stride(1), idx_mapping, seq_lens,
        out_draft, out_draft.stride(0), out_draft.stride(1), out_num_draft,
        max_len, num_spec, min_n,
        MAX_N=max_n, BLOCK=min(_POS_BLOCK, triton.next_power_of_2(max_len)),
        SPEC_BLOCK=triton.next_power_of_2(num_spec),
    )  # fmt: skip


# --------------------------------------------------------------------------- public API


def _check_arguments(
    all_token_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    num_spec: int,
    min_n: int,
    max_n: int,
    out_draft: torch.Tensor,
    out_num_draft: torch.Tensor,
) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"min_n={min_n}, max_n={max_n}: need 1 <= min_n <= max_n")
    if num_spec < 1:
        raise ValueError(f"num_spec={num_spec} must be at least 1")
    if all_token_ids.dim() != 2 or all_token_ids.shape[1] < 1:
        raise ValueError(f"all_token_ids has shape {tuple(all_token_ids.shape)}, expected [rows, L] with L >= 1")
    if idx_mapping.dim() != 1 or idx_mapping.shape[0] < 1:
        raise ValueError(f"idx_mapping has shape {tuple(idx_mapping.shape)}, expected [R_pad] with R_pad >= 1")
    num_reqs = idx_mapping.shape[0]
    check_tensor("all_token_ids", all_token_ids, tuple(all_token_ids.shape), _I32)
    check_tensor("idx_mapping", idx_mapping, (num_reqs,), _I32)
    check_tensor("seq_lens", seq_lens, (num_reqs,), _I32)
    check_tensor("out_draft", out_draft, (num_reqs, num_spec), _I32)
    check_tensor("out_num_draft", out_num_draft, (num_reqs,), _I32)
    named = (("idx_mapping", idx_mapping), ("seq_lens", seq_lens), ("out_draft", out_draft))
    for name, t in (*named, ("out_num_draft", out_num_draft)):
        if t.device != all_token_ids.device:
            raise ValueError(f"{name} is on {t.device}, all_token_ids on {all_token_ids.device}")


def propose_ngram(
    all_token_ids: torch.Tensor,  # [rows, L] int32, the persistent token histories
    idx_mapping: torch.Tensor,  # [R_pad] int32, batch entry -> row (padded entries: any valid row)
    seq_lens: torch.Tensor,  # [R_pad] int32, known tokens per entry; 0 for padded entries
    num_spec: int,  # k: draft tokens per entry at most
    min_n: int,
    max_n: int,
    out_draft: torch.Tensor,  # [R_pad, num_spec] int32
    out_num_draft: torch.Tensor,  # [R_pad] int32
) -> None:
    """Propose up to `num_spec` draft tokens per batch entry by n-gram prompt lookup.

    Writes `out_draft[b, :out_num_draft[b]]` = the tokens that followed the leftmost earlier
    occurrence of the longest suffix of length n in `[min_n, max_n]` of entry b's history
    (the exact rule is in this module's docstring); every other element of `out_draft` is
    written as 0 and every element of `out_num_draft` is written. `idx_mapping` values must
    be valid rows (they cannot be checked without reading the device); `seq_lens` values
    are clamped to `[0, L]`. Graph-safe: host-side metadata checks only, then the torch
    reference (CPU; O(R_pad * L * max_n) temporaries) or the Triton kernel (CUDA; none).
    """
    _check_arguments(all_token_ids, idx_mapping, seq_lens, num_spec, min_n, max_n, out_draft, out_num_draft)
    impl = propose_ngram_triton if use_triton(out_draft) else propose_ngram_torch
    impl(all_token_ids, idx_mapping, seq_lens, num_spec, min_n, max_n, out_draft, out_num_draft)


__all__ = ["propose_ngram", "propose_ngram_torch", "propose_ngram_triton"]
