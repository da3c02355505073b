"""BatchExecutionDescriptor: the key of a captured graph and the plan of one step.

Pure standard library (no torch). A descriptor says which runtime mode a step uses and
the padded shape it runs at:

    FULL       pads tokens and requests: num_reqs is set; uniform_token_count = q for
               uniform-decode graphs (then num_tokens == num_reqs * q), None for mixed ones.
    PIECEWISE  pads tokens only: num_reqs is None because attention runs eagerly
               between the graphed pieces with the real request count.
    NONE       eager and unpadded: the real sizes (num_reqs may be left None).

`has_lora` says whether the step applies LoRA adapters: a graph captured with them runs their
kernels, one captured without them has none. A batch with adapters fits only a LoRA graph, a batch
without fits only a plain one, so the plain path never pays for LoRA and a LoRA batch never replays
a graph that would drop its adapters.

`microbatched` marks the FULL graph of a uniform-decode step run as two microbatches on two
streams (dual-batch overlap under lockstep DP): the cut is static, after num_reqs // 2 requests,
so both halves have fixed shapes and the graph holds both streams' work. It is a separate key: a
step replays it only when every DP rank agreed to microbatch (their collectives must match).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from capture.modes import CUDAGraphMode

__all__ = ["BatchExecutionDescriptor"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    """Padded batch shape plus runtime mode; frozen and hashable (a graph key)."""

    cg_mode: CUDAGraphMode
    num_tokens: int
    num_reqs: int | None = None
    uniform_token_count: int | None = None
    has_lora: bool = False
    microbatched: bool = False
    # The mode tests, as plain attributes: a step reads them several times, and an attribute
    # costs no Python call the way a property does (derived, so not part of the key).
    is_full: bool = field(init=False, repr=False, compare=False)
    is_piecewise: bool = field(init=False, repr=False, compare=False)
    is_eager: bool = field(init=False, repr=False, compare=False)
    is_uniform_decode: bool = field(init=False, repr=False, compare=False)  # FULL, every request q tokens

    def __post_init__(self) -> None:
        mode = self.cg_mode
        if not isinstance(mode, CUDAGraphMode) or not mode.is_runtime_mode:
            allowed = [m.name for m in CUDAGraphMode if m.is_runtime_mode]
            raise ValueError(f"cg_mode={mode!r} is not a runtime mode; allowed: {allowed}")
        if not _is_int(self.num_tokens) or self.num_tokens < 1:
            raise ValueError(f"num_tokens={self.num_tokens!r} must be an int >= 1")
        if self.num_reqs is not None and (
            not _is_int(self.num_reqs) or not 1 <= self.num_reqs <= self.num_tokens
        ):
            raise ValueError(f"num_reqs={self.num_reqs!r} must be an int in [1, num_tokens={self.num_tokens}]")
        if mode is CUDAGraphMode.FULL and self.num_reqs is None:
            raise ValueError("a FULL descriptor needs num_reqs: the graph replays a fixed request count")
        if mode is CUDAGraphMode.PIECEWISE and self.num_reqs is not None:
            raise ValueError(
                f"num_reqs={self.num_reqs} on a PIECEWISE descriptor: PIECEWISE pads tokens only, must be None"
            )
        if not isinstance(self.has_lora, bool):
            raise ValueError(f"has_lora={self.has_lora!r} must be a bool")
        q = self.uniform_token_count
        if q is not None:
            if not _is_int(q) or q < 1:
                raise ValueError(f"uniform_token_count={q!r} must be an int >= 1")
            if mode is not CUDAGraphMode.FULL:
                raise ValueError(f"uniform_token_count={q} is only meaningful for FULL descriptors, got {mode.name}")
            if self.num_tokens != self.num_reqs * q:  # type: ignore[operator]
                raise ValueError(
                    f"uniform-decode descriptor needs num_tokens == num_reqs * q, got "
                    f"{self.num_tokens} != {self.num_reqs} * {q}"
                )
        if not isinstance(self.microbatched, bool):
            raise ValueError(f"microbatched={self.microbatched!r} must be a bool")
        if self.microbatched and (q is None or self.num_reqs is None or self.num_reqs < 2):
            raise ValueError(f"microbatched needs a uniform-decode FULL descriptor of at least 2 requests, got "
                             f"{self.cg_mode.name}(t={self.num_tokens}, r={self.num_reqs}, q={q})")
        object.__setattr__(self, "is_full", mode is CUDAGraphMode.FULL)
        object.__setattr__(self, "is_piecewise", mode is CUDAGraphMode.PIECEWISE)
        object.__setattr__(self, "is_eager", mode is CUDAGraphMode.NONE)
        object.__setattr__(self, "is_uniform_decode", q is not None)

    def padded_tokens(self, real_tokens: int) -> int:
        """How many padding tokens a batch of `real_tokens` gets under this descriptor."""
        if not 0 <= real_tokens <= self.num_tokens:
            raise ValueError(f"real_tokens={real_tokens} must be in [0, num_tokens={self.num_tokens}]")
        return self.num_tokens - real_tokens

    def padded_reqs(self, real_reqs: int) -> int:
        """How many padding requests (0 unless the descriptor pads requests, i.e. FULL)."""
        if self.num_reqs is None:
            return 0
        if not 0 <= real_reqs <= self.num_reqs:
            raise ValueError(f"real_reqs={real_reqs} must be in [0, num_reqs={self.num_reqs}]")
        return self.num_reqs - real_reqs

    def fits(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None = None,
             has_lora: bool = False) -> bool:
        """Can a batch of these real sizes run under this descriptor (after padding)?

        `uniform_token_count` is q when every request of the batch has exactly q tokens,
        else None. Uniform-decode graphs only take uniform batches with the same q. `has_lora`:
        the batch has adapter rows; it must equal the descriptor's (module docstring).
        """
        return (
            self.has_lora == has_lora
            and (self.uniform_token_count is None or self.uniform_token_count == uniform_token_count)
            and (self.num_reqs is None or self.num_reqs >= num_reqs)
            and self.num_tokens >= num_tokens
        )

    def misfit(self, num_reqs: int, num_tokens: int, uniform_token_count: int | None = None,
               has_lora: bool = False) -> str | None:
        """Why a batch does not fit (None when it fits): the human side of `fits`."""
        if self.has_lora != has_lora:
            return ("graph captured without LoRA, the batch has adapters" if has_lora
                    else "LoRA graph, the batch has no adapters")
        q = self.uniform_token_count
        if q is not None and q != uniform_token_count:
            got = "a mixed batch" if uniform_token_count is None else f"a uniform batch with q={uniform_token_count}"
            return f"uniform-decode graph for q={q}, got {got}"
        if self.num_reqs is not None and self.num_reqs < num_reqs:
            return f"num_reqs={num_reqs} exceeds the graph's {self.num_reqs}"
        if self.num_tokens < num_tokens:
            return f"num_tokens={num_tokens} exceeds the graph's {self.num_tokens}"
        return None

    def __str__(self) -> str:
        parts = [f"t={self.num_tokens}"]
        if self.num_reqs is not None:
            parts.append(f"r={self.num_reqs}")
        if self.uniform_token_count is not None:
            parts.append(f"q={self.uniform_token_count}")
        if self.has_lora:
            parts.append("lora")
        if self.microbatched:
            parts.append("ubatch")
        return f"{self.cg_mode.name}({','.join(parts)})"
