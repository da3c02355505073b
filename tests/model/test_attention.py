"""Attention backends and the KV-write kernel against independent references.

CPU: the Triton kernels run interpreted (TRITON_INTERPRET=1, set by conftest) on tiny
shapes, grids of at most 16 programs. GPU (`gpu` mark): realistic shapes in bf16 and
capture/replay of the Triton backend in a real CUDA graph.

Tolerances: fp32 compares at atol/rtol 2e-5 (same math, different summation order);
fp16 outputs at 2e-3 (one fp16 rounding of values of magnitude <= ~1); bf16 on the GPU
at 3e-2 (bf16 inputs of the P@V dot in the kernel).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.attention import AttentionMetadata, get_attention_backend
from graphrunner.attention.base import rope_attention
from graphrunner.attention.kv_write import write_kv
from graphrunner.attention.torch_ref import TorchReferenceBackend, rotate_torch, write_kv_torch
from graphrunner.config import KernelConfig
from graphrunner.kernels import HAS_TRITON
from graphrunner.layers.rotary import RotaryEmbedding

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
if HAS_TRITON:
    from graphrunner.attention.kv_write import write_kv_triton
    from graphrunner.attention.triton_attn import (
        TritonPagedAttentionBackend,
        attention_launch_plan,
        paged_attention_triton,
    )

# triton 3.6's interpreter warns when a loaded scalar bounds a loop (harmless with numpy<2.4).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

SENTINEL = 7.0
# CPU-sized tests run wherever the suite runs: interpreted Triton on a CPU, real kernels on a GPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_CPU_PROGRAMS = 16


# --------------------------------------------------------------------------- batch builder


@dataclass
class Batch:
    """A padded attention batch plus everything an independent reference needs."""

    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D] new keys of this step (garbage on padded tokens)
    v: torch.Tensor  # [T, Hkv, D]
    kv_cache: torch.Tensor  # [2, nb, bs, Hkv, D] context already written, new slots still SENTINEL
    metadata: AttentionMetadata
    full_k: list[torch.Tensor]  # per real request: [seq_len, Hkv, D], context + new
    full_v: list[torch.Tensor]
    reqs: list[tuple[int, int]]  # per real request: (context_len, query_len)
    num_real_tokens: int


def make_batch(
    reqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = DEVICE,
    seed: int = 0,
    spare_blocks: int = 2,
) -> Batch:
    """Requests `(context_len, query_len)` with shuffled physical blocks, then padding.

    Padded requests get query length 0, seq_len 0 and a garbage block-table row; padded
    tokens get slot -1 and garbage q/k/v (docs/architecture.md §4).
    """
    gen = torch.Generator().manual_seed(seed)  # real data: the same whatever the padding
    junk = torch.Generator().manual_seed(seed + 1)  # garbage in padding and unused entries

    def randn(*shape: int, g: torch.Generator = gen) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    seq_lens = [c + n for c, n in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks
    max_blocks = max(blocks_per_req + [1]) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    num_reqs = len(reqs) + pad_reqs
    # Garbage everywhere first (valid ids, so a stray read would be wrong, not a crash).
    block_table = torch.randint(0, num_blocks, (num_reqs, max_blocks), generator=junk, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, dtype=dtype)

    qs, ks, vs, slots, full_k, full_v = [], [], [], [], [], []
    for b, (ctx, qlen) in enumerate(reqs):
        phys = [perm.pop() for _ in range(blocks_per_req[b])]
        block_table[b, : len(phys)] = torch.tensor(phys, dtype=torch.int32)
        fk, fv = randn(ctx + qlen, num_kv_heads, head_dim), randn(ctx + qlen, num_kv_heads, head_dim)
        for pos in range(ctx + qlen):
            slot = phys[pos // block_size] * block_size + pos % block_size
            if pos < ctx:  # context: already in the cache from earlier steps
                kv_cache[0, slot // block_size, slot % block_size] = fk[pos]
                kv_cache[1, slot // block_size, slot % block_size] = fv[pos]
            else:
                slots.append(slot)
        qs.append(randn(qlen, num_heads, head_dim))
        ks.append(fk[ctx:])
        vs.append(fv[ctx:])
        full_k.append(fk)
        full_v.append(fv)
    num_real = sum(n for _, n in reqs)
    qs.append(randn(pad_tokens, num_heads, head_dim, g=junk))
    ks.append(randn(pad_tokens, num_kv_heads, head_dim, g=junk))
    vs.append(randn(pad_tokens, num_kv_heads, head_dim, g=junk))
    slots += [-1] * pad_tokens

    qsl = [0]
    for _, n in reqs:
        qsl.append(qsl[-1] + n)
    qsl += [num_real] * pad_reqs
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_reqs=num_reqs,
        num_tokens=num_real + pad_tokens,
        max_query_len=max([n for _, n in reqs] + [1]),
        max_seq_len=max(seq_lens + [1]),
    )
    return Batch(
        q=torch.cat(qs).to(device),
        k=torch.cat(ks).to(device),
        v=torch.cat(vs).to(device),
        kv_cache=kv_cache.to(device),
        metadata=metadata,
        full_k=[t.to(device) for t in full_k],
        full_v=[t.to(device) for t in full_v],
        reqs=list(reqs),
        num_real_tokens=num_real,
    )


def dense_reference(batch: Batch, scale: float) -> torch.Tensor:
    """Per-request causal attention on the unpaged K/V with SDPA, fp32; padded rows 0."""
    q = batch.q
    num_heads, num_kv_heads = q.shape[1], batch.full_k[0].shape[1] if batch.full_k else 1
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for (ctx, qlen), fk, fv in zip(batch.reqs, batch.full_k, batch.full_v, strict=True):
        group = num_heads // num_kv_heads
        qq = q[start : start + qlen].float().transpose(0, 1)  # [H, qlen, D]
        kk = fk.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        vv = fv.float().repeat_interleave(group, dim=1).transpose(0, 1)
        key_pos = torch.arange(ctx + qlen, device=q.device)  # [S]
        query_pos = ctx + torch.arange(qlen, device=q.device)  # [qlen]
        allowed = key_pos[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed, scale=scale)
        out[start : start + qlen] = o.transpose(0, 1)
        start += qlen
    return out


def expected_cache(batch: Batch) -> torch.Tensor:
    """The cache after a step: context untouched, new slots hold k/v, all else SENTINEL."""
    cache = batch.kv_cache.clone()
    bs = cache.shape[2]
    for t, slot in enumerate(batch.metadata.slot_mapping.tolist()):
        if slot >= 0:
            cache[0, slot // bs, slot % bs] = batch.k[t]
            cache[1, slot // bs, slot % bs] = batch.v[t]
    return cache


def num_programs(batch: Batch, num_kv_splits: int) -> int:
    _, num_heads, head_dim = batch.q.shape
    num_kv_heads = batch.kv_cache.shape[3]
    md = batch.metadata
    plan = attention_launch_plan(md.num_tokens, md.num_reqs, num_heads, num_kv_heads, head_dim, torch.device("cpu"))
    main = plan["num_tiles"] * num_kv_heads * num_kv_splits
    return max(main, md.num_tokens * num_kv_heads if num_kv_splits > 1 else 0)


# --------------------------------------------------------------------------- strategies


@st.composite
def request_lists(draw, max_reqs: int, max_ctx: int, max_qlen: int, max_tokens: int) -> list[tuple[int, int]]:
    """Mixed batches: decodes (query 1) and prefill chunks, each with 0..max_ctx context."""
    n = draw(st.integers(1, max_reqs))
    reqs = []
    for _ in range(n):
        decode = draw(st.booleans())
        qlen = 1 if decode else draw(st.integers(1, max_qlen))
        reqs.append((draw(st.integers(0, max_ctx)), qlen))
    while sum(q for _, q in reqs) > max_tokens:
        reqs.pop()
    return reqs or [(draw(st.integers(0, max_ctx)), 1)]


heads = st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (3, 1), (6, 2)])  # (num_heads, num_kv_heads)


# --------------------------------------------------------------------------- write_kv


@st.composite
def kv_write_cases(draw):
    block_size = draw(st.sampled_from([4, 8, 16]))
    num_blocks = draw(st.integers(1, 4))
    num_tokens = draw(st.integers(1, min(6, num_blocks * block_size)))
    slots = draw(
        st.lists(st.integers(0, num_blocks * block_size - 1), min_size=num_tokens, max_size=num_tokens, unique=True)
    )
    skip = draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slots = [-1 if s else x for x, s in zip(slots, skip, strict=True)]
    num_kv_heads = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([16, 32, 48]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    return block_size, num_blocks, slots, num_kv_heads, head_dim, dtype, draw(st.integers(0, 2**16))


def _kv_write_inputs(block_size, num_blocks, slots, num_kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t = len(slots)
    # k, v as strided views of one fused projection output, as a model produces them
    kv = torch.randn(t, 3, num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    k, v = kv[:, 0], kv[:, 2]
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), SENTINEL, dtype=dtype, device=DEVICE)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    expected = cache.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            expected[0, s // block_size, s % block_size] = k[i]
            expected[1, s // block_size, s % block_size] = v[i]
    return k, v, cache, slot_mapping, expected


@settings(deadline=None)
@given(kv_write_cases())
def test_write_kv_torch_matches_loop(case):
    k, v, cache, slot_mapping, expected = _kv_write_inputs(*case)
    write_kv_torch(k, v, cache, slot_mapping)
    assert torch.equal(cache, expected)  # includes: slot -1 left every SENTINEL untouched


@needs_triton
@settings(deadline=None)
@given(kv_write_cases())
def test_write_kv_triton_matches_torch(case):
    k, v, cache, slot_mapping, expected = _kv_write_inputs(*case)
    ref = cache.clone()
    write_kv_triton(k, v, cache, slot_mapping)
    write_kv_torch(k, v, ref, slot_mapping)
    assert torch.equal(cache, ref)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_write_kv_skipped_tokens_never_clobber_slot_zero(impl):
    """Slot 0 belongs to a live token; skipped tokens around it must not overwrite it."""
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    fn = write_kv_torch if impl == "torch" else write_kv_triton
    k = torch.arange(4 * 2 * 16, dtype=torch.float32, device=DEVICE).view(4, 2, 16)
    for slots in ([-1, 0, -1, 5], [0, -1, -1, -1], [-1, -1, -1, 0], [-1, -1, -1, -1]):
        cache = torch.full((2, 2, 4, 2, 16), SENTINEL, device=DEVICE)
        fn(k, -k, cache, torch.tensor(slots, device=DEVICE))
        for i, s in enumerate(slots):
            if s >= 0:
                assert torch.equal(cache[0, s // 4, s % 4], k[i]) and torch.equal(cache[1, s // 4, s % 4], -k[i])
        live = {s for s in slots if s >= 0}
        for s in set(range(8)) - live:
            assert (cache[:, s // 4, s % 4] == SENTINEL).all(), (slots, s)


def test_write_kv_rejects_bad_shapes():
    cache = torch.zeros(2, 2, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="do not match"):
        write_kv(torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), cache, torch.zeros(3, dtype=torch.int64))


# --------------------------------------------------------------------------- torch reference backend


@settings(deadline=None)
@given(
    reqs=request_lists(max_reqs=5, max_ctx=40, max_qlen=9, max_tokens=24),
    hk=heads,
    head_dim=st.sampled_from([16, 32, 48]),
    block_size=st.sampled_from([4, 8, 16]),
    pad_reqs=st.integers(0, 2),
    pad_tokens=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_torch_backend_matches_dense(reqs, hk, head_dim, block_size, pad_reqs, pad_tokens, seed):
    num_heads, num_kv_heads = hk
    batch = make_batch(
        reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        pad_reqs=pad_reqs, pad_tokens=pad_tokens, seed=seed,
    )  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim)
    want_cache = expected_cache(batch)
    out = TorchReferenceBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale)
    torch.testing.assert_close(out, dense_reference(batch, scale), atol=2e-5, rtol=2e-5)
    assert torch.equal(out[batch.num_real_tokens :], torch.zeros_like(out[batch.num_real_tokens :]))
    assert torch.equal(batch.kv_cache, want_cache)  # new k/v in place, padded slot -1 wrote nothing


def test_torch_backend_writes_into_out_and_checks_shapes():
    batch = make_batch([(3, 2)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, pad_tokens=1)
    out = torch.full_like(batch.q, float("nan"))
    res = TorchReferenceBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, 0.25, out=out)
    assert res is out and not out.isnan().any()
    with pytest.raises(ValueError, match="num_tokens"):
        TorchReferenceBackend().forward(batch.q[:2], batch.k[:2], batch.v[:2], batch.kv_cache, batch.metadata, 0.25)


# --------------------------------------------------------------------------- Triton backend (interpreted on CPU)


@needs_triton
@settings(deadline=None)
@given(
    reqs=request_lists(max_reqs=3, max_ctx=40, max_qlen=4, max_tokens=5),
    hk=heads,
    head_dim=st.sampled_from([16, 32, 48]),
    block_size=st.sampled_from([4, 8, 16]),
    pad_reqs=st.integers(0, 1),
    pad_tokens=st.integers(0, 1),
    splits=st.sampled_from([1, 2, 3]),
    block_n=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_torch_reference(
    reqs, hk, head_dim, block_size, pad_reqs, pad_tokens, splits, block_n, dtype, seed
):
    num_heads, num_kv_heads = hk
    batch = make_batch(
        reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        pad_reqs=pad_reqs, pad_tokens=pad_tokens, dtype=dtype, seed=seed,
    )  # fmt: skip
    while splits > 1 and num_programs(batch, splits) > MAX_CPU_PROGRAMS:
        splits -= 1
    assert num_programs(batch, splits) <= MAX_CPU_PROGRAMS
    scale = 1.0 / math.sqrt(head_dim)
    ref = TorchReferenceBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale)
    out = torch.full_like(batch.q, float("nan"))  # every row must be written, padding included
    paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, scale, out, num_kv_splits=splits, block_n=block_n)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert torch.equal(out[batch.num_real_tokens :], torch.zeros_like(out[batch.num_real_tokens :]))


@needs_triton
@settings(deadline=None)
@given(
    # Queries up to 40 tokens: at G_PAD 4 a prefill tile holds 16, so requests span several tiles.
    reqs=request_lists(max_reqs=4, max_ctx=24, max_qlen=40, max_tokens=48),
    hk=heads,
    pad_reqs=st.integers(0, 1),
    pad_tokens=st.integers(0, 2),
    splits=st.sampled_from([1, 2, 3]),
    with_lse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decode_grid_equals_the_search_grid(reqs, hk, pad_reqs, pad_tokens, splits, with_lse, seed):
    """Program-per-request (each loops over its tiles) computes every tile as the searching grid
    does: the same bits, padded rows zero, LSE included, for any batch (not only decodes)."""
    num_heads, num_kv_heads = hk
    batch = make_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, block_size=4,
                       pad_reqs=pad_reqs, pad_tokens=pad_tokens, dtype=torch.float32, seed=seed)
    scale = 0.25
    TorchReferenceBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale)  # the write
    results = []
    for by_request in (False, True):
        out = torch.full_like(batch.q, float("nan"))
        lse = torch.full(batch.q.shape[:2], float("nan")) if with_lse else None
        paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, scale, out, lse, num_kv_splits=splits,
                               decode_grid=by_request)
        results.append((out, lse))
    (want, want_lse), (got, got_lse) = results
    assert torch.equal(got, want)
    assert not with_lse or torch.equal(got_lse, want_lse)
    assert torch.equal(got[batch.num_real_tokens:], torch.zeros_like(got[batch.num_real_tokens:]))


@needs_triton
@pytest.mark.parametrize("splits", [1, 2])
def test_triton_backend_forward_mixed_batch(splits):
    """Decode + prefill chunk with context + fresh prefill, GQA 4/2, through the backend API."""
    reqs = [(9, 1), (5, 3), (0, 2)]
    batch = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, pad_reqs=1, pad_tokens=2, seed=3)
    scale = 0.2
    want_cache = expected_cache(batch)
    ref_batch_cache = batch.kv_cache.clone()
    ref = TorchReferenceBackend().forward(batch.q, batch.k, batch.v, ref_batch_cache, batch.metadata, scale)
    if splits == 1:
        out = TritonPagedAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale)
    else:
        write_kv_triton(batch.k, batch.v, batch.kv_cache, batch.metadata.slot_mapping)
        out = paged_attention_triton(
            batch.q, batch.kv_cache, batch.metadata, scale, torch.empty_like(batch.q), num_kv_splits=2
        )
    assert torch.equal(batch.kv_cache, want_cache)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, dense_reference(batch, scale), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_does_not_change_real_rows(backend):
    """Padded requests/tokens leave real outputs and the cache as the unpadded batch has them."""
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    reqs = [(6, 1), (3, 2)]
    kw = dict(num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, seed=11)
    plain = make_batch(reqs, **kw)
    padded = make_batch(reqs, pad_reqs=2, pad_tokens=3, **kw)
    assert torch.equal(plain.q, padded.q[: plain.q.shape[0]]) and torch.equal(plain.kv_cache, padded.kv_cache)
    impl = get_attention_backend(DEVICE, backend)
    out_plain = impl.forward(plain.q, plain.k, plain.v, plain.kv_cache, plain.metadata, 0.3)
    out_padded = impl.forward(padded.q, padded.k, padded.v, padded.kv_cache, padded.metadata, 0.3)
    n = plain.q.shape[0]
    torch.testing.assert_close(out_padded[:n], out_plain, atol=1e-6, rtol=1e-6)
    assert torch.equal(out_padded[n:], torch.zeros_like(out_padded[n:]))
    assert torch.equal(padded.kv_cache, plain.kv_cache)


@needs_triton
@settings(deadline=None)
@given(
    qlens=st.lists(st.integers(0, 40), min_size=0, max_size=12),
    pad_tokens=st.integers(0, 40),
    num_heads=st.sampled_from([1, 2, 4, 7, 14, 16, 32]),
)
def test_launch_grid_covers_every_token_once(qlens, pad_tokens, num_heads):
    """Replays the kernel's tile arithmetic in Python: with the planned grid every token,
    padded ones included, belongs to exactly one tile, whatever the batch's contents."""
    num_reqs, num_tokens = len(qlens), sum(qlens) + pad_tokens
    plan = attention_launch_plan(num_tokens, num_reqs, num_heads, 1, 64, torch.device("cpu"))
    bq = plan["block_q"]
    assert bq * plan["g_pad"] >= 16 or plan["g_pad"] >= 16
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    seen = [0] * num_tokens
    for pid in range(plan["num_tiles"]):
        b = max(i for i in range(num_reqs + 1) if qsl[i] // bq + i <= pid)  # the kernel's binary search
        q_end = qsl[b + 1] if b < num_reqs else num_tokens
        tok0 = qsl[b] + (pid - (qsl[b] // bq + b)) * bq
        for t in range(tok0, min(tok0 + bq, q_end)):
            seen[t] += 1
    assert seen == [1] * num_tokens


# --------------------------------------------------------------------------- registry and KernelConfig


@needs_triton
@pytest.mark.parametrize("rope_in_attention", [True, False])
def test_triton_rope_attend_equals_the_torch_rotation_then_the_reference(rope_in_attention):
    """A decode batch through `rope_attention` of a Triton backend (the rotary embedding and the KV write
    in the attention launch, or the rotary + KV-write kernel first, as KernelConfig.attention_rope says)
    against the torch backend's rotation, write and attention."""
    batch = make_batch([(9, 1), (5, 1), (0, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=7)
    positions = batch.metadata.seq_lens[:3].long() - 1
    cos_sin = RotaryEmbedding(16, 64, 10000.0).cos_sin_cache
    backend = get_attention_backend("cpu", "triton", KernelConfig(attention_rope=rope_in_attention))
    assert backend.rope_in_attention == rope_in_attention
    ref_cache = batch.kv_cache.clone()
    ref = rope_attention(TorchReferenceBackend())(batch.q, batch.k, batch.v, positions, cos_sin, ref_cache,
                                                  batch.metadata, 0.25)
    got = rope_attention(backend)(batch.q, batch.k, batch.v, positions, cos_sin, batch.kv_cache, batch.metadata,
                                  0.25)
    torch.testing.assert_close(batch.kv_cache, ref_cache, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    written = ref_cache[0].flatten(0, 1)[batch.metadata.slot_mapping[:3]]  # the new keys, rotated
    torch.testing.assert_close(written, rotate_torch(positions, batch.k, cos_sin), atol=0, rtol=0)


@needs_triton
def test_plan_caps_the_splits_at_kernel_config(monkeypatch):
    """attention_max_kv_splits bounds the plan (132 SMs faked: batch 1 wants 132 splits)."""
    import graphrunner.attention.triton_attn as triton_attn

    monkeypatch.setattr(triton_attn, "sm_count", lambda device, cpu: 132)
    cuda = torch.device("cuda", 0)
    assert attention_launch_plan(1, 1, 14, 2, 64, cuda)["num_kv_splits"] == KernelConfig().attention_max_kv_splits
    for cap in (1, 4, 32):
        assert attention_launch_plan(1, 1, 14, 2, 64, cuda, cap)["num_kv_splits"] == cap
    backend = get_attention_backend("cpu", "triton", KernelConfig(attention_max_kv_splits=4, pdl=True))
    assert backend.max_kv_splits == 4 and backend.pdl_rows == 0  # no PDL off a GPU
    with pytest.raises(ValueError, match=r"attention_max_kv_splits=33 must be an int in \[1, 32\]"):
        KernelConfig(attention_max_kv_splits=33)


def test_registry_defaults_and_errors():
    assert get_attention_backend(torch.device("cpu")).name == "torch"
    assert isinstance(get_attention_backend("cpu", "torch"), TorchReferenceBackend)
    if HAS_TRITON:
        assert get_attention_backend("cpu", "triton").name == "triton"
    with pytest.raises(ValueError, match=r"'flash'.*allowed.*torch.*triton"):
        get_attention_backend("cpu", "flash")


# --------------------------------------------------------------------------- GPU


def _gpu_reqs(
    gen: torch.Generator, num_decodes: int, prefills: list[tuple[int, int]], max_ctx: int
) -> list[tuple[int, int]]:
    ctx = torch.randint(1, max_ctx, (num_decodes,), generator=gen).tolist()
    return [(c, 1) for c in ctx] + prefills


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hk", [(14, 2), (32, 8)])
@pytest.mark.parametrize(
    "num_decodes,prefills",
    [(1, []), (7, []), (64, []), (0, [(0, 77)]), (5, [(300, 64), (0, 33)]), (32, [(1500, 128)])],
)
def test_gpu_triton_matches_reference(head_dim, hk, num_decodes, prefills):
    num_heads, num_kv_heads = hk
    gen = torch.Generator().manual_seed(num_decodes * 1000 + head_dim)
    reqs = _gpu_reqs(gen, num_decodes, prefills, max_ctx=2048)
    batch = make_batch(
        reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
        pad_reqs=3, pad_tokens=5, dtype=torch.bfloat16, device="cuda", seed=head_dim,
    )  # fmt: skip
    scale = head_dim**-0.5
    want_cache = expected_cache(batch)
    ref = dense_reference(batch, scale)  # fp32 from the bf16 inputs
    out = TritonPagedAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale)
    assert torch.equal(batch.kv_cache, want_cache)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    for splits, by_request in ((1, False), (4, False), (1, True), (4, True)):
        out2 = paged_attention_triton(
            batch.q, batch.kv_cache, batch.metadata, scale, torch.empty_like(out), num_kv_splits=splits,
            decode_grid=by_request,
        )
        torch.testing.assert_close(out2.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("maxnreg", [96, 128])
def test_gpu_register_cap_changes_no_result(maxnreg):
    """`maxnreg` (a sweep option; the plan's 0 leaves it out) caps registers, not arithmetic: decode rows and
    a prefill give the uncapped launch's outputs, which match the reference."""
    batch = make_batch(
        [(1023, 1)] * 9 + [(300, 40)], num_heads=14, num_kv_heads=2, head_dim=64, block_size=16,
        pad_reqs=2, pad_tokens=3, dtype=torch.bfloat16, device="cuda", seed=maxnreg,
    )  # fmt: skip
    TritonPagedAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, 0.125)
    plain = paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, 0.125, torch.empty_like(batch.q))
    capped = paged_attention_triton(batch.q, batch.kv_cache, batch.metadata, 0.125, torch.empty_like(batch.q),
                                    maxnreg=maxnreg)
    torch.testing.assert_close(capped, plain, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(capped.float(), dense_reference(batch, 0.125), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes_and_odd_head_dim(dtype):
    for head_dim in (32, 48, 64):
        batch = make_batch(
            [(100, 1), (17, 9), (0, 20)], num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16,
            pad_reqs=1, pad_tokens=3, dtype=dtype, device="cuda", seed=head_dim,
        )  # fmt: skip
        scale = head_dim**-0.5
        out = TritonPagedAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata, scale)
        tol = 2e-3 if dtype == torch.float16 else 1e-4
        torch.testing.assert_close(out.float(), dense_reference(batch, scale), atol=tol, rtol=tol)


def _load_batch_into(static: Batch, batch: Batch) -> None:
    """Copy a batch's contents into the static buffers of another of the same padded shape."""
    md, smd = batch.metadata, static.metadata
    for dst, src in ((static.q, batch.q), (static.k, batch.k), (static.v, batch.v), (static.kv_cache, batch.kv_cache)):
        dst.copy_(src)
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        getattr(smd, name).copy_(getattr(md, name))
    smd.block_table.zero_()
    smd.block_table[:, : md.block_table.shape[1]].copy_(md.block_table)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["decode1", "mixed"])
def test_gpu_cuda_graph_capture_and_replay(shape):
    """Capture once, then replay with different batch contents of the same padded shape."""
    num_heads, num_kv_heads, head_dim, bs = 14, 2, 64, 16
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=bs)
    kw.update(dtype=torch.bfloat16, device="cuda")
    if shape == "decode1":  # split-KV path: batch-1 decode at long context
        batches = [[(100, 1)], [(2000, 1)], [(5, 1)]]
        pad = lambda reqs: dict(pad_reqs=1 - len(reqs), pad_tokens=1 - sum(n for _, n in reqs))  # noqa: E731
    else:
        batches = [[(10, 1), (3, 20)], [(700, 1), (40, 1), (0, 25)], [(0, 30)]]
        pad = lambda reqs: dict(pad_reqs=4 - len(reqs), pad_tokens=32 - sum(n for _, n in reqs))  # noqa: E731
    # Equal spare blocks make every batch's cache the same size; block tables are copied in.
    made = [
        make_batch(r, seed=i, spare_blocks=200 - sum(-(-(c + n) // bs) for c, n in r), **pad(r), **kw)
        for i, r in enumerate(batches)
    ]
    width = max(b.metadata.block_table.shape[1] for b in made)
    md0 = made[0].metadata
    static = dataclasses.replace(  # the persistent buffers a graph reads, filled per step
        made[0],
        q=made[0].q.clone(), k=made[0].k.clone(), v=made[0].v.clone(), kv_cache=made[0].kv_cache.clone(),
        metadata=dataclasses.replace(
            md0,
            query_start_loc=md0.query_start_loc.clone(), seq_lens=md0.seq_lens.clone(),
            slot_mapping=md0.slot_mapping.clone(),
            block_table=torch.zeros(md0.num_reqs, width, dtype=torch.int32, device="cuda"),
        ),
    )  # fmt: skip
    _load_batch_into(static, made[0])
    backend = TritonPagedAttentionBackend()
    out = torch.empty_like(static.q)
    scale = head_dim**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        backend.forward(static.q, static.k, static.v, static.kv_cache, static.metadata, scale, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(static.q, static.k, static.v, static.kv_cache, static.metadata, scale, out=out)
    for batch in made[1:] + made[:1]:
        _load_batch_into(static, batch)
        want_cache = expected_cache(batch)
        graph.replay()
        torch.cuda.synchronize()
        ref = dense_reference(batch, scale)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
        assert torch.equal(static.kv_cache, want_cache)


@pytest.mark.parametrize("num_reqs, num_tokens, splits, by_request", [
    (1, 1, 16, False),     # batch-1 decode: the plan's most splits, the search grid (measured faster there)
    (8, 8, 16, False),
    (64, 64, 2, True),     # (request, KV head) pairs fill the GPU: one program per request
    (256, 256, 1, True),
    (4, 64, 16, False),    # prefill-shaped: the search grid spreads long queries over tiles
])
def test_plan_uses_the_decode_grid_once_requests_fill_the_gpu(monkeypatch, num_reqs, num_tokens, splits, by_request):
    """The plan's grid choice on a 132-SM GPU (the H100's count, faked) for a 14/2 x 64 model."""
    import graphrunner.attention.triton_attn as triton_attn

    # Patched where the plan looks it up (not torch.cuda.get_device_properties: kernels.sm_count caches per device).
    monkeypatch.setattr(triton_attn, "sm_count", lambda device, cpu: 132)
    plan = attention_launch_plan(num_tokens, num_reqs, 14, 2, 64, torch.device("cuda", 0))
    assert (plan["num_kv_splits"], plan["decode_grid"]) == (splits, by_request)
