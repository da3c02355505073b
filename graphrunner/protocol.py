"""Engine-facing types: what a scheduler hands the runner each step and what comes back.

Names follow vLLM's so that an engine written against vLLM's model runner ports with
few changes. All of these are plain host-side data (lists and dicts of Python ints).
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphrunner.multimodal.features import MultiModalFeatureSpec
from graphrunner.pool.params import PoolingParams
from graphrunner.structured_outputs import StructuredOutputsParams

# A request's seed lives in an int64 row (SamplingStates.seed) and the counter-based
# RNG (sample/rng.py) hashes both 32-bit halves of it, so every int64 is a valid,
# distinct seed; larger ints would not fit the row.
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1
# Most completions one prompt may ask for (n, best_of).
MAX_N = 1024
# Counts the sampler keeps in int32 rows (min_tokens).
INT32_MAX = (1 << 31) - 1
# Float settings reach the device as float32: larger magnitudes would turn into inf there.
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Temperatures below this are greedy (vLLM's sampling epsilon). Dividing by a tinier one
# overflows float32 (a logit of 10 at T = 1e-40 is 1e41 > 3.4e38) and samples garbage,
# while any temperature this low picks the argmax anyway.
GREEDY_TEMPERATURE = 1e-5
# Largest |logit_bias| value: it outweighs any logit (a ban or a must), and stays finite through
# the lowest sampled temperature (1e30 / 1e-5 = 1e35 < 3.4e38). Larger biases overflow to inf
# there, and inf - inf in the softmax samples garbage (or a ban of every allowed token escapes
# allowed_token_ids).
LOGIT_BIAS_MAX = 1e30


def _show(value: object) -> str:
    """repr(value), shortened for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    """A real integer (Python or numpy int); not a bool, which is no count or id."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_field(name: str, value: object, rule: str, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as a Python int, or ValueError naming the field, the value and `rule`."""
    if type(value) is int:  # the common case first: the ABC check costs more
        v = value
    elif _is_int(value):
        v = int(value)  # type: ignore[call-overload]
    else:
        raise ValueError(f"{name}={_show(value)} must be {rule}, got {type(value).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name}={_show(value)} must be {rule}")
    return v


def _float_field(name: str, value: object, rule: str, in_range: Callable[[float], bool]) -> float:
    """`value` as a finite Python float within float32 range and `in_range`, or ValueError."""
    if type(value) is float:
        v = value
    elif not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name}={_show(value)} must be {rule}, got {type(value).__name__}")
    else:
        try:
            v = float(value)
        except (OverflowError, TypeError, ValueError):
            raise ValueError(f"{name}={_show(value)} must be {rule}") from None
    if math.isfinite(v) and abs(v) > FLOAT32_MAX:
        raise ValueError(f"{name}={_show(value)} must be {rule}, within the float32 range (|x| <= {FLOAT32_MAX:.4g})")
    if not (math.isfinite(v) and in_range(v)):
        raise ValueError(f"{name}={_show(value)} must be {rule}")
    return v


