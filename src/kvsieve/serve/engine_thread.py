"""The server's engine thread: the one `Scheduler` of `kvsieve.engine`, fed from a bounded queue.

The HTTP front submits a `Request` (full: 429) and reads the events the request emits. The
thread owns the model: it moves queued requests into the scheduler and runs its steps (a
decoding token for every running request plus at most `max_step_tokens` of prefill), so a long
prompt delays running streams by one prefill slice per step, never by its whole prefill. A
request whose client went away (the front sets `request.cancelled`) leaves at the next step.

Memory (docs/SERVING.md#memory-what-the-server-holds): nothing here holds a request once it is
answered (no reference cycle through its events, so its tensors go when the front drops it, without waiting for
Python's garbage collector), and after a step in which a prefill or an answer ended the freed heap pages go
back to the system (`kvsieve.memory.release_freed`): glibc would otherwise keep them, and the resident size
would climb towards the sum of every peak the server has seen.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.engine import Event, Failed, Finished, PrefixCache, Request, Scheduler, Selected, Started, Text
from kvsieve.memory import PeakWatch, model_bytes, release_freed, resident_bytes
from kvsieve.serve.metrics import Metrics
from kvsieve.serve.openai_types import ApiError

log = logging.getLogger("kvsieve.serve")


class EngineThread:
    """Owns the model and the scheduler; `start()` runs the loop in a daemon thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        metrics: Metrics,
        *,
        max_queue: int = 64,
        max_batch: int = 16,
        max_step_tokens: int | None = 512,
        cache_bytes: int = 0,
        reuse_budget: int | float | None = None,
    ):
        self.model, self.tokenizer, self.metrics = model, tokenizer, metrics
        prefix_cache = PrefixCache(model, cache_bytes, reuse_budget) if cache_bytes > 0 else None
        self.scheduler = Scheduler(
            model, tokenizer, max_step_tokens=max_step_tokens, max_batch=max_batch, prefix_cache=prefix_cache
        )
        self._queue: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self._open: set[Request] = set()  # taken by the engine thread, not yet answered (its own)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvsieve-engine", daemon=True)
        for name, text, read in [
            ("queue_depth", "requests waiting for the engine", lambda: self._queue.qsize()),
            (
                "active_requests",
                "requests prefilling or decoding",
                lambda: len(self.scheduler.prefilling) + len(self.scheduler.running),
            ),
            ("kv_entries", "KV entries per layer and KV head held by the decoding requests", self.kv_entries),
            ("prefix_cache_bytes", "bytes of stored prompt states", lambda: self._cache_stat("bytes")),
            ("prefix_cache_states", "stored prompt states", lambda: self._cache_stat("states")),
            # Memory, named part by part beside the process's resident size (kvsieve.memory).
            ("resident_bytes", "the process's resident set size", resident_bytes),
            ("model_bytes", "the model's parameters and buffers", lambda: self._model_bytes),
            ("batch_table_bytes", "the running batch's key/value tables and rings, as allocated", self._tables),
            (
                "largest_step_bytes",
                "the most memory one engine step with prefill work took above where it began "
                "(resident memory on a CPU, the allocator's on CUDA)",
                lambda: self.largest_step,
            ),
        ]:
            metrics.gauge(name, text, read)
        self._model_bytes = model_bytes(model)
        self._watch = PeakWatch(next(model.parameters()).device)
        self.largest_step = 0

    # ------------------------------------------------------------------------- front side

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        """Queue `request`, or answer 429 when the queue is full. Its events are counted in the metrics."""
        request.emit = self._counted(request, request.emit)
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            raise ApiError(
                429,
                f"The server is busy: {self._queue.maxsize} requests are already waiting. Retry shortly.",
                type="rate_limit_exceeded",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None

    def kv_entries(self) -> int:
        try:  # read from another thread: a snapshot is enough for a gauge
            return self.scheduler.kv_entries()
        except (IndexError, AttributeError):
            return 0

    def _tables(self) -> int:
        try:  # read from another thread: a snapshot is enough for a gauge
            return self.scheduler.batch.nbytes
        except AttributeError:
            return 0

    def _cache_stat(self, what: str) -> int:
        cache = self.scheduler.prefix_cache
        if cache is None:
            return 0
        return cache.bytes if what == "bytes" else len(cache)

    def _counted(self, request: Request, emit: Callable[[Event], None]) -> Callable[[Event], None]:
        """`emit` that also feeds the metrics: time to first token, gaps between streamed pieces, tokens,
        prefix-cache hits and misses. It refers to the request weakly: the request holds it, and a cycle would
        keep the request's tensors until the garbage collector ran."""
        last, arrived, prompt_tokens, taken = 0.0, request.arrived, request.prompt.length, weakref.ref(request)

        def counted(event: Event) -> None:
            nonlocal last
            now = time.perf_counter()
            if isinstance(event, Started):
                self.metrics.add("prompt_tokens", prompt_tokens)
                self.metrics.add("prefill_tokens", event.info["prefill_tokens"])
                if event.info["cache"] == "hit":
                    self.metrics.add("prefix_cache_hits")
                elif event.info["cache"] == "miss":
                    self.metrics.add("prefix_cache_misses")
                self.metrics.first_token(now - arrived)
            elif isinstance(event, Text):
                self.metrics.token_latency(now - last)
            elif isinstance(event, Finished):
                self.metrics.add("generation_tokens", event.completion_tokens)
            elif isinstance(event, Failed):  # logged where it was raised; its frames would hold the request
                event.error.__traceback__ = None
            if isinstance(event, Finished | Failed | Selected):
                self._open.discard(taken())
            last = now
            emit(event)

        return counted

    # ------------------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._take(block=not self.scheduler.has_work())
                if self.scheduler.has_work():
                    # Only a step with prefill work is watched (0.2 ms on a CPU): a decoding-only step writes into
                    # tables allocated before it.
                    watched = bool(self.scheduler.waiting or self.scheduler.prefilling)
                    ended = self.scheduler.ended
                    if watched:
                        self._watch.start()
                    self.scheduler.step()
                    if watched:
                        self.largest_step = max(self.largest_step, self._watch.peak())
                    if self.scheduler.ended != ended:
                        self._release()
            except Exception as error:  # a bug must not stop the server: fail what runs, go on
                log.exception("engine step failed")
                self._fail_all(error)

    def _release(self) -> None:
        """Give the heap pages freed by the prefill or answer that just ended back to the system (timed)."""
        start = time.perf_counter()
        release_freed()
        self.metrics.add("memory_releases")
        self.metrics.add("memory_release_seconds", time.perf_counter() - start)

    def _take(self, block: bool) -> None:
        """Move queued requests into the scheduler while it has room (waiting briefly for one when idle);
        the others stay in the queue, which is what 429 and the queue_depth gauge count. Cancelled requests leave
        `_open` here (the scheduler drops them silently), so that nothing holds one once its client has gone."""
        if any(r.cancelled.is_set() for r in self._open):
            self._open = {r for r in self._open if not r.cancelled.is_set()}
        while self.scheduler.has_room():
            try:
                request = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            except queue.Empty:
                return
            self._open.add(request)
            self.scheduler.add(request)
            block = False

    def _fail_all(self, error: Exception) -> None:
        """Answer every request the engine took and has not answered with `error` (wherever the step left it:
        in the scheduler's lists or between them), and start over with an empty scheduler."""
        scheduler = self.scheduler
        for request in list(self._open):
            request.emit(Failed(error))
        self.scheduler = Scheduler(
            self.model,
            self.tokenizer,
            max_step_tokens=scheduler.max_step_tokens,
            max_batch=scheduler.max_batch,
            prefix_cache=scheduler.prefix_cache,
        )


__all__ = ["EngineThread", "Event", "Failed", "Finished", "Request", "Started", "Text"]
