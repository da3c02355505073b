"""Bad words (vLLM's `SamplingParams.bad_words`): words a request never generates.

Each word is tokenized as vLLM does: the word without leading spaces, and again after one space
(kept only when its first token differs and it has as many tokens: a tokenizer that folds the
space into the word's first token). A sequence of one token is banned outright (a logit bias the
runner applies every step). A sequence of several tokens bans its last token at a step where the
request's generated tokens (not the prompt's) end with the sequence's other tokens: the engine
adds that step's mask row for the request (`WordBans.banned`), as it does for a grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["WordBans", "bad_words_token_ids", "clear_bits"]


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Every token sequence `words` ban, vLLM's way (module docstring). ValueError for a word
    that encodes to no token."""
    sequences: list[list[int]] = []
    for word in words:
        plain = _encode_plain(tokenizer, word.lstrip())
        if not plain:
            raise ValueError(f"bad_words: {word!r} encodes to no token")
        sequences.append(plain)
        spaced = _encode_plain(tokenizer, " " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    """`text`'s token ids without special tokens (BOS) added."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # the `tokenizers` adapter adds none
        return list(tokenizer.encode(text))


class WordBans:
    """One request's bad words of several tokens and its last generated tokens (as many as the
    longest word's prefix): which tokens its next step may not sample."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        if not sequences or min(map(len, sequences)) < 2:
            raise ValueError(f"WordBans takes sequences of 2 or more tokens, got {[list(s) for s in sequences]}")
        # prefix -> the last tokens it bans
        self.by_prefix: dict[tuple[int, ...], set[int]] = {}
        for seq in sequences:
            self.by_prefix.setdefault(tuple(seq[:-1]), set()).add(int(seq[-1]))
        self.prefix_lens = sorted({len(prefix) for prefix in self.by_prefix})
        self.recent: list[int] = []  # the request's last generated tokens, at most max(prefix_lens)

    def accept(self, tokens: Sequence[int]) -> None:
        """The request generated `tokens` (in order)."""
        self.recent = [*self.recent, *tokens][-self.prefix_lens[-1] :]

    def banned(self, drafts: Sequence[int] = ()) -> set[int]:
        """The tokens banned after the generated tokens and then `drafts` (speculation: tokens the
        step verifies before this position)."""
        tail = [*self.recent, *drafts][-self.prefix_lens[-1] :]
        out: set[int] = set()
        for n in self.prefix_lens:
            if n > len(tail):
                break
            out |= self.by_prefix.get(tuple(tail[len(tail) - n :]), set())
        return out

    def valid_drafts(self, drafts: Sequence[int]) -> list[int]:
        """The drafts before the first one banned where it stands."""
        for j, token in enumerate(drafts):
            if token in self.banned(drafts[:j]):
                return list(drafts[:j])
        return list(drafts)


def clear_bits(row: np.ndarray, tokens: set[int]) -> None:
    """Forbid `tokens` in one packed bitmask row ([words] int32, bit v % 32 of word v // 32)."""
    bits = row.view(np.uint32)
    for token in tokens:
        bits[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
