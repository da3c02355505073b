"""Triton paged attention for mixed batches (decodes + prefill chunks), graph-safe.

One launch serves the whole padded batch. Its grid depends only on Python ints (the
padded token / request counts and head counts), never on tensor values, so a CUDA
graph captured for one padded shape replays correctly with any batch of that shape.

Work split. Each request's query tokens are cut into tiles of `BLOCK_Q` tokens. A
program handles one (tile, kv head) pair: its `BLOCK_M = BLOCK_Q * G_PAD` rows are the
tile's tokens times the kv head's GQA group of query heads (the group padded to a power
of two, so that `tl.dot` sees at least 16 rows even for decode). Tile j of request b
is program `query_start_loc[b] // BLOCK_Q + b + j`; since that start is strictly
increasing in b, a program finds its request by binary search, and

    num_tokens // BLOCK_Q + num_reqs + 1

programs cover every tile of every request plus the padded tokens after
`query_start_loc[num_reqs]` (handled as a pseudo-request with no keys, so their rows
come out as zeros). Programs left over inside a request's range find an empty tile and
store nothing.

Decode grid (`decode_grid`, plan field): program b serves request b's tiles in a loop
(b = num_reqs: the padded tokens), so no program searches for its request and none is empty.
Correct for any batch; for a decode batch (one token per request) every program has one tile,
where the search grid has num_tokens // BLOCK_Q + num_reqs + 1 programs (a third empty at
BLOCK_Q = 2) that each run an 8-step binary search before their first key load.

Keys are read page by page through the block table, `BLOCK_N` at a time, up to the
tile's causal limit read from `seq_lens` at runtime, with an online softmax in fp32
(base 2). Query token i of a request with `seq_len` keys and `query_len` tokens sees
keys `0 .. seq_len - query_len + i`.

Split-KV (flash-decoding). When the batch is too small to fill the GPU (batch-1
decode at long context), a third grid axis cuts each tile's key range into
`num_kv_splits` chunks; every split writes an unnormalized partial result to scratch
and a second kernel merges them. The split count is also a function of padded sizes.

Log-sum-exp (`out_lse`, for merging partial attention across key shards). A variant
compiled with `STORE_LSE=True` also stores each row's natural LSE, `ln 2 * (m + log2 l)`
from the final running max `m` and denominator `l` (-inf for a row that saw no key);
under split-KV the merge kernel stores it. The default variant (`STORE_LSE=False`)
compiles without those stores, so attention without an LSE buffer runs the same code.

fp8 KV cache (`FP8`, from the cache's dtype float8_e4m3fn), with the scales read from the
layer's [2] fp32 tensor on the device. fp32 queries (a CPU, fp32 models) dequantize each loaded
key and value block first, `element * k_scale` (or `v_scale`) in fp32, and enter the same dots
as an fp32 cache holding those values: the same results bit for bit. bf16 / fp16 queries take
fp16 tensor-core dots: the e4m3 elements convert to fp16 exactly (the cheapest conversion out of
e4m3), the query converts to fp16 once (exact for bf16 magnitudes in fp16's normal range, 6.1e-5
to 65504), and the scales apply outside the dots:
k_scale joins the softmax scale (q . (s k) = s (q . k)) and v_scale multiplies the accumulated
output once (p . (s v) = s (p . v)). Dequantizing each element in fp32 and rounding it to bf16
instead left an H200's llama-3.1-8b batch-1 decode at 32k context slower over the fp8 cache
than over a bf16 one (6.51 vs 5.93 ms). The folded KV write (ROPE_KV) quantizes as kv_write.py does.
"""

from __future__ import annotations

import dataclasses

import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.attention.kv_write import fp8_mode, rope_write_kv_triton, write_kv_triton
from graphrunner.attention.torch_ref import (
    WriteThenAttendBackend,
    check_attention_args,
    check_kv_scale,
    check_rope_args,
    kv_scale_pair,
)
from graphrunner.config import MAX_KV_SPLITS, KernelConfig
from graphrunner.kernels import HAS_TRITON, sm_count
from graphrunner.kernels.device import device_properties
from graphrunner.kernels.pdl import pdl_launch, pdl_max_rows

