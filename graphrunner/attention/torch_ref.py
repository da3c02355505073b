"""Torch reference attention backend: the CPU path and the yardstick for the Triton one.

Plain and explicit rather than fast: it reads the metadata back to the host and loops
over requests, so it is *not* graph-safe on CUDA (FULL graphs need the Triton backend;
on CPU, "capture" re-runs the step eagerly, where host reads are fine).
"""

from __future__ import annotations

import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.attention.kv_write import write_kv


def check_attention_args(
    q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, out: torch.Tensor | None
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


def paged_attention_torch(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, H, D], written in place
) -> torch.Tensor:
    """Attend every real query token to its request's cached keys (causal), in fp32.

    Query token i of a request with `seq_len` keys and `query_len` tokens sits at
    position `seq_len - query_len + i` and sees keys `0..` that position. Rows of
    padded tokens are set to 0. Syncs with the host.
    """
    check_attention_args(q, kv_cache, metadata, out)
    num_heads = q.shape[1]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    qsl = metadata.query_start_loc[: metadata.num_reqs + 1].tolist()
    seq_lens = metadata.seq_lens[: metadata.num_reqs].tolist()
    out.zero_()
    for b in range(metadata.num_reqs):
        q0, q1, seq_len = qsl[b], qsl[b + 1], seq_lens[b]
        query_len = q1 - q0
        if query_len <= 0:
            continue
        if seq_len < query_len:
            raise ValueError(f"request {b}: seq_len={seq_len} is smaller than its query length {query_len}")
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_table[b, :num_blocks].long()
        # k, v: [seq_len, Hkv, D] -> [H, seq_len, D] (query head h reads kv head h // group)
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1).transpose(0, 1)
        qr = q[q0:q1].float().transpose(0, 1)  # [H, query_len, D]
        scores = torch.matmul(qr, k.transpose(1, 2)) * scale  # [H, query_len, seq_len]
        pos = torch.arange(query_len, device=q.device).view(-1, 1) + (seq_len - query_len)
        visible = torch.arange(seq_len, device=q.device).view(1, -1) <= pos  # [query_len, seq_len]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[q0:q1] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out


class WriteThenAttendBackend:
    """The backend protocol as every paged backend implements it: write k/v into the
    cache at `metadata.slot_mapping`, then attend (subclasses supply `attend`)."""

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
    ) -> torch.Tensor:  # [T, H, D]; rows of padded tokens are 0
        """Write k/v at `metadata.slot_mapping`, then attend; returns `out` (allocated if None)."""
        check_attention_args(q, kv_cache, metadata, out)
        write_kv(k, v, kv_cache, metadata.slot_mapping[: metadata.num_tokens])
        if out is None:
            out = torch.empty_like(q)
        return self.attend(q, kv_cache, metadata, scale, out)

    def attend(self, q, kv_cache, metadata, scale, out) -> torch.Tensor:
        raise NotImplementedError


class TorchReferenceBackend(WriteThenAttendBackend):
    """Attention by paged gather + dense masked softmax, one request at a time (CPU path)."""

    name = "torch"

    def attend(self, q, kv_cache, metadata, scale, out) -> torch.Tensor:
        return paged_attention_torch(q, kv_cache, metadata, scale, out)
