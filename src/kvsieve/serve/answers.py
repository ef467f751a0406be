"""How the HTTP front reads one submitted request's answer: its events handed over from the engine thread
(`RequestEvents`, which notices a client that left), a failure as the HTTP error (`as_api_error`), and the answer as
server-sent chunks (`stream_chunks`) with its log-probabilities in the endpoint's format (`logprobs_of`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HttpRequest
from transformers import PreTrainedTokenizerBase

from kvsieve.decode import TokenLogprob
from kvsieve.engine import Event, Failed, Finished, Request, Text
from kvsieve.errors import KvsieveError
from kvsieve.serve.openai_types import CLIENT_CLOSED, ApiError, Reply, finish_reason, logprobs_object, sse, usage


class ClientGone(Exception):
    """The client disconnected while its request was queued or running."""


class RequestEvents:
    """The engine's events for one request, handed from the engine thread to the event loop."""

    def __init__(self, request: HttpRequest):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._request = request
        self._checked = self._loop.time()  # when the client was last seen connected

    def emit(self, event: Event) -> None:
        """Called on the engine thread."""
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server is shutting down
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next(self, watch_client: bool = True) -> Event:
        """The next event; every half second, notice a client that went away (unless a stream watches it),
        also while events keep coming (a non-streamed answer being decoded)."""
        while True:
            if watch_client and self._loop.time() - self._checked >= 0.5:
                if await self._request.is_disconnected():
                    raise ClientGone
                self._checked = self._loop.time()
            try:
                return await asyncio.wait_for(self._queue.get(), timeout=0.5)
            except TimeoutError:
                continue


def as_api_error(error: Exception) -> ApiError:
    """A request's failure as the HTTP answer: what the method cannot do is the client's 400, the rest ours."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, KvsieveError):
        return ApiError(400, str(error), param="kvsieve", code="invalid_method")
    return ApiError(500, f"The engine failed: {error!r}", type="server_error")


@dataclass(frozen=True)
class Echo:
    """A completion's `echo`: the prompt's text, and its tokens' log-probabilities when asked for."""

    text: str
    logprobs: list[TokenLogprob]


def logprobs_of(
    tokenizer: PreTrainedTokenizerBase, chat: bool, entries: list[TokenLogprob], before: list[int] | None = None
) -> dict[str, Any]:
    """`entries` in the endpoint's logprobs format, each token as the text it decodes to; a completion's
    text offsets are where the answer's text (after the `before` tokens reported already) grows by it."""
    tokens, earlier = [e.token for e in entries], before or []
    offsets = [] if chat else [len(tokenizer.decode(earlier + tokens[:i])) for i in range(len(tokens))]
    return logprobs_object(chat, entries, lambda token: tokenizer.decode([token]), offsets)


async def stream_chunks(
    tokenizer: PreTrainedTokenizerBase,
    request: HttpRequest,
    job: Request,
    events: RequestEvents,
    reply: Reply,
    include_usage: bool,
    continuous_usage: bool,
    started: dict[str, Any],
    with_logprobs: bool,
    answers: int,
    echo: Echo | None,
) -> AsyncIterator[bytes]:
    """Server-sent chunks until the answer is finished; a client that leaves cancels the job.

    `continuous_usage` (vLLM's `stream_options.continuous_usage_stats`) puts the usage so far in every
    text chunk; `started` is the record the request's prefill reported; `with_logprobs` puts each
    chunk's tokens' log-probabilities in it; `answers` (n) chunks carry their answer's index; `echo`
    sends the prompt's text (and log-probabilities) first."""
    status, n = CLIENT_CLOSED, answers
    reported: list[list[int]] = [[] for _ in range(n)]  # per answer: tokens whose log-probabilities were sent
    tokens, finished = [0] * n, []
    try:
        if reply.chat:
            for index in range(n):
                yield sse(reply.chunk(role=True, index=index))
        for index in range(n if echo is not None else 0):
            logprobs = logprobs_of(tokenizer, False, echo.logprobs) if with_logprobs else None
            reported[index] += [e.token for e in echo.logprobs]
            yield sse(reply.chunk(text=echo.text, logprobs=logprobs, index=index))
        while True:
            event = await events.next(watch_client=False)  # Starlette watches the client while streaming
            logprobs = None
            if isinstance(event, Text | Finished):
                i = event.index
                logprobs = logprobs_of(tokenizer, reply.chat, event.logprobs, reported[i]) if with_logprobs else None
                reported[i] += [e.token for e in event.logprobs]
            if isinstance(event, Text):
                tokens[event.index] = event.tokens
                chunk = reply.chunk(text=event.piece, logprobs=logprobs, index=event.index)
                if continuous_usage:
                    chunk["usage"] = usage(reply.prompt_tokens, sum(tokens), started["cached_tokens"])
                yield sse(chunk)
            elif isinstance(event, Finished):
                finished.append(event)
                reason = finish_reason(event.reason)
                yield sse(
                    reply.chunk(reason=reason, extra={"kvsieve": event.info}, logprobs=logprobs, index=event.index)
                )
                if len(finished) < n:
                    continue
                if include_usage:
                    generated = sum(f.completion_tokens for f in finished)
                    yield sse(reply.chunk(use=usage(reply.prompt_tokens, generated, event.info["cached_tokens"])))
                yield sse("[DONE]")
                status = 200
                return
            elif isinstance(event, Failed):
                error = as_api_error(event.error)
                status = error.status
                yield sse(error.body())
                yield sse("[DONE]")
                return
    finally:
        job.cancelled.set()
        request.state.outcome = status  # the status line said 200 before the stream's end
