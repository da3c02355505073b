"""RequestState: one persistent row per live request.

A request owns a row from admission until it finishes or is preempted (preemption is
removal: a resumed request is admitted again and recomputes its KV). Rows hold the
token history and the counters the step reads on the device; the host keeps mirrors of
the counters so the runner can validate scheduler input and decide which requests
produce a token without ever reading the device.

Row `max_num_reqs` is a scratch row that is never live: padded batch entries point at
it, so a padded entry can never read or write a live request's state.
"""

from __future__ import annotations

import numpy as np
import torch

from graphrunner.state.staging import StagedWrites


class RequestState:
    """Per-request rows on the device plus host-side bookkeeping."""

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device,
                 staging: StagedWrites | None = None, num_speculative_tokens: int = 0):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.staging = staging if staging is not None else StagedWrites(device)
        self.num_rows = max_num_reqs + 1
        self.scratch_row = max_num_reqs

        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: list[str | None] = [None] * self.num_rows
        # Lowest row first: keeps live rows dense, which keeps gathers cache-friendly.
        self._free_rows: list[int] = list(range(max_num_reqs - 1, -1, -1))

        # Device state, read and written by the step (and so by captured graphs).
        self.all_token_ids = torch.zeros(self.num_rows, max_model_len, dtype=torch.int32, device=device)  # [rows, L]
        self.num_computed_tokens = torch.zeros(self.num_rows, dtype=torch.int32, device=device)  # [rows]
        self.prefill_len = torch.zeros(self.num_rows, dtype=torch.int32, device=device)  # [rows]
        self.last_sampled = torch.zeros(self.num_rows, dtype=torch.int32, device=device)  # [rows]
        # Speculative decoding: the drafts the next step verifies (the drafter's proposals,
        # or ids the scheduler placed), k columns; None without speculation.
        k = num_speculative_tokens
        self.num_speculative_tokens = k
        self.draft_token_ids = (torch.zeros(self.num_rows, k, dtype=torch.int32, device=device)  # [rows, k]
                                if k else None)
        self.num_draft = torch.zeros(self.num_rows, dtype=torch.int32, device=device) if k else None  # [rows]

        # Host mirrors of the device counters (kept in step by the runner).
        self.num_computed_np = np.zeros(self.num_rows, dtype=np.int64)
        self.prefill_len_np = np.zeros(self.num_rows, dtype=np.int64)
        # Which admission holds each row (a running count): a late host-side update for a
        # request (a speculative step's settled counts) applies only while it still holds it.
        self.admission_np = np.zeros(self.num_rows, dtype=np.int64)
        self._admissions = 0

        # Bumped whenever the row of some request changes (admission, removal): host-side
        # caches keyed on the batch layout (the runner's steady-decode plan) compare it.
        self.epoch = 0

    # ---- predicates -------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self.req_id_to_index)

    def has(self, req_id: str) -> bool:
        return req_id in self.req_id_to_index

    def can_add(self, n: int = 1) -> bool:
        return len(self._free_rows) >= n

    # ---- actions ----------------------------------------------------------------
    def add_request(self, req_id: str, token_ids: list[int], num_computed_tokens: int) -> int:
        """Admit a request (staged until `apply_staged_writes`). Returns its row.

        The caller validates the request first; this only checks invariants that
        would otherwise corrupt rows.
        """
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} is already live")
        if not self._free_rows:
            raise ValueError(f"no free request row: {self.num_live} live requests, max_num_reqs={self.max_num_reqs}")
        row = self._free_rows.pop()
        self.epoch += 1
        self._admissions += 1
        self.admission_np[row] = self._admissions
        self.req_id_to_index[req_id] = row
        self.index_to_req_id[row] = req_id
        self.num_computed_np[row] = num_computed_tokens
        self.prefill_len_np[row] = len(token_ids)
        staging = self.staging
        # The token history: flat elements row * L .. row * L + len - 1 of all_token_ids.
        base = row * self.max_model_len
        staging.stage_array(self.all_token_ids, np.arange(base, base + len(token_ids), dtype=np.int64),
                            np.asarray(token_ids, dtype=np.int32))
        staging.stage(self.num_computed_tokens, row, num_computed_tokens)
        staging.stage(self.prefill_len, row, len(token_ids))
        staging.stage(self.last_sampled, row, 0)
        if self.num_draft is not None:
            staging.stage(self.num_draft, row, 0)  # no drafts until the drafter proposes some
        return row

    def stage_drafts(self, row: int, draft_ids: list[int]) -> None:
        """Drafts placed by the scheduler (ids >= 0, at most k, checked by validation):
        they replace the row's own drafts for the next verification."""
        assert self.draft_token_ids is not None and self.num_draft is not None
        base = row * self.num_speculative_tokens
        self.staging.stage_array(self.draft_token_ids, np.arange(base, base + len(draft_ids), dtype=np.int64),
                                 np.asarray(draft_ids, dtype=np.int32))
        self.staging.stage(self.num_draft, row, len(draft_ids))

    def settle_rejected(self, rows: np.ndarray, admissions: np.ndarray, num_rejected: np.ndarray) -> None:
        """A speculative step's outcome reached the host: its rows computed `num_rejected`
        fewer tokens than the host mirror assumed at launch. Rows that changed hands since
        (finished, preempted, readmitted) are skipped."""
        held = self.admission_np[rows] == admissions
        np.subtract.at(self.num_computed_np, rows[held], num_rejected[held])

    def remove_request(self, req_id: str) -> int | None:
        """Free a request's row. Returns the row, or None if the id was not live."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.epoch += 1
        self.index_to_req_id[row] = None
        self.num_computed_np[row] = 0
        self.prefill_len_np[row] = 0
        self._free_rows.append(row)
        # An admission staged in the same step for this row still lands: a free row is
        # read by no batch, and a later admission's writes to it win.
        return row

    def apply_staged_writes(self) -> None:
        """Commit the staging (all of it: with the runner's shared staging, every holder's)."""
        self.staging.commit()
