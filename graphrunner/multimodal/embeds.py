"""Which request kinds a runner serves, and the persistent `inputs_embeds` its first stage reads.

A request with prompt embeddings (vLLM's `enable_prompt_embeds`) or multimodal inputs takes some of
its prompt's embeddings from elsewhere than the token table. Graphs bake in addresses, so those rows
travel through one persistent buffer (`EmbedBuffers`): before each step, outside the graphs, the
runner copies the rows this batch's tokens take (from the request's prompt embeddings or the encoder
cache) into `inputs_embeds` at the tokens' batch positions and flags them in `is_embed`; inside the
step, `merge` gives every other row its token embedding, in place, and the decoder reads the result.
Padded tokens are never flagged; flags of the last staged step are cleared before the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphrunner.multimodal.cache import EncoderCache
from graphrunner.multimodal.features import MultiModalFeatureSpec
from graphrunner.multimodal.mrope import MRopeBuffers, MRopeInputs, uses_mrope
from graphrunner.protocol import SchedulerOutput
from graphrunner.step.inputs import InputBatch


def check_request_kinds(so: SchedulerOutput, *, pooling: bool, prompt_embeds: bool, multimodal: bool) -> None:
    """ValueError naming the first new request of a kind this runner does not serve: a pooling request
    on a generative runner (or the reverse), prompt embeddings without `enable_prompt_embeds`, or
    multimodal inputs for a text-only model. Changes nothing."""
    for new in so.scheduled_new_reqs:
        if (new.pooling_params is not None) != pooling:
            raise ValueError(
                f"request {new.req_id!r} is a pooling request (pooling_params set) and this runner generates"
                if not pooling else
                f"request {new.req_id!r} has no pooling_params: a pooling runner serves pooling requests only")
        if new.prompt_embeds is not None and not prompt_embeds:
            raise ValueError(f"request {new.req_id!r} carries prompt_embeds but the model was loaded without "
                             "enable_prompt_embeds=True")
        if new.mm_features and not multimodal:
            kinds = sorted({f.modality for f in new.mm_features})
            raise ValueError(f"request {new.req_id!r} carries {len(new.mm_features)} multimodal input(s) {kinds} "
                             "but the model is text-only")


@dataclass
class EmbedBuffers:
    """inputs_embeds: [max_num_tokens, hidden] in the model dtype: rows staged from prompt embeddings and
    encoder outputs, merged in place with the token embeddings inside the step (graphs included);
    is_embed: [max_num_tokens] bool, the staged rows of this step."""

    inputs_embeds: torch.Tensor
    is_embed: torch.Tensor

    @classmethod
    def allocate(cls, max_num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> EmbedBuffers:
        return cls(inputs_embeds=torch.zeros(max_num_tokens, hidden_size, dtype=dtype, device=device),
                   is_embed=torch.zeros(max_num_tokens, dtype=torch.bool, device=device))

    def merge(self, model: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """In the step body: rows not staged this step get their token embedding; returns the [T_pad, hidden]
        view the model reads. Graph-safe (shapes from the padded token count, no host sync)."""
        n = input_ids.shape[0]
        embeds = self.inputs_embeds[:n]
        embeds.copy_(torch.where(self.is_embed[:n].unsqueeze(1), embeds, model.embed_input_ids(input_ids)))
        return embeds


class EmbedInputs:
    """The runner's side of prompt embeddings and multimodal inputs (module docstring).

    Per step, outside the graphs: `validate` (before any state changes), `update` (new requests'
    sources, finished ones dropped, scheduled encoder inputs encoded, freed hashes dropped) and
    `stage` (this batch's rows copied into `inputs_embeds`, flagged in `is_embed`).
    """

    def __init__(self, buffers: EmbedBuffers, model: Any, hidden_size: int, device: torch.device,
                 dtype: torch.dtype, mrope: MRopeInputs | None = None) -> None:
        self.buffers = buffers
        self.mrope = mrope  # M-RoPE models: each prompt's (t, h, w) positions, staged with its embeddings
        self.model = model
        self.hidden_size = hidden_size
        self.device, self.dtype = device, dtype
        self.encoder_cache = EncoderCache()
        self._prompt_embeds: dict[str, torch.Tensor] = {}  # req_id -> [prompt_len, hidden] on the device
        self._features: dict[str, list[MultiModalFeatureSpec]] = {}
        self._flagged = 0  # is_embed[:_flagged] may hold flags of the last staged step

    # ---- before the state update ---------------------------------------------------------
    def validate(self, so: SchedulerOutput, live: Callable[[str], bool]) -> None:
        """ValueError naming the request for prompt embeddings of the wrong shape or not finite,
        placeholders outside the prompt, or encoder inputs of requests or indices that do not exist."""
        for new in so.scheduled_new_reqs:
            if new.prompt_embeds is not None:
                e = new.prompt_embeds
                shape = (len(new.prompt_token_ids), self.hidden_size)
                if not isinstance(e, torch.Tensor) or tuple(e.shape) != shape or not e.dtype.is_floating_point:
                    got = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
                    raise ValueError(f"request {new.req_id!r}: prompt_embeds must be a float tensor of shape {shape} "
                                     f"(prompt length, hidden size), got {got}")
                if not bool(torch.isfinite(e).all()):
                    raise ValueError(f"request {new.req_id!r}: prompt_embeds has non-finite values")
            for f in new.mm_features:
                if f.mm_position.end > len(new.prompt_token_ids):
                    raise ValueError(f"request {new.req_id!r}: placeholders [{f.mm_position.offset}, "
                                     f"{f.mm_position.end}) reach past its {len(new.prompt_token_ids)}-token prompt")
        new_features = {new.req_id: new.mm_features for new in so.scheduled_new_reqs}
        for req_id, indices in so.scheduled_encoder_inputs.items():
            features = new_features.get(req_id, self._features.get(req_id) if live(req_id) else None)
            if features is None:
                raise ValueError(f"scheduled_encoder_inputs names request {req_id!r}, which has no multimodal inputs")
            bad = [i for i in indices if not 0 <= i < len(features)]
            if bad:
                raise ValueError(f"scheduled_encoder_inputs[{req_id!r}] = {indices}: request has {len(features)} "
                                 "multimodal inputs")

    # ---- after the state update ----------------------------------------------------------
    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._prompt_embeds.pop(req_id, None)
            self._features.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.prompt_embeds is not None:
                self._prompt_embeds[new.req_id] = new.prompt_embeds.to(self.device, self.dtype)
            if new.mm_features:
                self._features[new.req_id] = list(new.mm_features)
        if self.mrope is not None:
            self.mrope.update(so)
        self.encoder_cache.free(so.free_encoder_mm_hashes)
        if so.scheduled_encoder_inputs:
            self._encode(so.scheduled_encoder_inputs)

    def _encode(self, scheduled: dict[str, list[int]]) -> None:
        """Run the encoder over this step's scheduled inputs not cached yet (each hash once), eagerly."""
        todo: dict[str, MultiModalFeatureSpec] = {}
        for req_id, indices in scheduled.items():
            for i in indices:
                f = self._features[req_id][i]
                if f.identifier not in self.encoder_cache and f.identifier not in todo:
                    todo[f.identifier] = f
        if not todo:
            return
        outputs = self.model.encode_mm_inputs([f.data for f in todo.values()])  # one [tokens, hidden] per input
        for (mm_hash, f), out in zip(todo.items(), outputs, strict=True):
            if out.shape[0] != f.mm_position.length:
                raise ValueError(f"input {mm_hash!r} encodes to {out.shape[0]} embeddings but has "
                                 f"{f.mm_position.length} placeholder tokens")
            self.encoder_cache.put(mm_hash, out.to(self.dtype))

    # ---- after planning ------------------------------------------------------------------
    def stage(self, batch: InputBatch, num_computed: np.ndarray) -> None:
        """Copy the rows this batch's tokens take from prompt embeddings and encoder outputs into
        `inputs_embeds` and flag them; clear the flags of the last staged step. num_computed: [rows]
        host mirror of each row's computed tokens (the batch's chunks start there)."""
        if self.mrope is not None:
            self.mrope.stage(batch, num_computed)
        b = self.buffers
        if self._flagged:
            b.is_embed[: self._flagged].zero_()
            self._flagged = 0
        if not self._prompt_embeds and not self._features:
            return
        offset = 0
        for req_id, row, q in zip(batch.req_ids, batch.idx_mapping_np.tolist(), batch.query_lens_np.tolist(),
                                  strict=True):
            start = int(num_computed[row])
            sources: list[tuple[int, torch.Tensor | None]] = []  # (first prompt position, rows; None: not read)
            embeds = self._prompt_embeds.get(req_id)
            if embeds is not None:
                sources.append((0, embeds))
            for f in self._features.get(req_id, ()):
                sources.append((f.mm_position.offset, self.encoder_cache.get(f.identifier)
                                if _overlaps(f.mm_position.offset, f.mm_position.end, start, start + q) else None))
            for first, rows in sources:
                lo, hi = max(first, start), min(first + (0 if rows is None else rows.shape[0]), start + q)
                if rows is None or lo >= hi:
                    continue
                dst = slice(offset + lo - start, offset + hi - start)
                b.inputs_embeds[dst].copy_(rows[lo - first : hi - first], non_blocking=True)
                b.is_embed[dst] = True
                self._flagged = max(self._flagged, dst.stop)
            offset += q


def _overlaps(a0: int, a1: int, b0: int, b1: int) -> bool:
    return a0 < b1 and b0 < a1


def make_embed_inputs(model_config: Any, max_num_tokens: int, model: Any, device: torch.device,
                      dtype: torch.dtype, *, pipeline_parallel: bool, num_rows: int = 0) -> EmbedInputs | None:
    """The runner's `EmbedInputs` when the model takes prompt embeddings or multimodal inputs, else None;
    with M-RoPE positions (`num_rows`: the request state's rows) when the model's rotary is M-RoPE."""
    if not (model_config.enable_prompt_embeds or model_config.vision is not None):
        return None
    if pipeline_parallel:
        raise ValueError("prompt embeddings and multimodal inputs need pipeline_parallel_size=1 (the first stage "
                         "reads them and the last pools or samples)")
    buffers = EmbedBuffers.allocate(max_num_tokens, model_config.hidden_size, dtype, device)
    mrope = None
    if uses_mrope(model_config):
        mrope = MRopeInputs(MRopeBuffers.allocate(max_num_tokens, num_rows, device),
                            model_config.vision.spatial_merge_size, device)
    return EmbedInputs(buffers, model, model_config.hidden_size, device, dtype, mrope)
