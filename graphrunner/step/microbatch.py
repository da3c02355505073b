"""Microbatching ("dual batch overlap", vLLM's `enable_dbo`): one step's forward as two halves.

Under lockstep DP (`data_parallel_lockstep=True`) every rank reports whether it would split
its step (`wants_microbatch`: at least `dbo_decode_token_threshold` tokens for a uniform
decode batch, `dbo_prefill_token_threshold` otherwise, and at least two requests), and the
DP coordinator decides for all ranks at once (graphrunner.distributed.dp_coordinator, rule 7:
all-or-nothing, split = padded // 2, abandoned when any rank's second half would be empty).
When it says split, this rank's step runs

    prepare_inputs (whole batch, as always)
    microbatch 0: tokens [0, c), requests [0, r)        on the current stream
    microbatch 1: tokens [c, T), requests [r, R)        on a side stream (fork / join events)
    logits, sampling, post-update (whole batch, as always)

Where the cut goes. A request cut in two would have its second part attend to keys its first
part writes, layer by layer, from the other stream: a race. So the cut is moved to a request
boundary: `c` is the boundary nearest to the agreed token split (ties to the lower one),
among the interior boundaries 1..R-1 only. A rank reports `wants_microbatch` only with at
least two requests, so every rank the coordinator tells to split has an interior boundary
and splits: all-or-nothing holds through real ranks, and both halves of every rank hold real
tokens (the coordinator's empty-second-half rule is kept by construction: a cut strictly
inside (0, T) leaves real tokens on both sides). The cut is a local matter: DP replicas of a
dense model share no collective, and the TP ranks of one replica see the same batch, so they
cut it in the same place.

What each half sees: views of the step's persistent buffers (input ids, positions, slot
mapping, seq_lens, block table rows, query_start_loc), except microbatch 1's query_start_loc,
which has the offset `c` subtracted on the device into a persistent buffer: no host sync.
The halves write disjoint KV slots (their own requests' new tokens) and read only their own
requests' KV. This assumes no request of a step reads KV another request of the same step
writes: the reference engine registers prefix-cache blocks only after the step that filled
them, an outside engine that shares blocks still being computed must keep DBO off.

Graphs. A uniform-decode step (every request q tokens) at a size of at least
`dbo_decode_token_threshold` tokens replays a FULL graph of the two-stream step (its descriptor's
`microbatched` twin, captured with the others): the cut is static there, after R_pad // 2 requests,
so both halves have fixed shapes on every rank and their MoE layers gather their own token counts
with no padding; the graph holds the fork, both streams' kernels and collectives, and the join.
Measured on 2 H200s (qwen3-30b-a3b, DP2 + EP, 256 requests): the eager two-stream step ran at
0.12x the throughput of the same step without DBO, its halves overlapping 6% of their span, the
host issuing 48 layers twice per step. Other microbatched steps (prefill, mixed) run eagerly (NONE;
with the compiled model's fused kernels when graph modes are on, no piece graphs). Under TP each
half's all-reduces are issued in host order, half 0 then half 1, the same on every rank. PP and PCP
are refused with DBO (`ParallelConfig`).

Under expert parallelism across the replicas (DP + EP) every MoE layer all-gathers its tokens
over the DP group, which needs the same count on every replica, while the cut point is each
rank's own. The whole step is padded to the agreed token count T_pad (the coordinator's
`pad_eager`), and each microbatch's MoE layers pad their tokens to the largest size that
microbatch has on any rank (`DPComm.pad_tokens`, agreed in one more CPU all-reduce of the two
sizes, `agree_sizes`): padding both to T_pad would gather and compute every expert over twice the
step's tokens. Such microbatches run the model's eager modules (the padding target is a host value
a compiled piece would bake in).
On CUDA microbatch 1's collectives (the DP all-gather / reduce-scatter and the TP all-reduce)
go over a second set of communicators, so that they overlap microbatch 0's attention and expert
GEMMs without two streams sharing one NCCL communicator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from graphrunner.step.inputs import InputBatch

__all__ = ["Microbatcher", "cut_point", "split_batch", "wants_microbatch"]


def wants_microbatch(num_reqs: int, num_tokens: int, uniform_token_count: int | None, decode_query_len: int,
                     decode_threshold: int, prefill_threshold: int) -> bool:
    """Whether a rank would split its step: >= 2 requests (one request cannot be cut on a request
    boundary) and at least the threshold of its kind of tokens (decode: a uniform batch of
    `decode_query_len` tokens per request, i.e. 1 + speculative tokens; prefill: anything else)."""
    if num_reqs < 2:
        return False
    decode = uniform_token_count is not None and uniform_token_count == decode_query_len
    return num_tokens >= (decode_threshold if decode else prefill_threshold)


def cut_point(query_lens: np.ndarray, split: int) -> tuple[int, int] | None:
    """(requests r, tokens c) of microbatch 0: the interior request boundary nearest to token
    `split` (ties to the lower); None when the batch has fewer than two non-empty requests.

    query_lens: [R] int, the step's scheduled tokens per request, in batch order.
    """
    bounds = np.cumsum(query_lens)[:-1]  # [R - 1] tokens before request i + 1
    total = int(query_lens.sum())
    inside = np.flatnonzero((bounds > 0) & (bounds < total))
    if len(inside) == 0:
        return None
    best = inside[np.argmin(np.abs(bounds[inside] - split))]  # argmin: the first (lowest) of ties
    return int(best) + 1, int(bounds[best])


def split_batch(batch: InputBatch, r: int, c: int, qsl_out: torch.Tensor) -> tuple[InputBatch, InputBatch]:
    """The two microbatches of `batch` cut after request `r` (token `c`): views of its buffers.

    qsl_out: [>= R_pad - r + 1] int32 persistent buffer, written on the device with microbatch 1's
    query_start_loc (batch.query_start_loc[r:] - c); no host sync.
    """
    R, Rp, Tp = batch.num_reqs, batch.num_reqs_padded, batch.num_tokens_padded
    assert 0 < r < R and 0 < c < batch.num_tokens, f"cut (r={r}, c={c}) outside batch ({R} reqs, {batch.num_tokens})"
    qsl1 = qsl_out[: Rp - r + 1]
    torch.sub(batch.query_start_loc[r:], c, out=qsl1)  # [R_pad - r + 1] int32
    m = batch.attn_metadata
    halves = []
    for (r0, r1), (t0, t1), qsl in (((0, r), (0, c), batch.query_start_loc[: r + 1]), ((r, Rp), (c, Tp), qsl1)):
        lens = batch.query_lens_np[r0:min(r1, R)]
        meta = dataclasses.replace(
            m, query_start_loc=qsl, seq_lens=batch.seq_lens[r0:r1], block_table=batch.block_table[r0:r1],
            slot_mapping=batch.slot_mapping[t0:t1], num_reqs=r1 - r0, num_tokens=t1 - t0,
            max_query_len=int(lens.max()),
        )
        halves.append(dataclasses.replace(
            batch, req_ids=batch.req_ids[r0:r1], idx_mapping_np=batch.idx_mapping_np[r0:r1], query_lens_np=lens,
            num_reqs=len(lens), num_tokens=int(lens.sum()), num_reqs_padded=r1 - r0, num_tokens_padded=t1 - t0,
            idx_mapping=batch.idx_mapping[r0:r1], query_start_loc=qsl, input_ids=batch.input_ids[t0:t1],
            positions=batch.positions[t0:t1], seq_lens=meta.seq_lens, slot_mapping=meta.slot_mapping,
            block_table=meta.block_table, attn_metadata=meta,
        ))
    return halves[0], halves[1]


class Microbatcher:
    """Runs an armed step's forward as two microbatches (module docstring). One per runner.

    The lockstep DP hook `arm`s it with the agreed token split before the step (or None);
    `StepBody.forward_and_sample` calls `forward` instead of its whole-batch forward while armed.
    """

    def __init__(self, max_num_reqs: int, device: torch.device, ep: Any = None, side_comms: Any = None,
                 agree_sizes: Callable[[int, int], tuple[int, int]] | None = None) -> None:
        self.device = device
        self.ep = ep  # DP + EP: the MoE layers' DPComm, whose pad_tokens each microbatch sets
        # DP + EP: (this rank's two microbatch sizes) -> the largest of each over the DP replicas
        self.agree_sizes = agree_sizes
        # DP + EP on CUDA: a context manager giving the side stream's microbatch its own communicators
        # (comm.second_communicators): one NCCL communicator must not run on two streams at once.
        self.side_comms = side_comms
        self.qsl = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)  # microbatch 1's query_start_loc
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None  # microbatch 1 runs here
        self.forked = torch.cuda.Event() if cuda else None
        self.joined = torch.cuda.Event() if cuda else None
        self.split: int | None = None  # the armed token split of the next step
        self.static = False  # the armed step is a microbatched FULL graph's: equal shapes on every rank
        self.num_steps = 0  # steps actually run as two microbatches
        self.num_graph_steps = 0  # of which replayed a microbatched FULL graph
        self.last_cut: tuple[int, int] | None = None  # (requests, tokens) of the last step's microbatch 0

    @property
    def armed(self) -> bool:
        return self.split is not None

    def arm(self, split: int | None, static: bool = False) -> None:
        """The next step splits near token `split` (None: runs whole). `static`: the step is the one a
        microbatched FULL graph captures, whose halves have the same shapes on every rank."""
        self.split = split
        self.static = static and split is not None

    def replayed(self, desc: Any) -> None:
        """A step replayed the microbatched FULL graph of `desc` (counted as a microbatched step)."""
        self.split, self.static = None, False
        self.num_steps += 1
        self.num_graph_steps += 1
        r = desc.num_reqs // 2
        self.last_cut = (r, r * desc.uniform_token_count)

    def forward(self, body: Any, batch: InputBatch) -> Any:
        """body.forward over the two microbatches of `batch` -> hidden [T_pad, H]; disarms.

        A batch that cannot be cut (one request, a PCP split step, PP stage inputs) runs whole."""
        split, self.split = self.split, None
        static, self.static = self.static, False
        cut = cut_point(batch.query_lens_np, split) if split is not None else None
        if cut is None or batch.pcp is not None or not body.is_last_stage or body.buffers.stage.hidden_in is not None:
            return body.forward(batch)
        first, second = split_batch(batch, *cut, self.qsl)
        pads: tuple[int | None, int | None] = (None, None)  # static halves: the same sizes on every rank
        if self.ep is not None and not static:
            sizes = first.num_tokens_padded, second.num_tokens_padded
            pads = self.agree_sizes(*sizes) if self.agree_sizes is not None else sizes
        try:
            if self.stream is None:  # CPU: one after the other
                out = (self._forward(body, first, pads[0]), self._forward(body, second, pads[1]))
            else:
                out = self._two_streams(body, first, second, pads)
        finally:
            if self.ep is not None:
                self.ep.pad_tokens = None
        if not static:  # a microbatched graph's step is counted when it is replayed (`replayed`)
            self.num_steps += 1
            self.last_cut = cut
        return torch.cat(out)  # [T_pad, H]

    def _forward(self, body: Any, half: InputBatch, pad: int | None) -> Any:
        if self.ep is None:
            return body.forward(half)
        self.ep.pad_tokens = pad  # read while the layers are issued, before the other half's
        return body.forward(half, modules=True)

    def _two_streams(self, body: Any, first: InputBatch, second: InputBatch,
                     pads: tuple[int | None, int | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Microbatch 0 on the current stream, 1 on the side stream; the current stream waits for both."""
        assert self.stream is not None and self.forked is not None and self.joined is not None
        main = torch.cuda.current_stream(self.device)
        self.forked.record(main)  # the prepared inputs (and microbatch 1's query_start_loc) are ready
        out0 = self._forward(body, first, pads[0])
        self.stream.wait_event(self.forked)
        with torch.cuda.stream(self.stream), (self.side_comms() if self.side_comms is not None else nullcontext()):
            out1 = self._forward(body, second, pads[1])
            self.joined.record(self.stream)
        main.wait_event(self.joined)
        out1.record_stream(main)  # allocated on the side stream, read on the current one
        return out0, out1

