"""The HTTP front: OpenAI's endpoints on FastAPI. It validates, queues, streams; the engine computes.

POST /v1/chat/completions and /v1/completions (stream or not), GET /v1/models (and /v1/models/{id}),
vLLM's POST /tokenize and /detokenize, GET /health and /metrics. Every failure is OpenAI's error
object with a 4xx/5xx status, and the server goes on serving. With an API key every endpoint but
/health needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from kvsieve.engine import Failed, Finished, Request, Text
from kvsieve.serve.answers import ClientGone, Echo, RequestEvents, as_api_error, logprobs_of, stream_chunks
from kvsieve.serve.engine_thread import EngineThread
from kvsieve.serve.metrics import CONTENT_TYPE, CountRequests, Metrics
from kvsieve.serve.openai_types import (
    CLIENT_CLOSED,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Reply,
    TokenizeRequest,
    choice_object,
    completion_object,
    finish_reason,
    new_id,
    parse_body,
    usage,
)
from kvsieve.serve.prompts import as_prompt, chat_prompt, completion_prompt
from kvsieve.serve.relay import Relay
from kvsieve.serve.request_options import ServeConfig, method_of, read_body, sampling_of
from kvsieve.serve.upstream import Upstream

log = logging.getLogger("kvsieve.serve")


def create_app(
    engine: EngineThread,
    tokenizer: PreTrainedTokenizerBase,
    config: ServeConfig,
    metrics: Metrics,
    upstream: Upstream | None = None,
) -> FastAPI:
    """The ASGI app: OpenAI's routes on a `Front`. The engine thread starts and stops with the app (lifespan)."""
    front = Front(engine, tokenizer, config, metrics, upstream)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        yield
        engine.stop()
        if upstream is not None:
            await upstream.close()

    app = FastAPI(title="kvsieve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(CountRequests, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, error: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = f"{request.method} {request.url.path}: {error.detail}"
        return await api_error(request, ApiError(error.status_code, message, code=codes.get(error.status_code)))

    @app.exception_handler(Exception)
    async def server_error(request: HttpRequest, error: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return await api_error(request, ApiError(500, f"Internal error: {error!r}", type="server_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            raise ApiError(503, "The engine thread has stopped.", type="server_error")
        if upstream is None:
            return JSONResponse({"status": "ok", "model": config.model_name})
        try:
            await upstream.check()
        except ApiError as error:  # this server is up, but cannot answer without its upstream
            raise ApiError(503, f"Upstream unavailable: {error.message}", type="upstream_error") from None
        return JSONResponse({"status": "ok", "model": config.model_name, "upstream": upstream.url})

    @app.get("/metrics", dependencies=[Depends(front.authorize)])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(front.authorize)])
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [front.model_card()]})

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(front.authorize)])
    async def model(model_id: str) -> JSONResponse:
        front.check_model(model_id)
        return JSONResponse(front.model_card())

    @app.post("/tokenize", dependencies=[Depends(front.authorize)])
    async def tokenize(request: HttpRequest) -> JSONResponse:
        return JSONResponse(await front.tokenize(request))

    @app.post("/detokenize", dependencies=[Depends(front.authorize)])
    async def detokenize(request: HttpRequest) -> JSONResponse:
        return JSONResponse(await front.detokenize(request))

    @app.post("/v1/chat/completions", dependencies=[Depends(front.authorize)])
    async def chat_completions(request: HttpRequest) -> Response:
        return await front.serve(request, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(front.authorize)])
    async def completions(request: HttpRequest) -> Response:
        return await front.serve(request, chat=False)

    return app


