"""A step's grammar masks into `SamplingStates.grammar_mask` ([rows, S, W]): one upload, placed on the device.

The engine's `GrammarOutput` holds vLLM's layout: per listed request 1 + (its drafts) consecutive
bitmask rows, in the order of the ids. The host does no per-row work on the masks themselves: it
computes where each bitmask row goes (flat `[rows * S]` indices, a few hundred integers), uploads
the bitmask once (without a host copy when the engine filled it in a pinned block,
`GrammarOutput.pinned`) and the device sets the step's grammar rows to "every token allowed" and
scatters the rows into their slots. At 64 rows of a 152k vocabulary that replaces two host passes
over 1.2 MB (an all-ones fill and a fancy-indexed copy) by index arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch

from graphrunner.state.staging import host_buffer, to_device_async
from graphrunner.structured_outputs import GrammarOutput

__all__ = ["grammar_starts", "place_grammar"]


def grammar_starts(grammar: GrammarOutput, req_ids: list[str], width: np.ndarray, words: int) -> dict[str, int]:
    """The first bitmask row of each listed request (`width`: [R] rows per batch entry); ValueError
    naming the expected and given row counts, a repeated id or too wide a row."""
    mask = grammar.grammar_bitmask
    if mask.shape[1] > words:
        raise ValueError(f"grammar_bitmask has {mask.shape[1]} words per row; the vocabulary needs {words}")
    entry_of = {rid: i for i, rid in enumerate(req_ids)}
    starts: dict[str, int] = {}
    offset = 0
    for rid in grammar.structured_output_request_ids:
        if rid in starts:
            raise ValueError(f"grammar_output lists request {rid!r} twice")
        starts[rid] = offset
        entry = entry_of.get(rid)
        offset += int(width[entry]) if entry is not None else 1
    if offset != mask.shape[0]:
        raise ValueError(f"grammar_bitmask has {mask.shape[0]} rows; expected {offset}: 1 + the scheduled draft "
                         f"slots of each of its {len(starts)} request ids, in their order")
    return starts


def _destinations(state_rows: np.ndarray, first: np.ndarray, width: np.ndarray,
                  slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(dest, src): bitmask row src[i] goes to flat slot dest[i] of `grammar_mask.view(-1, W)`.
    state_rows, first, width: [N] each listed entry's state row, first bitmask row and row count."""
    if (width == 1).all():
        return state_rows * slots, first
    entry = np.repeat(np.arange(len(width)), width)  # [M] the entry of each placed row
    slot = np.arange(len(entry)) - np.repeat(np.cumsum(width) - width, width)  # [M] its slot in the entry
    return state_rows[entry] * slots + slot, first[entry] + slot


def _upload(grammar: GrammarOutput, words: int, device: torch.device) -> torch.Tensor:
    """The bitmask on `device`, [num_rows, words]; words past the grammar's vocabulary (padding ids)
    are 0 (forbidden). Copied without blocking the host: from the engine's pinned block when it has
    one (the caching host allocator keeps it until the copy is done), else through a fresh one."""
    mask = grammar.grammar_bitmask
    if grammar.pinned is not None and mask.shape[1] == words:
        return grammar.pinned.to(device, non_blocking=True)
    staged = host_buffer((mask.shape[0], words), torch.int32, device)
    host = staged.numpy()
    host[:, : mask.shape[1]] = mask
    host[:, mask.shape[1] :] = 0
    return staged.to(device, non_blocking=True)


def place_grammar(grammar_mask: torch.Tensor, rows: np.ndarray, mine: np.ndarray, req_ids: list[str],
                  grammar: GrammarOutput | None, width: np.ndarray) -> None:
    """grammar_mask [rows, S, W]: entries `mine` (the batch entries with a grammar, state rows
    rows[mine]) allow every token in every slot, then each listed one takes its bitmask rows in its
    first width[entry] slots. ValueError, with nothing written, on a bad layout."""
    slots, words = grammar_mask.shape[1:]
    dest = src = np.zeros(0, dtype=np.int64)
    num_mask_rows = 0
    if grammar is not None:
        num_mask_rows = len(grammar.grammar_bitmask)
        starts = grammar_starts(grammar, req_ids, width, words)
        first = np.array([starts.get(req_ids[e], -1) for e in mine.tolist()], dtype=np.int64)  # [N]
        listed = first >= 0
        dest, src = _destinations(rows[mine][listed].astype(np.int64), first[listed], width[mine][listed], slots)
    if not len(mine):
        return
    # Every bitmask row placed in its own order (no speculation, ids in batch order): no gather.
    gather = len(src) != num_mask_rows or not (src == np.arange(len(src))).all()
    n, m = len(mine), len(dest)
    index = to_device_async(np.concatenate([rows[mine], dest, src if gather else src[:0]]).astype(np.int64),
                            grammar_mask.device)  # one upload: [fill rows | destinations | sources]
    grammar_mask.index_fill_(0, index[:n], -1)  # all bits set: every token allowed
    if m:
        assert grammar is not None
        upload = _upload(grammar, words, grammar_mask.device)
        if gather:
            upload = upload.index_select(0, index[n + m :])
        grammar_mask.view(-1, words).index_copy_(0, index[n : n + m], upload)
