"""DispatchTable: capture sizes -> descriptors -> per-token-count candidates -> dispatch().

Pure standard library (no torch), so every rule here is testable with hypothesis on a
CPU. Built once from the resolved mode, the capture sizes and the batch limits:

- uniform-decode FULL descriptors (modes whose decode routine is FULL and differs from
  the mixed one): each capture size rounded up to a multiple of q, kept while
  num_reqs = size / q <= max_num_reqs and size <= max_num_batched_tokens;
- mixed descriptors, one per capture size: PIECEWISE pads tokens only, FULL pads tokens
  and requests (num_reqs = min(size, max_num_reqs));
- `candidates(t)`: for every token count t, the smallest uniform-decode descriptor with
  >= t tokens, then the smallest mixed one. A uniform-decode batch prefers its FULL
  graph even when a mixed graph would pad less: a FULL replay beats PIECEWISE pieces
  with eager attention.

`dispatch()` walks that precomputed list (at most two entries) and returns the first
descriptor the batch fits, else NONE with the real sizes: O(1), no scan over sizes.

LoRA (`enable_lora`): the same descriptors again with `has_lora=True`, at the LoRA capture sizes
(`default_lora_capture_sizes`: a sparser ladder, so that capturing them adds at most half of the
plain table's capture time), each with candidates of its own. A batch without adapters dispatches
exactly as without LoRA; a batch with adapters gets a LoRA graph or runs eager.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from capture.descriptor import BatchExecutionDescriptor
from capture.modes import CUDAGraphMode, Resolution

logger = logging.getLogger("graphrunner.capture")

__all__ = ["CandidateVerdict", "DispatchTable", "Explanation", "default_capture_sizes", "default_lora_capture_sizes",
           "validate_capture_sizes"]

# Default ladder (docs/architecture.md §5): dense where small decode batches live, coarser above.
_SMALL_SIZES = (1, 2, 4)
_STEP_BELOW_256 = 8
_STEP_FROM_256 = 16
# Beyond ~512 tokens a step is compute-bound: a graph saves little launch time but
# costs capture time and pool memory.
_DEFAULT_MAX_CAPTURE_SIZE = 512


def _check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return value


def default_capture_sizes(
    max_num_reqs: int, max_num_batched_tokens: int, uniform_decode_query_len: int = 1
) -> tuple[int, ...]:
    """[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), kept <= max, where
    max = min(2 * max_num_reqs * q, 512, max_num_batched_tokens)."""
    _check_positive_int("max_num_reqs", max_num_reqs)
    _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
    q = _check_positive_int("uniform_decode_query_len", uniform_decode_query_len)
    # 2x the largest decode batch leaves room for short mixed steps above it.
    top = min(2 * max_num_reqs * q, _DEFAULT_MAX_CAPTURE_SIZE, max_num_batched_tokens)
    ladder = [*_SMALL_SIZES, *range(8, 256, _STEP_BELOW_256), *range(256, top + 1, _STEP_FROM_256)]
    return tuple(s for s in ladder if s <= top)


# LoRA graphs at about every 1.5x step of size (1, 2, 4, 8, 12, 16, 24, 32, 48, ...): a LoRA batch
# pads at most a third more than a plain one, and the LoRA graphs number about 30% of the default
# ladder's (15 of 51 up to 512). A LoRA graph has two more launches per projection than its plain
# twin; at most 40% as many of them keeps their capture under half of the plain table's capture time.
_LORA_LADDER_SMALL = (1, 2, 4, 8)
_LORA_GRAPH_SHARE = 0.4


def default_lora_capture_sizes(capture_sizes: Iterable[int]) -> tuple[int, ...]:
    """The token counts to capture with LoRA: for 1, 2, 4, 8 and then every 2^k and 3 * 2^(k-1), the
    smallest capture size that holds it, and always the largest capture size (so that every batch a
    plain graph takes has a LoRA graph too); thinned from the top down to at most 40% of the sizes
    (a short ladder, say [1, 2, 4, 8, 16], keeps [2, 16])."""
    sizes = sorted(set(capture_sizes))
    if not sizes:
        return ()
    ladder = list(_LORA_LADDER_SMALL)
    while ladder[-1] < sizes[-1]:
        ladder += [ladder[-1] * 3 // 2, ladder[-1] * 2]
    picked = sorted({next(s for s in sizes if s >= v) for v in ladder if v <= sizes[-1]} | {sizes[-1]})
    most = max(1, int(_LORA_GRAPH_SHARE * len(sizes)))
    step = -(-len(picked) // most)
    return tuple(picked[::-1][::step][::-1])


def validate_capture_sizes(sizes: Iterable[int], max_num_batched_tokens: int) -> tuple[int, ...]:
    """User sizes: ints >= 1, de-duplicated and sorted; sizes above max_num_batched_tokens
    are dropped with a warning; an empty result is an error."""
    if isinstance(sizes, (str, bytes)):
        raise ValueError(f"capture_sizes={sizes!r} must be a sequence of ints, not a string")
    sizes = tuple(sizes)
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"capture size {s!r} in capture_sizes={list(sizes)} must be an int >= 1")
    unique = sorted(set(sizes))
    kept = [s for s in unique if s <= max_num_batched_tokens]
    dropped = unique[len(kept):]
    if dropped:
        logger.warning(
            "capture sizes %s exceed max_num_batched_tokens=%d and are dropped", dropped, max_num_batched_tokens
        )
    if not kept:
        raise ValueError(
            f"capture_sizes={list(sizes)} leaves no size <= max_num_batched_tokens={max_num_batched_tokens}"
        )
    return tuple(kept)


@dataclass(frozen=True)
class CandidateVerdict:
    """One candidate considered by `DispatchTable.explain`."""

    descriptor: BatchExecutionDescriptor
    accepted: bool
    reason: str
    reached: bool = True  # False: an earlier candidate was accepted, this one was never checked

    @property
    def label(self) -> str:
        return "accepted" if self.accepted else ("rejected" if self.reached else "skipped")


@dataclass(frozen=True)
class Explanation:
    """Why `dispatch` chose what it chose, for logs and `graphrunner inspect`."""

    num_reqs: int
    num_tokens: int
    uniform_token_count: int | None
    verdicts: tuple[CandidateVerdict, ...]
    chosen: BatchExecutionDescriptor
    note: str  # why the step runs eager, when it does
    has_lora: bool = False  # the batch has adapter rows

    @property
    def padding_tokens(self) -> int:
        return self.chosen.padded_tokens(self.num_tokens)

    @property
    def padding_reqs(self) -> int:
        return self.chosen.padded_reqs(self.num_reqs)

    @property
    def waste(self) -> float:
        """Fraction of the step's tokens that are padding."""
        return self.padding_tokens / self.chosen.num_tokens

    def __str__(self) -> str:
        q = self.uniform_token_count
        kind = ("mixed" if q is None else f"uniform q={q}") + (", with LoRA adapters" if self.has_lora else "")
        lines = [f"batch: num_reqs={self.num_reqs} num_tokens={self.num_tokens} ({kind})"]
        width = max((len(str(v.descriptor)) for v in self.verdicts), default=0)
        for v in self.verdicts:
            lines.append(f"  {str(v.descriptor):<{width}}  {v.label}: {v.reason}")
        if not self.verdicts:
            lines.append("  no candidates")
        result = f"-> {self.chosen}: {self.padding_tokens} padding tokens ({self.waste:.1%} of the step)"
        if self.chosen.num_reqs is not None and self.chosen.is_full:
            result += f", {self.padding_reqs} padding requests"
        if self.note:
            result += f"; {self.note}"
        lines.append(result)
        return "\n".join(lines)


