"""The server's Prometheus metrics, rendered in the text exposition format at GET /metrics.

Counters and histograms are written by the HTTP front and the engine thread, so every update
takes one lock. Gauges (queue depth, KV entries held, prefix-cache size) are read from their
owners when /metrics is scraped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus histograms are."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        rows = [f'{name}_bucket{{le="{bound:g}"}} {n}' for bound, n in zip(self.buckets, self.counts, strict=True)]
        rows.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        return [*rows, f"{name}_sum {self.total:.6f}", f"{name}_count {self.count}"]


class Metrics:
    """Everything /metrics reports; `gauges` maps a gauge's name to (help, a function reading it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.counters: dict[str, int] = {
            "prompt_tokens": 0,
            "prefill_tokens": 0,
            "generation_tokens": 0,
            "prefix_cache_hits": 0,
            "prefix_cache_misses": 0,
        }
        self.ttft = Histogram(TTFT_BUCKETS)
        self.per_token = Histogram(TOKEN_BUCKETS)
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def add(self, counter: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[counter] += amount

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def token_latency(self, seconds: float) -> None:
        with self._lock:
            self.per_token.observe(seconds)

    def render(self) -> str:
        """The Prometheus text format (version 0.0.4)."""
        helps = {
            "prompt_tokens": "prompt tokens received",
            "prefill_tokens": "prompt tokens run through the model (reused prefixes are not)",
            "generation_tokens": "tokens generated",
            "prefix_cache_hits": "requests that started from a cached prompt state",
            "prefix_cache_misses": "requests that could have reused a prompt state but found none",
        }
        with self._lock:
            out = ["# HELP kvsieve_requests_total HTTP requests answered, by endpoint and status code"]
            out.append("# TYPE kvsieve_requests_total counter")
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f'kvsieve_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            for name, value in self.counters.items():
                out += [f"# HELP kvsieve_{name}_total {helps[name]}", f"# TYPE kvsieve_{name}_total counter"]
                out.append(f"kvsieve_{name}_total {value}")
            for name, histogram, text in (
                ("kvsieve_time_to_first_token_seconds", self.ttft, "request arrival to the first token"),
                ("kvsieve_time_per_output_token_seconds", self.per_token, "time between two generated tokens"),
            ):
                out += [f"# HELP {name} {text}", f"# TYPE {name} histogram", *histogram.lines(name)]
        for name, (text, read) in self.gauges.items():
            out += [f"# HELP kvsieve_{name} {text}", f"# TYPE kvsieve_{name} gauge", f"kvsieve_{name} {read():g}"]
        return "\n".join(out) + "\n"
