"""Log-sum-exp output of the attention backends and the exact merge of partial attention.

Decode context parallelism splits a request's keys across ranks; each rank attends over
its shard with `out_lse`, and `merge_attention_states` must give attention over all the
keys. Here the shards live in one process: each is a paged batch of its own (a local KV
cache holding the shard's keys in position order), and every query token is one row
whose `seq_len` is the number of the shard's keys at or before its position (what a
rank's local sequence length is under DCP). Shardings: DCP's interleaving (key p on
shard (p // I) % N), contiguous cuts and arbitrary assignments, empty shards included.

The references are independent: float64 dense attention and torch.logsumexp of its
scores. Tolerances (float32): outputs and LSE at atol/rtol 2e-5 (same math, another
summation order plus the merge's few roundings); fp16 inputs at 2e-3 on outputs (one
fp16 rounding) and 1e-4 on the LSE (computed in fp32 from the same fp16 values); bf16
on the GPU at 3e-2 on outputs (bf16 P@V dot) and 1e-2 on the LSE.

CPU: the Triton kernels run interpreted (TRITON_INTERPRET=1 from conftest) on tiny shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from graphrunner.attention import AttentionMetadata
from graphrunner.attention.merge import merge_attention_states, merge_attention_states_torch
from graphrunner.attention.torch_ref import TorchReferenceBackend, paged_attention_torch
from graphrunner.kernels import HAS_TRITON
from tests.model.test_attention import Batch, heads, make_batch, num_programs, request_lists

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
if HAS_TRITON:
    from graphrunner.attention.merge import merge_attention_states_triton
    from graphrunner.attention.triton_attn import TritonPagedAttentionBackend, paged_attention_triton

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEG_INF = float("-inf")
TOL32 = dict(atol=2e-5, rtol=2e-5)
MAX_CPU_PROGRAMS = 16  # per interpreted launch, as in test_attention.py

# Attention over one batch into (out, out_lse): the torch reference or the Triton kernel.
AttendFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, torch.Tensor, torch.Tensor], None]


# --------------------------------------------------------------------------- references


def dense_attention_f64(batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every real token over its request's keys, in float64.

    Returns out [T, H, D] and lse [T, H] (torch.logsumexp of the masked scaled scores);
    padded tokens get 0 and -inf.
    """
    num_tokens, num_heads, head_dim = batch.q.shape
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64, device=batch.q.device)
    lse = torch.full((num_tokens, num_heads), NEG_INF, dtype=torch.float64, device=batch.q.device)
    start = 0
    for (ctx, qlen), fk, fv in zip(batch.reqs, batch.full_k, batch.full_v, strict=True):
        group = num_heads // fk.shape[1]
        qq = batch.q[start : start + qlen].double()  # [qlen, H, D]
        kk = fk.double().repeat_interleave(group, dim=1)  # [S, H, D]
        vv = fv.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", qq, kk) * scale  # [H, qlen, S]
        key_pos, query_pos = torch.arange(ctx + qlen, device=qq.device), ctx + torch.arange(qlen, device=qq.device)
        allowed = key_pos[None, :] <= query_pos[:, None]  # [qlen, S]
        masked = scores.masked_fill(~allowed, NEG_INF)
        lse[start : start + qlen] = torch.logsumexp(masked, dim=-1).transpose(0, 1)
        out[start : start + qlen] = torch.einsum("hqs,shd->qhd", masked.softmax(dim=-1), vv)
        start += qlen
    return out, lse


