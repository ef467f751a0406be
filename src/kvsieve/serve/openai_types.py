"""OpenAI's request bodies (validated strictly) and response objects, plus its error format.

Requests are parsed here rather than by FastAPI's own body validation so that every mistake is
answered the way OpenAI answers it: a 4xx status with `{"error": {"message", "type", "param",
"code"}}`. Types are strict ("5" is not a number). Fields OpenAI documents but kvsieve cannot
honour (tool calls) are refused by name instead of being silently ignored.
Fields nobody documents are ignored and logged once per name, as vLLM does, so that clients that
send their own extensions work; vLLM's `ignore_eos` and `stream_options.continuous_usage_stats`
are honoured. kvsieve's own `"kvsieve"` object stays strict: a typo there is an error.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvsieve.decode import MAX_CHOICES, MAX_LOGPROBS, TokenLogprob
from kvsieve.structured import ANY_JSON

log = logging.getLogger("kvsieve.serve")

MAX_STOP_STRINGS = 4  # as OpenAI documents for `stop`
_TYPE_TAG = re.compile(r"str|int|float|bool|(list|dict)\[.*\]|[A-Z]\w*")  # union members in pydantic's error paths


CLIENT_CLOSED = 499  # nginx's status for a request whose client went away


class ApiError(Exception):
    """An error answered to the client as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    """No unknown fields, no type coercion ("5" is not a number, true is not 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)


_IGNORED: set[str] = set()  # unknown field names already logged


class _Tolerant(BaseModel):
    """Strict types, unknown fields ignored (logged once per name): OpenAI's and vLLM's policy."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {field.alias for field in cls.model_fields.values() if field.alias}
            for name in sorted(set(data) - known):
                where = f"{cls.__name__}.{name}"
                if where not in _IGNORED:
                    _IGNORED.add(where)
                    log.warning("ignoring the unknown request field '%s' (%s); logged once", name, cls.__name__)
        return data


class KvsieveOptions(_Strict):
    """The request's `"kvsieve"` field: which method runs, its settings, and whether to reuse states."""

    method: str | None = None  # a registered name; None: the server's --method
    set: dict[str, Any] = Field(default_factory=dict)  # {"compress.budget": 0.25, ...}
    cache: bool = True  # look up and store reusable prompt states (False: a fresh prefill, same procedure)


class StreamOptions(_Tolerant):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchemaFormat(_Tolerant):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Tolerant):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object: {"name": ..., "schema": {...}}')
        return self


class TextPart(_Tolerant):
    type: Literal["text"]
    text: str


class Message(_Tolerant):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _Sampling(_Tolerant):
    """Fields shared by both endpoints, with OpenAI's defaults (temperature 1 samples)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch.Generator takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # answers sampled from the one prefill
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    ignore_eos: bool = False  # vLLM's extensions: decode on past EOS tokens up to max_tokens,
    top_k: int = Field(-1, ge=-1)  # sample among the k likeliest tokens (-1 or 0: all),
    min_tokens: int = Field(0, ge=0)  # no EOS before this many tokens,
    repetition_penalty: float = Field(1.0, gt=0, le=2)  # and CTRL's repetition penalty (1: off)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    kvsieve: KvsieveOptions = Field(default_factory=KvsieveOptions)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids as strings, got '{key}'")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @model_validator(mode="after")
    def _no_tool_use(self) -> _Sampling:
        """Tools that may not be called are fine; calling them needs a tool-call parser kvsieve does not have
        (vLLM answers the same 400 when it runs without one)."""
        if self.tools and self.tool_choice != "none":
            raise ValueError(
                "tool calls are not supported: kvsieve has no tool-call parser. Send no tools, or tool_choice "
                '"none"; for JSON answers use response_format {"type": "json_object"} or "json_schema"'
            )
        if isinstance(self.tool_choice, dict) or self.tool_choice not in (None, "none", "auto"):
            raise ValueError('tool_choice must be "none" (or "auto" with no tools): kvsieve calls no tools')
        return self

    def grammar(self) -> str | None:
        """The answer's grammar for `Sampling.grammar`: None (text), any JSON, or the schema's text."""
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return ANY_JSON
        return json.dumps(self.response_format.json_schema.schema_)

    def biases(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items())

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_alternatives(self) -> int | None:
        """Alternatives per answer token when log-probabilities are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Tolerant):
    """vLLM's /tokenize: a completion `prompt`, or chat `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' (text) or 'messages' (chat), not both")
        return self


class DetokenizeRequest(_Tolerant):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int] = Field(min_length=1)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """The request body as `model`, or a 400 naming the first problem and its field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"The request body is not valid JSON: {error}.", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "The request body nests too deeply.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    try:  # "\ud800" is valid JSON but no text: a lone surrogate cannot be encoded, let alone tokenized
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(400, f"The request holds invalid Unicode ({error.reason}).", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = max(error.errors(), key=lambda e: len(e["loc"]))  # a union's deepest member error says most
        loc = [str(part) for part in first["loc"] if not _TYPE_TAG.fullmatch(str(part))]
        where = ".".join(loc)
        param = loc[0] if loc else None  # the top-level field, as OpenAI names it
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = f"Unknown field '{where}'; kvsieve accepts OpenAI's documented fields and 'kvsieve'."
        elif where:
            message = f"{where}: {message} (got {_short(first.get('input'))})."
        raise ApiError(400, message, param=param, code="invalid_value") from None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(kvsieve_reason: str) -> str:
    """kvsieve's eos / stop / length as OpenAI's stop / length."""
    return "length" if kvsieve_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def logprobs_object(
    chat: bool, entries: list[TokenLogprob], text_of: Callable[[int], str], offsets: list[int]
) -> dict[str, Any]:
    """Answer tokens' log-probabilities in the endpoint's format: chat's `{"content": [{token, logprob,
    bytes, top_logprobs}]}`, or completions' `{tokens, token_logprobs, top_logprobs, text_offset}`, where
    `offsets` are where each token's text starts in the answer."""
    if chat:

        def item(token: int, logprob: float) -> dict[str, Any]:
            text = text_of(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        }
    return {
        "tokens": [text_of(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text_of(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def choice_object(
    chat: bool, index: int, text: str, reason: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One answer of a whole response."""
    if chat:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "finish_reason": reason, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}


def completion_object(
    chat: bool, rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, Any], info: dict[str, Any]
) -> dict[str, Any]:
    """A whole chat.completion or text_completion response (`choice_object`s), with kvsieve's record."""
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
        "kvsieve": info,
    }


def chunk_object(
    chat: bool,
    rid: str,
    model: str,
    *,
    text: str | None = None,
    role: bool = False,
    reason: str | None = None,
    extra: dict[str, Any] | None = None,
    use: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One streamed chunk: a text delta, the opening role delta, the finish reason, or (with no
    choices) the usage chunk that `stream_options.include_usage` asks for."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": reason}
        if logprobs is not None:
            choice["logprobs"] = logprobs
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [] if use is not None else [choice],
    }
    if use is not None:
        chunk["usage"] = use
    if extra:
        chunk.update(extra)
    return chunk


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event line pair: `data: {...}` (or `data: [DONE]`)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


@dataclass(frozen=True)
class Reply:
    """One response's identity: chat or completion, id, model, prompt size; builds its chunks."""

    chat: bool
    id: str
    model: str
    prompt_tokens: int

    def chunk(self, **fields: Any) -> dict[str, Any]:
        return chunk_object(self.chat, self.id, self.model, **fields)
