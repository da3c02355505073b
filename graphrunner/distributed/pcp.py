"""Prefill context parallelism (PCP): which of a step's tokens each rank of the PCP group computes.

Pure host-side numpy, no process group: every rank builds the same `PCPPartition` from the same
step layout and reads its own rows. The runner wiring (K/V all-gather, hidden-state restore before
the logits) uses the arrays below; nothing here touches a device.

Notation. A step has R batch entries in batch order; entry i schedules `q_i` tokens
(`query_lens[i]`) after `n_i` already computed ones (`num_computed[i]`), and is either a decode
(`is_decode[i]`: 1 + k tokens with k speculative drafts) or a prefill chunk. The global layout is
the step's tokens in batch order: entry i owns global indices `gqsl[i] .. gqsl[i] + q_i - 1`
(`gqsl` = exclusive cumsum of q), and its token j has RoPE position `n_i + j`. T = sum(q).
P is the PCP size, r this rank.

Rules:

1. Prefill split (DualChunkSwap). With P > 1 a prefill entry is padded to
   `Lp = ceil(q / 2P) * 2P` tokens and cut in 2P chunks of `c = Lp / 2P`; chunk k holds the
   entry's indices `[k*c, (k+1)*c)`. Rank r holds chunk r (its *head*) followed by chunk
   2P-1-r (its *tail*): 2c local tokens. An index j >= q is padding. Pairing an early chunk with
   its mirror image balances causal-attention work (rule 8).
2. Whole entries. A decode is held whole, in order, by every rank (duplicated, never padded).
   With P = 1 every entry is held whole: the partition is the identity, without padding.
3. Local layout. Entries keep batch order; entry i occupies local rows
   `local_query_start_loc[i] : local_query_start_loc[i + 1]`. Every rank holds the same number
   of local tokens, `T_local = sum(2 c_i over prefills) + sum(q_i over whole entries)`, so an
   all-gather needs no extra padding; only the share of padding differs between ranks.
4. Padding tokens have global index -1 (`PAD`), RoPE position 0 and `is_real` False; their
   `gather_index` (the row to read input ids from) is clamped to the first global token of
   their own entry, which always exists (an entry with padding has q >= 1). Their slot must be
   -1: the slot-mapping step writes `where(is_real, slot[gather_index], -1)`, so a padding token
   never writes K/V, and at position 0 its causal window is its own request's first key, never
   a neighbour's.
5. Gathered layout. An all-gather concatenates the ranks' local rows in rank order with a row
   stride `stride >= T_local` (the graph-padded local size; rows `T_local .. stride - 1` of each
   rank are padding too): rank k's local row l is gathered row `k * stride + l`.
6. Restore. `restore_index(stride)` [T] gives the global order back: `gathered[restore_index]`
   is the step's tokens in global order, padding dropped. A prefill token is taken from the one
   rank that holds it, a decode token from rank 0's copy. It equals the first T entries of a
   stable argsort of the gathered global indices in which padding rows and ranks 1..P-1's decode
   copies are keyed past every real index.
7. K/V write mask. `gathered_kv_write_mask(stride)` marks the gathered rows that write K/V:
   exactly the rows `restore_index` selects, so every global token is written once.
8. Work balance. A rank's causal-attention work is the sum, over its real prefill tokens, of
   `position + 1` (keys attended, counting the entry's computed context). For every prefill
   entry, the works of any two ranks differ by at most `K_i = c(n + Lp) - c(c - 1)/2`, the work of
   the entry's last chunk were it all real; so the batch's works differ by at most sum(K_i)
   (`work_imbalance_bound`), and by 0 when every q_i is a multiple of 2P. Proof: unpadded, rank
   r's chunk pair weighs `2c(n + 1) + (2P - 1)c^2 + c(c - 1)`, the same for every r; padding is
   the suffix `[q, Lp)`, shorter than 2P. For c >= 2 it lies inside the tail chunks (reaching a
   head chunk needs `q < Pc`, but `q > 2P(c - 1)`), so each rank loses at most the weight of one
   tail chunk, at most K_i, and two ranks differ by at most the larger loss. For c = 1 (Lp = 2P)
   a rank holds j = r and j = 2P-1-r, real iff below q; a rank with both real and one with none
   cannot coexist, and the other differences are at most `n + 2P = K_i`. The bound is tight.
9. Segments. For attention, each rank's entry splits into contiguous *segments*: a whole entry
   is one, a prefill entry two (head, tail). A segment holds its real tokens first, then its
   padding; its real tokens have consecutive positions ending at `segment_seq_lens - 1` (the
   keys its last real query attends to); a segment with no real token has seq_len 0.
10. Attention segments. A paged attention kernel places a request's last query row at position
   `seq_len - 1`, so a segment's trailing padding would shift its real rows. `attention_segments`
   therefore cuts each segment into its real run (with the segment's seq_len) and, where there
   is padding, a run of padding rows with seq_len 0 (they see no key and read no block).

Dtypes: lengths, local offsets and entry indices int32; global indices and positions int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD = -1  # global index of a padding token, and the slot it must get


def _lengths(name: str, values: np.ndarray) -> np.ndarray:
    """`values` as int64 after checking it is a 1-D array of non-negative integers."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{name}[{i}] = {int(arr[i])} is negative (must be >= 0)")
    return arr.astype(np.int64)