def _token_ids(name: str, values: object) -> tuple[int, ...]:
    """A list of token ids as a tuple of Python ints >= 0 (the vocabulary bound is the runner's)."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise ValueError(f"{name}={_show(values)} must be a list of token ids (ints >= 0), got {type(values).__name__}")
    ids = tuple(values)
    if set(map(type, ids)) <= {int} and (not ids or min(ids) >= 0):  # the common case, at C speed
        return ids
    for pos, t in enumerate(ids):
        if not _is_int(t):
            raise ValueError(
                f"{name}[{pos}]={_show(t)} is not a token id: token ids must be ints >= 0, got {type(t).__name__}"
            )
        if t < 0:
            raise ValueError(f"{name}[{pos}] is a negative token id: {t}; token ids must be ints >= 0")
    return tuple(int(t) for t in ids)


def check_token_ids(what: str, token_ids: object) -> None:
    """Raise ValueError unless `token_ids` is a list of ints (numpy ints too; not bools,
    floats or strings). O(len) once per request; ranges are checked elsewhere."""
    if isinstance(token_ids, (str, bytes, Mapping)) or not isinstance(token_ids, Iterable):
        raise ValueError(f"{what} must be a list of token ids (ints), got {_show(token_ids)}")
    if set(map(type, token_ids)) <= {int}:  # the common case, at C speed
        return
    for pos, t in enumerate(token_ids):
        if not _is_int(t):
            raise ValueError(f"{what}: token id {_show(t)} at position {pos} is not an int (got {type(t).__name__})")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and semantics).

    temperature below GREEDY_TEMPERATURE (1e-5, 0 included) means greedy. top_k 0 (or -1, as in
    vLLM), top_p == 1 and min_p == 0 disable those filters. repetition_penalty == 1 and
    frequency/presence_penalty == 0 disable the penalties; repetition counts prompt and output
    tokens, frequency/presence count output tokens only. logit_bias maps token id -> additive
    bias (|bias| <= LOGIT_BIAS_MAX, 1e30); allowed_token_ids
    restricts sampling to those ids. Until `min_tokens` tokens were generated, the
    stop ids and EOS (unless ignore_eos) cannot be drawn. `logprobs=k` returns the
    sampled token's logprob and rank plus the top-k (k=0: the sampled token only);
    `prompt_logprobs=k` does the same for every prompt position. A request with a
    `seed` (any int64) gets the same tokens whatever batch it shares a step with.

    Construction checks every field by type and range and raises ValueError naming the
    field, the value and what is allowed (ints must be ints: no bools, floats or
    strings; floats finite reals). Vocabulary-dependent limits (token ids < vocab, slot
    counts) are checked by `SamplingStates.validate`, since the vocabulary is the runner's.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the request (the engine matches decoded text; needs a tokenizer)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # The engine's side (vLLM's names); the runner reads none of these.
    n: int = 1  # completions per prompt
    best_of: int | None = None  # sampled per prompt (>= n); the n with the highest cumulative logprob are returned
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True
    bad_words: tuple[str, ...] = ()  # words never generated (the engine tokenizes them; see bad_words_token_ids)
    detokenize: bool = True  # build the text (False: token ids only)
    # The runner's side of bad_words (vLLM's _bad_words_token_ids, the engine fills it): token sequences of
    # two or more tokens whose last token is banned after the request's generated tokens end with the rest.
    # The engine supplies a mask row for such a request every step, as for a grammar (structured_outputs).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's name), safe to change with `dataclasses.replace`."""
        return copy.deepcopy(self)

    def validate(self) -> None:
        """Check every field by type and range; ValueError names the field, the value and
        what is allowed. Changes nothing but the representation: values are normalised to
        Python ints/floats/tuples (numpy scalars and lists accepted) so that equal settings
        compare and hash equal.

        Runs at construction, so a bad value fails where the request is built, not inside
        a runner step; the engine runs it again at admission, which also catches params
        changed after construction (e.g. through object.__setattr__).
        """
        set_ = object.__setattr__
        set_(self, "max_tokens", _int_field("max_tokens", self.max_tokens, "an int >= 1", 1))
        set_(self, "temperature", _float_field("temperature", self.temperature,
                                               "a finite float >= 0 (0 is greedy)", lambda v: v >= 0.0))
        set_(self, "top_k", _int_field("top_k", self.top_k, "an int >= -1 (-1 or 0 disables it)", -1))
        set_(self, "top_p", _float_field("top_p", self.top_p, "a float in (0, 1]", lambda v: 0.0 < v <= 1.0))
        if self.seed is not None:
            set_(self, "seed", _int_field("seed", self.seed, "None or an int in [-2**63, 2**63 - 1] (int64)",
                                          SEED_MIN, SEED_MAX))
        if isinstance(self.ignore_eos, (bool, np.bool_)):
            set_(self, "ignore_eos", bool(self.ignore_eos))
        else:
            kind = type(self.ignore_eos).__name__
            raise ValueError(f"ignore_eos={_show(self.ignore_eos)} must be a bool, got {kind}")
        set_(self, "min_p", _float_field("min_p", self.min_p, "a float in [0, 1] (0 disables it)",
                                         lambda v: 0.0 <= v <= 1.0))
        set_(self, "repetition_penalty", _float_field(
            "repetition_penalty", self.repetition_penalty, "a finite float > 0 (1 disables it)", lambda v: v > 0.0))
        for name in ("frequency_penalty", "presence_penalty"):
            set_(self, name, _float_field(name, getattr(self, name), "a float in [-2, 2] (0 disables it)",
                                          lambda v: -2.0 <= v <= 2.0))
        set_(self, "min_tokens", _int_field("min_tokens", self.min_tokens, f"an int in [0, {INT32_MAX}]", 0, INT32_MAX))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, _int_field(name, value, "None or an int >= 0 (0: the sampled token only)", 0))
        # Accept lists/dicts from callers but keep the dataclass hashable and immutable.
        stop = () if self.stop_token_ids is None else _token_ids("stop_token_ids", self.stop_token_ids)
        set_(self, "stop_token_ids", stop)
        if self.allowed_token_ids is not None:
            allowed = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids=[] is empty: it would allow no token (use None to allow all)")
            set_(self, "allowed_token_ids", allowed)
        if self.logit_bias is not None:
            bias = FrozenLogitBias(self.logit_bias)
            set_(self, "logit_bias", bias if bias else None)
        stop_strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"stop={_show(self.stop)} must be a string or a list of non-empty strings")
        set_(self, "stop", stop_strings)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs={_show(self.structured_outputs)} must be a StructuredOutputsParams")
        self._validate_engine_fields()

    def _validate_engine_fields(self) -> None:
        """The fields only the engine reads (n, best_of, the text switches, bad_words) and bad_words_token_ids."""
        set_ = object.__setattr__
        set_(self, "n", _int_field("n", self.n, f"an int in [1, {MAX_N}]", 1, MAX_N))
        if self.best_of is not None:
            set_(self, "best_of", _int_field("best_of", self.best_of, f"None or an int in [n={self.n}, {MAX_N}]",
                                             self.n, MAX_N))
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name}={_show(value)} must be a bool, got {type(value).__name__}")
            set_(self, name, bool(value))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words or ())
        if not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words={_show(self.bad_words)} must be a list of non-blank strings")
        set_(self, "bad_words", words)
        sequences = tuple(_token_ids("bad_words_token_ids", seq) for seq in self.bad_words_token_ids or ())
        short = next((list(seq) for seq in sequences if len(seq) < 2), None)
        if short is not None:
            raise ValueError(f"bad_words_token_ids: {short} has fewer than 2 tokens (ban one token with logit_bias)")
        set_(self, "bad_words_token_ids", sequences)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder, named and numbered by the caller.

    `lora_int_id` (>= 1) identifies the adapter: requests with equal ids share one loaded copy
    (the folder is read once, while it stays cached), as in vLLM. `lora_path` is a folder holding
    `adapter_config.json` and `adapter_model.safetensors`.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id={self.lora_int_id!r} must be an int >= 1")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is empty; give the adapter's folder")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __str__(self) -> str:
        return f"adapter {self.lora_name!r} (id {self.lora_int_id}, {self.lora_path})"


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption.

    `output_token_ids` carries tokens generated before a preemption: the runner
    recomputes their KV together with the prompt (preemption by recompute) and
    continues sampling after them.

    vLLM's optional fields: `pooling_params` marks a pooling request (a pooling runner's only
    kind); `prompt_embeds` [len(prompt_token_ids), hidden] replaces the prompt's token embeddings
    (its token ids are placeholders); `mm_features` are the prompt's multimodal inputs, whose
    encoder outputs replace the embeddings of their placeholder positions.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter it runs with (vLLM's field); None: the base model
    pooling_params: PoolingParams | None = None
    prompt_embeds: Any = None  # torch.Tensor [prompt_len, hidden]
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Built once per admission (not per step): O(tokens) at C speed for int lists.
        # A float or string id would otherwise be truncated or fail deep inside a step.
        check_token_ids(f"request {self.req_id!r} prompt_token_ids", self.prompt_token_ids)
        if self.output_token_ids:
            check_token_ids(f"request {self.req_id!r} output_token_ids", self.output_token_ids)
        # Tuples and arrays as lists: `all_token_ids` concatenates the two.
        if type(self.prompt_token_ids) is not list:
            self.prompt_token_ids = list(self.prompt_token_ids)
        if type(self.output_token_ids) is not list:
            self.output_token_ids = list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class CachedRequestData:
    """Requests that ran before and continue this step (column-wise, as in vLLM)."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to each request's table this step (None = no new blocks).
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's plan, from the engine's scheduler."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding (vLLM's field): per verifying request, the draft ids placed
    # behind its last sampled token, so it is scheduled 1 + len(drafts) tokens. -1 is a
    # placeholder: "the draft the runner proposed for this slot" (read on the device; async
    # scheduling never knows the ids). A decoding request scheduled q > 1 tokens without an
    # entry here has q - 1 placeholders. Real ids (>= 0) replace the runner's own drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Multimodal (vLLM's fields): per request, the indices (into its `mm_features`) of the inputs
    # to encode this step; and the content hashes whose encoder outputs the runner may drop.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # KV connector (vLLM's field): what the runner loads before the step and saves after it, built by the
    # scheduler's side of the connector (graphrunner.kv_transfer); None when no connector is on.
    kv_connector_metadata: Any = None

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls()


class ModelRunnerOutput:
    """Sampled tokens of one step.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; it is empty for a request whose
    prefill chunk did not reach the end of its prompt (nothing to sample yet).

    The runner builds this from a token array (`from_token_array`): the per-entry lists
    and the id -> index map are made on first access, not per step. Building 256
    one-token lists costs ~12 us, a fifth of the per-step host budget; an engine that
    reads `token_array` / `sampled_token(i)` never pays it.
    """

    __slots__ = ("req_ids", "_index", "_index_source", "_sampled", "_tokens", "_produces", "logprobs",
                 "prompt_logprobs_dict", "pooler_output")

    def __init__(
        self,
        req_ids: list[str] | None = None,
        req_id_to_index: dict[str, int] | None = None,
        sampled_token_ids: list[list[int]] | None = None,
        logprobs: list[list[dict[int, Logprob]]] | None = None,
        prompt_logprobs_dict: dict[str, list[dict[int, Logprob] | None]] | None = None,
        pooler_output: list[Any] | None = None,
    ):
        self.req_ids: list[str] = req_ids if req_ids is not None else []
        self._index = req_id_to_index if req_id_to_index is not None else ({} if req_ids is None else None)
        self._index_source: dict[str, int] | None = None
        self._sampled = sampled_token_ids if sampled_token_ids is not None else ([] if req_ids is None else None)
        self._tokens: np.ndarray | None = None
        self._produces: np.ndarray | None = None
        # Per entry, one `{token_id: Logprob}` per sampled token (the sampled token first, with
        # its rank, then the request's top-k); [] for entries that asked for none. None when
        # no entry of the step asked for logprobs.
        self.logprobs = logprobs
        # Requests whose prompt logprobs completed this step: req_id -> PromptLogprobs.
        self.prompt_logprobs_dict = prompt_logprobs_dict if prompt_logprobs_dict is not None else {}
        # A pooling runner's step (vLLM's field): per entry its pooled tensor, None where the
        # entry's prompt is not complete yet; empty for a generative runner.
        self.pooler_output: list[Any] = pooler_output if pooler_output is not None else []

    @classmethod
    def from_token_array(
        cls,
        req_ids: list[str],
        tokens: np.ndarray,
        produces: np.ndarray | None = None,
        index_source: dict[str, int] | None = None,
        logprobs: list[list[dict[int, Logprob]]] | None = None,
        prompt_logprobs_dict: dict[str, list[dict[int, Logprob] | None]] | None = None,
    ) -> ModelRunnerOutput:
        """One token per entry. tokens: [R] int (owned by the output: not a view of a
        reused buffer); produces: [R] bool, False where the entry sampled nothing (None:
        every entry did); index_source: `req_ids`' id -> index map, copied on first access
        (None: built from req_ids)."""
        out = cls(req_ids, None, None, logprobs, prompt_logprobs_dict)
        out._tokens, out._produces, out._index_source = tokens, produces, index_source
        return out

    @classmethod
    def from_token_rows(
        cls,
        req_ids: list[str],
        tokens: np.ndarray,
        num_tokens: np.ndarray,
        index_source: dict[str, int] | None = None,
        logprobs: list[list[dict[int, Logprob]]] | None = None,
        prompt_logprobs_dict: dict[str, list[dict[int, Logprob] | None]] | None = None,
    ) -> ModelRunnerOutput:
        """Several tokens per entry (speculative decoding): tokens [R, k + 1] int, of which
        entry i emitted the first num_tokens[i] (0..k + 1; 0: it sampled nothing)."""
        sampled = [row[:n] for row, n in zip(tokens.tolist(), num_tokens.tolist(), strict=True)]
        out = cls(req_ids, None, sampled, logprobs, prompt_logprobs_dict)
        out._index, out._index_source = None, index_source
        return out

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls()

    # ---- lazily built views ----------------------------------------------------------
    @property
    def req_id_to_index(self) -> dict[str, int]:
        if self._index is None:
            src = self._index_source
            self._index = dict(src) if src is not None else {rid: i for i, rid in enumerate(self.req_ids)}
        return self._index

    @req_id_to_index.setter
    def req_id_to_index(self, value: dict[str, int]) -> None:
        self._index = value

    @property
    def sampled_token_ids(self) -> list[list[int]]:
        if self._sampled is None:
            assert self._tokens is not None
            if self._produces is None:
                self._sampled = [[t] for t in self._tokens.tolist()]
            else:
                pairs = zip(self._tokens.tolist(), self._produces.tolist(), strict=True)
                self._sampled = [[t] if p else [] for t, p in pairs]
        return self._sampled

    @sampled_token_ids.setter
    def sampled_token_ids(self, value: list[list[int]]) -> None:
        self._sampled, self._tokens, self._produces = value, None, None

    @property
    def token_array(self) -> np.ndarray | None:
        """[R] int32, entry i's sampled token (meaningless where it sampled nothing); None
        for an output built from lists."""
        return self._tokens

    @property
    def produces_array(self) -> np.ndarray | None:
        """[R] bool beside `token_array`, False where the entry sampled nothing; None when every
        entry sampled (or the output was built from lists)."""
        return self._produces if self._tokens is not None else None

    def sampled_token(self, index: int) -> int | None:
        """Entry `index`'s one sampled token, None where it sampled nothing."""
        if self._tokens is not None and self._sampled is None:
            if self._produces is not None and not self._produces[index]:
                return None
            return int(self._tokens[index])
        toks = self.sampled_token_ids[index]
        if len(toks) > 1:
            raise ValueError(f"entry {index} sampled {len(toks)} tokens; use sampled_token_ids")
        return toks[0] if toks else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelRunnerOutput):
            return NotImplemented
        return (self.req_ids == other.req_ids and self.req_id_to_index == other.req_id_to_index
                and self.sampled_token_ids == other.sampled_token_ids and self.logprobs == other.logprobs
                and self.prompt_logprobs_dict == other.prompt_logprobs_dict)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (f"ModelRunnerOutput(req_ids={self.req_ids!r}, sampled_token_ids={self.sampled_token_ids!r}, "
                f"logprobs={'None' if self.logprobs is None else '...'}, "
                f"prompt_logprobs_dict={list(self.prompt_logprobs_dict)!r})")


