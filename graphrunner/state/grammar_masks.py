"""A step's grammar masks into `SamplingStates.grammar_mask` ([rows, S, W]): one upload, placed on the device.

The engine's `GrammarOutput` holds vLLM's layout: per listed request 1 + (its drafts) consecutive
bitmask rows, in the order of the ids. The host does no per-row work on the masks themselves: it
computes where each bitmask row goes (flat `[rows * S]` slot indices, a few hundred integers, with
numpy over the whole step, no loop over its requests), and the device gets masks and indices in
ONE copy (`GrammarStaging`; no host copy of the masks when the engine filled them in the staging's
block, `GrammarOutput.pinned`). Then at most one fill (grammar rows that must allow every token:
rows the output does not list, slots past an entry's drafts) and one scatter of the rows into
their slots; when the rows go to consecutive slots in their own order (the engine's step without
speculation over state rows in order) the copy writes them in place and nothing else runs.
"""

from __future__ import annotations

import numpy as np
import torch

from graphrunner.state.grammar_staging import GrammarStaging
from graphrunner.structured_outputs import GrammarOutput

__all__ = ["grammar_firsts", "place_grammar"]


def grammar_firsts(grammar: GrammarOutput, req_ids: list[str], width: np.ndarray, words: int) -> np.ndarray:
    """[R] int64: each batch entry's first bitmask row, -1 where the output does not list it
    (`width`: [R] rows per batch entry; an id not in the batch takes one row). ValueError naming
    the expected and given row counts, a repeated id or too wide a row."""
    mask = grammar.grammar_bitmask
    if mask.shape[1] > words:
        raise ValueError(f"grammar_bitmask has {mask.shape[1]} words per row; the vocabulary needs {words}")
    ids = grammar.structured_output_request_ids
    entries = None  # [L] the batch entry of each listed id (-1: not in the batch)
    if ids == req_ids:  # the engine's usual step: every entry listed, in batch order
        rows_of = width[: len(ids)]
    else:
        entry_of = {rid: i for i, rid in enumerate(req_ids)}
        entries = np.array([entry_of.get(rid, -1) for rid in ids], dtype=np.int64)
        if len(set(ids)) != len(ids):
            _raise_repeated(ids)
        rows_of = np.where(entries >= 0, width[entries], 1)
    ends = np.cumsum(rows_of)  # [L]
    expected = int(ends[-1]) if len(ends) else 0
    if expected != mask.shape[0]:
        raise ValueError(f"grammar_bitmask has {mask.shape[0]} rows; expected {expected}: 1 + the scheduled draft "
                         f"slots of each of its {len(ids)} request ids, in their order")
    starts = ends - rows_of
    if entries is None:
        return starts
    first = np.full(len(req_ids), -1, dtype=np.int64)
    inside = entries >= 0
    first[entries[inside]] = starts[inside]
    return first


def _raise_repeated(ids: list[str]) -> None:
    seen: set[str] = set()
    for rid in ids:
        if rid in seen:
            raise ValueError(f"grammar_output lists request {rid!r} twice")
        seen.add(rid)


def _destinations(state_rows: np.ndarray, first: np.ndarray, width: np.ndarray,
                  slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(dest, src): bitmask row src[i] goes to flat slot dest[i] of `grammar_mask.view(-1, W)`.
    state_rows, first, width: [N] each listed entry's state row, first bitmask row and row count."""
    if (width == 1).all():
        return state_rows * slots, first
    entry = np.repeat(np.arange(len(width)), width)  # [M] the entry of each placed row
    slot = np.arange(len(entry)) - np.repeat(np.cumsum(width) - width, width)  # [M] its slot in the entry
    return state_rows[entry] * slots + slot, first[entry] + slot


def _placement(grammar: GrammarOutput | None, rows: np.ndarray, mine: np.ndarray, req_ids: list[str],
               width: np.ndarray, slots: int, words: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(fill, dest, src): state rows whose every slot allows every token first ([n]), then bitmask
    row src[i] into flat slot dest[i] ([m] each; src None: row i into dest[i], every row). A grammar
    entry needs the fill when the output does not list it or its rows do not cover its slots.
    ValueError on a bad layout."""
    empty = np.zeros(0, dtype=np.int64)
    if grammar is None:
        return rows[mine].astype(np.int64), empty, empty
    mask = grammar.grammar_bitmask
    if (slots == 1 and len(mine) == len(rows) and mask.shape[1] <= words
            and grammar.structured_output_request_ids == req_ids and int(width.sum()) == len(mask)):
        # The engine's step without speculation (every entry a grammar row, listed in batch order, one
        # row each: all that grammar_firsts would check and find): no per-entry arithmetic.
        return empty, rows.astype(np.int64), None
    mine_rows = rows[mine].astype(np.int64)  # [N]
    first = grammar_firsts(grammar, req_ids, width, words)[mine]  # [N]
    mine_width = width[mine]
    listed = first >= 0
    fill = mine_rows[~listed | (mine_width < slots)]
    dest, src = _destinations(mine_rows[listed], first[listed], mine_width[listed], slots)
    return fill, dest, src


def place_grammar(grammar_mask: torch.Tensor, rows: np.ndarray, mine: np.ndarray, req_ids: list[str],
                  grammar: GrammarOutput | None, width: np.ndarray, staging: GrammarStaging) -> None:
    """grammar_mask [rows, S, W]: entries `mine` (the batch entries with a grammar, state rows
    rows[mine]) allow every token in every slot, except that each listed one takes its bitmask
    rows in its first width[entry] slots. ValueError, with nothing written, on a bad layout."""
    slots, words = grammar_mask.shape[1:]
    fill, dest, src = _placement(grammar, rows, mine, req_ids, width, slots, words)
    if not len(mine):
        return
    n, m = len(fill), len(dest)
    mask = grammar.grammar_bitmask if grammar is not None else None
    pinned = grammar.pinned if grammar is not None else None
    flat = grammar_mask.view(-1, words)  # [rows * S, W]
    gather = mask is None or m != len(mask)  # some bitmask rows go nowhere (ids not in the step)
    if not gather:  # each bitmask row has its slot: dest in the rows' order, no gather
        order = dest
        if src is not None:
            order = np.empty(m, dtype=np.int64)
            order[src] = dest
        if not n and m and bool((order[1:] - order[:-1] == 1).all()):  # consecutive slots: copied in place
            assert mask is not None
            staging.send_rows(mask, pinned, flat, int(order[0]))
            return
        index = np.concatenate([fill, order])
    else:
        assert src is not None
        index = np.concatenate([fill, dest, src])
    device_index, device_rows = staging.upload(mask if m else None, pinned, index)  # [K] int64, [M, W] int32
    if n:
        grammar_mask.index_fill_(0, device_index[:n], -1)  # all bits set: every token allowed
    if m:
        source = device_rows.index_select(0, device_index[n + m :]) if gather else device_rows
        flat.index_copy_(0, device_index[n : n + m], source)
