"""Prompts to token ids: text (one user turn), chat messages, or token ids used as they are."""
from __future__ import annotations

from typing import Any

from .errors import InvalidRequest

Prompt = str | list[dict[str, str]] | list[int]


def encode_prompt(tokenizer: Any, vocab_size: int, prompt: Prompt, system: str | None = None) -> list[int]:
    """Apply the tokenizer's chat template (with an optional system prompt) and tokenize."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidRequest("empty prompt")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        return list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if "role" not in m or not isinstance(m.get("content"), str):
                raise InvalidRequest("each chat message needs a 'role' and a string 'content'")
        messages = list(prompt)
    else:
        raise InvalidRequest("empty prompt" if not prompt else
                             "a prompt is a string, a list of chat messages, or a list of token ids")
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n\n".join(m["content"] for m in messages)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:         # a lone surrogate (JSON can carry one): the tokenizer would raise
        raise InvalidRequest(f"the prompt is not valid Unicode text (a lone surrogate, U+{ord(text[e.start]):04X})") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise InvalidRequest("empty prompt")
    return ids
