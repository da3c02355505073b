"""Logprobs without a full-vocabulary logprob tensor.

A token's logprob is `logit - logsumexp(logits)`: one [R] logsumexp, a top-k of the
logits and a gather give the sampled token's logprob, its rank and the top-k, with
no [R, V] log_softmax buffer (on CUDA all three come from one read of the logits:
`logprobs_triton`). These are the RAW model distribution's logprobs (vLLM's
default `raw_logprobs`): of the logits before bias, penalties, temperature and filters.

Sampled logprobs run inside the step (graph-safe, preallocated outputs). Prompt
logprobs run eagerly on prefill steps only, outside graphs: `prompt_logprobs` walks a
chunk's positions in fixed-size slices so memory is bounded by `chunk_size x V`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from graphrunner.kernels import use_triton
from graphrunner.protocol import Logprob, NewRequestData
from graphrunner.sample.logprobs_triton import logprobs_triton, triton_fits
from graphrunner.state.staging import to_device_async

DEFAULT_PROMPT_CHUNK = 256  # prompt positions per logits slice: 256 x 152k x 4 B = 156 MB


LOGPROBS_IMPLS = ("auto", "torch", "triton")


def compute_logprobs(
    logits: torch.Tensor,  # [R, V] float32 raw logits
    token_ids: torch.Tensor,  # [R] int: the sampled (or target) token per row, in [0, V)
    num_logprobs: int,  # K >= 0 (static)
    out_logprobs: torch.Tensor,  # [R, >= K+1] float32, written in place
    out_ids: torch.Tensor,  # [R, >= K+1] int32, written in place
    out_ranks: torch.Tensor,  # [R] int32, written in place
    *,
    impl: str = "auto",
) -> None:
    """Column 0: the token's logprob; columns 1..K: the top-K (descending). Graph-safe.

    rank = 1 + number of tokens with a strictly larger logit (logprob order = logit
    order within a row). Columns past K+1 are left untouched.

    impl: "auto" (default) runs the one-pass Triton kernels (`logprobs_triton`: no sort,
    no [R, V] temporaries) on CUDA logits when triton imports and K <= MAX_TOPK, else
    the torch path (logsumexp, a `logits > chosen` count and topk); "torch" or "triton"
    force one. Both give the same logprobs (to fp32 rounding), ranks and top-K values;
    they differ only where the order is a choice: among equal logits the Triton path
    lists the lower token id first (torch.topk's order of ties is unspecified), and its
    top-K counts a NaN entry as -inf, where torch.topk lists NaN first. On both paths a
    row's non-finite values never reach another row and its ids and rank stay in range;
    a row with a NaN has only NaN logprobs, a row with +inf NaN or -inf ones, a row of
    only -inf NaN ones (the sampler's docstring holds for either path).
    """
    if impl not in LOGPROBS_IMPLS:
        raise ValueError(f"impl={impl!r} not in {LOGPROBS_IMPLS}")
    if impl == "triton" or (impl == "auto" and use_triton(logits) and triton_fits(logits, num_logprobs)):
        logprobs_triton(logits, token_ids, num_logprobs, out_logprobs, out_ids, out_ranks)
        return
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
    ids = token_ids.to(torch.int64)[:, None]  # [R, 1]
    chosen = logits.gather(1, ids)  # [R, 1]
    out_logprobs[:, :1].copy_(chosen - lse)
    out_ids[:, :1].copy_(ids)
    out_ranks.copy_((logits > chosen).sum(dim=-1) + 1)
    if num_logprobs > 0:
        top_values, top_ids = logits.topk(num_logprobs, dim=-1)  # [R, K]
        out_logprobs[:, 1 : num_logprobs + 1].copy_(top_values - lse)
        out_ids[:, 1 : num_logprobs + 1].copy_(top_ids)


def time_logprobs(num_rows: int, vocab_size: int, num_logprobs: int, *, impl: str = "auto", iters: int = 50,
                  device: str | torch.device = "cuda", seed: int = 0) -> float:
    """Mean microseconds of one `compute_logprobs` call on random logits (a quick A/B of
    `impl`; `graphrunner bench sampler --variants all_on` times it inside the sampler).

    CUDA: CUDA events around `iters` back-to-back calls after a warmup; elsewhere perf_counter.
    """
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=g, device=device) * 3  # [R, V] float32
    tokens = torch.randint(0, vocab_size, (num_rows,), generator=g, device=device)
    lp = torch.empty(num_rows, num_logprobs + 1, device=device)
    ids = torch.empty(num_rows, num_logprobs + 1, dtype=torch.int32, device=device)
    ranks = torch.empty(num_rows, dtype=torch.int32, device=device)

    def call() -> None:
        for _ in range(iters):
            compute_logprobs(logits, tokens, num_logprobs, lp, ids, ranks, impl=impl)

    call()  # warmup (and Triton compilation)
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    call()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / iters


@dataclass
class LogprobsTensors:
    """Logprobs of N positions: column 0 is the target/sampled token, then the top-K."""

    logprobs: torch.Tensor  # [N, K+1] float32
    token_ids: torch.Tensor  # [N, K+1] int32
    ranks: torch.Tensor  # [N] int32: rank of column 0's token

    @classmethod
    def empty(cls, n: int, num_logprobs: int, device: torch.device) -> LogprobsTensors:
        return cls(
            torch.zeros(n, num_logprobs + 1, dtype=torch.float32, device=device),
            torch.zeros(n, num_logprobs + 1, dtype=torch.int32, device=device),
            torch.zeros(n, dtype=torch.int32, device=device),
        )

    def to_dicts(self, num_logprobs: int | None = None) -> list[dict[int, Logprob]]:
        """vLLM's shape: per position `{token_id: Logprob}`, the column-0 token first
        (with its rank), then the top-k (ranks 1..k). One D2H copy."""
        k = self.logprobs.shape[1] - 1 if num_logprobs is None else num_logprobs
        return logprob_dicts(self.logprobs[:, : k + 1].cpu().numpy(), self.token_ids[:, : k + 1].cpu().numpy(),
                             self.ranks.cpu().numpy())


def logprob_dicts(logprobs: np.ndarray, token_ids: np.ndarray, ranks: np.ndarray) -> list[dict[int, Logprob]]:
    """Host arrays ([N, K+1], [N, K+1], [N]) -> per-position `{token_id: Logprob}` dicts."""
    out = []
    for lp, ids, rank in zip(logprobs.tolist(), token_ids.tolist(), ranks.tolist(), strict=True):
        d = {ids[0]: Logprob(lp[0], rank)}
        for j in range(1, len(ids)):
            d.setdefault(ids[j], Logprob(lp[j], j))
        out.append(d)
    return out


def prompt_logprob_targets(token_ids: list[int], start: int, num_tokens: int, prompt_len: int) -> list[int]:
    """Targets of a prefill chunk's positions [start, start + num_tokens): the next prompt token.

    Only positions < prompt_len - 1 have one (the last prompt position predicts the first
    sampled token, which is not a prompt logprob), so the list may be shorter than the chunk.
    """
    end = min(start + num_tokens, prompt_len - 1)
    return list(token_ids[start + 1 : end + 1]) if end > start else []


@torch.inference_mode()
def prompt_logprobs(
    hidden_or_logits: torch.Tensor,  # [N, H] hidden states (or [N, V] logits with compute_logits=None)
    targets: torch.Tensor,  # [N] int: the next prompt token of each position
    num_logprobs: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk_size: int = DEFAULT_PROMPT_CHUNK,
) -> LogprobsTensors:
    """Logprob, rank and top-k of each prompt position's next token, in slices of chunk_size.

    Eager (runs on prefill steps, outside graphs); memory is bounded by one slice's
    [chunk_size, V] float32 logits. `compute_logits` maps hidden [n, H] -> logits [n, V].
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    n = hidden_or_logits.shape[0]
    if targets.shape[0] != n:
        raise ValueError(f"{targets.shape[0]} targets for {n} positions")
    out = LogprobsTensors.empty(n, num_logprobs, hidden_or_logits.device)
    for s in range(0, n, chunk_size):
        e = min(s + chunk_size, n)
        part = hidden_or_logits[s:e]
        logits = (compute_logits(part) if compute_logits is not None else part).float()  # [n', V]
        compute_logprobs(logits, targets[s:e], num_logprobs, out.logprobs[s:e], out.token_ids[s:e], out.ranks[s:e])
    return out


class PromptLogprobsCollector:
    """Assembles one request's prompt logprobs across prefill chunks (host side).

    `add_chunk(start, tensors)` takes the LogprobsTensors of positions start.. (as
    `prompt_logprobs` returned for `prompt_logprob_targets`); `result()` is vLLM's
    PromptLogprobs: None for the first prompt token, then one dict per later token.
    """

    def __init__(self, prompt_len: int, num_logprobs: int):
        self.prompt_len = prompt_len
        self.num_logprobs = num_logprobs
        self._entries: list[dict[int, Logprob] | None] = [None] * prompt_len

    def add_chunk(self, start: int, tensors: LogprobsTensors) -> None:
        for i, d in enumerate(tensors.to_dicts(self.num_logprobs)):
            # Position p predicts prompt token p + 1.
            self._entries[start + i + 1] = d

    @property
    def done(self) -> bool:
        return all(e is not None for e in self._entries[1:])

    def result(self) -> list[dict[int, Logprob] | None]:
        return list(self._entries)


class PromptLogprobs:
    """The runner's prompt-logprob bookkeeping: which requests still want them, their
    collection from each prefill step's hidden states, and the finished results.

    A step that carries such a request must run outside FULL graphs (it reads every
    prompt position's hidden state, which no graph keeps): `needs_eager`.
    """

    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.compute_logits = compute_logits  # hidden [n, H] -> logits [n, V]; set once the model loads
        # req_id -> (prompt, collector) of requests still in their prompt; plain dicts, so that
        # the per-step checks (`if tracker.active`) cost no Python call.
        self.active: dict[str, tuple[list[int], PromptLogprobsCollector]] = {}
        self.done: dict[str, list] = {}  # req_id -> vLLM's PromptLogprobs, completed, not yet returned

    def add_request(self, new: NewRequestData) -> None:
        """Track a new request if it asked for prompt logprobs (a resumed one delivered them already)."""
        k, prompt = new.sampling_params.prompt_logprobs, new.prompt_token_ids
        if k is not None and not new.output_token_ids and len(prompt) >= 1:  # one token: [None]
            self.active[new.req_id] = (list(prompt), PromptLogprobsCollector(len(prompt), k))

    def remove_request(self, req_id: str) -> None:
        self.active.pop(req_id, None)  # a preempted prompt restarts from token 0

    def needs_eager(self, req_ids) -> bool:
        return bool(self.active) and not self.active.keys().isdisjoint(req_ids)

    def collect(self, hidden: torch.Tensor, req_ids: list[str], query_lens: np.ndarray, starts: np.ndarray) -> None:
        """Prompt logprobs of one step's prefill chunks (eager; never inside a FULL graph).

        hidden: [T_pad, H]. Entry i's query_lens[i] tokens sit at rows sum(query_lens[:i])..
        of hidden and at positions starts[i].. of its request.
        """
        offsets = np.concatenate(([0], np.cumsum(query_lens)))
        for i, req_id in enumerate(req_ids):
            entry = self.active.get(req_id)
            if entry is None:
                continue
            prompt, collector = entry
            start = int(starts[i])
            targets = prompt_logprob_targets(prompt, start, int(query_lens[i]), len(prompt))
            if targets:
                first = int(offsets[i])
                target_ids = to_device_async(np.asarray(targets, dtype=np.int64), hidden.device)
                tensors = prompt_logprobs(hidden[first : first + len(targets)], target_ids, collector.num_logprobs,
                                          compute_logits=self.compute_logits)
                collector.add_chunk(start, tensors)
            if collector.done:
                self.done[req_id] = collector.result()
                del self.active[req_id]

    def take_done(self) -> dict[str, list] | None:
        """The results completed since the last call (None when there are none)."""
        if not self.done:
            return None
        done, self.done = self.done, {}
        return done
