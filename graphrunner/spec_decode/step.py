"""SpeculativeStep: the speculative parts of a step, inside the step body (and its graph).

    prepare (drafts into the history, k + 1 logits rows per entry)
    -> forward -> verify (target logits at k + 1 positions, rejection sampling, logprobs)
    -> post-update (advance by accepted + 1) -> propose (the drafter, for the next step)

All of it runs in `StepBody.run`, so a FULL graph of a verifying step holds the
verification and the drafter's proposal too: one launch per step. Every entry of the
batch goes through the same k + 1 slots (a prefill chunk or plain decode has no verified
drafts: its slot 0 is the plain sample), so shapes are static per descriptor.

Host side (`VerifyRecord`): the host mirror of num_computed_tokens advances by the
scheduled q at launch; when the step's output reaches the host, each verifying entry
gives back its rejected slots (`RequestState.settle_rejected`). A scheduler follows the
same rule (`docs/speculative_decoding.md`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphrunner.config import LoadConfig, ModelConfig, SpeculativeConfig, kv_cache_dtype
from graphrunner.distributed.groups import ParallelGroups
from graphrunner.kv_shape import KVCacheShape
from graphrunner.limits import StepLimits
from graphrunner.models.loader import load_model, load_model_config
from graphrunner.sample.logprobs import compute_logprobs
from graphrunner.sample.sampler import Sampler
from graphrunner.spec_decode.draft_model import DraftModelDrafter
from graphrunner.spec_decode.eagle import EagleDrafter
from graphrunner.spec_decode.ngram import propose_ngram
from graphrunner.spec_decode.rejection import rejection_sample
from graphrunner.spec_decode.verify import prepare_verify
from graphrunner.state.block_tables import BlockTables
from graphrunner.state.requests import RequestState
from graphrunner.step.inputs import InputBatch


@dataclass
class SpecBuffers:
    """Per batch entry, persistent (graphs write them in place), k + 1 slots per entry."""

    logits_indices: torch.Tensor  # [max_reqs, k + 1] int64
    verify_num_draft: torch.Tensor  # [max_reqs] int32: draft slots verified
    sample_positions: torch.Tensor  # [max_reqs] int64: position sampled by slot 0
    num_rejected: torch.Tensor  # [max_reqs] int32: slots given back (post-update)
    tokens: torch.Tensor  # [max_reqs, k + 1] int32: emitted tokens, -1 after them
    num_accepted: torch.Tensor  # [max_reqs] int32
    proposed: torch.Tensor  # [max_reqs, k] int32: the drafter's proposals for the next step
    num_proposed: torch.Tensor  # [max_reqs] int32
    pp_wire: torch.Tensor  # [max_reqs, 2k + 4] int32: what the last PP stage broadcasts (pp_payload)
    # EAGLE-3: the target's feature layers' inputs [max_tokens, n * hidden], one slot per layer id of the
    # head (fc order), written by the target's forward (under PP each stage its own, then sent on).
    aux_hidden: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_num_reqs: int, k: int, device: torch.device) -> SpecBuffers:
        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        return cls(
            logits_indices=torch.zeros(max_num_reqs, k + 1, dtype=torch.int64, device=device),
            verify_num_draft=i32(max_num_reqs), sample_positions=torch.zeros(max_num_reqs, dtype=torch.int64,
                                                                             device=device),
            num_rejected=i32(max_num_reqs), tokens=i32(max_num_reqs, k + 1), num_accepted=i32(max_num_reqs),
            proposed=i32(max_num_reqs, k), num_proposed=i32(max_num_reqs), pp_wire=i32(max_num_reqs, 2 * k + 4),
        )


@dataclass
class VerifyRecord:
    """The verifying entries of a launched step, for settling the host mirrors later."""

    entries: np.ndarray  # [n] batch entries that verify
    rows: np.ndarray  # [n] their state rows
    admissions: np.ndarray  # [n] RequestState.admission_np of those rows at launch
    slots: np.ndarray  # [n] draft slots scheduled (q - 1)

    @classmethod
    def of(cls, batch: InputBatch, requests: RequestState) -> VerifyRecord | None:
        """Call before the host mirrors advance. None when no entry verifies."""
        idx, q = batch.idx_mapping_np, batch.query_lens_np
        verify = (q > 1) & (requests.num_computed_np[idx] >= requests.prefill_len_np[idx])
        if not verify.any():
            return None
        entries = np.flatnonzero(verify)
        rows = idx[entries].astype(np.int64)
        return cls(entries, rows, requests.admission_np[rows].copy(), q[entries].astype(np.int64) - 1)

    def settle(self, num_accepted: np.ndarray, requests: RequestState) -> None:
        """num_accepted: [R] host copy of the step's accepted counts."""
        requests.settle_rejected(self.rows, self.admissions, self.slots - num_accepted[self.entries])


