"""Streaming text never splits a multi-byte character, and concatenates to the full decode."""
from __future__ import annotations

import pytest

from pdchat.engine.detokenizer import IncrementalDetokenizer
from pdchat.engine.random_models import byte_tokenizer

TEXTS = ["naïve café 😀 — 日本語のテキスト", "emoji🎉🎉 and ZWJ 👩‍👩‍👧 done", "plain ascii"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_stream_splits_characters_across_tokens(text):
    tok = byte_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))      # one token per byte: characters do split
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("prompt: ", add_special_tokens=False))
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_default_tokenizer_stream(default_engine):
    tok = default_engine.tokenizer
    text = "Größe: 12 µm — 東京 🚀 ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=default_engine.encode("hi"))
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_are_flushed_at_the_end():
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok)
    cut = "é".encode("utf-8")[:1]          # half a character, then the stream ends
    assert detok.add(cut[0]) == ""
    assert detok.flush() == "\ufffd"