def merge_f64(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge by its definition, in float64 (the empty rows handled by masking)."""
    lse = torch.logsumexp(lses.double(), dim=0)  # [T, H]
    seen = lse > NEG_INF
    w = torch.exp(lses.double() - torch.where(seen, lse, 0.0))  # [N, T, H]
    o = torch.where(w[..., None] > 0, outputs.double(), 0.0)  # weight-0 rows may hold garbage
    return (w[..., None] * o).sum(0), lse


# --------------------------------------------------------------------------- sharded batches


@dataclass
class Shard:
    """One shard's paged batch: real token t of the full batch is row t."""

    q: torch.Tensor  # [T, H, D] (the full batch's rows, padded tokens included)
    kv_cache: torch.Tensor  # [2, nb, bs, Hkv, D]: this shard's keys, compact, in position order
    metadata: AttentionMetadata  # one request per token (query length 1); padded rows have seq_len 0


def make_shard(batch: Batch, shard_of: Callable[[int], int], shard: int, block_size: int, seed: int) -> Shard:
    """The paged batch that attends every token of `batch` over the keys `shard` holds.

    A request's shard keys sit in a local cache in position order; the rows of its query
    tokens share that request's blocks, each with the count of shard keys at or before
    its position as seq_len (0 = an empty shard for that token).
    """
    num_tokens, _, head_dim = batch.q.shape
    num_kv_heads, dtype, device = batch.kv_cache.shape[3], batch.kv_cache.dtype, batch.q.device
    gen = torch.Generator().manual_seed(seed)
    # per request: (the key positions this shard holds, context length, query length)
    local = [([p for p in range(ctx + qlen) if shard_of(p) == shard], ctx, qlen) for ctx, qlen in batch.reqs]
    blocks_per_req = [-(-len(pos) // block_size) for pos, _, _ in local]
    num_blocks = sum(blocks_per_req) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype, device=device)
    width = max(blocks_per_req + [1])
    block_table = torch.randint(0, num_blocks, (num_tokens, width), generator=gen, dtype=torch.int32)
    seq_lens = [0] * num_tokens
    row = 0
    for (pos, ctx, qlen), fk, fv, nb in zip(local, batch.full_k, batch.full_v, blocks_per_req, strict=True):
        phys = [perm.pop() for _ in range(nb)]
        index = torch.tensor(pos, dtype=torch.long, device=device)
        for j, blk in enumerate(phys):
            chunk = index[j * block_size : (j + 1) * block_size]
            kv_cache[0, blk, : chunk.numel()] = fk[chunk]
            kv_cache[1, blk, : chunk.numel()] = fv[chunk]
        for i in range(qlen):
            block_table[row, :nb] = torch.tensor(phys, dtype=torch.int32)
            seq_lens[row] = sum(1 for p in pos if p <= ctx + i)
            row += 1
    num_real = row
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(list(range(num_real + 1)) + [num_real] * (num_tokens - num_real),
                                     dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        num_reqs=num_tokens,
        num_tokens=num_tokens,
        max_query_len=1,
        max_seq_len=max(seq_lens + [1]),
    )  # fmt: skip
    return Shard(q=batch.q, kv_cache=kv_cache, metadata=metadata)


def attend_shards(
    batch: Batch,
    shard_of: Callable[[int], int],
    num_shards: int,
    block_size: int,
    attend: AttendFn,
    scale: float,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every shard's partial attention: outputs [N, T, H, D] (out_dtype) and lses [N, T, H] fp32."""
    device = batch.q.device
    outputs = torch.full((num_shards, *batch.q.shape), math.nan, dtype=out_dtype, device=device)
    lses = torch.full((num_shards, *batch.q.shape[:2]), math.nan, dtype=torch.float32, device=device)
    for r in range(num_shards):
        shard = make_shard(batch, shard_of, r, block_size, seed=r)
        attend(shard.q, shard.kv_cache, shard.metadata, scale, outputs[r], lses[r])
    return outputs, lses


def torch_attend(q, kv_cache, metadata, scale, out, out_lse) -> None:
    paged_attention_torch(q, kv_cache, metadata, scale, out, out_lse)


def triton_attend(splits: int | None = 1) -> AttendFn:
    """The Triton kernel with `splits` split-KV chunks (None: the launch plan's count)."""

    def attend(q, kv_cache, metadata, scale, out, out_lse) -> None:
        paged_attention_triton(q, kv_cache, metadata, scale, out, out_lse, num_kv_splits=splits)

    return attend


# --------------------------------------------------------------------------- strategies


@st.composite
def shardings(draw, max_keys: int, max_shards: int = 4) -> tuple[int, Callable[[int], int], str]:
    """(N, position -> shard, description): DCP interleaving, contiguous cuts or arbitrary."""
    n = draw(st.integers(1, max_shards))
    kind = draw(st.sampled_from(["interleaved", "contiguous", "arbitrary"]))
    if kind == "interleaved":
        interleave = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
        return n, lambda p: (p // interleave) % n, f"(p // {interleave}) % {n}"
    if kind == "contiguous":
        cuts = sorted(draw(st.lists(st.integers(0, max_keys), min_size=n - 1, max_size=n - 1)))
        return n, lambda p: sum(p >= c for c in cuts), f"cuts {cuts}"
    owner = draw(st.lists(st.integers(0, n - 1), min_size=max_keys, max_size=max_keys))
    return n, lambda p: owner[p], f"owner {owner}"


def _batch(reqs, hk, head_dim, block_size, pad_tokens, seed, dtype=torch.float32) -> Batch:
    num_heads, num_kv_heads = hk
    return make_batch(
        reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        pad_reqs=pad_tokens, pad_tokens=pad_tokens, dtype=dtype, seed=seed,
    )  # fmt: skip


def _check_merged(batch: Batch, outputs: torch.Tensor, lses: torch.Tensor, scale: float, tol: dict) -> None:
    """Merge (torch, and Triton when present) and compare with full attention over all keys."""
    want_out, want_lse = dense_attention_f64(batch, scale)
    impls = [merge_attention_states_torch] + ([merge_attention_states_triton] if HAS_TRITON else [])
    for impl in impls:
        out = torch.full(batch.q.shape, math.nan, dtype=torch.float32, device=batch.q.device)
        out_lse = torch.full(batch.q.shape[:2], math.nan, dtype=torch.float32, device=batch.q.device)
        impl(outputs, lses, out, out_lse)
        torch.testing.assert_close(out, want_out.float(), **tol)
        torch.testing.assert_close(out_lse, want_lse.float(), **tol)  # -inf on padded rows, equal_nan off


# --------------------------------------------------------------------------- LSE of the backends


@settings(deadline=None)
@given(
    reqs=request_lists(max_reqs=4, max_ctx=40, max_qlen=9, max_tokens=20),
    hk=heads,
    head_dim=st.sampled_from([16, 32]),
    block_size=st.sampled_from([4, 8, 16]),
    pad_tokens=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_torch_lse_is_logsumexp_of_the_scores(reqs, hk, head_dim, block_size, pad_tokens, seed):
    batch = _batch(reqs, hk, head_dim, block_size, pad_tokens, seed)
    scale = head_dim**-0.5
    lse = torch.full(batch.q.shape[:2], math.nan)
    out = TorchReferenceBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale, out_lse=lse)
    want_out, want_lse = dense_attention_f64(batch, scale)
    torch.testing.assert_close(lse, want_lse.float(), **TOL32)
    torch.testing.assert_close(out, want_out.float(), **TOL32)


@needs_triton
@settings(deadline=None)
@given(
    reqs=request_lists(max_reqs=3, max_ctx=40, max_qlen=4, max_tokens=5),
    hk=heads,
    head_dim=st.sampled_from([16, 32]),
    block_size=st.sampled_from([4, 8, 16]),
    pad_tokens=st.integers(0, 1),
    splits=st.sampled_from([1, 2, 3]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_triton_lse_is_logsumexp_of_the_scores(reqs, hk, head_dim, block_size, pad_tokens, splits, dtype, seed):
    """Mixed batches (prefill tiles, GQA groups, split-KV); the output with an LSE buffer is
    bit-identical to the output without one."""
    batch = _batch(reqs, hk, head_dim, block_size, pad_tokens, seed, dtype)
    while splits > 1 and num_programs(batch, splits) > MAX_CPU_PROGRAMS:
        splits -= 1
    scale = head_dim**-0.5
    want_out, want_lse = dense_attention_f64(batch, scale)
    lse_tol = TOL32 if dtype == torch.float32 else dict(atol=1e-4, rtol=1e-4)
    out_tol = TOL32 if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    lse = torch.full(batch.q.shape[:2], math.nan)
    backend = TritonPagedAttentionBackend()  # writes the new k/v, then attends with the planned split count
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale, out_lse=lse)
    torch.testing.assert_close(lse, want_lse.float(), **lse_tol)
    torch.testing.assert_close(out.float(), want_out.float(), **out_tol)
    plain = paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, scale, torch.empty_like(batch.q),
                                   num_kv_splits=splits)  # fmt: skip
    lse.fill_(math.nan)
    out = paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, scale, torch.empty_like(batch.q), lse,
                                 num_kv_splits=splits)  # fmt: skip
    assert torch.equal(out, plain)
    torch.testing.assert_close(lse, want_lse.float(), **lse_tol)


def _no_key_metadata(device) -> AttentionMetadata:
    """Request 0: seq_len 1, 3 query tokens (the first two see no key); request 1: seq_len 0, one token;
    request 2: one ordinary decode; then one padded token."""
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 3, 4, 5], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([1, 0, 2], dtype=torch.int32, device=device),
        block_table=torch.tensor([[1], [0], [0]], dtype=torch.int32, device=device),
        slot_mapping=torch.full((6,), -1, dtype=torch.int64, device=device),
        num_reqs=3, num_tokens=6, max_query_len=3, max_seq_len=2,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_token_that_sees_no_key_gets_lse_minus_inf_and_zero_output(backend):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 16, generator=gen).to(DEVICE)
    kv_cache = torch.randn(2, 2, 4, 1, 16, generator=gen).to(DEVICE)  # block 1 holds request 0's key
    for attend in [torch_attend] if backend == "torch" else [triton_attend(1), triton_attend(2)]:
        out = torch.full_like(q, math.nan)
        lse = torch.full((6, 2), math.nan, device=DEVICE)
        attend(q, kv_cache, _no_key_metadata(DEVICE), 0.25, out, lse)
        _check_no_key_rows(q, kv_cache, out, lse)


def _check_no_key_rows(q, kv_cache, out, lse) -> None:
    empty = [0, 1, 3, 5]  # tokens before request 0's key, request 1's token, the padded token
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert (lse[empty] == NEG_INF).all()
    # The rows that see keys: token 2 sees request 0's one key, token 4 request 2's two keys.
    k0, v0 = kv_cache[0, 1, 0, 0].float(), kv_cache[1, 1, 0, 0].float()
    torch.testing.assert_close(lse[2], (q[2].float() @ k0) * 0.25, **TOL32)
    torch.testing.assert_close(out[2], v0.expand(2, 16), **TOL32)
    s4 = (q[4].float() @ kv_cache[0, 0, :2, 0].float().T) * 0.25  # [H, 2]
    torch.testing.assert_close(lse[4], torch.logsumexp(s4, dim=-1), **TOL32)
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_lse_shape_and_dtype_are_checked(backend):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    batch = make_batch([(3, 2)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    impl = TorchReferenceBackend() if backend == "torch" else TritonPagedAttentionBackend()
    for bad in (torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.float16)):
        with pytest.raises(ValueError, match="out_lse"):
            impl.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, 0.25, out_lse=bad.to(DEVICE))


# --------------------------------------------------------------------------- shards merged = full attention


@settings(deadline=None)
@given(
    reqs=request_lists(max_reqs=4, max_ctx=30, max_qlen=5, max_tokens=10),
    hk=heads,
    head_dim=st.sampled_from([16, 32]),
    block_size=st.sampled_from([4, 8]),
    pad_tokens=st.integers(0, 2),
    sharding=shardings(max_keys=35),
    seed=st.integers(0, 2**16),
)
def test_torch_shards_merged_equal_full_attention(reqs, hk, head_dim, block_size, pad_tokens, sharding, seed):
    num_shards, shard_of, _ = sharding
    batch = _batch(reqs, hk, head_dim, block_size, pad_tokens, seed)
    scale = head_dim**-0.5
    outputs, lses = attend_shards(batch, shard_of, num_shards, block_size, torch_attend, scale)
    _check_merged(batch, outputs, lses, scale, TOL32)


@needs_triton
@settings(deadline=None)
@given(
    reqs=request_lists(max_reqs=2, max_ctx=24, max_qlen=2, max_tokens=3),
    hk=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    block_size=st.sampled_from([4, 8]),
    pad_tokens=st.integers(0, 1),
    sharding=shardings(max_keys=26, max_shards=3),
    splits=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
@example(reqs=[(5, 1)], hk=(2, 1), block_size=4, pad_tokens=1, sharding=(3, lambda p: (p // 8) % 3, "(p // 8) % 3"),
         splits=2, seed=0).via("an empty shard and a padded row")  # fmt: skip
def test_triton_shards_merged_equal_full_attention(reqs, hk, block_size, pad_tokens, sharding, splits, seed):
    """Tiny cases (the interpreter runs one launch per shard); split-KV inside a shard too."""
    num_shards, shard_of, _ = sharding
    batch = _batch(reqs, hk, 16, block_size, pad_tokens, seed)
    scale = 0.25
    outputs, lses = attend_shards(batch, shard_of, num_shards, block_size, triton_attend(splits), scale)
    _check_merged(batch, outputs, lses, scale, TOL32)


def test_dcp_interleaved_shards_with_an_empty_rank():
    """DCP-like: 4 ranks, interleave 4, decodes with 0..9 keys, so some ranks hold nothing for some rows."""
    batch = _batch([(0, 1), (3, 1), (8, 1), (5, 4)], (4, 2), 32, 4, 2, seed=5)
    scale = 32**-0.5
    outputs, lses = attend_shards(batch, lambda p: (p // 4) % 4, 4, 4, torch_attend, scale)
    assert (lses[3, 0] == NEG_INF).all() and torch.equal(outputs[3, 0], torch.zeros_like(outputs[3, 0]))
    _check_merged(batch, outputs, lses, scale, TOL32)


# --------------------------------------------------------------------------- the merge itself


@st.composite
def merge_inputs(draw, max_tokens: int = 4, max_heads: int = 3):
    n = draw(st.integers(1, 4))
    t = draw(st.integers(1, max_tokens))
    h = draw(st.integers(1, max_heads))
    d = draw(st.sampled_from([1, 5, 16, 24]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lses = torch.randn(n, t, h, generator=gen) * draw(st.sampled_from([1.0, 30.0, 1e3]))
    empty = torch.rand(n, t, h, generator=gen) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    lses = lses.masked_fill(empty, NEG_INF)
    outputs = torch.randn(n, t, h, d, generator=gen)
    outputs = outputs.masked_fill(empty[..., None], draw(st.sampled_from([0.0, math.nan, math.inf])))
    return outputs, lses


@settings(deadline=None)
@given(merge_inputs(), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_torch_merge_matches_its_definition(inputs, dtype):
    """Stable for large LSE gaps, 0 / -inf for all-empty rows, garbage in empty shards unread."""
    outputs, lses = inputs
    outputs = outputs.to(dtype)
    out = torch.empty(outputs.shape[1:], dtype=dtype)
    out_lse = torch.empty(lses.shape[1:])
    merge_attention_states(outputs, lses, out, out_lse)
    want_out, want_lse = merge_f64(outputs, lses)
    assert not out.isnan().any() and not out_lse.isnan().any()
    tol = TOL32 if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # one rounding to fp16/bf16
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(out_lse, want_lse.float(), **TOL32)
    all_empty = lses.amax(0) == NEG_INF
    assert torch.equal(out[all_empty], torch.zeros_like(out[all_empty]))
    assert (out_lse[all_empty] == NEG_INF).all()


@needs_triton
@settings(deadline=None)
@given(merge_inputs(), st.sampled_from([torch.float32, torch.float16]), st.booleans())
def test_triton_merge_matches_torch(inputs, dtype, with_lse):
    outputs, lses = (x.to(DEVICE) for x in inputs)
    outputs = outputs.to(dtype)
    out = torch.full(outputs.shape[1:], math.nan, dtype=dtype, device=DEVICE)
    out_lse = torch.full(lses.shape[1:], math.nan, device=DEVICE) if with_lse else None
    merge_attention_states_triton(outputs, lses, out, out_lse)
    ref = torch.empty_like(out)
    ref_lse = torch.empty(lses.shape[1:], device=DEVICE)
    merge_attention_states_torch(outputs, lses, ref, ref_lse)
    tol = TOL32 if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out, ref, **tol)
    if out_lse is not None:
        torch.testing.assert_close(out_lse, ref_lse, **TOL32)


@settings(deadline=None)
@given(merge_inputs(), st.integers(1, 3))
def test_merge_is_associative(inputs, cut):
    """Merging two partial merges equals one merge of all shards (ranks can merge in stages)."""
    outputs, lses = inputs
    n = outputs.shape[0]
    cut = min(cut, n)
    out_all, lse_all = torch.empty(outputs.shape[1:]), torch.empty(lses.shape[1:])
    merge_attention_states(outputs, lses, out_all, lse_all)
    parts = [(outputs[:cut], lses[:cut]), (outputs[cut:], lses[cut:])] if cut < n else [(outputs, lses)]
    outs, part_lses = [], []
    for o, lse in parts:
        outs.append(torch.empty(outputs.shape[1:]))
        part_lses.append(torch.empty(lses.shape[1:]))
        merge_attention_states(o, lse, outs[-1], part_lses[-1])
    out2, lse2 = torch.empty_like(out_all), torch.empty_like(lse_all)
    merge_attention_states(torch.stack(outs), torch.stack(part_lses), out2, lse2)
    torch.testing.assert_close(out2, out_all, **TOL32)
    torch.testing.assert_close(lse2, lse_all, **TOL32)


def test_merge_rejects_bad_shapes():
    out, out_lse = torch.empty(3, 2, 8), torch.empty(3, 2)
    with pytest.raises(ValueError, match="lses"):
        merge_attention_states(torch.zeros(2, 3, 2, 8), torch.zeros(3, 3, 2), out, out_lse)
    with pytest.raises(ValueError, match="lses.*dtype"):
        merge_attention_states(torch.zeros(2, 3, 2, 8), torch.zeros(2, 3, 2, dtype=torch.float16), out, out_lse)
    with pytest.raises(ValueError, match="out_lse"):
        merge_attention_states(torch.zeros(2, 3, 2, 8), torch.zeros(2, 3, 2), out, torch.empty(3, 3))
    with pytest.raises(ValueError, match="num_shards"):
        merge_attention_states(torch.zeros(0, 3, 2, 8), torch.zeros(0, 3, 2), out, out_lse)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_shards,interleave", [(2, 1), (2, 16), (4, 64), (3, 5)])
def test_gpu_triton_shards_merged_equal_full_attention(dtype, num_shards, interleave):
    """Realistic GQA shapes, long contexts, decodes plus a 3-token speculative-style query;
    each shard with the planned split-KV count and with 4 splits; merge on the GPU."""
    reqs = [(3000, 1), (1, 1), (0, 1), (777, 1), (1500, 3)] + [(c, 1) for c in range(40, 400, 60)]
    batch = make_batch(
        reqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, pad_reqs=3, pad_tokens=3,
        dtype=dtype, device="cuda", seed=num_shards * 100 + interleave,
    )  # fmt: skip
    scale = 128**-0.5
    want_out, want_lse = dense_attention_f64(batch, scale)
    out_tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    lse_tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for splits in (None, 4):
        outputs, lses = attend_shards(batch, lambda p: (p // interleave) % num_shards, num_shards, 16,
                                      triton_attend(splits), scale, out_dtype=dtype)  # fmt: skip
        out = torch.empty_like(batch.q)
        out_lse = torch.empty(batch.q.shape[:2], device="cuda")
        merge_attention_states(outputs, lses, out, out_lse)  # the Triton merge (CUDA tensors)
        torch.testing.assert_close(out.float(), want_out.float(), **out_tol)
        torch.testing.assert_close(out_lse, want_lse.float(), **lse_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "reqs", [[(2000, 1)], [(c, 1) for c in range(1, 64)], [(5, 1), (300, 64), (0, 33)], [(1500, 128), (10, 1)]]
)
def test_gpu_output_with_lse_is_bit_identical_and_lse_exact(dtype, reqs):
    """The output with an LSE buffer equals the one without, bit for bit, for the planned
    split count and forced ones; the LSE matches torch.logsumexp of the scores."""
    batch = make_batch(
        reqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, pad_reqs=2, pad_tokens=3,
        dtype=dtype, device="cuda", seed=len(reqs),
    )  # fmt: skip
    scale = 128**-0.5
    backend = TritonPagedAttentionBackend()
    plain = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale)
    lse = torch.full(batch.q.shape[:2], math.nan, device="cuda")
    with_lse = backend.attend(batch.q, batch.kv_cache, batch.metadata, scale, torch.empty_like(plain), lse)
    assert torch.equal(with_lse, plain)
    _, want_lse = dense_attention_f64(batch, scale)
    lse_tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse.float(), **lse_tol)
    for splits in (1, 3, 8):
        a = paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, scale, torch.empty_like(plain),
                                   num_kv_splits=splits)  # fmt: skip
        b = paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, scale, torch.empty_like(plain), lse,
                                   num_kv_splits=splits)  # fmt: skip
        assert torch.equal(a, b), splits
        torch.testing.assert_close(lse, want_lse.float(), **lse_tol)


@pytest.mark.gpu
def test_gpu_lse_attention_and_merge_in_a_cuda_graph():
    """Shard attention with LSE plus the merge captured once, replayed with new contents."""
    batch = make_batch([(900, 1), (33, 1), (2, 1)], num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                       pad_reqs=1, pad_tokens=1, dtype=torch.bfloat16, device="cuda", seed=1)  # fmt: skip
    scale = 128**-0.5
    shards = [make_shard(batch, lambda p: p % 2, r, 16, seed=r) for r in range(2)]
    outputs = torch.zeros(2, *batch.q.shape, dtype=torch.float32, device="cuda")
    lses = torch.zeros(2, *batch.q.shape[:2], device="cuda")
    out = torch.empty_like(batch.q)

    def step() -> None:
        for r, s in enumerate(shards):
            paged_attention_triton(s.q, s.kv_cache, s.metadata, scale, outputs[r], lses[r])
        merge_attention_states(outputs, lses, out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for s in shards:
        s.kv_cache.mul_(0.5)  # new contents, same addresses
    batch.full_k = [k * 0.5 for k in batch.full_k]
    batch.full_v = [v * 0.5 for v in batch.full_v]
    graph.replay()
    torch.cuda.synchronize()
    want_out, _ = dense_attention_f64(batch, scale)
    torch.testing.assert_close(out.float(), want_out.float(), atol=3e-2, rtol=3e-2)