class DispatchTable:
    """Which descriptor (graph) each batch runs with; built once, then `dispatch` per step.

    mode: a resolved `Resolution` (from `resolve_mode`), a `CUDAGraphMode` or its name.
    capture_sizes: token counts to capture; None = `default_capture_sizes(...)`.
    uniform_decode_query_len: q = 1 + num_speculative_tokens, the tokens of each request
    in a uniform-decode batch.
    """

    def __init__(
        self,
        mode: Resolution | CUDAGraphMode | str,
        capture_sizes: Iterable[int] | None = None,
        *,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        uniform_decode_query_len: int = 1,
        enable_lora: bool = False,
        lora_capture_sizes: Iterable[int] | None = None,
    ) -> None:
        if isinstance(mode, Resolution):
            self.resolution = mode
        else:
            self.resolution = Resolution(CUDAGraphMode.parse(mode), None, "given to DispatchTable")
        self.mode: CUDAGraphMode = self.resolution.mode
        self.max_num_reqs = _check_positive_int("max_num_reqs", max_num_reqs)
        self.max_num_batched_tokens = _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.uniform_decode_query_len = _check_positive_int("uniform_decode_query_len", uniform_decode_query_len)
        if capture_sizes is None:
            self.capture_sizes = default_capture_sizes(max_num_reqs, max_num_batched_tokens, uniform_decode_query_len)
        else:
            self.capture_sizes = validate_capture_sizes(capture_sizes, max_num_batched_tokens)

        self.enable_lora = bool(enable_lora)
        q = self.uniform_decode_query_len
        if not self.enable_lora:
            self.lora_capture_sizes: tuple[int, ...] = ()
            lora_decode_sizes: tuple[int, ...] = ()
        elif lora_capture_sizes is None:
            self.lora_capture_sizes = default_lora_capture_sizes(self.capture_sizes)
            # The decode ladder over the sizes a uniform-decode graph can have (<= max_num_reqs requests).
            lora_decode_sizes = default_lora_capture_sizes(
                s for s in self.capture_sizes if -(-s // q) <= self.max_num_reqs)
        else:
            self.lora_capture_sizes = validate_capture_sizes(lora_capture_sizes, max_num_batched_tokens)
            lora_decode_sizes = self.lora_capture_sizes

        self._decode_descs = self._build_decode_descs(self.capture_sizes, False)  # ascending num_tokens
        self._mixed_descs = self._build_mixed_descs(self.capture_sizes, False)  # ascending num_tokens
        lora_decode = self._build_decode_descs(lora_decode_sizes, True)
        lora_mixed = self._build_mixed_descs(self.lora_capture_sizes, True)
        self._descriptors = self._capture_order(self._decode_descs + self._mixed_descs + lora_decode + lora_mixed)
        top = max((d.num_tokens for d in self._descriptors), default=0)
        self._candidates = self._build_candidates(self._decode_descs, self._mixed_descs, top)  # index: num_tokens
        self._lora_candidates = self._build_candidates(lora_decode, lora_mixed, top) if self.enable_lora else ()

    # -- construction -------------------------------------------------------------------------

    def _build_decode_descs(self, sizes: tuple[int, ...], has_lora: bool) -> tuple[BatchExecutionDescriptor, ...]:
        mode, q = self.mode, self.uniform_decode_query_len
        # Single-routine FULL needs no separate decode graphs: its mixed FULL graphs take
        # uniform batches too.
        if not (mode.separate_routine and mode.decode_mode is CUDAGraphMode.FULL):
            return ()
        out: dict[int, BatchExecutionDescriptor] = {}
        for size in sizes:
            tokens = -(-size // q) * q  # a uniform batch always holds a multiple of q tokens
            reqs = tokens // q
            if reqs > self.max_num_reqs or tokens > self.max_num_batched_tokens:
                continue
            out.setdefault(tokens, BatchExecutionDescriptor(CUDAGraphMode.FULL, tokens, reqs, q, has_lora))
        return tuple(out[t] for t in sorted(out))

    def _build_mixed_descs(self, sizes: tuple[int, ...], has_lora: bool) -> tuple[BatchExecutionDescriptor, ...]:
        mixed = self.mode.mixed_mode
        if mixed is CUDAGraphMode.PIECEWISE:
            return tuple(BatchExecutionDescriptor(mixed, s, has_lora=has_lora) for s in sizes)
        if mixed is CUDAGraphMode.FULL:
            # Every request has >= 1 token, so a t-token batch has <= min(t, max_num_reqs) requests.
            return tuple(BatchExecutionDescriptor(mixed, s, min(s, self.max_num_reqs), has_lora=has_lora)
                         for s in sizes)
        return ()

    @staticmethod
    def _capture_order(descs: Iterable[BatchExecutionDescriptor]) -> tuple[BatchExecutionDescriptor, ...]:
        # PIECEWISE first, then FULL, each largest first: the largest graphs size the shared
        # pool and PIECEWISE activations are the larger, so later graphs reuse that memory.
        # A LoRA graph right after its plain twin of the same size.
        def key(d: BatchExecutionDescriptor) -> tuple[int, int, int, bool]:
            return (0 if d.is_piecewise else 1, -d.num_tokens, -(d.num_reqs or 0), d.has_lora)

        return tuple(sorted(descs, key=key))

    @staticmethod
    def _build_candidates(decode_descs: tuple[BatchExecutionDescriptor, ...],
                          mixed_descs: tuple[BatchExecutionDescriptor, ...],
                          top: int) -> tuple[tuple[BatchExecutionDescriptor, ...], ...]:
        decode = _ceilings(decode_descs, top)
        mixed = _ceilings(mixed_descs, top)
        return tuple(tuple(d for d in (decode[t], mixed[t]) if d is not None) for t in range(top + 1))

    # -- queries ------------------------------------------------------------------------------

    @property
    def descriptors(self) -> tuple[BatchExecutionDescriptor, ...]:
        """Everything to capture, in capture order: PIECEWISE before FULL, largest first."""
        return self._descriptors

    @property
    def max_graph_tokens(self) -> int:
        """Largest token count any graph takes (0 when nothing is captured)."""
        return len(self._candidates) - 1

    def candidates(self, num_tokens: int, has_lora: bool = False) -> tuple[BatchExecutionDescriptor, ...]:
        """Ordered candidates for a batch of `num_tokens` tokens: uniform-decode FULL first,
        then the mixed mode's descriptor; empty when no graph is large enough. `has_lora`: the
        LoRA graphs' candidates (none without `enable_lora`)."""
        if not 1 <= num_tokens <= self.max_num_batched_tokens:
            raise ValueError(self._tokens_range_error(num_tokens))
        table = self._lora_candidates if has_lora else self._candidates
        return table[num_tokens] if num_tokens < len(table) else ()

    def dispatch(
        self, num_reqs: int, num_tokens: int, uniform_token_count: int | None = None, has_lora: bool = False
    ) -> BatchExecutionDescriptor:
        """Descriptor for a batch: the first compatible candidate (least padding of its kind),
        else NONE with the real sizes.

        uniform_token_count=q only when every request has exactly q tokens (a pure decode
        batch); then num_tokens must equal num_reqs * q. A prompt chunk that happens to be
        q long is not a decode: pass None for any batch with a prefill. `has_lora`: some row of
        the batch has an adapter (only LoRA graphs, or NONE, serve it).
        """
        self._check_batch(num_reqs, num_tokens, uniform_token_count)
        table = self._lora_candidates if has_lora else self._candidates
        if num_tokens < len(table):
            for desc in table[num_tokens]:
                if desc.fits(num_reqs, num_tokens, uniform_token_count, has_lora):
                    return desc
        return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs, has_lora=has_lora)

    def explain(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None = None,
                has_lora: bool = False) -> Explanation:
        """What `dispatch` considers for this batch, why each candidate is taken or not, and
        the padding waste of the result."""
        self._check_batch(num_reqs, num_tokens, uniform_token_count)
        verdicts: list[CandidateVerdict] = []
        chosen: BatchExecutionDescriptor | None = None
        for desc in self.candidates(num_tokens, has_lora):
            if chosen is not None:
                verdicts.append(CandidateVerdict(desc, False, f"{chosen} was accepted first", reached=False))
                continue
            why = desc.misfit(num_reqs, num_tokens, uniform_token_count, has_lora)
            if why is None:
                chosen = desc
                pads = f"+{desc.padded_tokens(num_tokens)} tokens"
                if desc.num_reqs is not None:
                    pads += f", +{desc.padded_reqs(num_reqs)} requests"
                verdicts.append(CandidateVerdict(desc, True, f"smallest graph of its kind that fits; {pads}"))
            else:
                verdicts.append(CandidateVerdict(desc, False, why))
        note = ""
        if chosen is None:
            chosen = BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs, has_lora=has_lora)
            note = self._eager_reason(num_tokens, uniform_token_count, bool(verdicts), has_lora)
        return Explanation(num_reqs, num_tokens, uniform_token_count, tuple(verdicts), chosen, note, has_lora)

    def _eager_reason(self, num_tokens: int, uniform_token_count: int | None, had_candidates: bool,
                      has_lora: bool = False) -> str:
        if not self._descriptors:
            return f"mode {self.mode.name} captures no graphs"
        if has_lora and not self.enable_lora:
            return "the table has no LoRA graphs (enable_lora is off)"
        if uniform_token_count is None and self.mode.mixed_mode is CUDAGraphMode.NONE:
            return f"mode {self.mode.name} runs mixed batches eager"
        if had_candidates:
            return "every candidate was rejected"
        if has_lora:
            top = max((d.num_tokens for d in self._descriptors if d.has_lora), default=0)
            return f"num_tokens={num_tokens} exceeds the largest LoRA graph ({top} tokens)"
        return f"num_tokens={num_tokens} exceeds the largest graph ({self.max_graph_tokens} tokens)"

    def _tokens_range_error(self, num_tokens: int) -> str:
        return f"num_tokens={num_tokens} must be in [1, max_num_batched_tokens={self.max_num_batched_tokens}]"

    def _check_batch(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None) -> None:
        if not 1 <= num_tokens <= self.max_num_batched_tokens:
            raise ValueError(self._tokens_range_error(num_tokens))
        if not 1 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs={num_reqs} must be in [1, max_num_reqs={self.max_num_reqs}]")
        if num_reqs > num_tokens:
            raise ValueError(f"num_reqs={num_reqs} exceeds num_tokens={num_tokens}: every request has >= 1 token")
        if uniform_token_count is not None and (
            uniform_token_count < 1 or num_tokens != num_reqs * uniform_token_count
        ):
            raise ValueError(
                f"uniform_token_count={uniform_token_count} needs num_tokens == num_reqs * uniform_token_count, "
                f"got num_tokens={num_tokens}, num_reqs={num_reqs}"
            )

    def __repr__(self) -> str:
        sizes = self.capture_sizes
        span = f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)" if len(sizes) > 3 else str(list(sizes))
        n_full = sum(d.is_full for d in self._descriptors)
        n_lora = sum(d.has_lora for d in self._descriptors)
        lora = f", {n_lora} with LoRA at {len(self.lora_capture_sizes)} sizes" if self.enable_lora else ""
        return (
            f"DispatchTable(mode={self.mode.name}, q={self.uniform_decode_query_len}, "
            f"max_num_reqs={self.max_num_reqs}, max_num_batched_tokens={self.max_num_batched_tokens}, "
            f"capture_sizes={span}, graphs={len(self._descriptors)} "
            f"[{len(self._descriptors) - n_full} PIECEWISE, {n_full} FULL{lora}])"
        )


def _ceilings(
    ascending: tuple[BatchExecutionDescriptor, ...], top: int
) -> list[BatchExecutionDescriptor | None]:
    """For t in 0..top: the first descriptor (ascending num_tokens) with num_tokens >= t."""
    out: list[BatchExecutionDescriptor | None] = []
    i = 0
    for t in range(top + 1):
        while i < len(ascending) and ascending[i].num_tokens < t:
            i += 1
        out.append(ascending[i] if i < len(ascending) else None)
    return out
