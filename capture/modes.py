"""Graph modes, what attention backends can replay, and how a requested mode is resolved.

Pure standard library on purpose (no torch, no graphrunner): the dispatch table, the
inspection tool and config parsing import this without a GPU stack.

A *mode* names one routine for uniform-decode batches and one for mixed batches
(anything with a prefill or uneven query lengths):

    mode                 decode routine   mixed routine
    NONE                 NONE             NONE
    PIECEWISE            PIECEWISE        PIECEWISE
    FULL                 FULL             FULL
    FULL_DECODE_ONLY     FULL             NONE
    FULL_AND_PIECEWISE   FULL             PIECEWISE      (the default)

Only NONE, PIECEWISE and FULL are *runtime* modes: the mode a single step runs in.

Resolution is data: `MODE_RULES` maps (requested mode, backend support) to a downgrade
target with its reason, or to "cannot be honoured". A downgrade is always logged on
the "graphrunner.capture" logger; an explicit user choice that cannot be honoured at
all raises, naming the value and the modes the backend allows.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

logger = logging.getLogger("graphrunner.capture")

__all__ = [
    "AttentionCGSupport",
    "CUDAGraphMode",
    "DEFAULT_MODE",
    "MODE_RULES",
    "ModeRule",
    "Resolution",
    "resolve_mode",
    "supported_modes",
]


def _parse_enum(
    cls: type[enum.Enum], value: object, what: str, aliases: Mapping[str, str] | None = None
) -> enum.Enum:
    """Member of `cls` from a member or a case-insensitive name ('-' and ' ' read as '_')."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower().replace("-", "_").replace(" ", "_")
        key = (aliases or {}).get(key, key)
        for member in cls:
            if member.name.lower() == key:
                return member
    allowed = [m.name.lower() for m in cls]
    raise ValueError(f"unknown {what} {value!r}; allowed: {allowed}")


class CUDAGraphMode(enum.Enum):
    """How steps run: eager, PIECEWISE graphs, FULL graphs, or a decode/mixed combination."""

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @classmethod
    def parse(cls, value: str | CUDAGraphMode) -> CUDAGraphMode:
        """`"full_and_piecewise"`, `"FULL"`, `"full-decode-only"`, `"eager"` (= NONE), or a member."""
        return _parse_enum(cls, value, "cudagraph_mode", _MODE_ALIASES)  # type: ignore[return-value]

    @classmethod
    def parse_capturing(cls, value: str | CUDAGraphMode) -> CUDAGraphMode:
        """`parse`, refusing NONE: for the commands whose point is to capture graphs."""
        mode = cls.parse(value)
        if mode is cls.NONE:
            capturing = ", ".join(m.name for m in cls if m is not cls.NONE)
            raise ValueError(f"mode=NONE captures nothing; pick one of {capturing}")
        return mode

    @property
    def decode_mode(self) -> CUDAGraphMode:
        """Runtime mode for uniform-decode batches."""
        return _ROUTINES[self][0]

    @property
    def mixed_mode(self) -> CUDAGraphMode:
        """Runtime mode for mixed batches (prefills, uneven query lengths)."""
        return _ROUTINES[self][1]

    @property
    def separate_routine(self) -> bool:
        """True when decode and mixed batches run in different runtime modes."""
        return self.decode_mode is not self.mixed_mode

    @property
    def is_runtime_mode(self) -> bool:
        """True for the modes a single step can run in: NONE, PIECEWISE, FULL."""
        return _ROUTINES[self] == (self, self)

    @property
    def has_full_graphs(self) -> bool:
        return CUDAGraphMode.FULL in _ROUTINES[self]

    @property
    def has_piecewise_graphs(self) -> bool:
        return CUDAGraphMode.PIECEWISE in _ROUTINES[self]


_MODE_ALIASES: Mapping[str, str] = MappingProxyType({"eager": "none"})

# mode -> (decode routine, mixed routine)
_ROUTINES: Mapping[CUDAGraphMode, tuple[CUDAGraphMode, CUDAGraphMode]] = MappingProxyType(
    {
        CUDAGraphMode.NONE: (CUDAGraphMode.NONE, CUDAGraphMode.NONE),
        CUDAGraphMode.PIECEWISE: (CUDAGraphMode.PIECEWISE, CUDAGraphMode.PIECEWISE),
        CUDAGraphMode.FULL: (CUDAGraphMode.FULL, CUDAGraphMode.FULL),
        CUDAGraphMode.FULL_DECODE_ONLY: (CUDAGraphMode.FULL, CUDAGraphMode.NONE),
        CUDAGraphMode.FULL_AND_PIECEWISE: (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE),
    }
)