# Finite stand-in for -inf as the running max: keeps exp2(m_old - m_new) at 1 (not NaN)
# for rows that have seen no visible key yet.
_NEG_BIG = -1.0e30
_MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16
# The plan's largest split count by default (KernelConfig.attention_max_kv_splits). H100, context
# 1024, FULL, batch 1: qwen2.5-0.5b 0.794 / 0.790 ms at 16 against 0.865 / 0.832 at 32,
# llama-3.1-8b 6.66-6.75 against 6.80 (with the rotary + KV write in the launch; at 1024 keys in
# 128-key blocks only 9 splits hold keys either way). Longer contexts were not measured.
_PLAN_MAX_SPLITS = KernelConfig().attention_max_kv_splits
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.attention.kv_write import store_kv
    from graphrunner.kernels.pdl import pdl_wait

    _NEG_BIG_C: tl.constexpr = tl.constexpr(_NEG_BIG)
    _LN2_C: tl.constexpr = tl.constexpr(_LN2)

    @triton.jit
    def _e4m3_to_fp16_in_registers(v):
        # v (e4m3, any shape) -> fp16, converted where it was loaded. A plain cast lets the compiler
        # stage the e4m3 tile in shared memory and convert it after: for the value tile, the B
        # operand of p . v (its K dimension, the keys, is not the contiguous one), that read it back
        # one byte at a time (sm_90 PTX of the decode kernel: 128 ld.shared.b8 per thread per key
        # block; there is no transposing ldmatrix for 8-bit elements). Converted first, it is staged
        # as fp16 and read back with ldmatrix.trans, as a bf16 cache's value tile is. The conversion
        # is the one the cast uses (cvt.rn.f16x2.e4m3x2, element 0 in the low half); declaring it
        # impure is what keeps the compiler from moving it after the staging.
        return tl.inline_asm_elementwise(
            "{ .reg .b16 a<2>; mov.b32 {a0, a1}, $2; cvt.rn.f16x2.e4m3x2 $0, a0; cvt.rn.f16x2.e4m3x2 $1, a1; }",
            "=r,=r,r", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)

    @triton.jit
    def _natural_lse(m, denom):
        """ln(sum_n exp(s_n)) from the base-2 running max `m` and denominator `denom`; -inf if none."""
        return tl.where(denom > 0.0, (m + tl.log2(tl.where(denom > 0.0, denom, 1.0))) * _LN2_C, float("-inf"))

    @triton.jit
    def _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
        """Largest b in [0, num_reqs] with query_start_loc[b] // BLOCK_Q + b <= pid."""
        lo = 0
        hi = num_reqs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(start <= pid, mid, lo)
            hi = tl.where(start <= pid, hi, mid - 1)
        return lo

    @triton.jit
    def _rotate(rows, stride_d, pos, cs_ptr, stride_cs, ok, d, HEAD_DIM: tl.constexpr):
        """Neox rotation of rows[..., d] by pos, as kv_write.py's rotary + KV-write kernel computes
        it: cos / sin rounded to the activation dtype, fp32 arithmetic, one rounding (a [.., D_PAD]
        tile, zeros where masked). pos and ok broadcast against d."""
        HALF: tl.constexpr = HEAD_DIM // 2
        ty = rows.dtype.element_ty
        first = d < HALF
        mask = ok & (d < HEAD_DIM)
        j = tl.where(first, d, d - HALF)  # the pair's index in either half
        cs_row = cs_ptr + pos.to(tl.int64) * stride_cs + j
        cos = tl.load(cs_row, mask=mask, other=0.0).to(ty).to(tl.float32)
        sin = tl.load(cs_row + HALF, mask=mask, other=0.0).to(ty).to(tl.float32)
        x = tl.load(rows + d * stride_d, mask=mask, other=0.0).to(tl.float32)
        partner = tl.load(rows + tl.where(first, d + HALF, d - HALF) * stride_d, mask=mask, other=0.0).to(tl.float32)
        # First half x1 cos - x2 sin, second half x2 cos + x1 sin (x = the element, partner = its pair).
        return tl.where(first, x * cos - partner * sin, x * cos + partner * sin).to(ty)

    @triton.jit
    def _split_range(kv_hi, seq_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, ROPE_KV: tl.constexpr):
        """[kv_lo, kv_end): the keys a split reads for a tile that sees kv_hi of them. Under ROPE_KV
        the chunks are cut from the request's whole key range (seq_len), so that a key falls in the
        same split for every tile of its request: that split's program writes it (_write_request_kv)."""
        if NUM_SPLITS > 1:
            whole = seq_len if ROPE_KV else kv_hi
            chunk = tl.cdiv(tl.cdiv(whole, NUM_SPLITS), BLOCK_N) * BLOCK_N
            kv_lo = split * chunk
            kv_end = tl.minimum(kv_lo + chunk, kv_hi)
        else:
            kv_lo = 0
            kv_end = kv_hi
        return kv_lo, kv_end

    @triton.jit
    def _write_request_kv(q_start, q_end, seq_len, kvh, split, k_new_ptr, v_new_ptr, pos_ptr, cs_ptr, slot_ptr,
                          kv_ptr, scale_ptr, block_size, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh,
                          stride_vd, stride_cs, stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          BLOCK_N: tl.constexpr, FP8: tl.constexpr):
        """ROPE_KV, decode grid: this program (request, kv head kvh, split) is the only one that reads
        the keys of its split's range, for every tile of the request. It writes the rotated keys and
        the values of the request's new tokens that fall there (at their slots; -1 = skip) before
        its tiles read them, and barriers so that its own loads see the stores."""
        kv_lo, kv_end = _split_range(seq_len, seq_len, split, NUM_SPLITS, BLOCK_N, True)
        d = tl.arange(0, D_PAD)[None, :]
        for t0 in range(q_start, q_end, 16):
            tok = t0 + tl.arange(0, 16)  # [16] tokens of the request
            live = tok < q_end
            n = seq_len - q_end + tok  # their key indices
            slot = tl.load(slot_ptr + tok, mask=live, other=-1)
            writes = (live & (n >= kv_lo) & (n < kv_end) & (slot >= 0))[:, None]  # [16, 1]
            tok64 = tok.to(tl.int64)[:, None]
            pos = tl.load(pos_ptr + tok64, mask=writes, other=0)
            k_rot = _rotate(k_new_ptr + tok64 * stride_kt + kvh * stride_kh, stride_kd, pos, cs_ptr, stride_cs,
                            writes, d, HEAD_DIM)  # [16, D_PAD]
            mask = writes & (d < HEAD_DIM)
            v = tl.load(v_new_ptr + tok64 * stride_vt + kvh * stride_vh + d * stride_vd, mask=mask, other=0.0)
            slot = slot.to(tl.int64)[:, None]
            dst = (kv_ptr + (slot // block_size) * stride_c_blk + (slot % block_size) * stride_c_off
                   + kvh.to(tl.int64) * stride_c_h + d * stride_c_d)
            store_kv(dst, stride_c_kv, k_rot, v, scale_ptr, mask, FP8)
        tl.debug_barrier()

    @triton.jit
    def _attend_tile(
        tok0,  # the tile's first token
        b,  # its request (num_reqs: the padded tokens' pseudo-request)
        q_end,  # the request's end token
        seq_len,  # its key count (0 for the pseudo-request)
        kvh,
        split,
        q_ptr,
        kv_ptr,
        scale_ptr,  # [2] fp32 (k_scale, v_scale) (FP8 only)
        out_ptr,
        lse_ptr,  # [T, H] fp32 (STORE_LSE only)
        bt_ptr,
        part_o_ptr,  # [S, T, H, D_PAD] fp32 scratch (split-KV only)
        part_ml_ptr,  # [S, T, H, 2] fp32 scratch: running max (base 2) and denominator
        num_tokens,
        block_size,
        qk_scale,  # softmax scale * log2(e)
        dcp_size,  # decode context parallelism (IS_DCP): the cache holds this rank's share of each sequence
        dcp_rank,
        dcp_interleave,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_lt,
        stride_lh,
        stride_c_kv,
        stride_c_blk,
        stride_c_off,
        stride_c_h,
        stride_c_d,
        stride_bt,
        k_new_ptr,  # [T, Hkv, D] this step's keys, not yet rotated (ROPE_KV only)
        v_new_ptr,  # [T, Hkv, D] (ROPE_KV only)
        pos_ptr,  # [T] int64 (ROPE_KV only)
        cs_ptr,  # [max_positions, D] fp32 cos | sin (ROPE_KV only)
        slot_ptr,  # [T] int64 cache slots, -1 = do not write (ROPE_KV only)
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_cs,
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        COMPUTE_FP32: tl.constexpr,
        STORE_LSE: tl.constexpr,
        IS_DCP: tl.constexpr,
        ROPE_KV: tl.constexpr,
        FP8: tl.constexpr,
    ):
        """One (tile, kv head, split) of the module docstring: rows tok0 .. tok0 + BLOCK_Q - 1."""
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        tile_end = tl.minimum(tok0 + BLOCK_Q, q_end)
        # Keys visible to the tile's last token (<= 0 for an empty tile or padding).
        kv_hi = tl.maximum(seq_len - q_end + tile_end, 0)
        if IS_DCP:  # global positions -> this rank's local key count (graphrunner.kernels.dcp layout)
            span = dcp_interleave * dcp_size
            kv_hi = (kv_hi // span) * dcp_interleave + tl.minimum(
                tl.maximum(kv_hi % span - dcp_rank * dcp_interleave, 0), dcp_interleave)
        kv_lo, kv_end = _split_range(kv_hi, seq_len, split, NUM_SPLITS, BLOCK_N, ROPE_KV)

        r = tl.arange(0, BLOCK_M)
        tok = tok0 + r // G_PAD  # [BLOCK_M]
        g = r % G_PAD
        head = kvh * GROUP + g
        row_ok = (tok < q_end) & (g < GROUP)
        row_lim = seq_len - q_end + tok + 1  # row sees keys n < row_lim
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        tok64 = tok.to(tl.int64)

        q_rows = q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh  # [BLOCK_M, 1]
        if ROPE_KV:  # q arrives unrotated (its keys were written by _write_request_kv)
            q = _rotate(q_rows, stride_qd, tl.load(pos_ptr + tok64, mask=row_ok, other=0)[:, None], cs_ptr,
                        stride_cs, row_ok[:, None], d[None, :], HEAD_DIM)  # q: [BLOCK_M, D_PAD]
        else:
            q = tl.load(q_rows + d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if COMPUTE_FP32:
            q = q.to(tl.float32)
        if FP8:
            k_scale = tl.load(scale_ptr)
            v_scale = tl.load(scale_ptr + 1)
            if not COMPUTE_FP32:  # fp16 dots; k_scale joins the score scale, v_scale the output (docstring)
                q = q.to(tl.float16)
                qk_scale = qk_scale * k_scale

        m_i = tl.full([BLOCK_M], _NEG_BIG_C, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        head_off = kvh.to(tl.int64) * stride_c_h
        for start in range(kv_lo, kv_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            blk = tl.load(bt_row + n // block_size, mask=n_ok, other=0).to(tl.int64)
            base = blk * stride_c_blk + (n % block_size).to(tl.int64) * stride_c_off + head_off  # [BLOCK_N]
            kv_off = base[:, None] + d[None, :] * stride_c_d
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(kv_ptr + kv_off, mask=kv_mask, other=0.0)  # k: [BLOCK_N, D_PAD]
            v = tl.load(kv_ptr + stride_c_kv + kv_off, mask=kv_mask, other=0.0)  # v: [BLOCK_N, D_PAD]
            if FP8:
                if COMPUTE_FP32:  # dequantize on load: element * scale in fp32
                    k = k.to(tl.float32) * k_scale
                    v = v.to(tl.float32) * v_scale
                else:  # e4m3 values are exact in fp16: the scales apply outside the dots
                    k = k.to(tl.float16)
                    v = _e4m3_to_fp16_in_registers(v) if FP8 == 1 else v.to(tl.float16)
            if COMPUTE_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale  # s: [BLOCK_M, BLOCK_N], log2 domain
            if IS_DCP:  # local key n sits at global position gpos
                gpos = (n // dcp_interleave) * (dcp_interleave * dcp_size) + dcp_rank * dcp_interleave \
                    + n % dcp_interleave
                visible = (gpos[None, :] < row_lim[:, None]) & n_ok[None, :]
            else:
                visible = (n[None, :] < row_lim[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if COMPUTE_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if FP8 and not COMPUTE_FP32:
            acc = acc * v_scale

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )
            if STORE_LSE:
                tl.store(lse_ptr + tok64 * stride_lt + head * stride_lh, _natural_lse(m_i, l_i), mask=row_ok)
        else:
            row = (split * num_tokens + tok64) * NUM_HEADS + head  # [BLOCK_M] row of the scratch
            tl.store(part_o_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


    @triton.jit(do_not_specialize=['num_reqs', 'num_tokens'])
    def _paged_attn_kernel(
        q_ptr,
        kv_ptr,
        scale_ptr,  # [2] fp32 (k_scale, v_scale) of an fp8 cache (FP8 only)
        out_ptr,
        lse_ptr,  # [T, H] fp32 (STORE_LSE only)
        qsl_ptr,
        seq_lens_ptr,
        bt_ptr,
        part_o_ptr,  # [S, T, H, D_PAD] fp32 scratch (split-KV only)
        part_ml_ptr,  # [S, T, H, 2] fp32 scratch: running max (base 2) and denominator
        num_reqs,
        num_tokens,
        block_size,
        qk_scale,  # softmax scale * log2(e)
        dcp_size,  # decode context parallelism (IS_DCP): the cache holds this rank's share of each sequence
        dcp_rank,
        dcp_interleave,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_lt,
        stride_lh,
        stride_c_kv,
        stride_c_blk,
        stride_c_off,
        stride_c_h,
        stride_c_d,
        stride_bt,
        k_new_ptr,  # ROPE_KV: this step's k and v, positions, the cos | sin table, the slots
        v_new_ptr,
        pos_ptr,
        cs_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_cs,
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        COMPUTE_FP32: tl.constexpr,
        STORE_LSE: tl.constexpr,
        IS_DCP: tl.constexpr,
        ROPE_KV: tl.constexpr,  # decode batch, q unrotated: rotate here and write the new k / v (rope_kv)
        GDC: tl.constexpr,  # launched with PDL: wait before the first access (graphrunner.kernels.pdl)
        DECODE_GRID: tl.constexpr,  # program b serves request b's tiles (attention_launch_plan)
        FP8: tl.constexpr,  # kv_write.fp8_mode: the cache stores quantized e4m3 (module docstring)
    ):
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        pdl_wait(GDC)
        if DECODE_GRID:
            b = pid  # no search; the grid has num_reqs + 1 programs per kv head and split
        else:
            b = _find_request(qsl_ptr, num_reqs, pid, BLOCK_Q)
        is_req = b < num_reqs
        q_start = tl.load(qsl_ptr + b)
        # b == num_reqs: the padded tokens, a pseudo-request with no keys.
        q_end = tl.where(is_req, tl.load(qsl_ptr + b + 1, mask=is_req, other=0), num_tokens)
        seq_len = tl.load(seq_lens_ptr + b, mask=is_req, other=0)
        if DECODE_GRID:
            if ROPE_KV:
                _write_request_kv(q_start, q_end, seq_len, kvh, split, k_new_ptr, v_new_ptr, pos_ptr, cs_ptr,
                                  slot_ptr, kv_ptr, scale_ptr, block_size, stride_kt, stride_kh, stride_kd, stride_vt,
                                  stride_vh, stride_vd, stride_cs, stride_c_kv, stride_c_blk, stride_c_off,
                                  stride_c_h, stride_c_d, HEAD_DIM, D_PAD, NUM_SPLITS, BLOCK_N, FP8)
            for tok0 in range(q_start, q_end, BLOCK_Q):  # one tile per decode request
                _attend_tile(
                    tok0, b, q_end, seq_len, kvh, split,
                    q_ptr, kv_ptr, scale_ptr, out_ptr, lse_ptr, bt_ptr, part_o_ptr, part_ml_ptr, num_tokens,
                    block_size,
                    qk_scale, dcp_size, dcp_rank, dcp_interleave, stride_qt, stride_qh, stride_qd, stride_ot,
                    stride_oh, stride_od, stride_lt, stride_lh, stride_c_kv, stride_c_blk, stride_c_off, stride_c_h,
                    stride_c_d, stride_bt, k_new_ptr, v_new_ptr, pos_ptr, cs_ptr, slot_ptr, stride_kt, stride_kh,
                    stride_kd, stride_vt, stride_vh, stride_vd, stride_cs, NUM_HEADS, GROUP, G_PAD, BLOCK_Q,
                    HEAD_DIM, D_PAD, BLOCK_N, NUM_SPLITS, COMPUTE_FP32, STORE_LSE, IS_DCP, ROPE_KV, FP8,
                )
        else:
            _attend_tile(
                q_start + (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q, b, q_end, seq_len, kvh, split,
                q_ptr, kv_ptr, scale_ptr, out_ptr, lse_ptr, bt_ptr, part_o_ptr, part_ml_ptr, num_tokens, block_size,
                qk_scale,
                dcp_size, dcp_rank, dcp_interleave, stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,
                stride_od, stride_lt, stride_lh, stride_c_kv, stride_c_blk, stride_c_off, stride_c_h, stride_c_d,
                stride_bt, k_new_ptr, v_new_ptr, pos_ptr, cs_ptr, slot_ptr, stride_kt, stride_kh, stride_kd,
                stride_vt, stride_vh, stride_vd, stride_cs, NUM_HEADS, GROUP, G_PAD, BLOCK_Q, HEAD_DIM, D_PAD,
                BLOCK_N, NUM_SPLITS, COMPUTE_FP32, STORE_LSE, IS_DCP, ROPE_KV, FP8,
            )

    @triton.jit(do_not_specialize=['num_tokens'])
    def _merge_splits_kernel(
        part_o_ptr,  # [S, T, H, D_PAD] fp32
        part_ml_ptr,  # [S, T, H, 2] fp32
        out_ptr,
        lse_ptr,  # [T, H] fp32 (STORE_LSE only)
        num_tokens,
        stride_ot,
        stride_oh,
        stride_od,
        stride_lt,
        stride_lh,
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        STORE_LSE: tl.constexpr,
        GDC: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        pdl_wait(GDC)
        g = tl.arange(0, G_PAD)
        g_ok = g < GROUP
        head = kvh * GROUP + g
        d = tl.arange(0, D_PAD)
        m_max = tl.full([G_PAD], _NEG_BIG_C, tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            row = (s * num_tokens + t) * NUM_HEADS + head
            m_max = tl.maximum(m_max, tl.load(part_ml_ptr + row * 2, mask=g_ok, other=_NEG_BIG_C))
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        l_sum = tl.zeros([G_PAD], tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            row = (s * num_tokens + t) * NUM_HEADS + head
            w = tl.exp2(tl.load(part_ml_ptr + row * 2, mask=g_ok, other=_NEG_BIG_C) - m_max)
            l_sum += w * tl.load(part_ml_ptr + row * 2 + 1, mask=g_ok, other=0.0)
            o = tl.load(part_o_ptr + row[:, None] * D_PAD + d[None, :], mask=g_ok[:, None], other=0.0)
            acc += w[:, None] * o
        o = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + t * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & (d[None, :] < HEAD_DIM),
        )
        if STORE_LSE:
            tl.store(lse_ptr + t * stride_lt + head * stride_lh, _natural_lse(m_max, l_sum), mask=g_ok)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def attention_launch_plan(
    num_tokens: int, num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
    max_kv_splits: int = _PLAN_MAX_SPLITS,
) -> dict[str, int]:
    """Tile sizes, grid and launch options of `paged_attention_triton` for a padded batch shape.

    A pure function of Python ints (never of tensor values): that is what lets one
    captured graph serve every batch of its padded shape. Decode-shaped batches
    (no more tokens than requests) get the smallest tile that still feeds `tl.dot`
    and long key blocks; longer queries get taller tiles so that each key block is
    reused by more rows. Block sizes / stages were picked by a sweep on an H200
    (bf16, head_dim 64 and 128). Small batches split the keys, up to `max_kv_splits` ways.
    """
    group = num_heads // num_kv_heads
    g_pad = _next_pow2(group)
    d_pad = max(_MIN_DOT_ROWS, _next_pow2(head_dim))
    decode_like = num_tokens <= num_reqs
    rows = _MIN_DOT_ROWS if decode_like else 64
    block_q = max(1, rows // g_pad)
    num_tiles = num_tokens // block_q + num_reqs + 1
    # Register budget: halve the key block for head dims above 128.
    block_n = (128 if decode_like else 64) // (1 if d_pad <= 128 else 2)
    num_kv_splits = 1
    if device.type == "cuda":
        # Tiles that can hold real work: one per request at least, more for long queries.
        busy = max(min(num_reqs, num_tokens), -(-num_tokens // block_q)) * num_kv_heads
        num_sms = sm_count(device, cpu=1)
        num_kv_splits = max(1, min(max_kv_splits, (2 * num_sms) // max(busy, 1)))
    num_warps = 4
    if decode_like and d_pad <= 64 and num_kv_splits == 1:
        # Large decode batches of small heads: 64-key blocks and 2 warps keep more programs
        # resident per SM; on an H100 batch 256 of a 14/2 x 64 model ran 74.8 -> 55.1 µs
        # (the KV-read floor). Head dim 128 gains nothing.
        block_n, num_warps = 64, 2
    return {
        "block_q": block_q,
        "g_pad": g_pad,
        "d_pad": d_pad,
        "num_tiles": num_tiles,
        # Decode grid (module docstring) once (request, KV head) pairs alone fill the GPU (at most
        # two splits): on an H100, 14/2 x 64 heads, context 1024, batch 256 55.2 -> 52.5 µs and
        # batch 64 16.7 -> 15.1 µs; at batch 1 (32 splits) the search grid stays ahead, 5.6 vs 5.9 µs.
        "decode_grid": decode_like and num_kv_splits <= 2,
        "num_kv_splits": num_kv_splits,
        "block_n": block_n,
        "num_warps": num_warps,
        "num_stages": 3 if decode_like else 2,
        "maxnreg": 0,  # 0: the compiler's choice
    }


@dataclasses.dataclass(frozen=True)
class RopeKV:
    """What `paged_attention_triton` needs to fold the rotary embedding and the KV write in."""

    k: torch.Tensor  # [T, Hkv, D], not yet rotated; any strides
    v: torch.Tensor  # [T, Hkv, D], any strides
    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # [max_positions, D] float32: cos | sin
    slot_mapping: torch.Tensor  # [>= T] int64, -1 = do not write


def _rope_kv_args(rope_kv: RopeKV | None, q: torch.Tensor, dcp: tuple[int, int, int] | None) -> tuple:
    """The kernel's ROPE_KV arguments (placeholders without it), after host-side checks."""
    if rope_kv is None:
        return (q, q, q, q, q) + (0,) * 7
    num_tokens = q.shape[0]
    if dcp is not None:
        raise ValueError(f"rope_kv cannot serve a DCP-sharded cache (dcp={dcp}): its rank writes its own share")
    k, v, cs = rope_kv.k, rope_kv.v, rope_kv.cos_sin
    check_rope_args(q, k, rope_kv.positions, cs)  # shapes against q, an even head_dim, the cos | sin table
    if v.shape != k.shape:
        raise ValueError(f"rope_kv: v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    if rope_kv.slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"rope_kv: slot_mapping has {rope_kv.slot_mapping.shape[0]} entries for {num_tokens} tokens")
    return (k, v, rope_kv.positions, cs, rope_kv.slot_mapping, *k.stride(), *v.stride(), cs.stride(0))


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, H, D], written in place
    out_lse: torch.Tensor | None = None,  # [T, H] fp32, written in place if given
    *,
    num_kv_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    dcp: tuple[int, int, int] | None = None,
    decode_grid: bool | None = None,
    rope_kv: RopeKV | None = None,
    max_kv_splits: int = _PLAN_MAX_SPLITS,
    pdl_rows: int = 0,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention of a padded mixed batch in one (or, split-KV, two) launches.

    Reads `metadata.query_start_loc[:num_reqs + 1]` (must start at 0),
    `seq_lens[:num_reqs]` and `block_table[:num_reqs]` on the device; rows of padded
    tokens are written as zeros. With `out_lse`, also writes each row's natural
    log-sum-exp of the scaled scores over the keys it saw (-inf for none: padded tokens,
    rows before a request's first key). The keyword arguments override
    `attention_launch_plan` (tests, tuning); they must stay fixed for a captured graph.
    `dcp` = (size, rank, interleave): the cache holds only this DCP rank's tokens (local
    positions, graphrunner.kernels.dcp); `seq_lens` stay global and each key is masked by
    its global position. `decode_grid` overrides the plan's grid (module docstring). `rope_kv`
    (not with `dcp`; the decode grid, which it needs, unless `decode_grid=False` is asked and
    refused): q is not yet rotated; the kernel rotates it, and each program first writes the
    rotated keys and the values of its request's new tokens that its split reads, at their
    slots (the rotary + KV-write kernel folded in; `RopeKV`). `kv_scale` ([2] fp32: k_scale,
    v_scale; None: 1.0) is read when the cache is fp8 (module docstring). Works on CPU tensors
    under TRITON_INTERPRET=1.
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_attention_triton needs triton, which failed to import; use the torch backend")
    check_attention_args(q, kv_cache, metadata, out, out_lse)
    check_kv_scale(kv_cache, kv_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_tokens == 0:
        return out
    plan = attention_launch_plan(num_tokens, metadata.num_reqs, num_heads, num_kv_heads, head_dim, q.device,
                                 max_kv_splits)
    splits = plan["num_kv_splits"] if num_kv_splits is None else num_kv_splits
    if not 1 <= splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits={splits} must be in [1, {MAX_KV_SPLITS}]")
    d_pad = plan["d_pad"]
    block_n = plan["block_n"] if block_n is None else block_n
    num_warps = plan["num_warps"] if num_warps is None else num_warps
    num_stages = plan["num_stages"] if num_stages is None else num_stages
    maxnreg = plan["maxnreg"] if maxnreg is None else maxnreg
    if block_n < _MIN_DOT_ROWS or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two >= {_MIN_DOT_ROWS}")
    # The interpreter's bf16 arithmetic is broken, and fp32 inputs want exact dots:
    # both compute in fp32. fp16/bf16 on a GPU keep their native tensor-core dots.
    compute_fp32 = q.device.type != "cuda" or q.dtype == torch.float32
    group = num_heads // num_kv_heads
    if splits > 1:
        part_o = torch.empty((splits, num_tokens, num_heads, d_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, num_tokens, num_heads, 2), dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused by the kernel
    store_lse = out_lse is not None
    lse = out_lse if out_lse is not None else out  # unused by the kernel unless STORE_LSE
    lse_strides = out_lse.stride() if out_lse is not None else (0, 0)
    block_table = metadata.block_table
    launch = pdl_launch(num_tokens, pdl_rows)
    gdc = bool(launch)
    registers = {"maxnreg": maxnreg} if maxnreg else {}  # 0: no cap, the option left out
    by_request = (plan["decode_grid"] or rope_kv is not None) if decode_grid is None else decode_grid
    rope_args = _rope_kv_args(rope_kv, q, dcp)
    if rope_kv is not None and not by_request:
        raise ValueError("rope_kv needs the decode grid: a request's keys are written by the programs that read them")
    num_programs = metadata.num_reqs + 1 if by_request else plan["num_tiles"]
    fp8 = fp8_mode(kv_cache)
    _paged_attn_kernel[(num_programs, num_kv_heads, splits)](
        q,
        kv_cache,
        kv_scale_pair(kv_scale, kv_cache.device) if fp8 else q,  # unread without FP8
        out,
        lse,
        metadata.query_start_loc,
        metadata.seq_lens,
        block_table,
        part_o,
        part_ml,
        metadata.num_reqs,
        num_tokens,
        block_size,
        scale * _LOG2E,
        *(dcp if dcp is not None else (1, 0, 1)),
        *q.stride(),
        *out.stride(),
        *lse_strides,
        *kv_cache.stride(),
        block_table.stride(0),
        *rope_args,
        NUM_HEADS=num_heads,
        GROUP=group,
        G_PAD=plan["g_pad"],
        BLOCK_Q=plan["block_q"],
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        COMPUTE_FP32=compute_fp32,
        STORE_LSE=store_lse,
        IS_DCP=dcp is not None,
        ROPE_KV=rope_kv is not None,
        GDC=gdc,
        DECODE_GRID=by_request,
        FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
        **registers,
        **launch,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_kv_heads)](
            part_o,
            part_ml,
            out,
            lse,
            num_tokens,
            *out.stride(),
            *lse_strides,
            NUM_HEADS=num_heads,
            GROUP=group,
            G_PAD=plan["g_pad"],
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=splits,
            STORE_LSE=store_lse,
            GDC=gdc,
            **launch,
        )
    return out


class TritonPagedAttentionBackend(WriteThenAttendBackend):
    """Graph-safe paged attention: Triton KV write, then one mixed-batch Triton launch.

    Built for one device under a `KernelConfig`: the plan's split cap, PDL, and whether decode
    batches fold the rotary embedding and the KV write into the attention launch."""

    name = "triton"

    def __init__(self, kernel: KernelConfig | None = None, device: torch.device | str | None = None) -> None:
        if not HAS_TRITON:
            raise RuntimeError("TritonPagedAttentionBackend needs triton, which failed to import")
        kernel = kernel or KernelConfig()
        self.rope_in_attention = kernel.attention_rope
        self.max_kv_splits = kernel.attention_max_kv_splits
        self.pdl_rows = pdl_max_rows(kernel, device_properties(device))

    def write_kv(self, k, v, kv_cache, slot_mapping, kv_scale=None) -> None:
        write_kv_triton(k, v, kv_cache, slot_mapping, kv_scale)

    def attend(self, q, kv_cache, metadata, scale, out, out_lse=None, dcp=None, kv_scale=None) -> torch.Tensor:
        return paged_attention_triton(q, kv_cache, metadata, scale, out, out_lse, dcp=dcp,
                                      max_kv_splits=self.max_kv_splits, pdl_rows=self.pdl_rows, kv_scale=kv_scale)

    def rope_attend(self, q, k, v, positions, cos_sin, kv_cache, metadata, scale, out=None,
                    kv_scale=None) -> torch.Tensor:
        """q and k not yet rotated. A decode batch (no more tokens than requests): the attention
        launch rotates, writes and attends (`RopeKV`, with its decode grid). Other batches: the
        rotary + KV-write kernel, then attention. Under prefill context parallelism (k/v
        all-gathered before the write): the torch rotation, then `forward`."""
        if metadata.kv_gather is not None:
            return super().rope_attend(q, k, v, positions, cos_sin, kv_cache, metadata, scale, out, kv_scale)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D], contiguous like q_rot
        if self.rope_in_attention and q.shape[0] <= metadata.num_reqs:
            rope = RopeKV(k, v, positions, cos_sin, metadata.slot_mapping)
            return paged_attention_triton(q, kv_cache, metadata, scale, out, rope_kv=rope,
                                          max_kv_splits=self.max_kv_splits, pdl_rows=self.pdl_rows,
                                          kv_scale=kv_scale)
        slots = metadata.slot_mapping[: metadata.num_tokens]
        q_rot = rope_write_kv_triton(q, k, v, positions, cos_sin, kv_cache, slots, self.pdl_rows, kv_scale)
        return self.attend(q_rot, kv_cache, metadata, scale, out, kv_scale=kv_scale)


__all__ = ["RopeKV", "TritonPagedAttentionBackend", "paged_attention_triton", "attention_launch_plan"]
