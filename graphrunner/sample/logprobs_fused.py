"""Logprobs from the statistics the fused processing pass leaves: no second read of the logits.

`logprobs_triton` streams the raw [R, V] logits once more after sampling (93 us of the
all-features sampler at 256 x 151,936 on an H100) for three things: the logsumexp, the
group maxima that locate the top-K, and the rank of the sampled token. The dense pass of
`fused_process` already reads every raw logit, so with `stats` it also writes, per tile of
TILE entries (a [TILE / GROUP, GROUP] block) of each batch entry, into this persistent
scratch (never the graph pool):

- the tile's max and sum of exp relative to it, and whether it held a NaN (the logsumexp,
  merged exactly as `logprobs_triton`'s chunks: NaN entries count as -inf, a NaN flag makes
  the logsumexp NaN, +inf makes it +inf);
- the sort key of each group's max (`logprobs_triton._sort_key`: value, then lower id).

After sampling, `logprobs_from_stats` runs two small kernels:

1. rank (R x T / 8 programs, 8 tiles each): the sampled token's rank is 1 + the number of raw
   logits strictly above the chosen one, and only a group whose max is above it can hold
   one, so a program rereads just those of its tiles' groups (the others' loads are masked
   off and cost no memory traffic). A sampled token near the top of its row (the usual
   case: top-k / top-p keep the head) rereads a few groups; a token deep in a flat row
   rereads up to the whole row, no worse than the stream it replaces. Exact: the count is
   the same integer.
2. select: `logprobs_triton`'s select kernel, unchanged, over these partials (tiles for
   chunks): logsumexp, rank, the K best groups and the top-K among their entries.

Results: the same ids, ranks and top-K values as `logprobs_triton` (both are exact), and
logprobs equal to fp32 rounding (the logsumexp sums the same terms in another order; tests
hold it to 1e-5 x (1 + max |finite logit|) as the stream path's).

A batch whose features run no processor has no dense pass: it keeps `logprobs_triton`'s one
stream (a stats-only dense pass would read the logits once too, and then need the rank pass
besides, because the sampled token is not known before sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner.kernels import HAS_TRITON
from graphrunner.sample.logprobs_triton import MAX_TOPK, check_logprob_args

__all__ = ["GROUP", "TILE", "LogprobStats", "logprobs_from_stats"]

# Raw logits per program of the dense pass (fused_process._BLOCK): one stats partial each. 1024, not
# 2048: with the stats the dense pass is no longer purely a stream, and the smaller tile's twice as
# many programs hide its latency better (Sampler._process on the all_on bench batch, 256 x 151,936,
# one H100: 230.7 us at 1024, 266.2 at 2048, 321.4 at 4096).
TILE = 1024
GROUP = 128  # entries per group, as logprobs_triton: a warp's row of a [TILE / GROUP, GROUP] fp32 tile
# Tiles per rank program: 19 programs per row at 151,936 (R x T programs of one tile each spent 29 us
# at 256 rows on an H200 waiting on dependent loads, not on memory).
_RANK_TILES = 8
_G_TILE = 2048  # group keys per step of the select program (logprobs_triton._GROUP_TILE)


@dataclass
class LogprobStats:
    """Persistent scratch of the dense pass's per-tile statistics, for up to `tile_m.shape[0]` entries."""

    tile: int  # entries per tile (a power of two, a multiple of `group`)
    group: int
    tile_m: torch.Tensor  # [N, T] float32: each tile's max (NaN as -inf)
    tile_acc: torch.Tensor  # [N, T] float32: sum of exp(x - max) over the tile
    tile_nan: torch.Tensor  # [N, T] int32: 1 if the tile holds a NaN
    tile_cnt: torch.Tensor  # [N, T] int32: raw logits above the chosen one (the rank pass)
    group_keys: torch.Tensor  # [N, G] int64: sort key of each group's max

    @classmethod
    def allocate(cls, num: int, vocab_size: int, device: torch.device, tile: int | None = None) -> LogprobStats:
        tile = TILE if tile is None else tile
        group = min(GROUP, tile)
        num_tiles, num_groups = -(-vocab_size // tile), -(-vocab_size // group)
        f32 = torch.empty(num, num_tiles, dtype=torch.float32, device=device)
        i32 = torch.empty(num, num_tiles, dtype=torch.int32, device=device)
        return cls(tile, group, f32, torch.empty_like(f32), i32, torch.empty_like(i32),
                   torch.empty(num, num_groups, dtype=torch.int64, device=device))

    def fits(self, num: int, vocab_size: int) -> bool:
        """Whether the scratch covers `num` entries of `vocab_size` logits (at its own tile)."""
        return (self.tile_m.shape[0] >= num and self.tile_m.shape[1] == -(-vocab_size // self.tile)
                and self.group_keys.shape[1] == -(-vocab_size // self.group))

    @property
    def num_tiles(self) -> int:
        return self.tile_m.shape[1]

    @property
    def num_groups(self) -> int:
        return self.group_keys.shape[1]


def stats_usable(logits: torch.Tensor, num_logprobs: int) -> bool:
    """Whether the select kernel takes this K for these logits (else compute_logprobs' own choice)."""
    return 0 <= num_logprobs <= min(MAX_TOPK, logits.shape[1]) and logits.dtype == torch.float32


if HAS_TRITON:
    import triton
    import triton.language as tl

    from graphrunner.sample.logprobs_triton import _chosen_logit, _key_value, _select_kernel, _sort_key

    _NEG_INF = tl.constexpr(float("-inf"))
    _LOW = tl.constexpr(-(1 << 63))

    @triton.jit
    def tile_stats(x, on, ids, e, tile, m_ptr, acc_ptr, nan_ptr, num_tiles, gkey_ptr, num_groups,
                   GROUP: tl.constexpr):
        """Write the stats partials of one [GROUPS, GROUP] tile `x` of raw logits (lanes `on`) of entry e."""
        is_nan = (x != x) & on
        key = tl.where(on & (x == x), x, _NEG_INF)  # NaN and off lanes out of the max and the sum
        peak = tl.max(tl.max(key, 1), 0)
        shift = tl.where(peak == _NEG_INF, 0.0, peak)  # a tile of only -inf: sum 0, not NaN
        at = e * num_tiles + tile
        tl.store(m_ptr + at, peak)
        tl.store(acc_ptr + at, tl.sum(tl.sum(tl.exp(key - shift), 1), 0))
        tl.store(nan_ptr + at, tl.max(tl.max(is_nan.to(tl.int32), 1), 0))
        # Group ids taken from `ids` by a row reduction, so they share the maxima's layout.
        gid = tl.min(ids, 1) // GROUP  # [GROUPS]
        tl.store(gkey_ptr + e * num_groups + gid, _sort_key(tl.max(key, 1), gid), mask=gid < num_groups)

    @triton.jit(do_not_specialize=["vocab_size", "num_tiles", "num_groups"])
    def _rank_kernel(x_ptr, x_stride, tok_ptr, tok_stride, gkey_ptr, cnt_ptr, vocab_size, num_tiles, num_groups,
                     TILES: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr):
        # Program (row, part) over TILES tiles: raw logits above the chosen one, in the groups whose
        # max is above it. Its count goes to the part's first tile slot, zeros to the others. Few, fat
        # programs: each waits on the chosen logit's two dependent loads once, and the unrolled loop
        # issues its group-key loads together (masked-off group loads cost nothing).
        row, part = tl.program_id(0), tl.program_id(1)
        x_row = x_ptr + row.to(tl.int64) * x_stride
        gkey_row = gkey_ptr + row.to(tl.int64) * num_groups
        _, chosen = _chosen_logit(x_row, tok_ptr, tok_stride, row, vocab_size)
        offs = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
        cnt = tl.zeros([GROUPS, GROUP], tl.int32)
        for t in tl.static_range(TILES):
            v = (part * TILES + t) * (GROUPS * GROUP) + offs
            gid = tl.min(v, 1) // GROUP  # [GROUPS]
            key = tl.load(gkey_row + gid, mask=gid < num_groups, other=_LOW)
            over = (_key_value(key) > chosen) & (gid < num_groups)  # NaN chosen: no group (rank 1)
            s = tl.load(x_row + v, mask=over[:, None] & (v < vocab_size), other=_NEG_INF)
            cnt += (s > chosen).to(tl.int32)
        j = tl.arange(0, TILES)
        total = tl.sum(tl.sum(cnt, 1), 0)
        tl.store(cnt_ptr + row * num_tiles + part * TILES + j, tl.where(j == 0, total, 0),
                 mask=part * TILES + j < num_tiles)


def logprobs_from_stats(
    logits: torch.Tensor,  # [R, V] float32 raw logits the dense pass read (unit stride in V)
    token_ids: torch.Tensor,  # [R] int32 | int64 in [0, V): the sampled token per row
    num_logprobs: int,  # K, 0 <= K <= min(V, MAX_TOPK) (static)
    out_logprobs: torch.Tensor,  # [R, >= K+1] float32, written in place
    out_ids: torch.Tensor,  # [R, >= K+1] int32 | int64, written in place
    out_ranks: torch.Tensor,  # [R] int32 | int64, written in place
    stats: LogprobStats,  # filled by fused_process.process_logits_triton(..., stats=stats) for these logits
) -> None:
    """`compute_logprobs` from the dense pass's partials (module docstring). Graph-safe, no host sync."""
    check_logprob_args(logits, token_ids, num_logprobs, out_logprobs, out_ids, out_ranks)
    rows, vocab = logits.shape
    if not stats.fits(rows, vocab):
        raise ValueError(f"stats scratch {tuple(stats.tile_m.shape)} does not cover {rows} x {vocab}")
    if rows == 0:
        return
    num_tiles, num_groups, group = stats.num_tiles, stats.num_groups, stats.group
    _rank_kernel[(rows, triton.cdiv(num_tiles, _RANK_TILES))](
        logits, logits.stride(0), token_ids, token_ids.stride(0), stats.group_keys, stats.tile_cnt, vocab, num_tiles,
        num_groups, TILES=_RANK_TILES, GROUPS=stats.tile // group, GROUP=group, num_warps=4)
    _select_kernel[(rows,)](
        stats.tile_m, stats.tile_acc, stats.tile_nan, stats.tile_cnt, stats.group_keys, logits, logits.stride(0),
        token_ids, token_ids.stride(0), out_logprobs, out_logprobs.stride(0), out_logprobs.stride(1), out_ids,
        out_ids.stride(0), out_ids.stride(1), out_ranks, out_ranks.stride(0), num_tiles, vocab, num_groups,
        C_PAD=triton.next_power_of_2(max(num_tiles, 2)), K=num_logprobs,
        K_PAD=triton.next_power_of_2(max(num_logprobs, 1)), GROUP=group,
        G_TILE=min(_G_TILE, triton.next_power_of_2(num_groups)), num_warps=4 if num_logprobs > 0 else 1)