class Front:
    """The HTTP side of one request: parse and check it, submit it to the engine, answer it whole,
    streamed or relayed from --upstream. Holds no request state of its own."""

    def __init__(
        self,
        engine: EngineThread,
        tokenizer: PreTrainedTokenizerBase,
        config: ServeConfig,
        metrics: Metrics,
        upstream: Upstream | None,
    ):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.metrics = metrics
        self.relay = Relay(upstream, metrics, self.first_event) if upstream is not None else None  # --upstream

    def authorize(self, request: HttpRequest) -> None:
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise ApiError(
                401, "Missing or wrong API key: send the header Authorization: Bearer <key>.", code="invalid_api_key"
            )

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvsieve",
            "max_model_len": self.config.max_positions,
        }

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not have (None: the request named none)."""
        if name is not None and name != self.config.model_name:
            raise ApiError(
                404, f"The model '{name}' does not exist; this server has '{self.config.model_name}'.",
                param="model", code="model_not_found",
            )  # fmt: skip

    async def tokenize(self, request: HttpRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the ids a completion prompt or chat messages become (the chat template applied)."""
        body = parse_body(await read_body(request, self.config.max_body_bytes), TokenizeRequest)
        self.check_model(body.model)
        if body.messages is not None:
            prompt = await run_in_threadpool(chat_prompt, self.tokenizer, body.messages)
        else:
            prompt = await run_in_threadpool(completion_prompt, self.tokenizer, body.prompt, self.config.vocab_size)
        return {"count": len(prompt.ids), "max_model_len": self.config.max_positions, "tokens": prompt.ids}

    async def detokenize(self, request: HttpRequest) -> dict[str, Any]:
        """vLLM's /detokenize: the text of token ids (ids outside the vocabulary: 400)."""
        body = parse_body(await read_body(request, self.config.max_body_bytes), DetokenizeRequest)
        self.check_model(body.model)
        ids = completion_prompt(self.tokenizer, body.tokens, self.config.vocab_size).ids
        return {"prompt": self.tokenizer.decode(ids)}

    async def serve(self, request: HttpRequest, chat: bool) -> Response:
        arrived = time.perf_counter()
        body = parse_body(
            await read_body(request, self.config.max_body_bytes), ChatRequest if chat else CompletionRequest
        )
        self.check_model(body.model)
        spec = method_of(body.kvsieve, self.config)
        if chat:
            prompt = await run_in_threadpool(chat_prompt, self.tokenizer, body.messages)
        else:
            prompt = await run_in_threadpool(completion_prompt, self.tokenizer, body.prompt, self.config.vocab_size)
        sampling = sampling_of(
            body,
            prompt,
            spec,
            "messages" if chat else "prompt",
            self.config,
            self.tokenizer,
            relayed=self.relay is not None,
        )
        events = RequestEvents(request)
        reply = Reply(chat, new_id("chatcmpl" if chat else "cmpl"), self.config.model_name, len(prompt.ids))
        ids = as_prompt(prompt, self.tokenizer)
        if self.relay is not None:
            return await self.relay.answer(request, body, spec, ids, sampling, events, reply, arrived)
        job = Request(
            ids,
            spec,
            sampling,
            events.emit,
            boundary=prompt.boundary,
            use_cache=body.kvsieve.cache,
            keep_cache=False,  # the answers are sent as events: no one reads the cache they decoded into
        )
        first = await self.first_event(job, events)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        echo = None
        if getattr(body, "echo", False):  # completions: the prompt's text (and log-probabilities) first
            text = body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt.ids)
            echo = Echo(text, first.prompt_logprobs or [])
        if body.stream:
            chunks = stream_chunks(
                self.tokenizer, request, job, events, reply, body.include_usage(), body.continuous_usage(), first.info,
                sampling.logprobs is not None, sampling.n, echo,
            )  # fmt: skip
            return StreamingResponse(chunks, media_type="text/event-stream")
        n = sampling.n
        texts: list[list[str]] = [[] for _ in range(n)]
        entries: list[list] = [[] for _ in range(n)]
        done: list[Finished | None] = [None] * n
        try:
            while any(d is None for d in done):
                event = await events.next()
                if isinstance(event, Failed):
                    raise as_api_error(event.error)
                if isinstance(event, Text):
                    texts[event.index].append(event.piece)
                    entries[event.index] += event.logprobs
                elif isinstance(event, Finished):
                    done[event.index] = event
                    entries[event.index] += event.logprobs
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            job.cancelled.set()  # frees the slot if the engine still holds it; harmless otherwise
        info = done[0].info
        use = usage(reply.prompt_tokens, sum(d.completion_tokens for d in done), info["cached_tokens"])
        before, with_logprobs = echo or Echo("", []), sampling.logprobs is not None
        choices = [
            choice_object(
                chat,
                i,
                before.text + "".join(texts[i]),
                finish_reason(done[i].reason),
                logprobs_of(self.tokenizer, chat, before.logprobs + entries[i]) if with_logprobs else None,
            )
            for i in range(n)
        ]
        return JSONResponse(completion_object(chat, reply.id, reply.model, choices, use, info))

    async def first_event(self, job: Request, events: RequestEvents) -> Any:
        """Submit `job` to the engine and wait for its first event (the prefill's, or the selection's); None where
        the client left first (the job is cancelled). A failure cancels the job and is raised as its API error."""
        self.engine.submit(job)
        try:
            first = await events.next()
        except ClientGone:
            job.cancelled.set()
            return None
        if isinstance(first, Failed):
            job.cancelled.set()
            raise as_api_error(first.error)
        return first
