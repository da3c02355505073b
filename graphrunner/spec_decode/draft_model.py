"""The draft-model drafter: a small Llama-family model proposes k tokens, inside the step.

After verification and post-update, each entry that produced a token has it at position
P = num_computed_tokens (its KV not computed yet). The drafter then

1. runs the draft model over the step's own tokens (the same input ids, positions, slots
   and attention metadata as the target): its KV cache keeps up with the target's, chunked
   prefills and recomputation after preemption included (rejected draft positions get KV
   that later steps overwrite, as in the target's cache);
2. runs k one-token passes: pass i feeds the token at P + i (the new token, then its own
   previous draft), writes its KV there, and takes the argmax of its logits as the draft
   for position P + i + 1. Drafting is greedy, so the drafts are one-hot proposals: the
   verification rule of `spec_decode.rejection` for one-hot drafts applies.

Under graph modes the draft model is compiled like the target (`setup_compiled`: attention
becomes the opaque op, the rest fused by the compiler, one trace for every token count) and
a FULL graph captures its fused kernels; eager mode runs the plain modules.

The draft model has its own KV caches with the target's block geometry and number of
blocks, addressed through the target's block tables (the same blocks hold both models'
KV). A pass writes only at positions inside the blocks the row holds (`BlockTables
.num_blocks_dev`) and below max_model_len; an entry gets as many drafts as that room
allows (a scheduler that reserves k lookahead slots gives it all k). Entries that produced
no token (a partial prefill chunk, padding, the scratch row) propose nothing and write no
KV in the one-token passes.

Everything is fixed-shape torch over persistent buffers and the model's graph-safe
forward, so a FULL graph of the step holds the drafter too. The draft model runs without
the attention op (it is not compiled into PIECEWISE pieces: under PIECEWISE it runs
eagerly, compiled, after the pieces). With tensor parallelism every rank runs the whole draft model
and computes the same drafts.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.attention.base import AttentionMetadata
from graphrunner.attention.op import forward_context
from graphrunner.config import ModelConfig
from graphrunner.state.block_tables import BlockTables
from graphrunner.state.requests import RequestState
from graphrunner.step.inputs import InputBatch


class DraftModelDrafter:
    """Greedy k-token proposals of a draft model over persistent one-token-pass buffers."""

    def __init__(self, model_config: ModelConfig, k: int, max_num_reqs: int, requests: RequestState,
                 block_size: int, device: torch.device) -> None:
        self.model_config = model_config
        self.k = k
        self.requests = requests
        self.block_size = block_size
        self.model: torch.nn.Module | None = None  # set by the runner's load_model
        self.attn_backend: Any = None  # with the model
        self.compiled: Any = None  # capture.piecewise.PiecewiseCompiled under graph modes
        self.kv_caches: list[torch.Tensor] = []  # set with the target's KV cache
        n = max_num_reqs
        # One-token passes: entry b is token b.
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)  # [R]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [R]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [R]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [R]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [R + 1]

    def setup_compiled(self, enabled: bool, compile_backend: str, device: torch.device) -> None:
        """Compile the draft model (graph modes) or run its plain modules (eager)."""
        from capture.piecewise import PiecewiseCompiled

        model = self.model
        assert model is not None, "load_model() first"
        model.use_attention_op(enabled)  # type: ignore[operator]
        self.compiled = None
        if enabled:
            self.compiled = PiecewiseCompiled(
                model, [torch.ops.graphrunner.unified_attention], token_args=(0, 1),  # input_ids, positions: [T]
                compile_backend=compile_backend, device=device, name=f"draft {self.model_config.name}",
            )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The draft model's hidden states [T, H] (compiled kernels under graph modes)."""
        if self.compiled is None:
            assert self.model is not None
            return self.model(input_ids, positions, self.kv_caches, meta)
        # The attention op reads the metadata and caches from the context (as the target's does).
        with forward_context(meta, self.kv_caches, self.attn_backend):
            return self.compiled.run_compiled(input_ids, positions, self.kv_caches, meta)

    def propose(self, batch: InputBatch, tables: BlockTables, out_draft: torch.Tensor,
                out_num_draft: torch.Tensor) -> None:
        """out_draft [R, k] int32 (0 past each entry's count), out_num_draft [R] int32."""
        model = self.model
        assert model is not None, "load_model() before running a step"
        # 1. Catch up: the draft model's KV for this step's tokens (its hidden states are not needed).
        self._forward(batch.input_ids, batch.positions, batch.attn_metadata)
        # 2. k one-token passes behind each entry's new token.
        R, k, bs = batch.num_reqs_padded, self.k, self.block_size
        r = self.requests
        rows = batch.idx_mapping.long()  # [R]
        qlen = batch.query_start_loc[1:] - batch.query_start_loc[:-1]  # [R]
        produced = (qlen > 0) & (batch.seq_lens >= r.prefill_len[rows])  # [R]
        start = r.num_computed_tokens[rows].long()  # [R]: P, the position of the new token
        held = tables.num_blocks_dev[rows].long() * bs  # [R]: positions with a KV slot
        max_model_len = r.all_token_ids.shape[1]
        room = torch.minimum(held - start, max_model_len - 1 - start)  # [R]
        num = torch.where(produced, room.clamp(0, k), 0)  # [R]
        out_num_draft.copy_(num)
        token = r.last_sampled[rows]  # [R] int32: the new token
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: R + 1], seq_lens=self.seq_lens[:R], block_table=batch.block_table,
            slot_mapping=self.slot_mapping[:R], num_reqs=R, num_tokens=R, max_query_len=1,
            max_seq_len=max_model_len,  # a static upper bound: one graph serves every step
        )
        max_blocks = batch.block_table.shape[1]
        for i in range(k):
            active = num > i  # [R]
            pos = start + i  # [R]
            block = batch.block_table.gather(1, (pos // bs).clamp(0, max_blocks - 1)[:, None])[:, 0].long()
            self.positions[:R].copy_(torch.where(active, pos, 0))
            self.seq_lens[:R].copy_(torch.where(active, pos + 1, 1))
            self.slot_mapping[:R].copy_(torch.where(active, block * bs + pos % bs, -1))
            self.input_ids[:R].copy_(torch.where(active, token, 0))
            hidden = self._forward(self.input_ids[:R], self.positions[:R], meta)  # [R, H]
            token = model.compute_logits(hidden).argmax(dim=-1).to(torch.int32)  # type: ignore[operator]  # [R]
            out_draft[:, i].copy_(torch.where(active, token, 0))


__all__ = ["DraftModelDrafter"]
