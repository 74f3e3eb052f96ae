"""Incremental detokenization that never emits half a multi-byte character.

Decoding one token at a time breaks characters split across tokens (byte-level BPE) and drops
leading spaces (SentencePiece). We decode a short window of recent tokens twice (with and
without the newest) and emit the difference, holding back while the text ends in U+FFFD.
"""
from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None, context: int = 4):
        self.tokenizer = tokenizer
        tail = list(prompt_ids or [])[-context:]
        self.ids: list[int] = tail                  # window context + generated ids
        self.prefix_offset = 0                      # start of the decode window
        self.read_offset = len(tail)                # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the newly completed text (maybe empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (a genuinely invalid byte sequence)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
