"""StateStore: every per-request row of the runner, and one commit of their writes per step.

It applies the request-state part of a `SchedulerOutput` (removals, admissions, new KV
blocks of running requests) to the three holders of per-row state — `RequestState`
(token history, counters), `SamplingStates` (settings), `BlockTables` (KV blocks) —
which all stage their device writes into one `StagedWrites`. `commit()` pushes them, once
per step, before the step runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from graphrunner.limits import StepLimits
from graphrunner.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from graphrunner.state.block_tables import BlockTables
from graphrunner.state.requests import RequestState
from graphrunner.state.rules import token_limit
from graphrunner.state.sampling import SamplingStates
from graphrunner.state.staging import StagedWrites
from graphrunner.structured_outputs import GrammarOutput


@dataclass
class Removed:
    """The requests one step's state update removed: their ids, and the rows that freed."""

    req_ids: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)


class StateStore:
    """The per-row state of one runner. `block_tables` exist once the KV cache does."""

    def __init__(self, max_num_reqs: int, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 base_seed: int, device: torch.device, num_speculative_tokens: int = 0) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.staging = StagedWrites(device)
        self.requests = RequestState(max_num_reqs, max_model_len, device, staging=self.staging,
                                     num_speculative_tokens=num_speculative_tokens)
        self.sampling = SamplingStates(
            self.requests.num_rows, device, base_seed=base_seed, vocab_size=vocab_size,
            all_token_ids=self.requests.all_token_ids, staging=self.staging,
            grammar_slots=1 + num_speculative_tokens,  # a grammar mask per verified position
        )
        self.block_tables: BlockTables | None = None

    def init_block_tables(self, max_num_blocks_per_req: int, block_size: int, num_kv_blocks: int) -> BlockTables:
        self.block_tables = BlockTables(self.requests.num_rows, max_num_blocks_per_req, block_size, num_kv_blocks,
                                        self.device, staging=self.staging)
        return self.block_tables

    @property
    def tables(self) -> BlockTables:
        if self.block_tables is None:
            raise RuntimeError("call initialize_kv_cache(num_blocks) first")
        return self.block_tables

    # ---- the step's state changes ------------------------------------------------------
    def update(self, so: SchedulerOutput, steady: bool, new_blocks: bool) -> Removed | None:
        """The step's request-state changes as staged writes, committed once; on any error
        nothing is committed. `steady`: a reused decode plan (it admits and removes nothing;
        only new KV blocks of its requests may arrive). Returns what was removed (None: nothing)."""
        try:
            removed = None
            if not steady:
                removed = self.apply(so)
            elif new_blocks:
                self.append_cached_blocks(so.scheduled_cached_reqs)
            self.staging.commit()  # the step's one commit of staged state writes
        except BaseException:
            self.staging.discard()
            raise
        return removed

    def apply(self, so: SchedulerOutput) -> Removed | None:
        """Removals, then admissions, then new blocks of running requests (staged, not committed)."""
        tables = self.tables
        removed = None
        if so.finished_req_ids or so.preempted_req_ids:
            removed = Removed()
            for req_id in so.finished_req_ids | so.preempted_req_ids:
                row = self.requests.remove_request(req_id)
                removed.req_ids.append(req_id)
                if row is not None:
                    tables.clear_row(row)
                    removed.rows.append(row)
        for new in so.scheduled_new_reqs:
            self._add_request(new)
        cached = so.scheduled_cached_reqs
        if any(cached.new_block_ids):
            self.append_cached_blocks(cached)
        for req_id, draft_ids in so.scheduled_spec_decode_tokens.items():
            if draft_ids and draft_ids[0] >= 0:  # real ids (validation: all real or all placeholders)
                self.requests.stage_drafts(self.requests.req_id_to_index[req_id], draft_ids)
        return removed

    def _add_request(self, new: NewRequestData) -> None:
        row = self.requests.add_request(new.req_id, new.all_token_ids, new.num_computed_tokens)
        self.sampling.add_request(
            row, new.req_id, new.sampling_params, self.vocab_size,
            prompt_len=len(new.prompt_token_ids), eos_ids=self.eos_token_ids,
        )
        self.tables.append_block_ids(row, new.block_ids, overwrite=True)

    def append_cached_blocks(self, cached: CachedRequestData) -> None:
        """Stage the new KV blocks of running requests (`scheduled_cached_reqs.new_block_ids`)."""
        index = self.requests.req_id_to_index
        grown = [(index[req_id], blocks) for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True)
                 if blocks]
        if grown:
            rows, blocks = zip(*grown, strict=True)
            self.tables.append_to_rows(rows, blocks)

    def write_grammar(self, rows: np.ndarray, req_ids: list[str], query_lens: np.ndarray,
                      grammar: GrammarOutput | None) -> None:
        """The step's grammar masks (`SamplingStates.write_grammar`), before its host mirrors advance:
        a decoding entry scheduled q > 1 tokens verifies q - 1 draft slots and takes q bitmask rows.
        rows, query_lens: [R] the batch's state rows and scheduled tokens."""
        if not (query_lens > 1).any():  # nothing verifies drafts (every decode without speculation)
            self.sampling.write_grammar(rows, req_ids, grammar)
            return
        r = self.requests
        verifying = (query_lens > 1) & (r.num_computed_np[rows] >= r.prefill_len_np[rows])  # [R]
        self.sampling.write_grammar(rows, req_ids, grammar, np.where(verifying, query_lens - 1, 0))

    def commit(self) -> None:
        """Push every staged write to the device (once per step, before it runs)."""
        self.staging.commit()

    def token_limits(self, rows: np.ndarray, limits: StepLimits) -> np.ndarray:
        """[R] int64: the most tokens each row may hold (its blocks, capped by max_model_len)."""
        return token_limit(self.tables.num_blocks[rows], limits)