class AttentionCGSupport(enum.IntEnum):
    """Which batches an attention backend can replay inside a FULL graph.

    Ordered, so the weakest of several backends is `min(...)`.
    """

    NEVER = 0  # attention must run eagerly: only PIECEWISE graphs (or none)
    UNIFORM_DECODE = 1  # uniform-decode batches (every request q tokens, any fixed q)
    ALWAYS = 2  # any batch, mixed prefills included

    @classmethod
    def parse(cls, value: str | AttentionCGSupport) -> AttentionCGSupport:
        """`"never"`, `"UNIFORM_DECODE"`, `"always"`, or a member."""
        return _parse_enum(cls, value, "attention cudagraph support")  # type: ignore[return-value]


DEFAULT_MODE = CUDAGraphMode.FULL_AND_PIECEWISE


@dataclass(frozen=True)
class ModeRule:
    """What happens to a requested mode on a backend: `to` is the downgrade, None = impossible."""

    to: CUDAGraphMode | None
    reason: str


_M, _S = CUDAGraphMode, AttentionCGSupport

# (requested mode, backend support) -> rule. Pairs not listed are honoured as requested:
# NONE and PIECEWISE work on every backend (PIECEWISE runs attention eagerly between
# graphed pieces), and ALWAYS honours everything.
MODE_RULES: Mapping[tuple[CUDAGraphMode, AttentionCGSupport], ModeRule] = MappingProxyType(
    {
        (_M.FULL, _S.UNIFORM_DECODE): ModeRule(
            _M.FULL_AND_PIECEWISE,
            "the backend replays only uniform-decode batches in a FULL graph; "
            "mixed batches run PIECEWISE (attention eager between graphed pieces)",
        ),
        (_M.FULL, _S.NEVER): ModeRule(
            None, "the backend cannot run inside any FULL graph, so no FULL graph can be captured"
        ),
        (_M.FULL_DECODE_ONLY, _S.NEVER): ModeRule(
            None, "the backend cannot run inside any FULL graph, so this mode would capture no graph at all"
        ),
        (_M.FULL_AND_PIECEWISE, _S.NEVER): ModeRule(
            _M.PIECEWISE,
            "the backend cannot run inside a FULL graph; decode batches run PIECEWISE like mixed ones",
        ),
    }
)
del _M, _S


def supported_modes(support: AttentionCGSupport | str) -> tuple[CUDAGraphMode, ...]:
    """Modes honoured exactly as requested by a backend with this support level."""
    support = AttentionCGSupport.parse(support)
    return tuple(m for m in CUDAGraphMode if (m, support) not in MODE_RULES)


@dataclass(frozen=True)
class Resolution:
    """The mode a runner uses, and why (for logs and `graphrunner inspect`)."""

    mode: CUDAGraphMode
    downgraded_from: CUDAGraphMode | None = None  # the mode asked for, when it was not kept
    reason: str = ""

    def __str__(self) -> str:
        if self.downgraded_from is None:
            return f"{self.mode.name} ({self.reason})" if self.reason else self.mode.name
        return f"{self.mode.name} (downgraded from {self.downgraded_from.name}: {self.reason})"


def resolve_mode(
    requested: CUDAGraphMode | str | None,
    support: AttentionCGSupport | str,
    *,
    enforce_eager: bool = False,
    backend: str = "the attention backend",
) -> Resolution:
    """Resolve the user's `cudagraph_mode` against what the attention backend supports.

    requested=None means "not set": `DEFAULT_MODE`, downgraded (logged at INFO) when the
    backend cannot honour it. An explicit mode is downgraded with a WARNING when
    `MODE_RULES` names a fallback, and raises ValueError (naming the value and the
    modes this backend allows) when it cannot be honoured at all. `enforce_eager=True`
    wins over everything (NONE); overriding an explicit graph mode is logged.
    `support` is the weakest level of all backends in use (`min(...)`).
    """
    support = AttentionCGSupport.parse(support)
    explicit = requested is not None
    mode = CUDAGraphMode.parse(requested) if explicit else DEFAULT_MODE  # type: ignore[arg-type]

    if enforce_eager:
        if explicit and mode is not CUDAGraphMode.NONE:
            logger.warning("enforce_eager=True overrides cudagraph_mode=%s: running eager (NONE)", mode.name)
            return Resolution(CUDAGraphMode.NONE, mode, f"enforce_eager=True overrides cudagraph_mode={mode.name}")
        return Resolution(CUDAGraphMode.NONE, None, "enforce_eager=True")

    rule = MODE_RULES.get((mode, support))
    if rule is None:
        return Resolution(mode, None, "requested" if explicit else "default")
    if rule.to is None:
        allowed = [m.name for m in supported_modes(support)]
        raise ValueError(
            f"cudagraph_mode={mode.name} cannot be honoured by {backend} "
            f"(cudagraph support {support.name}): {rule.reason}; allowed with this backend: {allowed}"
        )
    origin = "cudagraph_mode" if explicit else "default cudagraph_mode"
    level = logging.WARNING if explicit else logging.INFO
    logger.log(
        level,
        "%s=%s downgraded to %s for %s (cudagraph support %s): %s",
        origin, mode.name, rule.to.name, backend, support.name, rule.reason,
    )
    return Resolution(rule.to, mode, rule.reason)