# ---- logprob containers (vLLM's shape) ----------------------------------------------


def _bias_key(token: object) -> int:
    """A logit_bias key as a token id: an int, or a str of one (JSON object keys are strings)."""
    if _is_int(token):
        return int(token)  # type: ignore[call-overload]
    if isinstance(token, str):
        try:
            return int(token)
        except ValueError:
            pass
    raise ValueError(f"logit_bias key {_show(token)} is not a token id (an int >= 0, or a str of one)")


class FrozenLogitBias(dict):
    """An immutable, hashable `{token_id: bias}` mapping (SamplingParams.logit_bias).

    Keys are ints (str keys, as JSON clients send them, are converted); biases must be
    within [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (1e30). Mutating methods raise TypeError, so SamplingParams stays hashable.
    """

    def __init__(self, items: Mapping[int, float] | None = None):
        if items is None:
            items = {}
        elif not isinstance(items, Mapping):
            try:
                items = dict(items)  # (token_id, bias) pairs
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias={_show(items)} must be a mapping {{token_id: bias}}") from None
        clean: dict[int, float] = {}
        for token, bias in items.items():
            token_id = _bias_key(token)
            if token_id < 0:
                raise ValueError(f"logit_bias token id {token_id} must be >= 0")
            clean[token_id] = _float_field(f"logit_bias[{token_id}]", bias, f"a finite float in [-{LOGIT_BIAS_MAX:g}, "
                                           f"{LOGIT_BIAS_MAX:g}]", lambda v: abs(v) <= LOGIT_BIAS_MAX)
        super().__init__(clean)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def _immutable(self, *args, **kwargs):
        raise TypeError("SamplingParams.logit_bias is immutable")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _immutable

    def __ior__(self, other):  # type: ignore[misc]
        self._immutable()

    def __reduce__(self):
        return (FrozenLogitBias, (dict(self),))


@dataclass
class DraftTokenIds:
    """The drafts a speculative step proposed for the next one (vLLM's `DraftTokenIds`):
    `draft_token_ids[i]` (0..k ids) belongs to `req_ids[i]`."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


@dataclass(frozen=True)
class Logprob:
    """One token's log probability (vLLM's `Logprob`): rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# A generated position's logprobs: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
# Prompt positions' logprobs; the first prompt token has none (no context), as in vLLM.
PromptLogprobs = list[dict[int, Logprob] | None]  # one entry per prompt token
