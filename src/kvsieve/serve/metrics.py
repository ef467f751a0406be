"""The server's Prometheus metrics, kept with `prometheus-client` and served at GET /metrics.

Each server has its own registry (several servers may share a process, as the tests do). Every
HTTP request is counted once, by endpoint and final status, by `CountRequests` (an ASGI
middleware); the engine adds token counts and latencies as its requests report them; gauges
(queue depth, KV entries held, prefix-cache size) are read from their owners at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
COUNTERS = {
    "prompt_tokens": "prompt tokens received",
    "prefill_tokens": "prompt tokens run through the model (reused prefixes are not)",
    "generation_tokens": "tokens generated",
    "prefix_cache_hits": "requests that started from a cached prompt state",
    "prefix_cache_misses": "requests that could have reused a prompt state but found none",
    "memory_releases": "times the engine gave freed heap memory back to the system (a prefill or answer ended)",
    "memory_release_seconds": "seconds the engine spent giving freed heap memory back",
}
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Everything /metrics reports, in one registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvsieve_requests", "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"], registry=self.registry,
        )  # fmt: skip
        self.counters = {
            name: Counter(f"kvsieve_{name}", text, registry=self.registry) for name, text in COUNTERS.items()
        }
        self.ttft = Histogram(
            "kvsieve_time_to_first_token_seconds", "request arrival to the first token",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.per_token = Histogram(
            "kvsieve_time_per_output_token_seconds", "time between two generated tokens",
            buckets=TOKEN_BUCKETS, registry=self.registry,
        )  # fmt: skip

    def gauge(self, name: str, text: str, read: Callable[[], float]) -> None:
        """A gauge read from its owner at each scrape."""
        Gauge(f"kvsieve_{name}", text, registry=self.registry).set_function(read)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def add(self, counter: str, amount: float = 1) -> None:
        self.counters[counter].inc(amount)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token_latency(self, seconds: float) -> None:
        self.per_token.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition format."""
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware: every HTTP request counted once when its response has ended, by endpoint (its
    route's template; paths no route matches share the label "other") and status. A handler whose real
    outcome comes after the status was sent (a stream whose client left) puts it in `request.state.outcome`."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = scope.get("route")  # the matched route's template: one label per endpoint, not per URL
            outcome = scope.get("state", {}).get("outcome", status)
            self.metrics.request_done(route.path if route is not None else "other", outcome)
