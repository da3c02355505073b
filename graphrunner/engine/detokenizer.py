"""Text out: a model folder's tokenizer, incremental detokenization and stop strings.

    tokenizer = load_text_tokenizer("/path/to/hf_folder")   # None for builtins
    detok = IncrementalDetokenizer(tokenizer, stop=("\\n\\n",), min_tokens=0)
    kept = detok.add_tokens([17, 5])      # None, or how many of them the text ends with (a stop string)
    detok.take_delta(finished=False)      # the text not handed out yet

Decoding follows vLLM's incremental detokenizer: each token decodes a short window
`tokens[prefix_offset:]` against the text of `tokens[prefix_offset:read_offset]`, and the
difference is appended once it does not end in U+FFFD (the window then holds an incomplete
UTF-8 sequence, or a merge the next token completes). The text is that of the generated tokens
alone, special tokens skipped: `tokenizer.decode(token_ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Any of these in a model folder means it carries a tokenizer AutoTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REPLACEMENT_CHAR = "\ufffd"


def load_text_tokenizer(model: str, required: bool = False) -> Any | None:
    """The tokenizer of a Hugging Face model folder, or None when it has none (builtins never do).
    `required` (a folder named as `tokenizer=`): ValueError instead of None, naming the folder.

    `transformers.AutoTokenizer` when transformers is installed, else a `tokenizers.Tokenizer`
    over tokenizer.json (the `text` extra) behind the same encode/decode calls.
    """
    folder = Path(model)
    if model.startswith("builtin:") or not any((folder / name).is_file() for name in TOKENIZER_FILES):
        if required:
            where = "a built-in model has none" if model.startswith("builtin:") else (
                f"the folder has neither of {list(TOKENIZER_FILES)}" if folder.is_dir() else "no such folder")
            raise ValueError(f"tokenizer={model!r}: no tokenizer to load ({where})")
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        from graphrunner.models.loader import load_tokenizer

        return _TokenizersAdapter(load_tokenizer(model))
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers / json / tokenizers errors that do not say which file is at fault
        raise ValueError(f"cannot load the tokenizer of {folder} ({_tokenizer_files(folder)}): "
                         f"{type(e).__name__}: {e}") from e


def _tokenizer_files(folder: Path) -> str:
    """The tokenizer files of `folder` that exist, and the first of them that is not valid JSON."""
    import json

    present = [name for name in (*TOKENIZER_FILES, "special_tokens_map.json") if (folder / name).is_file()]
    for name in present:
        try:
            json.loads((folder / name).read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            return f"{folder / name} is not valid JSON: {e}"
    return "files: " + ", ".join(str(folder / name) for name in present)


class _TokenizersAdapter:
    """A `tokenizers.Tokenizer` with the two calls the engine makes of a transformers tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """The output text of one request, grown token by token, cut before the first stop string.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=True)`.
        stop: strings that end the request (`SamplingParams.stop`); the text is truncated
            before the earliest one found, or after it with `include_stop_str_in_output`.
        min_tokens: stop strings count only from the token after the first `min_tokens` (vLLM).
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), min_tokens: int = 0, *,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string was found; nothing is added after it
        self._prefix_offset = 0  # the look-back window starts here
        self._read_offset = 0  # tokens before this one are in `text`
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._num_emitted = 0  # chars of `text` handed out by take_delta
        # While live, a stream holds back the chars a stop string could still begin with.
        self._hold_back = max((len(s) for s in stop), default=1) - 1

    def add_tokens(self, token_ids: Sequence[int]) -> int | None:
        """Decode the request's next tokens in order. Returns None, or, when a stop string now
        ends the text, how many of `token_ids` led to it (the rest are not added)."""
        for i, token in enumerate(token_ids):
            self.token_ids.append(int(token))
            delta = self._decode_next()
            if not delta:
                continue
            self.text += delta
            if self.stop and len(self.token_ids) > self.min_tokens and self._cut_at_stop(len(delta)):
                return i + 1
        return None

    def flush(self) -> None:
        """The request ended (not by a stop string): append what the window still holds, an
        incomplete character included, so that `text` is the decode of every token."""
        if self.stopped:
            return
        text = self._decode(self.token_ids[self._prefix_offset:])
        if len(text) > len(self._prefix_text):
            self.text += text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._prefix_text = ""

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet; while live, less the tail a stop string could start in."""
        end = len(self.text) if finished or self.stopped else max(len(self.text) - self._hold_back, 0)
        if end <= self._num_emitted:
            return ""
        delta, self._num_emitted = self.text[self._num_emitted:end], end
        return delta

    def _decode_next(self) -> str:
        """The text the last token adds, or "" while the window ends in an incomplete character."""
        text = self._decode(self.token_ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        return delta

    def _cut_at_stop(self, num_new_chars: int) -> bool:
        """Truncate the text before the earliest stop string that overlaps its last
        `num_new_chars` chars; whether one did."""
        found = []
        for s in self.stop:
            start = max(len(self.text) - num_new_chars - len(s) + 1, 0)
            at = self.text.find(s, start)
            if at >= 0:
                found.append((at, s))
        if not found:
            return False
        at, self.stop_reason = min(found, key=lambda hit: hit[0])
        self.text = self.text[:at + len(self.stop_reason) if self.include_stop_str_in_output else at]
        self.stopped = True
        return True

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

