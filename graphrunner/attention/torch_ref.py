"""Torch reference attention backend: the CPU path and the yardstick for the Triton one.

Plain and explicit rather than fast: it reads the metadata back to the host and loops
over requests, so it is *not* graph-safe on CUDA (FULL graphs need the Triton backend;
on CPU, "capture" re-runs the step eagerly, where host reads are fine).

Every torch reference of the attention kernels lives here too: the KV write (`write_kv_torch`),
the rotary embedding (`rotate_torch`) and the two together (`rope_write_kv_torch`).

Log-sum-exp. Every paged backend can also write, per query token and head, the natural
log-sum-exp of the scaled scores over the keys that token attended to (`out_lse`,
[T, H] fp32): what lets partial attention over disjoint key shards be merged exactly
(`graphrunner.attention.merge`). A token that sees no key (an empty shard, a padded
token) gets LSE -inf and an output row of zeros.

fp8 KV cache. A cache of dtype float8_e4m3fn (`CacheConfig.cache_dtype="fp8"`) stores each
key as `clamp(k / k_scale, -448, 448)` cast to e4m3 (round to nearest even) and each value
likewise with `v_scale`; `kv_scale` is the layer's persistent [2] fp32 tensor (k_scale,
v_scale). Every reader dequantizes on load, `element * scale` in fp32, before any other
arithmetic: attention over an fp8 cache equals attention over a cache holding those products.
Every path takes `kv_scale=None` as scales of 1.0; caches of other dtypes ignore it.
"""

from __future__ import annotations

import torch

from graphrunner.attention.base import AttentionMetadata, rotate_torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # the largest finite e4m3fn value: quantized keys and values are clamped to +-this


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` stores quantized fp8 keys and values (module docstring)."""
    return kv_cache.dtype == FP8_KV_DTYPE


def check_kv_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    """Host-side check of a layer's (k_scale, v_scale) tensor (metadata only, safe during capture)."""
    if kv_scale is None:
        return
    if kv_scale.shape != (2,) or kv_scale.dtype != torch.float32 or kv_scale.device != kv_cache.device:
        raise ValueError(f"kv_scale is {kv_scale.dtype} {tuple(kv_scale.shape)} on {kv_scale.device}, expected "
                         f"float32 [2] (k_scale, v_scale) on the cache's device {kv_cache.device}")


def kv_scale_pair(kv_scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(k_scale, v_scale) as a [2] fp32 tensor: `kv_scale`, or ones when none is given."""
    return kv_scale if kv_scale is not None else torch.ones(2, dtype=torch.float32, device=device)


def quantize_kv_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` in fp32, clamped to the e4m3 range and rounded to float8_e4m3fn (`scale`: 0-d fp32)."""
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 `x * scale`: what every attention path reads from an fp8 cache."""
    return x.float() * scale


def check_kv_args(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Host-side shape checks (metadata only, safe during capture)."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, num_kv_heads, head_dim]")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}, expected [2, num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"k/v heads x dim {tuple(k.shape[1:])} do not match kv_cache heads x dim {tuple(kv_cache.shape[3:])}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected [{k.shape[0]}]")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping has dtype {slot_mapping.dtype}, expected torch.int64")


def write_kv_torch(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    kv_scale: torch.Tensor | None = None,  # [2] fp32 (k_scale, v_scale): an fp8 cache's quantization scales
) -> None:
    """Write token t's k/v at cache slot `slot_mapping[t]`, skipping slot -1, in place (graph-safe).

    One `index_put_` per cache half. A tensor op cannot "skip" an element, and sending skipped
    tokens to a fixed slot (say 0) would overwrite the k/v of whichever live request owns that
    slot. Instead every skipped token is redirected to the slot *and the values* of one live
    token of the batch, so that slot receives several writes of identical data and the result
    does not depend on their order. When no token of the batch is live, every token rewrites
    slot 0 with the cache's own current content, which changes nothing.
    """
    check_kv_args(k, v, kv_cache, slot_mapping)
    check_kv_scale(kv_cache, kv_scale)
    if k.shape[0] == 0:
        return
    scales = kv_scale_pair(kv_scale, kv_cache.device) if is_fp8_cache(kv_cache) else None
    block_size = kv_cache.shape[2]
    live = slot_mapping >= 0  # [T] bool
    any_live = live.any()  # 0-d bool, stays on the device
    first = live.to(torch.int32).argmax().reshape(1)  # [1]: first live token (0 when none)
    # Redirect target for skipped tokens: the first live token's slot, else slot 0.
    fallback_slot = torch.where(
        any_live, slot_mapping.index_select(0, first), torch.zeros_like(first, dtype=torch.int64)
    )
    slots = torch.where(live, slot_mapping, fallback_slot)  # [T], all valid
    blk, off = slots // block_size, slots % block_size
    live3 = live.view(-1, 1, 1)
    for i, (half, new) in enumerate(((kv_cache[0], k), (kv_cache[1], v))):
        new = quantize_kv_torch(new, scales[i]) if scales is not None else new.to(half.dtype)
        # Value for redirected tokens: the first live token's own row, else slot 0's current content.
        fallback = torch.where(any_live, new.index_select(0, first), half[0, 0].unsqueeze(0))  # [1, Hkv, D]
        values = torch.where(live3, new, fallback)  # [T, Hkv, D]
        half.index_put_((blk, off), values)


