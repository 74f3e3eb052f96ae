"""The OpenAI wire format: request schemas (strict: unknown fields and bad values are 400s), the
response and chunk objects, and the error object.

Only what pdchat can honour is accepted. Fields that OpenAI clients commonly send with their
default values (n=1, penalties 0, no logprobs) are accepted at those values and refused otherwise,
so a client never silently gets something other than what it asked for. `top_k`, `min_p` and
`ignore_eos` are accepted as vLLM/SGLang do (load generators rely on `ignore_eos`), and
`cache_salt` as vLLM does (a separate prefix cache for the requests that share a salt).

Bodies are decoded strictly: NaN and Infinity, absurdly long numbers, nesting Python cannot
follow and lone surrogates (not Unicode, so neither tokenizable nor encodable) are 400s.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.responses import JSONResponse

from pdchat.engine import settings

# OpenAI's default for /v1/completions; chat completions default to "until the context is full".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI allows 4 stop sequences; every one is matched at every generated token, so a request
# with thousands would slow every stream in its batch.
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_SALT_CHARS = 256
# No field takes a number this long (a 64-bit seed has 20 digits); Python refuses past 4,300.
MAX_NUMBER_DIGITS = 40
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An error the HTTP layer turns into OpenAI's error object with this status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorResponse(JSONResponse):
    """The error object as an HTTP response. ASCII JSON: a message quoting the client's input
    (an unknown field, a model name) encodes whatever that input holds."""

    def __init__(self, e: APIError, *, close: bool = False):
        headers = {"Retry-After": "1"} if e.status == 503 else {}
        if close:
            headers["Connection"] = "close"
        super().__init__(e.body(), status_code=e.status, headers=headers)

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a bool, as in OpenAI's own validation
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_engine_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


def _bounds(name: str) -> dict[str, float]:
    """Pydantic's bounds for a sampling setting, from its declaration (pdchat.engine.settings)."""
    s = settings.get(name, settings.SAMPLING)
    out = {}
    if s.low is not None:
        out["gt" if s.low_open else "ge"] = s.low
    if s.high is not None:
        out["lt" if s.high_open else "le"] = s.high
    return out


class _Sampling(_Strict):
    # The defaults here are OpenAI's (the API's clients expect them); the bounds are pdchat's.
    model: str
    max_tokens: int | None = Field(None, **_bounds("max_tokens"))
    temperature: float = Field(1.0, **_bounds("temperature"))
    top_p: float = Field(1.0, **_bounds("top_p"))
    top_k: int = Field(0, ge=-1)                  # -1 (vLLM) and 0 both mean off
    min_p: float = Field(0.0, **_bounds("min_p"))
    seed: int | None = Field(None, **_bounds("seed"))
    stop: str | list[str] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters long")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    def check(self) -> None:
        super().check()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list) -> str | list:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is empty")
            if all(isinstance(p, str) for p in v) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("is not supported")
        return v

    def requested_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS

    def prompt_value(self) -> str | list[int]:
        """The text, or the token ids, to generate from."""
        p = self.prompt
        return p[0] if isinstance(p, list) and isinstance(p[0], str) else p


def parse(model: type[_Sampling], raw: bytes) -> Any:
    """Decode and validate a request body; every problem is a 400 naming the offending field."""
    try:
        data = json.loads(raw, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:           # JSONDecodeError, UnicodeDecodeError and ours
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    bad = _lone_surrogate(data)
    if bad is not None:
        param, char = bad
        raise APIError(400, f"{param or 'the request'} holds a lone surrogate (\\u{ord(char):04x}), which is not "
                            "valid Unicode", param=param or None)
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    request.check()
    return request


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number of {len(text.lstrip('-'))} digits (at most {MAX_NUMBER_DIGITS})")
    return int(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _lone_surrogate(data: Any) -> tuple[str, str] | None:
    """(the dotted path of the first string or field name holding a lone surrogate, that
    character), or None. JSON decoding joins valid pairs, so any surrogate left is a lone one.
    Iterative: the body may be as deep as the JSON decoder allows."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                return path, found.group()
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((path, key))           # the name itself, reported at its parent
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        message = f"unknown field '{param}'"
    elif err["type"] == "missing":
        message = f"missing required field '{param}'"
    else:
        message = f"{param}: {err['msg'].removeprefix('Value error, ')}"
    return APIError(400, message, param=param)


# ---- responses ---------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Shape:
    """Builds the objects of one endpoint (chat or text completions) for one request."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def response(self, text: str, finish_reason: str, usage_: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish_reason, "logprobs": None}
            out = self._envelope("chat.completion", [choice])
        else:
            out = self._envelope("text_completion", [{"index": 0, "text": text, "finish_reason": finish_reason,
                                                      "logprobs": None}])
        out["usage"] = usage_
        return out

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion", [{"index": 0, "text": text or "", "finish_reason": finish_reason,
                                                   "logprobs": None}])

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage_
        return out


def sse(obj: dict[str, Any] | str) -> str:
    """One event. ASCII JSON: some clients split lines on U+0085, U+2028 or U+2029 as well, and a
    raw one inside `data:` would cut the event in two."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
