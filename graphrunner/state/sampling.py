"""Per-request sampling state: persistent per-row device tensors plus host mirrors.

Every setting of a request lives in a row of a persistent tensor, written once at
admission through staged writes (one scatter per tensor per step, addresses never
change, so captured graphs stay valid). A step gathers the rows of its batch through
`idx_mapping`. The host keeps numpy mirrors of what decides code paths, so that
`features(rows)` picks a (static, per graph) pipeline without reading the device.

Sparse per-request settings and how they are stored (rows ~ 257, V ~ 152k):
- logit_bias: fixed per-row slots `[rows, max_logit_bias]` of (id, bias). OpenAI caps
  logit_bias at 300 entries; 257 x 300 x 12 B is under 1 MiB, and applying it is one
  scatter_add of `[R, max_logit_bias]` per step. Unused slots hold (0, +0.0): adding
  zero is exact, so they are neutral without a validity mask.
- allowed_token_ids: a packed bitmask `[rows, ceil(V / 32)]` int32 (4.9 MB at 257 x
  152k), not slots: allowed lists can be long (constrained decoding uses thousands of
  ids), a bitmask has no per-request cap and costs one [R, V] unpack per step. A dense
  bool [rows, V] mask would be 8x larger (39 MB); a pool of [V] masks would need slot
  management for no gain at this size.
- min_tokens stop ids: slots `[rows, max_stop_ids]` (stop_token_ids + EOS). Unused
  slots repeat the first real id, so every slot of a row masks a real id (duplicates
  are harmless, see `processors.apply_min_tokens`).
- penalty counts: one persistent `[rows, V]` int16 (int32 past max_model_len 32768: rows x V x
  2 bytes, 78 MB at 257 x 152k), a prompt flag and the output count packed (state/counts.py),
  allocated only where penalties can be served (`all_token_ids` and `vocab_size` given). Kept
  current instead of rebuilt from the history every step: a request admitted with penalties
  flags its row stale (`counts_stale`), the step body rebuilds stale rows of its batch from
  the history known at admission before sampling (`fused_process.refresh_counts`, inside
  the step and its graph: the history is only on the device once the staging committed, and
  a kernel that returns at once for current rows costs nothing on steps without
  admissions), and the post-update adds 1 per token it appends (accepted drafts + bonus).
  A caller that drives the Sampler without a step body (tests, benchmarks) leaves rows
  stale: the Sampler then counts them from the history up to the sampled position.
- grammar masks (structured outputs): `[rows, S, ceil(V / 32)]` int32, rewritten before each
  step that has constrained rows (`write_grammar`), one mask per sampled slot: S = 1 + k
  with speculative decoding (slot j samples after the entry's drafts 0..j-1), else 1.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from graphrunner.protocol import SamplingParams
from graphrunner.state.counts import allocate_counts
from graphrunner.state.features import (
    DEFAULT_MAX_LOGPROBS,
    NO_LOGPROBS,
    SamplingFeatures,
    round_logprobs,
)
from graphrunner.state.grammar_masks import place_grammar
from graphrunner.state.grammar_staging import GrammarStaging
from graphrunner.state.staging import StagedWrites
from graphrunner.structured_outputs import GrammarOutput

DEFAULT_MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
DEFAULT_MAX_STOP_IDS = 16  # stop_token_ids + EOS ids masked by min_tokens

def default_seed(base_seed: int, req_id: str) -> int:
    """Seed of a request that gave none: stable across preemption and re-admission."""
    digest = hashlib.blake2b(f"{base_seed}:{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SamplingStates:
    """Per-row sampling settings on the device, with host mirrors for feature flags.

    Args:
        num_rows: request rows (max_num_reqs + 1 scratch row; rows default to neutral
            greedy settings, so padded entries pointing at the scratch row are harmless).
        vocab_size: needed for the allowed-ids bitmask; without it allowed_token_ids
            are rejected by `validate`.
        all_token_ids: the request-state token history `[rows, L]` int32
            (RequestState.all_token_ids) the penalties read; without it requests with
            penalties are rejected by `validate`. The Sampler reads it from here.
        max_logit_bias / max_stop_ids / max_logprobs: per-request limits (slot counts).
        grammar_slots: sampled positions per batch entry, each with its own grammar mask
            (1 + num_speculative_tokens; 1 without speculation).
    """

    def __init__(
        self,
        num_rows: int,
        device: torch.device,
        base_seed: int = 0,
        *,
        vocab_size: int | None = None,
        all_token_ids: torch.Tensor | None = None,
        max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS,
        max_stop_ids: int = DEFAULT_MAX_STOP_IDS,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        staging: StagedWrites | None = None,
        grammar_slots: int = 1,
    ):
        device = torch.device(device)
        if all_token_ids is not None and (all_token_ids.dim() != 2 or all_token_ids.shape[0] != num_rows):
            raise ValueError(
                f"all_token_ids has shape {tuple(all_token_ids.shape)}, expected [{num_rows}, max_model_len]"
            )
        self.num_rows = num_rows
        self.device = device
        self.staging = staging if staging is not None else StagedWrites(device)
        self.base_seed = base_seed
        self.vocab_size = vocab_size
        self.all_token_ids = all_token_ids  # [rows, L] int32, owned by RequestState
        self.max_logit_bias = max_logit_bias
        self.max_stop_ids = max_stop_ids
        self.max_logprobs = max_logprobs
        self.grammar_slots = grammar_slots
        self._allocate_rows(num_rows, device)
        self._allocate_counts(num_rows, device)
        self._allocate_mirrors(num_rows)
        # Per-row scalar settings, staged by name at admission.
        self._scalars = {
            name: getattr(self, name)
            for name in ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "frequency_penalty",
                         "presence_penalty", "prompt_len", "min_tokens", "use_allowed", "use_grammar")
        }

    def _allocate_rows(self, num_rows: int, device: torch.device) -> None:
        """The device rows, at neutral greedy settings (what padded entries read)."""

        def full(value, dtype):
            return torch.full((num_rows,), value, dtype=dtype, device=device)

        f32, i32 = torch.float32, torch.int32
        self.temperature = full(0.0, f32)  # [rows], 0 = greedy
        self.top_k = full(0, i32)  # [rows], 0 = off
        self.top_p = full(1.0, f32)  # [rows], 1 = off
        self.min_p = full(0.0, f32)  # [rows], 0 = off
        self.seed = full(0, torch.int64)  # [rows]
        self.repetition_penalty = full(1.0, f32)  # [rows], 1 = off
        self.frequency_penalty = full(0.0, f32)  # [rows], 0 = off
        self.presence_penalty = full(0.0, f32)  # [rows], 0 = off
        # The ORIGINAL prompt length: a resumed request's earlier outputs are output
        # tokens for penalties and min_tokens, although they are re-prefilled.
        self.prompt_len = full(0, i32)  # [rows]
        self.min_tokens = full(0, i32)  # [rows], 0 = off
        self.use_allowed = full(False, torch.bool)  # [rows]
        self.use_grammar = full(False, torch.bool)  # [rows]: structured outputs (the step's grammar mask row)
        self.bias_ids = torch.zeros(num_rows, self.max_logit_bias, dtype=torch.int64, device=device)  # [rows, B]
        self.bias_values = torch.zeros(num_rows, self.max_logit_bias, dtype=f32, device=device)  # [rows, B]
        self.stop_ids = torch.zeros(num_rows, self.max_stop_ids, dtype=torch.int64, device=device)  # [rows, S]
        words = -(-self.vocab_size // 32) if self.vocab_size is not None else 0
        # [rows, ceil(V/32)]: bit (v % 32) of word v // 32 set = token v allowed.
        self.allowed_mask = torch.zeros(num_rows, words, dtype=i32, device=device) if words else None
        # [rows, S, ceil(V/32)]: the step's grammar mask of each structured-output row, per sampled slot
        # (`write_grammar`).
        self.grammar_mask = (torch.zeros(num_rows, self.grammar_slots, words, dtype=i32, device=device)
                             if words else None)
        # Host blocks the engine fills with a step's masks, uploaded with their placement in one copy.
        self.grammar_staging = GrammarStaging(device, words) if words else None

    def _allocate_counts(self, num_rows: int, device: torch.device) -> None:
        """Penalty counts and the processed-logits buffer (see the module docstring)."""
        self.counts: torch.Tensor | None = None  # [rows, V] int16 | int32, packed (state/counts.py)
        self.counts_stale = torch.zeros(num_rows, dtype=torch.bool, device=device)  # [rows]
        if self.all_token_ids is not None and self.vocab_size is not None:
            self.counts = allocate_counts(num_rows, self.vocab_size, self.all_token_ids.shape[1], device)
        # [rows * grammar_slots, V] float32: where the fused processing kernel writes (outside any
        # graph pool). Allocated up front on CUDA, where graphs are captured; elsewhere on first use.
        self._processed: torch.Tensor | None = None
        if device.type == "cuda" and self.vocab_size is not None:
            self.processed_logits(num_rows * self.grammar_slots, self.vocab_size)

    def processed_logits(self, num: int, vocab_size: int) -> torch.Tensor:  # [num, V] float32 view
        """The persistent buffer of the fused processors' output, first `num` rows."""
        buf = self._processed
        if buf is None or buf.shape[0] < num or buf.shape[1] != vocab_size:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"processed-logits buffer for {num} x {vocab_size} must exist before graph "
                                   f"capture (have {None if buf is None else tuple(buf.shape)})")
            rows = max(num, self.num_rows * self.grammar_slots)
            buf = self._processed = torch.empty(rows, vocab_size, dtype=torch.float32, device=self.device)
        return buf[:num]

    def _allocate_mirrors(self, num_rows: int) -> None:
        """Host mirrors of what decides a batch's code paths (`features`)."""
        self.random_np = np.zeros(num_rows, dtype=bool)
        self.top_k_np = np.zeros(num_rows, dtype=np.int64)
        self.top_p_np = np.ones(num_rows, dtype=np.float64)
        self.min_p_np = np.zeros(num_rows, dtype=np.float64)
        self.penalties_np = np.zeros(num_rows, dtype=bool)
        self.bias_np = np.zeros(num_rows, dtype=bool)  # logit_bias, allowed_token_ids or a grammar
        self.grammar_np = np.zeros(num_rows, dtype=bool)  # structured outputs
        self.logit_bias_np = np.zeros(num_rows, dtype=bool)  # logit_bias itself (no token mask)
        self.min_tokens_np = np.zeros(num_rows, dtype=bool)
        self.logprobs_np = np.full(num_rows, NO_LOGPROBS, dtype=np.int64)

    # ---- validation ---------------------------------------------------------------
    def validate(
        self, params: SamplingParams, vocab_size: int, eos_ids: tuple[int, ...] = (), prompt_len: int | None = None
    ) -> None:
        """Raise ValueError if this runner cannot serve `params`; changes nothing."""

        def check_ids(name: str, ids) -> None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} contains token id {bad[0]} outside the vocabulary [0, {vocab_size})")

        if params.logit_bias:
            check_ids("logit_bias", params.logit_bias)
            if len(params.logit_bias) > self.max_logit_bias:
                raise ValueError(
                    f"logit_bias has {len(params.logit_bias)} entries, more than max_logit_bias={self.max_logit_bias}"
                )
        if params.allowed_token_ids is not None:
            check_ids("allowed_token_ids", params.allowed_token_ids)
        for seq in params.bad_words_token_ids:
            check_ids("bad_words_token_ids", seq)
        if params.allowed_token_ids is not None or _takes_masks(params):
            if self.allowed_mask is None:
                raise ValueError(
                    "allowed_token_ids, structured_outputs and bad_words_token_ids need "
                    "SamplingStates(vocab_size=...); this runner was built without it"
                )
            if self.vocab_size != vocab_size:
                raise ValueError(f"vocab_size={vocab_size} differs from SamplingStates.vocab_size={self.vocab_size}")
        if params.stop_token_ids:
            check_ids("stop_token_ids", params.stop_token_ids)
        if params.min_tokens > 0:
            masked = self._min_tokens_ids(params, eos_ids)
            if len(masked) > self.max_stop_ids:
                raise ValueError(
                    f"min_tokens masks {len(masked)} stop/EOS ids, more than max_stop_ids={self.max_stop_ids}")
            # Every allowed id masked would leave a row of -inf, whose draw is no allowed token.
            if params.allowed_token_ids is not None and set(masked).issuperset(params.allowed_token_ids):
                raise ValueError(
                    f"allowed_token_ids={list(params.allowed_token_ids)} are all stop or EOS ids, which "
                    f"min_tokens={params.min_tokens} masks: no allowed token could be sampled")
        if (params.min_tokens > 0 or params.uses_penalties) and prompt_len is None:
            raise ValueError("min_tokens and penalties need the request's original prompt_len")
        if params.uses_penalties and self.all_token_ids is None:
            raise ValueError("penalties need SamplingStates(all_token_ids=...); this runner was built without it")
        if params.uses_penalties and self.counts is None:
            raise ValueError("penalties need SamplingStates(vocab_size=...) for their counts; this runner was built "
                             "without it")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name}={k} exceeds max_logprobs={self.max_logprobs}")
            if k is not None and k > vocab_size:
                raise ValueError(f"{name}={k} exceeds the vocabulary size {vocab_size}")

    @staticmethod
    def _min_tokens_ids(params: SamplingParams, eos_ids: tuple[int, ...]) -> list[int]:
        """Ids masked until min_tokens: stop ids, plus EOS unless ignore_eos (vLLM)."""
        ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))
        return list(dict.fromkeys(ids))

    # ---- admission ----------------------------------------------------------------
    def add_request(
        self,
        row: int,
        req_id: str,
        params: SamplingParams,
        vocab_size: int,
        prompt_len: int | None = None,
        eos_ids: tuple[int, ...] = (),
    ) -> None:
        """Stage `params` into `row` (applied by `apply_staged_writes`).

        `prompt_len` is the ORIGINAL prompt length (not counting a resumed request's
        earlier outputs); `eos_ids` are the model's EOS ids, masked by min_tokens.
        Validates first: a ValueError leaves every row and mirror unchanged.
        """
        self.validate(params, vocab_size, eos_ids, prompt_len)
        seed = params.seed if params.seed is not None else default_seed(self.base_seed, req_id)
        top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        random = not params.is_greedy

        stop = self._min_tokens_ids(params, eos_ids) if params.min_tokens > 0 else []
        min_tokens = params.min_tokens if stop else 0  # nothing to mask: min_tokens is moot
        use_allowed = params.allowed_token_ids is not None
        use_grammar = _takes_masks(params)

        self.random_np[row] = random
        self.grammar_np[row] = use_grammar
        self.logit_bias_np[row] = bool(params.logit_bias)
        self.top_k_np[row] = top_k
        self.top_p_np[row] = params.top_p
        self.min_p_np[row] = params.min_p
        self.penalties_np[row] = params.uses_penalties
        self.bias_np[row] = bool(params.logit_bias) or use_allowed or use_grammar
        self.min_tokens_np[row] = min_tokens > 0
        self.logprobs_np[row] = NO_LOGPROBS if params.logprobs is None else params.logprobs
        scalars = dict(
            # A greedy row holds 0: the sampler's greedy test (temperature == 0) covers T < 1e-5 too.
            temperature=params.temperature if random else 0.0, top_k=top_k, top_p=params.top_p, min_p=params.min_p,
            seed=seed,
            repetition_penalty=params.repetition_penalty, frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty, prompt_len=prompt_len or 0, min_tokens=min_tokens,
            use_allowed=use_allowed, use_grammar=use_grammar,
        )
        for name, value in scalars.items():
            self.staging.stage(self._scalars[name], row, value)
        # Its counts are rebuilt from the history inside the row's first step (module docstring).
        self.staging.stage(self.counts_stale, row, params.uses_penalties and self.counts is not None)
        self._stage_slots(row, params, stop)

    def _stage_slots(self, row: int, params: SamplingParams, stop: list[int]) -> None:
        """Stage the row's fixed-size slots: logit bias, min_tokens stop ids, allowed-ids bitmask."""
        staging = self.staging
        bias_ids = np.zeros(self.max_logit_bias, dtype=np.int64)
        bias_values = np.zeros(self.max_logit_bias, dtype=np.float32)
        if params.logit_bias:
            n = len(params.logit_bias)
            bias_ids[:n] = list(params.logit_bias.keys())
            bias_values[:n] = list(params.logit_bias.values())
        stop_ids = np.full(self.max_stop_ids, stop[0] if stop else 0, dtype=np.int64)
        stop_ids[: len(stop)] = stop
        staging.stage_row(self.bias_ids, row, bias_ids)
        staging.stage_row(self.bias_values, row, bias_values)
        staging.stage_row(self.stop_ids, row, stop_ids)
        if params.allowed_token_ids is not None:
            assert self.allowed_mask is not None  # validate() refuses allowed ids without the bitmask
            bits = np.zeros(self.allowed_mask.shape[1] * 32, dtype=bool)
            bits[list(params.allowed_token_ids)] = True
            words = np.packbits(bits, bitorder="little").view("<u4").view(np.int32)
            staging.stage_row(self.allowed_mask, row, words)

    def write_grammar(self, rows: np.ndarray, req_ids: list[str], grammar: GrammarOutput | None,
                      num_drafts: np.ndarray | None = None) -> None:
        """Before a step that has structured-output rows samples: each such row's masks from `grammar`.

        rows: [R] the batch's state rows, req_ids: its request ids, num_drafts: [R] the draft slots
        each entry verifies (None: none). vLLM's layout: a listed request takes 1 + its drafts
        consecutive bitmask rows, row j for slot j (an id not in the step takes one row, unused).
        Slots past them, and rows of requests `grammar` does not list, allow every token. Runs on
        the current stream, outside graphs. ValueError, with nothing written, on a bad layout."""
        # validate() refuses structured outputs without the bitmask
        assert self.grammar_mask is not None and self.grammar_staging is not None
        width = 1 + (np.zeros(len(req_ids), dtype=np.int64) if num_drafts is None else np.asarray(num_drafts))
        place_grammar(self.grammar_mask, np.asarray(rows), np.flatnonzero(self.grammar_np[rows]), req_ids, grammar,
                      width, self.grammar_staging)

    def grammar_block(self, num_rows: int, words: int) -> torch.Tensor:
        """[num_rows, words] int32 host memory for a step's masks (the engine fills it, the next
        `write_grammar` uploads it without a host copy: `GrammarStaging.block`). Valid until the
        block after next is taken."""
        if self.grammar_staging is None:
            raise ValueError("grammar masks need SamplingStates(vocab_size=...); this runner was built without it")
        return self.grammar_staging.block(num_rows, words)

    def apply_staged_writes(self) -> None:
        """Commit the staging (all of it: with the runner's shared staging, every holder's)."""
        self.staging.commit()

    # ---- features -----------------------------------------------------------------
    def features(self, rows: np.ndarray) -> SamplingFeatures:
        """What the batch with these state rows needs. Greedy rows ignore top-k/top-p/min-p."""
        rows = np.asarray(rows, dtype=np.int64)
        random = self.random_np[rows]
        any_random = bool(random.any())
        k = int(self.logprobs_np[rows].max()) if len(rows) else NO_LOGPROBS
        return SamplingFeatures(
            any_random=any_random,
            any_top_k=any_random and bool((self.top_k_np[rows][random] > 0).any()),
            any_top_p=any_random and bool((self.top_p_np[rows][random] < 1.0).any()),
            any_min_p=any_random and bool((self.min_p_np[rows][random] > 0.0).any()),
            any_penalties=bool(self.penalties_np[rows].any()),
            any_logit_bias=bool(self.bias_np[rows].any()),
            any_min_tokens=bool(self.min_tokens_np[rows].any()),
            num_logprobs=round_logprobs(k, self.max_logprobs),
        )

    def features_after_masks(self, rows: np.ndarray, features: SamplingFeatures | None = None) -> SamplingFeatures:
        """`features` (default: `self.features(rows)`) once the token masks (allowed ids, grammars) are
        applied in place beforehand (step/split.py): the logit-bias stage is needed only for rows with
        a real logit_bias."""
        rows = np.asarray(rows, dtype=np.int64)
        base = self.features(rows) if features is None else features
        return dataclasses.replace(base, any_logit_bias=bool(self.logit_bias_np[rows].any()))

    def masked_features(self, rows: np.ndarray, features: SamplingFeatures) -> SamplingFeatures | None:
        """A step's `features_after_masks`, None when none of its rows has a grammar (the runner's
        per-step check). `features`: the batch's, `self.features(rows)` as planned (the mirrors
        change only at admissions, which plan anew), reused instead of recomputed (~15 us)."""
        # A grammar row implies the logit-bias feature: a cheap gate first.
        if not features.any_logit_bias or not self.grammar_np[rows].any():
            return None
        return self.features_after_masks(rows, features)

    def logprobs_of(self, rows: np.ndarray) -> np.ndarray:
        """The logprob count each row asked for (-1 = none): how many columns to return."""
        return self.logprobs_np[np.asarray(rows, dtype=np.int64)]


def _takes_masks(params: SamplingParams) -> bool:
    """Whether the engine hands the request's next-token mask in every step's GrammarOutput: a grammar, or
    bad words of several tokens (the ban of a word's last token depends on the tokens before it)."""
    return params.structured_outputs is not None or bool(params.bad_words_token_ids)