def check_rope_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Host-side checks (metadata only, safe during capture)."""
    if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} must be [T, num_heads, head_dim] like k {tuple(k.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"head_dim={q.shape[2]} must be even for rotary embeddings")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected [{q.shape[0]}]")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != q.shape[2] or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"cos_sin_cache is {cos_sin.dtype} {tuple(cos_sin.shape)}, expected float32 [max_positions, {q.shape[2]}]"
        )


def rope_write_kv_torch(q, k, v, positions, cos_sin, kv_cache, slot_mapping, kv_scale=None) -> torch.Tensor:
    """Torch reference of `rope_write_kv_triton` (same arguments, same result)."""
    check_rope_args(q, k, positions, cos_sin)
    write_kv_torch(rotate_torch(positions, k, cos_sin), v, kv_cache, slot_mapping, kv_scale)
    return rotate_torch(positions, q, cos_sin)


def check_attention_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    out: torch.Tensor | None,
    out_lse: torch.Tensor | None = None,
) -> None:
    """Host-side checks shared by every backend (shapes only; safe during capture)."""
    if q.dim() != 3:
        raise ValueError(f"q has shape {tuple(q.shape)}, expected [num_tokens, num_heads, head_dim]")
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens != metadata.num_tokens:
        raise ValueError(f"q has {num_tokens} tokens but metadata.num_tokens={metadata.num_tokens}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache has shape {tuple(kv_cache.shape)}, "
            f"expected [2, num_blocks, block_size, num_kv_heads, {head_dim}]"
        )
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    num_reqs = metadata.num_reqs
    if metadata.query_start_loc.shape[0] < num_reqs + 1:
        raise ValueError(
            f"query_start_loc has {metadata.query_start_loc.shape[0]} entries, needs num_reqs + 1 = {num_reqs + 1}"
        )
    if metadata.seq_lens.shape[0] < num_reqs or metadata.block_table.shape[0] < num_reqs:
        raise ValueError(
            f"seq_lens {tuple(metadata.seq_lens.shape)} / block_table {tuple(metadata.block_table.shape)} "
            f"have fewer than num_reqs={num_reqs} rows"
        )
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected q's shape {tuple(q.shape)}")
    if out_lse is not None and (out_lse.shape != (num_tokens, num_heads) or out_lse.dtype != torch.float32):
        raise ValueError(
            f"out_lse has shape {tuple(out_lse.shape)} and dtype {out_lse.dtype}, "
            f"expected [{num_tokens}, {num_heads}] float32"
        )


def paged_attention_torch(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, H, D], written in place
    out_lse: torch.Tensor | None = None,  # [T, H] fp32, written in place if given
    dcp: tuple[int, int, int] | None = None,  # (size, rank, interleave): the cache holds this rank's share
    kv_scale: torch.Tensor | None = None,  # [2] fp32 (k_scale, v_scale): an fp8 cache's dequantization scales
) -> torch.Tensor:
    """Attend every real query token to its request's cached keys (causal), in fp32.

    Query token i of a request with `seq_len` keys and `query_len` tokens sits at
    position `seq_len - query_len + i` and sees keys `0..` that position (none when the
    position is negative: such rows come out 0, LSE -inf). Rows of padded tokens are set
    to 0 (LSE -inf). Syncs with the host.
    """
    check_attention_args(q, kv_cache, metadata, out, out_lse)
    check_kv_scale(kv_cache, kv_scale)
    scales = kv_scale_pair(kv_scale, kv_cache.device) if is_fp8_cache(kv_cache) else None
    block_size = kv_cache.shape[2]
    group = q.shape[1] // kv_cache.shape[3]
    qsl = metadata.query_start_loc[: metadata.num_reqs + 1].tolist()
    seq_lens = metadata.seq_lens[: metadata.num_reqs].tolist()
    out.zero_()
    if out_lse is not None:
        out_lse.fill_(float("-inf"))
    for b in range(metadata.num_reqs):
        q0, q1, seq_len = qsl[b], qsl[b + 1], seq_lens[b]
        query_len = q1 - q0
        if query_len <= 0:
            continue
        key_pos = _key_positions(seq_len, dcp, q.device)  # [n_keys]: global position of each cached key
        n_keys = len(key_pos)
        blocks = metadata.block_table[b, : -(-n_keys // block_size)].long()
        # k, v: [n_keys, Hkv, D] -> [H, n_keys, D] (query head h reads kv head h // group)
        k, v = kv_cache[0, blocks].flatten(0, 1)[:n_keys].float(), kv_cache[1, blocks].flatten(0, 1)[:n_keys].float()
        if scales is not None:  # dequantize on load, before any other arithmetic
            k, v = k * scales[0], v * scales[1]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qr = q[q0:q1].float().transpose(0, 1)  # [H, query_len, D]
        scores = torch.matmul(qr, k.transpose(1, 2)) * scale  # [H, query_len, n_keys]
        pos = torch.arange(query_len, device=q.device).view(-1, 1) + (seq_len - query_len)
        visible = key_pos.view(1, -1) <= pos  # [query_len, n_keys]
        masked = scores.masked_fill(~visible, float("-inf"))
        probs = masked.softmax(dim=-1)
        if seq_len < query_len or dcp is not None:  # rows that see no key: softmax gave NaN, the output is 0
            probs = probs.nan_to_num(0.0)
        out[q0:q1] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
        if out_lse is not None:
            out_lse[q0:q1] = torch.logsumexp(masked, dim=-1).transpose(0, 1)  # -inf where no key is visible
    return out


def _key_positions(seq_len: int, dcp: tuple[int, int, int] | None, device: torch.device) -> torch.Tensor:
    """Global positions of the cached keys of a sequence of `seq_len` tokens, in cache order:
    all of them, or under DCP this rank's interleaved share (graphrunner.kernels.dcp)."""
    positions = torch.arange(seq_len, device=device)
    if dcp is None:
        return positions
    size, rank, interleave = dcp
    return positions[(positions // interleave) % size == rank]


class WriteThenAttendBackend:
    """The backend protocol as every paged backend implements it: write k/v into the
    cache at `metadata.slot_mapping`, then attend (subclasses supply `write_kv` and `attend`)."""

    name = "base"

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # [T, H, D]
        out_lse: torch.Tensor | None = None,  # [T, H] fp32: the log-sum-exp, written in place if given
        kv_scale: torch.Tensor | None = None,  # [2] fp32 (k_scale, v_scale) of an fp8 cache (module docstring)
    ) -> torch.Tensor:  # [T, H, D]; rows of padded tokens are 0
        """Write k/v at `metadata.slot_mapping`, then attend; returns `out` (allocated if None)."""
        check_attention_args(q, kv_cache, metadata, out, out_lse)
        slots = metadata.slot_mapping[: metadata.num_tokens]
        if metadata.kv_gather is not None:  # PCP: every rank writes every token of the group
            k, v, slots = metadata.kv_gather.gather(k, v)
        self.write_kv(k, v, kv_cache, slots, kv_scale=kv_scale)
        if out is None:
            out = torch.empty_like(q)
        return self.attend(q, kv_cache, metadata, scale, out, out_lse, kv_scale=kv_scale)

    def rope_attend(self, q, k, v, positions, cos_sin, kv_cache, metadata, scale, out=None,
                    kv_scale=None) -> torch.Tensor:
        """q and k not yet rotated: the rotary embedding (torch), then `forward`."""
        q, k = rotate_torch(positions, q, cos_sin), rotate_torch(positions, k, cos_sin)
        return self.forward(q, k, v, kv_cache, metadata, scale, out=out, kv_scale=kv_scale)

    def write_kv(self, k, v, kv_cache, slot_mapping, kv_scale=None) -> None:
        raise NotImplementedError

    def attend(self, q, kv_cache, metadata, scale, out, out_lse=None, dcp=None, kv_scale=None) -> torch.Tensor:
        raise NotImplementedError


class TorchReferenceBackend(WriteThenAttendBackend):
    """Attention by paged gather + dense masked softmax, one request at a time (CPU path)."""

    name = "torch"

    def write_kv(self, k, v, kv_cache, slot_mapping, kv_scale=None) -> None:
        write_kv_torch(k, v, kv_cache, slot_mapping, kv_scale)

    def attend(self, q, kv_cache, metadata, scale, out, out_lse=None, dcp=None, kv_scale=None) -> torch.Tensor:
        return paged_attention_torch(q, kv_cache, metadata, scale, out, out_lse, dcp, kv_scale)