class SpeculativeStep:
    """Verification and drafting of a step with `num_speculative_tokens` = k > 0."""

    def __init__(self, config: SpeculativeConfig, requests: RequestState, sampler: Sampler,
                 limits: StepLimits, device: torch.device, target_config: ModelConfig | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.requests = requests
        self.sampler = sampler
        self.synthetic_rate = (config.synthetic_acceptance_rate
                               if config.rejection_sample_method == "synthetic" else None)
        self.buffers = SpecBuffers.allocate(limits.max_num_reqs, self.k, device)
        self.tables: BlockTables | None = None  # with the KV cache (the draft model writes KV)
        # False: `propose` does nothing (graphrunner inspect captures a step without the drafter
        # to attribute its nodes); a host-side switch, read when a step runs or is captured.
        self.drafting = True
        self.limits = limits
        self.target_config = target_config
        self._aux_local: tuple[int, ...] = ()  # EAGLE-3: the feature layers this stage's target returns
        self.drafter: DraftModelDrafter | EagleDrafter | None = None
        self.cache_dtype = "auto"  # CacheConfig.cache_dtype: the draft KV is stored like the target's (runner)
        if config.method in ("eagle", "eagle3"):
            from graphrunner.models.eagle import load_head_config

            assert config.model is not None and target_config is not None  # SpeculativeConfig; the runner
            head = load_head_config(config.model, config.method)
            head.check_target(target_config)  # ValueError naming both values
            self.drafter = EagleDrafter(head, head.aux_layers_for(target_config), self.k, limits.max_num_reqs,
                                        limits.max_num_tokens, requests, limits.block_size, device)
        elif config.method == "draft_model":
            assert config.model is not None  # SpeculativeConfig checks it
            draft_config = load_model_config(config.model)
            config.check_draft_vocab(limits.vocab_size, draft_config.vocab_size)
            self.drafter = DraftModelDrafter(draft_config, self.k, limits.max_num_reqs, requests, limits.block_size,
                                             device)

    # ---- the draft model's set-up (no-ops for the n-gram drafter) ----------------------------
    def load_draft_model(self, target_load: LoadConfig, attn_backend: Any, dtype: torch.dtype,
                         device: torch.device, target: Any = None) -> None:
        """Build and fill the draft model or head (dummy weights when the target's are dummy);
        an EAGLE head also takes the target (its embedding, LM head and feature layers)."""
        if self.drafter is None:
            return
        assert self.config.model is not None
        seed = self.config.draft_seed if self.config.draft_seed is not None else target_load.seed
        if isinstance(self.drafter, EagleDrafter):
            self._load_head(self.drafter, target_load, target, seed, attn_backend, dtype, device)
            return
        load = LoadConfig(model=self.config.model, load_format=target_load.load_format, seed=seed)
        self.drafter.model = load_model(self.drafter.model_config, load, attn_backend=attn_backend, dtype=dtype,
                                        device=device)
        self.drafter.attn_backend = attn_backend

    def _load_head(self, drafter: EagleDrafter, target_load: LoadConfig, target: Any, seed: int, attn_backend: Any,
                   dtype: torch.dtype, device: torch.device) -> None:
        from graphrunner.models.eagle import build_head

        assert target is not None, "an EAGLE head needs the target model"
        assert self.config.model is not None and self.target_config is not None
        drafter.model = build_head(drafter.head_config, self.config.model, target, self.target_config, target_load,
                                   seed, len(drafter.aux_layers), attn_backend, dtype, device)
        drafter.attn_backend = attn_backend
        if drafter.aux_layers:  # EAGLE-3: the target writes its feature layers' inputs every step
            target.set_aux_hidden_state_layers(drafter.aux_layers)
            n, h = len(drafter.aux_layers), self.target_config.hidden_size
            self.buffers.aux_hidden = torch.zeros(self.limits.max_num_tokens, n * h, dtype=dtype, device=device)
            drafter.aux_hidden = self.buffers.aux_hidden
            self._aux_local = target.model.local_aux_layers

    def take_features(self, out: Any, num_tokens_padded: int, is_last_stage: bool) -> Any:
        """After the target's forward: what an EAGLE head drafts from. EAGLE keeps (a reference to)
        the final hidden states; EAGLE-3 copies the feature layers' inputs out of the forward's output
        into their slots of `aux_hidden` (a layer id the head reads twice fills two) and returns the
        output without them. Identity for the other drafters."""
        drafter = self.drafter
        if not isinstance(drafter, EagleDrafter):
            return out
        aux_buf = self.buffers.aux_hidden
        if aux_buf is not None:
            assert self.target_config is not None
            n_main = 1 if is_last_stage else 2
            h = self.target_config.hidden_size
            for layer_id, value in zip(self._aux_local, out[n_main:], strict=True):
                for slot, wanted in enumerate(drafter.aux_layers):
                    if wanted == layer_id:
                        aux_buf[:num_tokens_padded, slot * h : (slot + 1) * h].copy_(value)
            out = out[0] if is_last_stage else out[:2]
        if is_last_stage:
            drafter.target_hidden = out
        return out

    def setup_compiled(self, enabled: bool, compile_backend: str, device: torch.device) -> None:
        """With the target's: the draft model compiled under graph modes, plain in eager mode."""
        if self.drafter is not None:
            self.drafter.setup_compiled(enabled, compile_backend, device)

    def _draft_kv_shape(self, block_size: int) -> KVCacheShape | None:
        """The draft model's KV per block (the same blocks as the target's), or None."""
        if self.drafter is None or self.drafter.model is None:
            return None
        m = self.drafter.model_config
        dtype = kv_cache_dtype(self.cache_dtype, next(self.drafter.model.parameters()).dtype)
        return KVCacheShape(m.num_hidden_layers, block_size, m.num_key_value_heads, m.head_dim, dtype)

    def draft_block_bytes(self, block_size: int) -> int:
        """What one KV block costs the draft model (0 without one)."""
        shape = self._draft_kv_shape(block_size)
        return shape.block_bytes if shape is not None else 0

    def attach_kv_cache(self, tables: BlockTables, num_blocks: int) -> list[torch.Tensor]:
        """With the target's KV cache: the block tables, and the draft model's own caches."""
        self.tables = tables
        shape = self._draft_kv_shape(tables.block_size)
        if self.drafter is None or shape is None:
            return []
        self.drafter.kv_caches = shape.allocate(num_blocks, tables.device)
        return self.drafter.kv_caches

    @property
    def slots(self) -> int:
        """Logits rows per batch entry (k + 1)."""
        return self.k + 1

    def prepare(self, batch: InputBatch) -> None:
        """Before `prepare_input_ids`: drafts into the history, logits indices, counts."""
        r, b, R = self.requests, self.buffers, batch.num_reqs_padded
        assert r.draft_token_ids is not None and r.num_draft is not None
        prepare_verify(batch.idx_mapping, batch.query_start_loc, r.num_computed_tokens, r.prefill_len,
                       r.draft_token_ids, r.num_draft, r.all_token_ids, b.logits_indices[:R],
                       b.verify_num_draft[:R], b.sample_positions[:R], b.num_rejected[:R],
                       synthetic=self.synthetic_rate is not None)

    def sample(self, hidden: torch.Tensor, batch: InputBatch, compute_logits,
               logprob_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Target logits at k + 1 positions per entry, rejection sampling, logprobs.

        Leaves each entry's last emitted token in `batch.sampled` and its rejected slots in
        `num_rejected`, which is what post-update consumes. Slot j of an entry applies the row's
        grammar mask j (structured outputs: the grammar after its drafts 0..j-1)."""
        b, R, S = self.buffers, batch.num_reqs_padded, self.slots
        features = batch.sampling_features
        logits = compute_logits(hidden[b.logits_indices[:R].view(-1)])  # [R * S, V] float32
        slot = torch.arange(S, device=logits.device)  # [S]
        positions = (b.sample_positions[:R, None] + slot).view(-1)  # [R * S]
        slots = slot.repeat(R)  # [R * S]: slot j reads the grammar mask after drafts 0..j-1
        target = self.sampler.target_logits(logits, batch.idx_mapping.repeat_interleave(S), positions, features,
                                            slots)

        rows = batch.idx_mapping.long()  # [R]
        states = self.sampler.states
        draft_ids = self.requests.draft_token_ids
        assert draft_ids is not None
        rejection_sample(
            target.view(R, S, -1), draft_ids[rows], b.verify_num_draft[:R], None, states.temperature[rows],
            states.seed[rows], b.sample_positions[:R], b.tokens[:R], b.num_accepted[:R],
            all_greedy=not features.any_random, synthetic_acceptance_rate=self.synthetic_rate,
        )
        accepted = b.num_accepted[:R]
        batch.sampled.copy_(b.tokens[:R].gather(1, accepted.long()[:, None])[:, 0])
        b.num_rejected[:R].sub_(accepted)  # verifying entries: (q - 1) - accepted; others 0 - 0
        if features.wants_logprobs:
            values, ids, ranks = logprob_out
            n = R * S
            compute_logprobs(logits, b.tokens[:R].view(-1).clamp(min=0), features.num_logprobs, values[:n],
                             ids[:n], ranks[:n])

    def propose(self, batch: InputBatch) -> None:
        """After post-update: the drafter proposes k tokens behind each entry's new token."""
        if not self.drafting:
            return
        r, b, R = self.requests, self.buffers, batch.num_reqs_padded
        assert r.draft_token_ids is not None and r.num_draft is not None
        rows = batch.idx_mapping.long()
        if isinstance(self.drafter, EagleDrafter):
            assert self.tables is not None, "initialize_kv_cache() before running a step"
            self.drafter.propose(batch, self.tables, b.logits_indices[:R], b.num_accepted[:R], b.proposed[:R],
                                 b.num_proposed[:R])
        elif self.drafter is not None:
            assert self.tables is not None, "initialize_kv_cache() before running a step"
            self.drafter.propose(batch, self.tables, b.proposed[:R], b.num_proposed[:R])
        else:
            qlen = batch.query_start_loc[1:] - batch.query_start_loc[:-1]  # [R]
            produced = (qlen > 0) & (batch.seq_lens >= r.prefill_len[rows])  # [R]
            history = torch.where(produced, r.num_computed_tokens[rows] + 1, 0)  # [R] int32: incl. the new token
            cfg = self.config
            propose_ngram(r.all_token_ids, batch.idx_mapping, history, self.k, cfg.prompt_lookup_min,
                          cfg.prompt_lookup_max, b.proposed[:R], b.num_proposed[:R])
        # Padded entries (scratch row) all propose nothing: identical duplicate writes.
        r.draft_token_ids[rows] = b.proposed[:R]
        r.num_draft[rows] = b.num_proposed[:R]


    # ---- pipeline parallelism: the last stage's outcome goes to the other stages ----------------
    @property
    def pp_width(self) -> int:
        """int32 values per entry in the PP broadcast: k + 1 tokens, 3 counts, k drafts."""
        return 2 * self.k + 4

    def pp_payload(self, batch: InputBatch) -> torch.Tensor:
        """Last stage, after the step: [R_pad, 2k + 4] int32 = [tokens (k + 1) | accepted |
        rejected | proposed count | proposed (k)] per entry (a persistent buffer)."""
        b, R, S = self.buffers, batch.num_reqs_padded, self.slots
        wire = b.pp_wire[:R]
        wire[:, :S].copy_(b.tokens[:R])
        wire[:, S].copy_(b.num_accepted[:R])
        wire[:, S + 1].copy_(b.num_rejected[:R])
        wire[:, S + 2].copy_(b.num_proposed[:R])
        wire[:, S + 3 :].copy_(b.proposed[:R])
        return wire

    def pp_apply(self, batch: InputBatch, index: torch.Tensor, payload: torch.Tensor) -> None:
        """Other stages, before their post-update: entries `index` [n] get the last stage's
        payload [n, 2k + 4] (their emitted tokens, counts and the drafts of their rows)."""
        b, S = self.buffers, self.slots
        r = self.requests
        assert r.draft_token_ids is not None and r.num_draft is not None
        p = payload.to(device=b.tokens.device, dtype=torch.int32)
        b.tokens.index_copy_(0, index, p[:, :S])
        b.num_accepted.index_copy_(0, index, p[:, S])
        b.num_rejected.index_copy_(0, index, p[:, S + 1])
        b.num_proposed.index_copy_(0, index, p[:, S + 2])
        b.proposed.index_copy_(0, index, p[:, S + 3 :])
        batch.sampled.index_copy_(0, index, p[:, :S].gather(1, p[:, S].long()[:, None])[:, 0])  # the last emitted
        rows = batch.idx_mapping.long()[index]
        r.draft_token_ids[rows] = p[:, S + 3 :]
        r.num_draft[rows] = p[:, S + 2]


def make_speculative_step(config: SpeculativeConfig, requests: RequestState, sampler: Sampler, limits: StepLimits,
                          groups: ParallelGroups, device: torch.device,
                          target_config: ModelConfig | None = None) -> SpeculativeStep | None:
    """The runner's speculative step, or None with num_speculative_tokens = 0. `target_config`: the
    target's (an EAGLE head must fit it)."""
    if config.num_speculative_tokens == 0:
        return None
    # Under PP the last stage verifies and drafts; the others get its outcome (pp_payload).
    return SpeculativeStep(config, requests, sampler, limits, device, target_config)


__all__ = ["SpecBuffers", "SpeculativeStep", "VerifyRecord", "make_speculative_step"]
