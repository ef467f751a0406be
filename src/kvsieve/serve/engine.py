"""The engine: one thread that owns the model, admits queued requests and decodes them in batches.

The HTTP front submits a `Job` to a bounded queue (full: 429) and reads the job's `Event`s. The
loop takes one queued job at a time while the batch has room: it prefills it (through the prefix
cache where the method allows), samples the first token, and lets it join the batch; then it
runs one batched decoding step for every active request. A request leaves the batch when it
finishes or its client goes away (the front sets `job.cancelled`), and its cache is freed then.
Prefill of a new request runs between two decoding steps, so long prompts delay the active
requests by one prefill, never by a whole generation.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.attention import attention_hooks
from kvsieve.decode import Sampling, TextStream, eos_token_ids, next_token
from kvsieve.errors import KvsieveError
from kvsieve.prompt import Prompt
from kvsieve.serve.batch import DecodeBatch, Row
from kvsieve.serve.metrics import Metrics
from kvsieve.serve.openai_types import ApiError
from kvsieve.serve.prefill import prefill_request, spec_key
from kvsieve.serve.prefix_cache import PrefixCache
from kvsieve.spec import MethodSpec

log = logging.getLogger("kvsieve.serve")


@dataclass
class Started:
    """Prefill is done; `info` says what the stages did. The first text follows."""

    info: dict[str, Any]


@dataclass
class Text:
    piece: str


@dataclass
class Finished:
    reason: str  # "eos", "stop" or "length"
    completion_tokens: int
    info: dict[str, Any]


@dataclass
class Selected:
    """Select-only jobs (--upstream): the prompt ids the select stage kept."""

    ids: list[int]
    info: dict[str, Any]


@dataclass
class Failed:
    error: ApiError


Event = Started | Text | Finished | Selected | Failed


@dataclass
class Job:
    """One request as the engine sees it: token ids, method, sampling, where to send events."""

    ids: list[int]
    spec: MethodSpec
    sampling: Sampling
    emit: Callable[[Event], None]
    boundary: int = 0  # tokens of reusable context (everything before the last chat message)
    tail: int = 0  # tokens a select stage always keeps (question and template suffix)
    use_cache: bool = True
    select_only: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class _Active:
    """A job in the decoding batch."""

    job: Job
    row: Row
    answer: TextStream
    generator: torch.Generator | None
    info: dict[str, Any]
    last_token_at: float


class Engine:
    """Owns the model; see the module docstring. `start()` runs the loop in a daemon thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        metrics: Metrics,
        *,
        max_queue: int = 64,
        max_batch: int = 16,
        cache_bytes: int = 0,
    ):
        self.model, self.tokenizer, self.metrics = model, tokenizer, metrics
        self.max_batch = max_batch
        self.eos = eos_token_ids(model, tokenizer)
        self.prefix_cache = PrefixCache(model, cache_bytes) if cache_bytes > 0 else None
        self.batch = DecodeBatch(model)
        self._active: list[_Active] = []
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvsieve-engine", daemon=True)
        metrics.gauges.update(
            {
                "queue_depth": ("requests waiting for the engine", lambda: self._queue.qsize()),
                "active_requests": ("requests in the decoding batch", lambda: len(self._active)),
                "kv_entries": (
                    "KV entries per layer and KV head held by the requests in the batch",
                    self.kv_entries,
                ),
                "prefix_cache_bytes": ("bytes of stored prompt states", lambda: self._cache_stat("bytes")),
                "prefix_cache_states": ("stored prompt states", lambda: self._cache_stat("states")),
            }
        )

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

    def submit(self, job: Job) -> None:
        """Queue `job`, or answer 429 when the queue is full."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise ApiError(
                429,
                f"The server is busy: {self._queue.maxsize} requests are already waiting. Retry shortly.",
                type="rate_limit_exceeded",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None

    def kv_entries(self) -> int:
        rows = list(self.batch.rows)  # read from another thread: a snapshot is enough for a gauge
        try:
            return sum(self.batch.entries(i) for i in range(len(rows)))
        except IndexError:
            return 0

    def _cache_stat(self, what: str) -> int:
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.bytes if what == "bytes" else len(self.prefix_cache)

    # ------------------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        with torch.no_grad():
            while not self._stop.is_set():
                try:
                    self._drop_cancelled()
                    job = self._take(block=not self._active) if len(self._active) < self.max_batch else None
                    if job is not None:
                        self._admit(job)
                    if self._active:
                        self._step()
                except Exception as error:  # a bug must not stop the server: fail the batch, go on
                    log.exception("engine step failed")
                    self._fail_all(ApiError(500, f"The engine failed: {error!r}", type="server_error"))

    def _fail_all(self, error: ApiError) -> None:
        """Answer every request in the batch with `error` and start over with an empty batch."""
        for active in self._active:
            active.job.emit(Failed(error))
        self._active = []
        self.batch = DecodeBatch(self.model)

    def _take(self, block: bool) -> Job | None:
        try:
            return self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _admit(self, job: Job) -> None:
        """Prefill `job` (or only select, for --upstream); a method the model cannot run answers 400."""
        if job.cancelled.is_set():
            return
        try:
            if job.select_only:
                self._select(job)
            else:
                self._start(job)
        except KvsieveError as error:
            job.emit(Failed(ApiError(400, str(error), param="kvsieve", code="invalid_method")))
        except Exception as error:  # a bug in one request must not fail the others
            log.exception("prefill failed")
            job.emit(Failed(ApiError(500, f"Prefill failed: {error!r}", type="server_error")))

    def _start(self, job: Job) -> None:
        """Prefill through the prefix cache, emit the first token, join the batch, then store states."""
        done = prefill_request(
            self.model,
            job.spec,
            job.ids,
            boundary=job.boundary,
            tail=job.tail,
            reserve=job.sampling.max_new_tokens,
            cache=self.prefix_cache,
            use_cache=job.use_cache,
        )
        self._count_prefill(job, done.info)
        job.emit(Started(done.info))
        generator = torch.Generator().manual_seed(job.sampling.seed) if job.sampling.seed is not None else None
        token = next_token(done.state.logits, job.sampling, generator)
        now = time.perf_counter()
        self.metrics.first_token(now - job.arrived)
        row = Row(token, done.state.position, done.evict)
        active = _Active(job, row, TextStream(self.tokenizer, job.sampling, self.eos), generator, done.info, now)
        if not self._deliver(active, token):
            self.batch.add(row, done.state.cache)
            self._active.append(active)
        if self.prefix_cache is not None:
            for ids, state in done.to_store:
                self.prefix_cache.store(spec_key(job.spec), ids, state)

    def _count_prefill(self, job: Job, info: dict[str, Any]) -> None:
        self.metrics.add("prompt_tokens", len(job.ids))
        self.metrics.add("prefill_tokens", info["prefill_tokens"])
        if info["cache"] == "hit":
            self.metrics.add("prefix_cache_hits")
        elif info["cache"] == "miss":
            self.metrics.add("prefix_cache_misses")

    def _select(self, job: Job) -> None:
        """Run only the select stage (for --upstream); without one the whole prompt goes on."""
        start = time.perf_counter()
        spec = job.spec
        ids = job.ids
        details: dict[str, Any] = {}
        if spec.select is not None:
            prompt = Prompt(torch.tensor([ids], device=self.model.device), 0, len(ids) - job.tail)
            kernel = spec.attention.begin() if spec.attention is not None else None
            with attention_hooks(kernel=kernel):
                selection = spec.select.select(self.model, prompt)
            ids = [ids[i] for i in selection.indices.tolist()]
            details = {k: v for k, v in selection.details.items() if isinstance(v, int | float | str)}
        info = {
            "method": spec.name,
            "prompt_tokens": len(job.ids),
            "selected_tokens": len(ids),
            "select_seconds": round(time.perf_counter() - start, 6),
            **details,
        }
        self.metrics.add("prompt_tokens", len(job.ids))
        job.emit(Selected(ids, info))

    def _step(self) -> None:
        """One batched decoding step for every active request."""
        logits = self.batch.step()
        now = time.perf_counter()
        finished = []
        for i, active in enumerate(self._active):
            token = next_token(logits[i], active.job.sampling, active.generator)
            self.metrics.token_latency(now - active.last_token_at)
            active.last_token_at = now
            active.row.token = token
            if self._deliver(active, token):
                finished.append(active)
        self._leave(finished)

    def _deliver(self, active: _Active, token: int) -> bool:
        """Send the text `token` completes; True when the answer is finished (Finished sent)."""
        self.metrics.add("generation_tokens")
        piece = active.answer.add(token)
        if piece:
            active.job.emit(Text(piece))
        if active.answer.finish is None:
            return False
        info = {**active.info, "kv_entries_at_end": self._entries(active)}
        active.job.emit(Finished(active.answer.finish, len(active.answer.tokens), info))
        return True

    def _entries(self, active: _Active) -> int:
        for i, row in enumerate(self.batch.rows):
            if row is active.row:
                return self.batch.entries(i)
        return active.info["kv_entries"]

    def _drop_cancelled(self) -> None:
        self._leave([a for a in self._active if a.job.cancelled.is_set()])

    def _leave(self, leaving: list[_Active]) -> None:
        if leaving:
            self.batch.remove([a.row for a in leaving])
            self._active = [a for a in self._active if all(a is not b for b in leaving)]