def _validate(query_lens: np.ndarray, num_computed: np.ndarray, is_decode: np.ndarray,
              pcp_size: int, pcp_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(pcp_size, bool) or not isinstance(pcp_size, (int, np.integer)) or pcp_size < 1:
        raise ValueError(f"pcp_size = {pcp_size!r} must be an integer >= 1")
    if isinstance(pcp_rank, bool) or not isinstance(pcp_rank, (int, np.integer)) or not 0 <= pcp_rank < pcp_size:
        raise ValueError(f"pcp_rank = {pcp_rank!r} must be an integer in [0, pcp_size = {pcp_size})")
    q = _lengths("query_lens", query_lens)
    n = _lengths("num_computed", num_computed)
    dec = np.asarray(is_decode)
    if dec.ndim != 1:
        raise ValueError(f"is_decode must be 1-D, got shape {dec.shape}")
    if dec.size and dec.dtype.kind != "b":
        raise ValueError(f"is_decode must be boolean, got dtype {dec.dtype}")
    if not len(q) == len(n) == len(dec):
        raise ValueError(f"query_lens, num_computed and is_decode must have one value per entry; "
                         f"got lengths {len(q)}, {len(n)} and {len(dec)}")
    return q, n, dec.astype(bool)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


@dataclass(frozen=True, eq=False)
class _EntryPlan:
    """Per-entry sizes (rules 1-3), all [R]."""

    whole: np.ndarray  # bool: held whole by every rank (decodes; every entry when P == 1)
    chunk_lens: np.ndarray  # int64: c for a split prefill, q for a whole entry
    padded_lens: np.ndarray  # int64: Lp for a split prefill, q for a whole entry
    local_lens: np.ndarray  # int64: 2c for a split prefill, q for a whole entry


def _plan_entries(q: np.ndarray, dec: np.ndarray, pcp_size: int) -> _EntryPlan:
    whole = dec | (pcp_size == 1)
    chunk = np.where(whole, q, -(-q // (2 * pcp_size)))
    return _EntryPlan(whole=whole, chunk_lens=chunk,
                      padded_lens=np.where(whole, q, 2 * pcp_size * chunk),
                      local_lens=np.where(whole, q, 2 * chunk))


def _within_entry_index(plan: _EntryPlan, entry: np.ndarray, offset: np.ndarray, pcp_size: int) -> np.ndarray:
    """[P, T_local] int64: for every rank, each local token's index j inside its entry (rule 1)."""
    ranks = np.arange(pcp_size, dtype=np.int64)[:, None]  # [P, 1]
    c = plan.chunk_lens[entry]  # [T_local]
    head = ranks * c + offset
    tail = (2 * pcp_size - 1 - ranks) * c + (offset - c)
    split = np.where(offset < c, head, tail)
    return np.where(plan.whole[entry], offset, split)


def _segments(q: np.ndarray, n: np.ndarray, plan: _EntryPlan, local_qsl: np.ndarray,
              pcp_size: int, rank: int) -> tuple[np.ndarray, ...]:
    """Rule 9 for one rank: (entry [S], start_loc [S + 1], real_lens [S], seq_lens [S])."""
    c = plan.chunk_lens
    first = np.stack([np.where(plan.whole, 0, rank * c), (2 * pcp_size - 1 - rank) * c], axis=1)  # [R, 2]
    length = np.stack([c, c], axis=1)
    real = np.clip(q[:, None] - first, 0, length)
    seq = np.where(real > 0, n[:, None] + first + real, 0)
    start = np.stack([local_qsl[:-1], local_qsl[:-1] + c], axis=1)
    keep = np.stack([np.ones_like(plan.whole), ~plan.whole], axis=1)  # a whole entry has no tail
    entry = np.repeat(np.arange(len(q)), 2).reshape(-1, 2)
    start_loc = np.append(start[keep], local_qsl[-1])
    return (entry[keep].astype(np.int32), start_loc.astype(np.int32),
            real[keep].astype(np.int32), seq[keep].astype(np.int32))


@dataclass(frozen=True, eq=False)
class PCPPartition:
    """One step's PCP split (module docstring: rules 1-9); build it with `PCPPartition.build`.

    Shapes: R entries, T global tokens, T_local local tokens per rank, S this rank's segments.
    `*_by_rank` arrays hold every rank (row k = rank k); the plain names are this rank's row.
    """

    pcp_size: int
    pcp_rank: int
    num_tokens: int  # T
    global_query_start_loc: np.ndarray  # [R + 1] int64
    chunk_lens: np.ndarray  # [R] int32: c (prefills, P > 1), q (whole entries)
    padded_lens: np.ndarray  # [R] int32: Lp (prefills, P > 1), q (whole entries)
    local_query_lens: np.ndarray  # [R] int32: same on every rank
    local_query_start_loc: np.ndarray  # [R + 1] int32: same on every rank
    local_entry: np.ndarray  # [T_local] int32: batch entry of each local token, same on every rank
    local_is_decode: np.ndarray  # [T_local] bool: the token belongs to a decode entry
    global_index_by_rank: np.ndarray  # [P, T_local] int64: global token index, PAD for padding
    positions_by_rank: np.ndarray  # [P, T_local] int64: RoPE position, 0 for padding
    tokens_per_rank: np.ndarray  # [P] int64: T_local on every rank (padding included)
    real_tokens_per_rank: np.ndarray  # [P] int64
    padding_per_rank: np.ndarray  # [P] int64
    prefill_work_per_rank: np.ndarray  # [P] int64: sum of position + 1 over real prefill tokens
    work_imbalance_bound: int  # sum of K_i over prefills (rule 8)
    segment_entry: np.ndarray  # [S] int32
    segment_start_loc: np.ndarray  # [S + 1] int32: local row where each segment starts
    segment_real_lens: np.ndarray  # [S] int32
    segment_seq_lens: np.ndarray  # [S] int32

    @classmethod
    def build(cls, query_lens: np.ndarray, num_computed: np.ndarray, is_decode: np.ndarray,
              pcp_size: int, pcp_rank: int) -> PCPPartition:
        """Partition one step: query_lens, num_computed [R] integers, is_decode [R] bool.

        Raises ValueError naming the value and its limit when an input is out of range.
        """
        q, n, dec = _validate(query_lens, num_computed, is_decode, pcp_size, pcp_rank)
        pcp_size, pcp_rank = int(pcp_size), int(pcp_rank)
        plan = _plan_entries(q, dec, pcp_size)
        gqsl = _exclusive_cumsum(q)
        local_qsl = _exclusive_cumsum(plan.local_lens)
        t_local = int(local_qsl[-1])
        entry = np.repeat(np.arange(len(q), dtype=np.int64), plan.local_lens)  # [T_local]
        offset = np.arange(t_local, dtype=np.int64) - local_qsl[entry]
        j = _within_entry_index(plan, entry, offset, pcp_size)  # [P, T_local]
        real = j < q[entry]
        glob = np.where(real, gqsl[entry] + j, PAD)
        pos = np.where(real, n[entry] + j, 0)
        num_real = real.sum(axis=1, dtype=np.int64)
        seg = _segments(q, n, plan, local_qsl, pcp_size, pcp_rank)
        return cls(
            pcp_size=pcp_size, pcp_rank=pcp_rank, num_tokens=int(gqsl[-1]), global_query_start_loc=gqsl,
            chunk_lens=plan.chunk_lens.astype(np.int32), padded_lens=plan.padded_lens.astype(np.int32),
            local_query_lens=plan.local_lens.astype(np.int32), local_query_start_loc=local_qsl.astype(np.int32),
            local_entry=entry.astype(np.int32), local_is_decode=dec[entry],
            global_index_by_rank=glob, positions_by_rank=pos,
            tokens_per_rank=np.full(pcp_size, t_local, dtype=np.int64), real_tokens_per_rank=num_real,
            padding_per_rank=t_local - num_real,
            prefill_work_per_rank=np.where(real & ~dec[entry], pos + 1, 0).sum(axis=1, dtype=np.int64),
            work_imbalance_bound=_imbalance_bound(q, n, plan),
            segment_entry=seg[0], segment_start_loc=seg[1], segment_real_lens=seg[2], segment_seq_lens=seg[3],
        )

    # ---- this rank's local layout ---------------------------------------------------------

    @property
    def num_local_tokens(self) -> int:
        """T_local: local tokens on every rank, padding included."""
        return int(self.local_query_start_loc[-1])

    @property
    def global_index(self) -> np.ndarray:
        """[T_local] int64: this rank's global token per local row, PAD (-1) for padding."""
        return self.global_index_by_rank[self.pcp_rank]

    @property
    def positions(self) -> np.ndarray:
        """[T_local] int64: RoPE positions of this rank's local tokens, 0 for padding."""
        return self.positions_by_rank[self.pcp_rank]

    @property
    def is_real(self) -> np.ndarray:
        """[T_local] bool: the unpad mask; False exactly on padding (whose slot must be -1)."""
        return self.global_index >= 0

    @property
    def gather_index(self) -> np.ndarray:
        """[T_local] int64: global row to read per-token inputs from; padding reads its entry's first token."""
        first = self.global_query_start_loc[self.local_entry]
        return np.where(self.is_real, self.global_index, first)

    def attention_segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rule 10 for this rank: (entry [A] int32, start_loc [A + 1] int32, seq_lens [A] int32,
        whole [A] bool), A <= 2 S. `whole` marks a whole entry's run (a decode: its seq_len is the
        entry's own, which the device knows best under speculative decoding)."""
        start, real = self.segment_start_loc[:-1].astype(np.int64), self.segment_real_lens.astype(np.int64)
        length = np.diff(self.segment_start_loc).astype(np.int64)
        padded = length > real
        # Interleave [real run, padding run] per segment; keep real runs that exist and padding that exists.
        keep = np.stack([real > 0, padded], axis=1).reshape(-1)
        starts = np.stack([start, start + real], axis=1).reshape(-1)[keep]
        seqs = np.stack([self.segment_seq_lens.astype(np.int64), np.zeros_like(real)], axis=1).reshape(-1)[keep]
        entry = np.repeat(self.segment_entry, 2)[keep]
        per_entry = np.bincount(self.segment_entry, minlength=len(self.local_query_lens))
        whole = np.repeat(per_entry[self.segment_entry] == 1, 2)[keep] & (seqs > 0)  # one segment: a whole entry
        start_loc = np.append(starts, self.segment_start_loc[-1])
        return entry.astype(np.int32), start_loc.astype(np.int32), seqs.astype(np.int32), whole

    # ---- the gathered layout (rules 5-7), identical on every rank ---------------------------

    def _stride(self, stride: int | None) -> int:
        if stride is None:
            return self.num_local_tokens
        if stride < self.num_local_tokens:
            raise ValueError(f"stride = {stride} is below the local token count {self.num_local_tokens}")
        return int(stride)

    def _kept(self) -> np.ndarray:
        """[P, T_local] bool: the gathered rows restore selects (real; decodes from rank 0 only)."""
        first_rank = (np.arange(self.pcp_size) == 0)[:, None]
        return (self.global_index_by_rank >= 0) & (first_rank | ~self.local_is_decode)

    def gathered_global_index(self, stride: int | None = None) -> np.ndarray:
        """[P * stride] int64: the global token of each all-gathered row, PAD for padding rows."""
        s = self._stride(stride)
        out = np.full((self.pcp_size, s), PAD, dtype=np.int64)
        out[:, : self.num_local_tokens] = self.global_index_by_rank
        return out.reshape(-1)

    def gathered_kv_write_mask(self, stride: int | None = None) -> np.ndarray:
        """[P * stride] bool: gathered rows that write K/V (each global token exactly once)."""
        s = self._stride(stride)
        out = np.zeros((self.pcp_size, s), dtype=bool)
        out[:, : self.num_local_tokens] = self._kept()
        return out.reshape(-1)

    def restore_index(self, stride: int | None = None) -> np.ndarray:
        """[T] int64: `gathered[restore_index]` is the global token order, padding dropped."""
        s = self._stride(stride)
        rows = np.arange(self.pcp_size, dtype=np.int64)[:, None] * s + np.arange(self.num_local_tokens)
        kept = self._kept()
        out = np.empty(self.num_tokens, dtype=np.int64)
        out[self.global_index_by_rank[kept]] = rows[kept]
        return out


def _imbalance_bound(q: np.ndarray, n: np.ndarray, plan: _EntryPlan) -> int:
    """Rule 8: sum over split prefills of K_i = c(n + Lp) - c(c - 1)/2."""
    c, lp = plan.chunk_lens, plan.padded_lens
    k = c * (n + lp) - c * (c - 1) // 2
    return int(np.where(plan.whole, 0, k).sum())
