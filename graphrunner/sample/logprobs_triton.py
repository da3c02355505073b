"""Sampled-token logprob, rank and top-K of every row in one read of the logits.

The torch path of `compute_logprobs` makes several passes over [R, V] fp32 logits
(logsumexp, a `logits > chosen` count, topk) and leaves [R, V] temporaries (the exp
of logsumexp, the bool mask of the count) in the graph pool. Here each row is cut
into C chunks of whole blocks (`chunk_plan`, as for the greedy argmax), so one row or
256 rows both fill the GPU, and the top-K costs no more than a max per group:

1. stream (R x C programs): each program streams its chunk once and keeps, per lane,
   an online logsumexp (running max and the sum of exp relative to it), whether it saw
   a NaN, and how many entries are strictly larger than the row's chosen logit (the
   value at `token_ids[row]`); it writes (max, sum, NaN flag, count) to scratch [R, C].
   With K > 0 it also writes, for every group of GROUP consecutive entries (a block is
   a [BLOCK / GROUP, GROUP] tile, so a group's max is one reduction inside a warp), the
   sort key of the group's max to scratch [R, ceil(V / GROUP)].
2. select (R programs): merges a row's C partials into its logsumexp and rank
   (1 + the summed counts), picks the K best group keys (a running "replace the worst"
   list over tiles of group keys), rereads the K x GROUP entries of those groups and
   takes the top-K among them (K rounds of a max), and writes the outputs in
   `compute_logprobs`'s layout: column 0 the chosen token's logprob and id, columns
   1..K the top-K by descending logit.

Why the K best groups hold the top-K. A sort key is one int64 per (value, id): the
value's bits made monotone above the inverted id, so one max compares both and every
key is distinct; a group's key is (its max, its group id), and lower groups hold lower
ids. If an entry e lies in a group outside the K best, each of those K groups has a
max above e's value, or equal to it with lower ids: K entries whose keys beat e's, so
e is not in the top-K. Exact for every input (ties, -inf, NaN) with no overflow path;
the second read is K x GROUP entries per row (10 KB at K = 20), the stream pass is the
one full read.

Order of the top-K: descending logit, and among equal logits (-0.0 and 0.0 are
equal) the lower token id first, so the result is one well-defined list (torch.topk
leaves the order of ties unspecified).

Non-finite logits (documented; a row's values never reach another row's outputs):
- the logsumexp is torch.logsumexp's: NaN if the row holds a NaN, else +inf if it
  holds +inf, else -inf for a row of only -inf; logprobs are `logit - logsumexp`, so
  such a row's logprobs are NaN or +-inf;
- the rank counts entries strictly larger than the chosen logit, as the torch path:
  NaN entries never count, and a NaN chosen logit has rank 1;
- in the top-K a NaN entry counts as -inf (torch.topk would list NaN first): it
  comes after every other value and ties with -inf entries by id, so the ids stay in
  [0, V) and a row of only NaN lists ids 0..K-1;
- `token_ids` must lie in [0, V): the kernels clamp the index they read (no access
  out of bounds) but report the id as given.

The grid and scratch shapes depend on R, V and K only, the scratch is `torch.empty`
(every element is written before it is read) and nothing is copied to the host, so
the kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import struct

import torch

from graphrunner.kernels import HAS_TRITON, sm_count
from graphrunner.sample.argmax import ChunkPlan, chunk_plan

__all__ = ["MAX_TOPK", "check_logprob_args", "logprobs_plan", "logprobs_triton", "triton_fits"]

MAX_TOPK = 32  # the select program holds [K_PAD] group keys and [K_PAD, GROUP] candidates in registers
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_ELEMS_PER_THREAD = 8  # as the argmax kernels: num_warps = BLOCK / (32 x 8)
_MAX_WARPS = 8
_MAX_CHUNKS = 64  # more would add partials without filling the GPU better (R = 1 already gets 64 programs)
_GROUP = 128  # entries per group: a warp's row of a [BLOCK / 128, 128] fp32 tile (4 per lane, 16-byte loads)
_GROUP_TILE = 2048  # group keys per step of the select program's running top-K (151,936 / 128: one step)
_INTERPRETER_SMS = 2  # CPU (TRITON_INTERPRET=1): tests force their own chunks
_MAX_VOCAB = 1 << 30  # ids and offsets stay well inside int32
_NO_INDEX = 2147483647  # "no id": off lanes; ids are stored as _NO_INDEX - id in the sort keys


def _ordered_bits(value: float) -> int:
    """The int32 that orders like the float32 `value` (the kernels' `_sort_key`, high half)."""
    bits = struct.unpack("<i", struct.pack("<f", value))[0]
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# Top-K sort keys (int64, larger = better). -inf with the largest id V - 1 gives the
# smallest real key, _EMPTY_KEY + 1; empty slots sit just below it, each its own key.
_EMPTY_KEY = _ordered_bits(float("-inf")) << 32
_LOW_KEY = -(1 << 63)  # off lanes and taken candidates: below everything
_PAD_KEY = (1 << 63) - 1  # slots K..K_PAD-1 of the list: never the worst


def logprobs_plan(num_rows: int, vocab_size: int, num_sms: int, *, block: int | None = None,
                  num_chunks: int | None = None) -> ChunkPlan:
    """The stream kernel's split: argmax's `chunk_plan`, at most `_MAX_CHUNKS` chunks per row."""
    if num_chunks is None:
        num_chunks = chunk_plan(num_rows, vocab_size, num_sms, block=block).num_chunks
    return chunk_plan(num_rows, vocab_size, num_sms, block=block, num_chunks=min(num_chunks, _MAX_CHUNKS))


if HAS_TRITON:
    import triton
    import triton.language as tl

    _NEG_INF = tl.constexpr(float("-inf"))
    _POS_INF = tl.constexpr(float("inf"))
    _NONE = tl.constexpr(_NO_INDEX)
    _NAN = tl.constexpr(float("nan"))
    _EMPTY = tl.constexpr(_EMPTY_KEY)
    _LOW = tl.constexpr(_LOW_KEY)
    _PAD = tl.constexpr(_PAD_KEY)

    @triton.jit
    def _lse_update(s, m, acc):
        # Online logsumexp with one exp per element: exp(-|s - m|) is exp(m - s) when s
        # is the new max (rescale the sum, add 1), else exp(s - m). s - m is NaN only when
        # both are -inf (adds 0) or both +inf (the row's logsumexp is +inf regardless).
        d = s - m
        e = tl.exp(-tl.abs(d))
        e = tl.where(d == d, e, 0.0)
        bigger = s > m
        return tl.where(bigger, s, m), tl.where(bigger, acc * e + 1.0, acc + e)

    @triton.jit
    def _sort_key(key, ids):
        # (value, id) -> one int64 whose order is the top-K order: the value's bits made
        # monotone (negative floats flip their magnitude bits) above `_NONE - id`, so a
        # larger key is a larger value, or the lower id of an equal one. -0.0 becomes 0.0.
        bits = tl.where(key == 0.0, 0.0, key).to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (ids ^ 0x7FFFFFFF).to(tl.int64)  # _NONE - id

    @triton.jit
    def _key_value(k64):
        ordered = (k64 >> 32).to(tl.int32)
        return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _key_id(k64):
        return (k64 - ((k64 >> 32) << 32)).to(tl.int32) ^ 0x7FFFFFFF

    @triton.jit
    def _merge_keys(k64, top, worst):
        # The keys of k64 that beat the worst of the top-K list replace it, best first (so
        # a better one prunes the rest): streaming "replace the worst" gives the exact top-K
        # of a strict order whatever the arrival order. Keys are unique, so `top == worst`
        # is one slot: empty slots have distinct keys below every real one.
        best = tl.max(k64, 0)
        while best > worst:
            top = tl.where(top == worst, best, top)
            worst = tl.min(top, 0)
            best = tl.max(tl.where(k64 < best, k64, _LOW), 0)
        return top, worst

    @triton.jit
    def _chosen_logit(x_row, tok_ptr, tok_stride, row, vocab_size):
        tok = tl.load(tok_ptr + row * tok_stride).to(tl.int32)
        tok_read = tl.minimum(tl.maximum(tok, 0), vocab_size - 1)  # never read out of bounds
        return tok, tl.load(x_row + tok_read).to(tl.float32)

    @triton.jit
    def _scan_tile(s, chosen, m, acc, nan, cnt, gkey_row, gid, g_on, K: tl.constexpr):
        # One [GROUPS, GROUP] tile of a stream program's running state (lanes that are off
        # hold -inf). With K > 0, the sort key of each group's max goes to scratch: every
        # group lies in one tile of one program, so each is written once.
        is_nan = s != s
        key = tl.where(is_nan, _NEG_INF, s)  # NaN out of the max, the sum and the top-K
        nan = nan | is_nan.to(tl.int32)
        cnt += (s > chosen).to(tl.int32)  # NaN never counts, as in the torch path
        m, acc = _lse_update(key, m, acc)
        if K > 0:
            tl.store(gkey_row + gid, _sort_key(tl.max(key, 1), gid), mask=g_on)
        return m, acc, nan, cnt

    @triton.jit(do_not_specialize=["vocab_size", "chunk_blocks", "num_groups"])
    def _stream_kernel(x_ptr, x_stride, tok_ptr, tok_stride, m_ptr, acc_ptr, nan_ptr, cnt_ptr, gkey_ptr,
                       vocab_size, chunk_blocks, num_groups, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                       GROUPS: tl.constexpr, K: tl.constexpr):
        # Program (row, part) over x[row, lo:hi] (module docstring, stage 1); BLOCK = GROUPS x GROUP.
        row, part = tl.program_id(0), tl.program_id(1)
        x_row = x_ptr + row.to(tl.int64) * x_stride
        _, chosen = _chosen_logit(x_row, tok_ptr, tok_stride, row, vocab_size)
        offs = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]: a block
        # [GROUPS] 0..GROUPS-1 taken from offs by a row reduction (once), so the group ids have
        # the layout of the per-group maxima and the loop stores them with no layout change.
        g = tl.min(offs, 1) // GROUP
        # lo is a multiple of BLOCK by construction, so the unmasked loads below are aligned
        # and vectorize; only the row's last, partial block is masked.
        lo = part * chunk_blocks * BLOCK
        hi = tl.minimum(lo + chunk_blocks * BLOCK, vocab_size)
        full = lo + (hi - lo) // BLOCK * BLOCK
        gkey_row = gkey_ptr + row.to(tl.int64) * num_groups
        m = tl.full([GROUPS, GROUP], _NEG_INF, tl.float32)
        acc = tl.zeros([GROUPS, GROUP], tl.float32)
        nan = tl.zeros([GROUPS, GROUP], tl.int32)
        cnt = tl.zeros([GROUPS, GROUP], tl.int32)
        for start in range(lo, full, BLOCK):
            m, acc, nan, cnt = _scan_tile(tl.load(x_row + start + offs).to(tl.float32), chosen, m, acc, nan, cnt,
                                          gkey_row, start // GROUP + g, g < GROUPS, K)
        v = full + offs  # the row's last, partial block; no lane is on in the other programs
        s = tl.load(x_row + v, mask=v < hi, other=_NEG_INF).to(tl.float32)
        # Groups that start at or past hi belong to the next chunk (or lie past V).
        m, acc, nan, cnt = _scan_tile(s, chosen, m, acc, nan, cnt, gkey_row, full // GROUP + g,
                                      full + g * GROUP < hi, K)
        peak = tl.max(m)
        shift = tl.where(peak == _NEG_INF, 0.0, peak)  # a chunk of only -inf: sum 0, not NaN
        out = row * tl.num_programs(1) + part
        tl.store(m_ptr + out, peak)
        tl.store(acc_ptr + out, tl.sum(acc * tl.exp(m - shift)))
        tl.store(nan_ptr + out, tl.max(nan))
        tl.store(cnt_ptr + out, tl.sum(cnt))

    @triton.jit
    def _combine_lse(m_ptr, acc_ptr, nan_ptr, at, on):
        # The row's logsumexp from its chunks' (max, sum relative to it, NaN flag).
        part_m = tl.load(m_ptr + at, mask=on, other=_NEG_INF)
        part_acc = tl.load(acc_ptr + at, mask=on, other=0.0)
        any_nan = tl.max(tl.load(nan_ptr + at, mask=on, other=0), 0)
        peak = tl.max(part_m, 0)
        shift = tl.where(peak == _NEG_INF, 0.0, peak)
        lse = shift + tl.log(tl.sum(part_acc * tl.exp(part_m - shift), 0))  # -inf for a row of only -inf
        lse = tl.where(peak == _POS_INF, _POS_INF, lse)
        return tl.where(any_nan > 0, _NAN, lse)

    @triton.jit
    def _best_groups(gkey_row, num_groups, K: tl.constexpr, K_PAD: tl.constexpr, G_TILE: tl.constexpr):
        # The K best group keys of a row ([K_PAD] int64; slots K.. are padding, and empty
        # slots stay below every real key when the row has fewer than K groups).
        slot = tl.arange(0, K_PAD)
        top = tl.where(slot < K, (slot.to(tl.int64) + 1) * -1 + _EMPTY, _PAD)  # empty, then padding
        worst = tl.min(top, 0)
        t = tl.arange(0, G_TILE)
        for first in range(0, num_groups, G_TILE):
            keys = tl.load(gkey_row + first + t, mask=first + t < num_groups, other=_LOW)
            top, worst = _merge_keys(keys, top, worst)
        return top

    @triton.jit
    def _top_k_of_groups(x_row, top, lse, lp_row, lp_s1, id_row, id_s1, vocab_size, K: tl.constexpr,
                         K_PAD: tl.constexpr, GROUP: tl.constexpr):
        # Reread the entries of the K best groups ([K_PAD, GROUP]) and write their top-K.
        real = (tl.arange(0, K_PAD) < K) & (top >= _EMPTY)
        gid = tl.where(real, _key_id(top), 0)
        v = gid[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [K_PAD, GROUP] token ids
        on = real[:, None] & (v < vocab_size)
        s = tl.load(x_row + v, mask=on, other=_NEG_INF).to(tl.float32)
        keys = tl.where(on, _sort_key(tl.where(s != s, _NEG_INF, s), v), _LOW)
        for col in range(1, K + 1):
            # The best remaining key. The K groups hold >= min(K, V) real entries, so no
            # masked lane (_LOW) is picked.
            best = tl.max(keys)
            tl.store(lp_row + col * lp_s1, _key_value(best) - lse)
            tl.store(id_row + col * id_s1, _key_id(best).to(id_row.dtype.element_ty))
            keys = tl.where(keys == best, _LOW, keys)

    @triton.jit(do_not_specialize=["num_chunks", "vocab_size", "num_groups"])
    def _select_kernel(m_ptr, acc_ptr, nan_ptr, cnt_ptr, gkey_ptr, x_ptr, x_stride, tok_ptr, tok_stride,
                       lp_ptr, lp_s0, lp_s1, id_ptr, id_s0, id_s1, rank_ptr, rank_stride, num_chunks, vocab_size,
                       num_groups, C_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, GROUP: tl.constexpr,
                       G_TILE: tl.constexpr):
        # Program row (module docstring, stage 2).
        row = tl.program_id(0)
        j = tl.arange(0, C_PAD)
        on = j < num_chunks
        at = row * num_chunks + j
        lse = _combine_lse(m_ptr, acc_ptr, nan_ptr, at, on)
        rank = 1 + tl.sum(tl.load(cnt_ptr + at, mask=on, other=0), 0)
        x_row = x_ptr + row.to(tl.int64) * x_stride
        tok, chosen = _chosen_logit(x_row, tok_ptr, tok_stride, row, vocab_size)
        lp_row = lp_ptr + row.to(tl.int64) * lp_s0
        id_row = id_ptr + row.to(tl.int64) * id_s0
        tl.store(lp_row, chosen - lse)
        tl.store(id_row, tok.to(id_ptr.dtype.element_ty))
        tl.store(rank_ptr + row * rank_stride, rank.to(rank_ptr.dtype.element_ty))
        if K > 0:
            top = _best_groups(gkey_ptr + row.to(tl.int64) * num_groups, num_groups, K, K_PAD, G_TILE)
            _top_k_of_groups(x_row, top, lse, lp_row, lp_s1, id_row, id_s1, vocab_size, K, K_PAD, GROUP)


def triton_fits(logits: torch.Tensor, num_logprobs: int) -> bool:
    """Whether the kernels take these logits and K as they are (else the torch path does)."""
    return (logits.dim() == 2 and logits.dtype in _DTYPES and logits.stride(-1) == 1
            and 0 < logits.shape[1] < _MAX_VOCAB and 0 <= num_logprobs <= MAX_TOPK)


def check_logprob_args(logits, token_ids, num_logprobs, out_logprobs, out_ids, out_ranks) -> None:
    if not triton_fits(logits, num_logprobs):
        raise ValueError(f"logits have shape {tuple(logits.shape)}, dtype {logits.dtype}, strides {logits.stride()} "
                         f"with K={num_logprobs}: expected [R, V] with 0 < V < {_MAX_VOCAB}, unit stride in V, "
                         f"dtype in {_DTYPES} and 0 <= K <= {MAX_TOPK}")
    rows, vocab = logits.shape
    if num_logprobs > vocab:
        raise ValueError(f"num_logprobs={num_logprobs} exceeds the vocabulary size {vocab}")
    if token_ids.shape != (rows,) or token_ids.dtype not in _INDEX_DTYPES:
        raise ValueError(f"token_ids has shape {tuple(token_ids.shape)}, dtype {token_ids.dtype}: "
                         f"expected ({rows},) in {_INDEX_DTYPES}")
    for name, out in (("out_logprobs", out_logprobs), ("out_ids", out_ids)):
        if out.dim() != 2 or out.shape[0] != rows or out.shape[1] < num_logprobs + 1:
            raise ValueError(f"{name} has shape {tuple(out.shape)}, expected [{rows}, >= {num_logprobs + 1}]")
    if out_logprobs.dtype != torch.float32 or out_ids.dtype not in _INDEX_DTYPES:
        raise ValueError(f"out_logprobs is {out_logprobs.dtype} (want float32), out_ids {out_ids.dtype} "
                         f"(want one of {_INDEX_DTYPES})")
    if out_ranks.shape != (rows,) or out_ranks.dtype not in _INDEX_DTYPES:
        raise ValueError(f"out_ranks has shape {tuple(out_ranks.shape)}, dtype {out_ranks.dtype}: "
                         f"expected ({rows},) in {_INDEX_DTYPES}")


def logprobs_triton(
    logits: torch.Tensor,  # [R, V] float32 | bfloat16 | float16 raw logits, unit stride in V
    token_ids: torch.Tensor,  # [R] int32 | int64 in [0, V): the sampled (or target) token per row
    num_logprobs: int,  # K, 0 <= K <= min(V, MAX_TOPK) (static)
    out_logprobs: torch.Tensor,  # [R, >= K+1] float32, written in place
    out_ids: torch.Tensor,  # [R, >= K+1] int32 | int64, written in place
    out_ranks: torch.Tensor,  # [R] int32 | int64, written in place
    *,
    block: int | None = None,
    num_chunks: int | None = None,
) -> None:
    """`compute_logprobs` in two kernels (module docstring); `block`/`num_chunks` override the plan (tests).

    Columns past K+1 are left untouched. Graph-safe, no host sync.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not importable; use compute_logprobs, which falls back to torch")
    check_logprob_args(logits, token_ids, num_logprobs, out_logprobs, out_ids, out_ranks)
    rows, vocab = logits.shape
    if rows == 0:
        return
    plan = logprobs_plan(rows, vocab, sm_count(logits.device, cpu=_INTERPRETER_SMS), block=block, num_chunks=num_chunks)
    k_pad = triton.next_power_of_2(max(num_logprobs, 1))
    group = min(_GROUP, plan.block)  # divides the block: both are powers of two
    num_groups = -(-vocab // group)
    dev = logits.device
    # Scratch, every element written by the stream kernel: empty, no memset in the graph.
    part_m = torch.empty(rows, plan.num_chunks, dtype=torch.float32, device=dev)
    part_acc = torch.empty_like(part_m)
    part_nan = torch.empty(rows, plan.num_chunks, dtype=torch.int32, device=dev)
    part_cnt = torch.empty_like(part_nan)
    key_rows = rows if num_logprobs > 0 else 0  # K = 0: no group keys
    group_keys = torch.empty(key_rows, num_groups, dtype=torch.int64, device=dev)  # sort keys of the group maxima
    num_warps = max(1, min(_MAX_WARPS, plan.block // (32 * _ELEMS_PER_THREAD)))
    _stream_kernel[(rows, plan.num_chunks)](
        logits, logits.stride(0), token_ids, token_ids.stride(0), part_m, part_acc, part_nan, part_cnt, group_keys,
        vocab, plan.chunk // plan.block, num_groups, BLOCK=plan.block, GROUP=group, GROUPS=plan.block // group,
        K=num_logprobs, num_warps=num_warps)
    c_pad = triton.next_power_of_2(max(plan.num_chunks, 2))
    _select_kernel[(rows,)](
        part_m, part_acc, part_nan, part_cnt, group_keys, logits, logits.stride(0), token_ids,
        token_ids.stride(0), out_logprobs, out_logprobs.stride(0), out_logprobs.stride(1), out_ids, out_ids.stride(0),
        out_ids.stride(1), out_ranks, out_ranks.stride(0), plan.num_chunks, vocab, num_groups, C_PAD=c_pad,
        K=num_logprobs, K_PAD=k_pad, GROUP=group, G_TILE=min(_GROUP_TILE, triton.next_power_of_2(num_groups)),
        num_warps=4 if num_logprobs > 0 else 1)
