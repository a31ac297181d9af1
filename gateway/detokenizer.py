"""Token ids to text one token at a time, never splitting a multi-byte character (vLLM's scheme).

Two offsets into the ids decoded so far:

    [0, prefix_offset)              text already emitted and no longer needed as context
    [prefix_offset, read_offset)    text already emitted, decoded again as context
    [read_offset, len(token_ids))   not yet emitted

A step decodes `[prefix_offset:]` and emits what it adds to `[prefix_offset:read_offset]`, unless
the decoded text ends in U+FFFD: then the last token holds only part of a character and we wait
for the rest. Decoding a window rather than single tokens keeps the spacing and merges the
tokenizer's decoder applies across tokens.
"""
from __future__ import annotations

from functools import lru_cache

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The concatenation of `add`s and the final `flush` equals `tokenizer.decode(token_ids)`.

    `skipped_ids`, when given, are left out and every other token decoded, special or not:
    skip_special_tokens that keeps some special tokens (a reasoning parser's tags)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, skipped_ids: frozenset[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.skipped_ids = skipped_ids if skip_special_tokens else None
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, token_ids: list[int]) -> str:
        if self.skipped_ids is not None:
            return self.tokenizer.decode([t for t in token_ids if t not in self.skipped_ids], skip_special_tokens=False)
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; the text it completes ("" while a character is still partial)."""
        self.token_ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back at the end of the sequence (a trailing partial character as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]


def token_text_cache(tokenizer, maxsize: int = 65536):
    """`token_id -> its text alone` (what logprobs report), memoized."""

    @lru_cache(maxsize=maxsize)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return token_text
