"""M-RoPE positions (Qwen2.5-VL): three positions per token, filled in the step like the 1-D ones.

A text token's three positions (temporal, height, width) are equal; an image's placeholders take
the image's grid: (t, row, column) of each merged patch, offset by where the image starts, and the
text after an image resumes past the image's largest position, so a prompt's positions end below its
length. `mrope_positions` computes a prompt's [3, L] positions and its delta (last position + 1 - L,
transformers' `get_rope_index`); every later token p is at p + delta on all three axes.

In the step (`MRopeBuffers`, graph-visible, written in place): `positions` [3, max_tokens] holds the
batch's positions. Before the step, outside the graphs, `MRopeInputs.stage` copies the rows of the
prompt chunks of requests with images from their precomputed positions and flags them in `staged`, and
writes new requests' deltas into `delta` (per state row). Inside the step, `fill` gives every other
token its 1-D position plus its row's delta (0 for text-only prompts) on all three axes, and padded
tokens 0; the decoder reads the [T, 3] view (`view`). Models with one position per token allocate
none of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphrunner.multimodal.features import MultiModalFeatureSpec
from graphrunner.protocol import SchedulerOutput
from graphrunner.state.staging import to_device_async
from graphrunner.step.inputs import InputBatch


def uses_mrope(model_config: Any) -> bool:
    return (model_config.rope_scaling or {}).get("rope_type") == "mrope"


def mrope_positions(prompt_len: int, features: list[MultiModalFeatureSpec] | tuple[MultiModalFeatureSpec, ...],
                    merge: int) -> tuple[np.ndarray, int]:
    """(positions [3, prompt_len] int64, delta) of a prompt whose images fill `features`' placeholders
    (`data["image_grid_thw"]`: the image's (t, h, w) patches). ValueError naming an image whose
    placeholder count is not its grid's t·h·w / merge²."""
    out = np.empty((3, prompt_len), dtype=np.int64)
    text_start = 0  # first prompt index after the last image
    next_pos = 0  # position of the next text token
    for f in sorted(features, key=lambda f: f.mm_position.offset):
        t, h, w = (int(g) for g in f.data["image_grid_thw"].tolist())
        gh, gw = h // merge, w // merge
        offset, length = f.mm_position.offset, f.mm_position.length
        if t * gh * gw != length:
            raise ValueError(f"input {f.identifier!r}: grid {(t, h, w)} makes {t * gh * gw} tokens, not its "
                             f"{length} placeholders")
        out[:, text_start:offset] = np.arange(offset - text_start) + next_pos
        start = next_pos + offset - text_start
        grid = np.indices((t, gh, gw)).reshape(3, -1)  # (frame, row, column) of each merged patch
        out[:, offset : offset + length] = grid + start
        next_pos = start + max(gh, gw)
        text_start = offset + length
    out[:, text_start:] = np.arange(prompt_len - text_start) + next_pos
    delta = int(out.max()) + 1 - prompt_len if prompt_len else 0
    return out, delta


@dataclass
class MRopeBuffers:
    """positions: [3, max_num_tokens] int64, this step's (t, h, w) positions; staged: [max_num_tokens] bool,
    the rows `MRopeInputs.stage` wrote; delta: [rows] int64, each state row's position delta."""

    positions: torch.Tensor
    staged: torch.Tensor
    delta: torch.Tensor

    @classmethod
    def allocate(cls, max_num_tokens: int, num_rows: int, device: torch.device) -> MRopeBuffers:
        return cls(positions=torch.zeros(3, max_num_tokens, dtype=torch.int64, device=device),
                   staged=torch.zeros(max_num_tokens, dtype=torch.bool, device=device),
                   delta=torch.zeros(num_rows, dtype=torch.int64, device=device))

    def fill(self, batch: InputBatch) -> None:
        """In the step, after the 1-D positions: rows not staged get position + delta[row] on all three axes,
        padded tokens 0. Graph-safe (shapes from the padded sizes, no host sync)."""
        T, R = batch.num_tokens_padded, batch.num_reqs_padded
        qsl = batch.query_start_loc  # [R_pad + 1] int32
        token = torch.arange(T, dtype=torch.int32, device=qsl.device)
        entry = torch.searchsorted(qsl[1:], token, right=True).clamp_(max=R - 1)  # batch entry of each token
        shifted = batch.positions + self.delta[batch.idx_mapping[entry].long()]
        # A padded token's entry may be a real one (PIECEWISE pads tokens only): its delta may be negative.
        shifted = torch.where(token < qsl[R], shifted, 0)
        out = self.positions[:, :T]
        out.copy_(torch.where(self.staged[:T], out, shifted))

    def view(self, num_tokens: int) -> torch.Tensor:
        """[T, 3] (t, h, w) positions of the step's first `num_tokens` tokens (token dim first)."""
        return self.positions[:, :num_tokens].t()


class MRopeInputs:
    """The runner's side of M-RoPE positions (module docstring): `update` after the state update,
    `stage` after planning, both outside the graphs; `buffers.fill` inside the step."""

    def __init__(self, buffers: MRopeBuffers, merge: int, device: torch.device) -> None:
        self.buffers = buffers
        self.merge = merge
        self.device = device
        self._prompt_positions: dict[str, torch.Tensor] = {}  # req_id -> [3, prompt_len] on the device
        self._new_deltas: dict[str, int] = {}  # admitted requests whose row's delta is not written yet
        self._staged = 0  # staged[:_staged] may hold flags of the last staged step

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._prompt_positions.pop(req_id, None)
            self._new_deltas.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            delta = 0
            if new.mm_features:
                positions, delta = mrope_positions(len(new.prompt_token_ids), new.mm_features, self.merge)
                self._prompt_positions[new.req_id] = torch.from_numpy(positions).to(self.device)
            self._new_deltas[new.req_id] = delta  # every admission: the row may have held another request

    def stage(self, batch: InputBatch, num_computed: np.ndarray) -> None:
        """Copy the positions of this batch's prompt chunks of requests with images into `positions` and
        flag them; write new requests' deltas; clear the flags of the last staged step."""
        b = self.buffers
        if self._staged:
            b.staged[: self._staged].zero_()
            self._staged = 0
        if self._new_deltas:
            rows, deltas = [], []
            for req_id, row in zip(batch.req_ids, batch.idx_mapping_np.tolist(), strict=True):
                delta = self._new_deltas.pop(req_id, None)
                if delta is not None:
                    rows.append(row)
                    deltas.append(delta)
            if rows:
                b.delta[to_device_async(np.asarray(rows, dtype=np.int64), self.device)] = to_device_async(
                    np.asarray(deltas), self.device, b.delta.dtype)
        if not self._prompt_positions:
            return
        offset = 0
        for req_id, row, q in zip(batch.req_ids, batch.idx_mapping_np.tolist(), batch.query_lens_np.tolist(),
                                  strict=True):
            positions = self._prompt_positions.get(req_id)
            start = int(num_computed[row])
            if positions is not None and start < positions.shape[1]:
                hi = min(start + q, positions.shape[1])
                dst = slice(offset, offset + hi - start)
                b.positions[:, dst].copy_(positions[:, start:hi], non_blocking=True)
                b.staged[dst] = True
                self._staged = max(self._staged, dst.stop)
                if hi == positions.shape[1]:  # the prompt is computed: later tokens take position + delta
                    del self._prompt_positions[req_id]
            offset += q
