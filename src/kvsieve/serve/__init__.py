"""`kvsieve serve`: an OpenAI-compatible server with batched decoding and compressed-context reuse.

    app.py             the HTTP front (FastAPI): parses, submits, answers whole or streamed
    answers.py         one request's events read on the event loop, its answer as chunks, its errors
    request_options.py what a request asks for (body, method, sampling), checked against the server's limits
    openai_types.py    OpenAI's request bodies, responses, chunks and errors
    prompts.py         token ids of a request, and where its reusable context ends
    engine_thread.py   the thread that owns the model and runs `kvsieve.engine`'s scheduler
    relay.py           --upstream: select locally, relay the upstream engine's answer as this request's
    upstream.py        the client of that upstream engine (its completions, streamed or whole)
    metrics.py         Prometheus text for /metrics

`create_server(model, tokenizer, ...)` builds the app; `ServerThread(app)` runs it on a free
localhost port in a background thread (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.models import architecture
from kvsieve.registry import method
from kvsieve.serve.app import create_app
from kvsieve.serve.engine_thread import EngineThread
from kvsieve.serve.metrics import Metrics
from kvsieve.serve.request_options import ServeConfig
from kvsieve.serve.upstream import Upstream
from kvsieve.spec import MethodSpec


def create_server(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name: str,
    spec: MethodSpec | str = "full",
    api_key: str | None = None,
    cache_bytes: int = 2_000_000_000,
    reuse_budget: int | float | None = None,
    max_queue: int = 64,
    max_batch: int = 16,
    max_step_tokens: int | None = 512,
    max_body_bytes: int = 4_000_000,
    max_prompt_tokens: int = 131_072,
    default_max_tokens: int = 256,
    upstream: str | None = None,
    upstream_model: str | None = None,
    upstream_api_key: str | None = None,
    upstream_timeout: float = 600,
) -> FastAPI:
    """The server's ASGI app for a kvsieve-prepared model; its engine thread starts with the app."""
    metrics = Metrics()
    engine = EngineThread(
        model,
        tokenizer,
        metrics,
        max_queue=max_queue,
        max_batch=max_batch,
        max_step_tokens=max_step_tokens,
        cache_bytes=0 if upstream else cache_bytes,
        reuse_budget=reuse_budget,
    )
    config = ServeConfig(
        model_name=model_name,
        default_spec=method(spec),
        max_positions=architecture(model).max_positions,
        vocab_size=model.config.vocab_size,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_prompt_tokens=max_prompt_tokens,
        default_max_tokens=default_max_tokens,
    )
    relay = (
        Upstream(upstream, api_key=upstream_api_key, model=upstream_model, timeout=upstream_timeout)
        if upstream
        else None
    )
    return create_app(engine, tokenizer, config, metrics, relay)


class ServerThread:
    """Run `app` with uvicorn in a daemon thread on `host` and a free port; a context manager."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30) -> ServerThread:
        """Start serving (once) and wait until the port accepts requests."""
        if not self._thread.is_alive():
            self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["ServerThread", "create_server"]
