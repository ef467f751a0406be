"""--upstream: select locally, send the kept token ids to the upstream engine, relay its answer as this request's.

Only the select stage (and its attention kernel) runs here: the request is submitted to the engine as a
`select_only` request, whose event is the kept token ids; the upstream engine (`serve.upstream`) prefills and
decodes them, and its answer or chunks become this request's, with what the select stage did under `kvsieve`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvsieve.decode import Sampling
from kvsieve.engine import Request, Selected
from kvsieve.prompt import Prompt
from kvsieve.serve.metrics import Metrics
from kvsieve.serve.openai_types import (
    CLIENT_CLOSED,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    choice_object,
    completion_object,
    sse,
    usage,
)
from kvsieve.serve.upstream import Upstream, UpstreamPiece
from kvsieve.spec import MethodSpec


class Relay:
    """Answers requests through `upstream`; `first_event` submits a request to this server's engine and waits for
    its first event (the front's, shared with the requests it answers itself)."""

    def __init__(self, upstream: Upstream, metrics: Metrics, first_event: Callable[[Request, Any], Awaitable[Any]]):
        self.upstream, self.metrics, self.first_event = upstream, metrics, first_event

    async def answer(
        self,
        request: HttpRequest,
        body: ChatRequest | CompletionRequest,
        spec: MethodSpec,
        prompt: Prompt,
        sampling: Sampling,
        events: Any,
        reply: Reply,
        arrived: float,
    ) -> Response:
        """--upstream: select locally, send the kept token ids upstream, relay the answer."""
        self.upstream.check_relayable(sampling)
        local = [stage for stage in ("compress", "evict") if getattr(spec, stage) is not None]
        if not spec.one_pass:
            local.insert(0, "feed")
        if local:
            raise ApiError(
                400,
                f"With --upstream only the select stage (and its attention kernel) runs here; method '{spec.name}' "
                f"also has {', '.join(local)}, which the upstream engine cannot run. Use gemfilter or full.",
                param="kvsieve",
                code="invalid_method",
            )
        job = Request(prompt, spec, sampling, events.emit, select_only=True)
        selected = await self.first_event(job, events)
        if selected is None:
            return Response(status_code=CLIENT_CLOSED)
        assert isinstance(selected, Selected)
        info = {**selected.info, "upstream": self.upstream.url}
        if not body.stream:
            asked = asyncio.ensure_future(self.upstream.complete(selected.ids, sampling))
            while not (await asyncio.wait({asked}, timeout=0.25))[0]:
                if await request.is_disconnected():  # closing its connection cancels the upstream's work too
                    asked.cancel()
                    return Response(status_code=CLIENT_CLOSED)
            answer = asked.result()
            self.metrics.first_token(time.perf_counter() - arrived)
            info["upstream_prompt_tokens"] = (answer.usage or {}).get("prompt_tokens")
            completion_tokens = (answer.usage or {}).get("completion_tokens", 0)
            use = usage(reply.prompt_tokens, completion_tokens)
            reason = answer.finish_reason or "stop"
            choices = [choice_object(reply.chat, 0, answer.text, reason)]
            return JSONResponse(completion_object(reply.chat, reply.id, reply.model, choices, use, info))
        pieces = self.upstream.stream(selected.ids, sampling)
        first = await anext(pieces, None)  # upstream errors become this request's status, before streaming
        return StreamingResponse(
            self._stream(request, first, pieces, reply, info, body.include_usage(), arrived),
            media_type="text/event-stream",
        )

    async def _stream(
        self,
        request: HttpRequest,
        first: UpstreamPiece | None,
        pieces: AsyncGenerator[UpstreamPiece, None],
        reply: Reply,
        info: dict[str, Any],
        include_usage: bool,
        arrived: float,
    ) -> AsyncIterator[bytes]:
        """The upstream's pieces as this request's chunks (chat or completion)."""
        status, completion_tokens, reason = CLIENT_CLOSED, 0, "stop"
        try:
            if reply.chat:
                yield sse(reply.chunk(role=True))
            piece, timed = first, False
            while piece is not None:
                if piece.text:
                    if not timed:
                        self.metrics.first_token(time.perf_counter() - arrived)
                        timed = True
                    yield sse(reply.chunk(text=piece.text))
                reason = piece.finish_reason or reason
                if piece.usage:
                    info["upstream_prompt_tokens"] = piece.usage.get("prompt_tokens")
                    completion_tokens = piece.usage.get("completion_tokens", 0)
                try:
                    piece = await anext(pieces, None)
                except ApiError as error:
                    status = error.status
                    yield sse(error.body())
                    yield sse("[DONE]")
                    return
            yield sse(reply.chunk(reason=reason, extra={"kvsieve": info}))
            if include_usage:
                yield sse(reply.chunk(use=usage(reply.prompt_tokens, completion_tokens)))
            yield sse("[DONE]")
            status = 200
        finally:
            await pieces.aclose()
            request.state.outcome = status  # the status line said 200 before the stream's end
