"""The EAGLE / EAGLE-3 drafter: a one-layer head over the target's own features, inside the step.

The head at position p reads the target's features at p and the token at p + 1 and proposes
the token at p + 2 (`graphrunner.models.eagle`). After verification and post-update each
entry that produced a token has it at position P = num_computed_tokens, and the history
`all_token_ids` holds every verified token up to P. The drafter then

1. catches up over the step's own tokens: the same positions, slots and attention metadata
   as the target, the features the target wrote this step (EAGLE: its final hidden states;
   EAGLE-3: the feature layers' residual streams, fused by `fc`), and as input ids the
   history's token after each position. Every position up to P - 1 gets its final head KV
   (rejected draft positions get KV that later steps overwrite, as in the target's cache);
   the row of position P - 1 (`logits_indices[b, num_accepted[b]]`: the last accepted
   token, or the last token of a prefill or plain decode) gives the first draft;
2. runs k - 1 one-token passes: pass i feeds the draft i - 1 at position P + i - 1 with the
   head's own pre-norm output of the pass before as features, writes the head's KV there,
   and proposes draft i. Drafting is greedy: one-hot proposals, verified by the rule of
   `spec_decode.rejection` for one-hot drafts.

The head's KV lives in its own caches with the target's block geometry, addressed through
the target's block tables, and an entry gets as many drafts as the blocks it holds allow
(as for the draft-model drafter). Under graph modes the head is compiled (attention as the
opaque op) and a FULL graph of the step captures it; eagerly it runs its plain modules.
Every TP rank runs the whole head (the shared embedding and LM head keep their sharding);
under PP the last stage drafts.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.attention.op import forward_context
from graphrunner.models.eagle import EagleHeadConfig
from graphrunner.state.block_tables import BlockTables
from graphrunner.state.requests import RequestState
from graphrunner.step.inputs import InputBatch


class EagleDrafter:
    """Greedy k-token proposals of an EAGLE head over persistent buffers (see the module docstring)."""

    def __init__(self, head_config: EagleHeadConfig, aux_layers: tuple[int, ...], k: int, max_num_reqs: int,
                 max_num_tokens: int, requests: RequestState, block_size: int, device: torch.device) -> None:
        self.head_config = head_config
        self.aux_layers = aux_layers  # EAGLE-3: the target layers whose inputs are the features, in fc order
        self.k = k
        self.requests = requests
        self.block_size = block_size
        self.model: Any = None  # EagleHead, set by SpeculativeStep.load_draft_model
        self.attn_backend: Any = None
        self.compiled: Any = None  # capture.piecewise.PiecewiseCompiled under graph modes
        self.kv_caches: list[torch.Tensor] = []  # the head's one cache, with the target's
        self.target_hidden: torch.Tensor | None = None  # EAGLE: the step's final hidden states [T_pad, H]
        self.aux_hidden: torch.Tensor | None = None  # EAGLE-3: [max_T, n H] persistent, written by the target
        n = max_num_reqs
        self.catch_up_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)  # [T]
        # One-token passes: entry b is token b.
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)  # [R]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [R]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [R]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [R]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [R + 1]

    @property
    def model_config(self) -> Any:
        """The head's decoder layer as a one-layer model config (KV shape, names)."""
        return self.head_config.layer

    def setup_compiled(self, enabled: bool, compile_backend: str, device: torch.device) -> None:
        """Compile the head (graph modes) or run its plain modules (eager)."""
        from capture.piecewise import PiecewiseCompiled

        head = self.model
        assert head is not None, "load_model() first"
        head.use_attention_op(enabled)
        self.compiled = None
        if enabled:
            self.compiled = PiecewiseCompiled(
                head, [torch.ops.graphrunner.unified_attention], token_args=(0, 1, 2),  # ids, positions, features
                compile_backend=compile_backend, device=device, name=f"{self.head_config.method} head",
            )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compiled is None:
            return self.model(input_ids, positions, features, self.kv_caches, meta)
        with forward_context(meta, self.kv_caches, self.attn_backend):
            return self.compiled.run_compiled(input_ids, positions, features, self.kv_caches, meta)

    def propose(self, batch: InputBatch, tables: BlockTables, logits_indices: torch.Tensor,
                num_accepted: torch.Tensor, out_draft: torch.Tensor, out_num_draft: torch.Tensor) -> None:
        """logits_indices [R, k + 1], num_accepted [R] (this step's); out_draft [R, k] int32 (0 past
        each entry's count), out_num_draft [R] int32."""
        head = self.model
        assert head is not None, "load_model() before running a step"
        R, Tp, k, bs = batch.num_reqs_padded, batch.num_tokens_padded, self.k, self.block_size
        r = self.requests
        rows = batch.idx_mapping.long()  # [R]
        max_model_len = r.all_token_ids.shape[1]

        # 1. Catch up: input id of token i is the history's token after its position.
        token = torch.arange(Tp, device=rows.device)  # [T]
        entry = torch.searchsorted(batch.query_start_loc[1:], token.to(torch.int32), right=True).clamp(max=R - 1)
        nxt = (batch.positions[:Tp] + 1).clamp(max=max_model_len - 1)  # [T]
        self.catch_up_ids[:Tp].copy_(r.all_token_ids[rows[entry], nxt])
        if self.aux_hidden is not None:  # EAGLE-3: the feature layers, fused
            features = head.combine(self.aux_hidden[:Tp])
        else:
            assert self.target_hidden is not None, "the step's sample() keeps the target's hidden states"
            features = self.target_hidden[:Tp]
        normed, prenorm = self._forward(self.catch_up_ids[:Tp], batch.positions[:Tp], features, batch.attn_metadata)
        last = logits_indices.gather(1, num_accepted.long()[:, None])[:, 0]  # [R]: the row of position P - 1
        token_r = head.greedy(normed[last])  # [R] int32: draft 0
        hidden = prenorm[last]  # [R, H]

        # 2. How many drafts each entry gets: the KV room its blocks leave (as the draft model's).
        qlen = batch.query_start_loc[1:] - batch.query_start_loc[:-1]  # [R]
        produced = (qlen > 0) & (batch.seq_lens >= r.prefill_len[rows])  # [R]
        start = r.num_computed_tokens[rows].long()  # [R]: P, the position of the new token
        held = tables.num_blocks_dev[rows].long() * bs  # [R]
        room = torch.minimum(held - start, max_model_len - 1 - start)  # [R]
        num = torch.where(produced, room.clamp(0, k), 0)  # [R]
        out_num_draft.copy_(num)
        out_draft[:, 0].copy_(torch.where(num > 0, token_r, 0))

        # 3. k - 1 one-token passes behind it.
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: R + 1], seq_lens=self.seq_lens[:R], block_table=batch.block_table,
            slot_mapping=self.slot_mapping[:R], num_reqs=R, num_tokens=R, max_query_len=1,
            max_seq_len=max_model_len,  # a static upper bound: one graph serves every step
        )
        max_blocks = batch.block_table.shape[1]
        for i in range(1, k):
            active = num > i  # [R]
            pos = start + i - 1  # [R]: the position whose next token draft i - 1 is
            block = batch.block_table.gather(1, (pos // bs).clamp(0, max_blocks - 1)[:, None])[:, 0].long()
            self.positions[:R].copy_(torch.where(active, pos, 0))
            self.seq_lens[:R].copy_(torch.where(active, pos + 1, 1))
            self.slot_mapping[:R].copy_(torch.where(active, block * bs + pos % bs, -1))
            self.input_ids[:R].copy_(torch.where(active, token_r, 0))
            normed, hidden = self._forward(self.input_ids[:R], self.positions[:R], hidden, meta)
            token_r = head.greedy(normed)
            out_draft[:, i].copy_(torch.where(active, token_r, 0))


__all__ = ["EagleDrafter"]
