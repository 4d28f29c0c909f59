"""Verified token ids -> text, incrementally: what the one-shot command prints and the daemon streams.

Each call decodes only the new ids, with the previous chunk as context (a leading space or a merge
depends on it), as TGI's and vLLM's incremental detokenizers do, so an answer of n tokens costs O(n)
decoding instead of decoding the whole text again at every token. A chunk that ends inside a
multi-byte character (byte-level BPE splits UTF-8) decodes to a replacement character; its text waits
for the tokens that complete it.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"   # what a tokenizer decodes an incomplete UTF-8 sequence to


class Detokenizer:
    """``add(ids)`` -> the text those ids add; ``flush()`` -> what is still held back."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0   # ids[_prefix:_read] were decoded last time: context for the new ones
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new: list[int]) -> str:
        self.ids.extend(new)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """The text of ids still held back (an incomplete character at the end, as decoded)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
