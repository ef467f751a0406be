"""The step scheduler: decoding steps of every running request, interleaved with prefill in slices.

Each `step()` runs one decoding token for every running request (one batched forward pass,
`engine.batch`), then spends at most `max_step_tokens` (less the tokens just decoded) on the
prefill of requests that wait, oldest first, in slices between decoder layers (`engine.slices`;
vLLM's chunked prefill with `max_num_batched_tokens`). A long prompt then delays running streams
by one slice per step, never by its whole prefill. A slice always runs at least one layer, so
prefill progresses even when the decode tokens alone use up the step's tokens. `max_step_tokens=None`
runs each prefill in one go (nothing to interleave with when a lone request runs).

At most `max_batch` requests prefill or decode at once; the rest wait. A cancelled request
(`request.cancelled`) leaves at the next step, and its cache is freed. `ended` counts the prefills and
answers that ended (done, failed, cancelled, left the batch): a step that moves it freed a working set or a
cache, which the server then gives back to the system (`kvsieve.memory.release_freed`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.decode import eos_token_ids
from kvsieve.engine.batch import DecodeBatch
from kvsieve.engine.prefix_cache import PrefixCache
from kvsieve.engine.request import Request
from kvsieve.errors import KvsieveError
from kvsieve.kv.cache import kv_entries
from kvsieve.kv.heads import is_segmented
from kvsieve.loading import pair_tokenizer

log = logging.getLogger("kvsieve.engine")


class Scheduler:
    """Moves requests through prefill and decoding by steps; see the module docstring."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_step_tokens: int | None = None,
        max_batch: int = 16,
        prefix_cache: PrefixCache | None = None,
    ):
        if max_step_tokens is not None and max_step_tokens < 1:
            raise KvsieveError(f"max_step_tokens must be at least 1 (or none: whole prefills), got {max_step_tokens}.")
        if max_batch < 1:
            raise KvsieveError(f"max_batch must be at least 1, got {max_batch}.")
        pair_tokenizer(model, tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self.max_step_tokens, self.max_batch = max_step_tokens, max_batch
        self.prefix_cache = prefix_cache
        self.eos = eos_token_ids(model, tokenizer)
        self.batch = DecodeBatch(model)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []  # in the order of the batch's rows
        self.parked: list[Request] = []  # prefilled answers waiting for the batch (`_joinable`)
        self.ended = 0  # prefills and answers that ended so far

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def run_to_end(self, requests: Sequence[Request]) -> None:
        """Add `requests`, then step until every request here has ended; raise the first failed one's error.

        What `run` (the library) and the evaluations do; the server steps by itself between its HTTP events."""
        for request in requests:
            self.add(request)
        while self.has_work():
            self.step()
        for request in requests:
            if request.error is not None:
                raise request.error

    def has_room(self) -> bool:
        """Whether a request added now could start at the next step (fewer than max_batch in all)."""
        return len(self.waiting) + len(self.prefilling) + len(self.running) + len(self.parked) < self.max_batch

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.parked)

    def kv_entries(self) -> int:
        """KV entries per layer and KV head held by the running requests."""
        return sum(self.batch.entries(i) for i in range(len(self.batch)))

    def step(self) -> None:
        """One decoding token for every running request, then prefill with the step's remaining tokens."""
        with torch.no_grad():
            self._drop_cancelled()
            decoded = len(self.running)
            if self.running:
                self._decode()
            tokens = None if self.max_step_tokens is None else max(self.max_step_tokens - decoded, 0)
            self._prefill(tokens)

    def _decode(self) -> None:
        logits = self.batch.step()
        finished, failed = [], []
        for i, request in enumerate(self.running):
            try:
                if request.sample(logits[i]):
                    finished.append(request)
            except Exception as error:  # this answer cannot go on (its grammar, a bug): it fails alone
                if not isinstance(error, KvsieveError):
                    log.exception("decoding failed")
                request.fail(error)
                failed.append(request)
        self._finish(finished)
        self._leave(failed)

    def _finish(self, finished: list[Request]) -> None:
        for request in finished:
            request.finish(self.batch.entries(self._row(request)))
        self._leave(finished)

    def _prefill(self, tokens: float | None) -> None:
        """Advance prefills, oldest first, until the step's `tokens` are spent (at least one layer if one waits);
        the requests whose prefill ended join the batch together (one rebuild of its tables)."""
        ended: list[Request] = []
        try:
            self._advance_prefills(tokens, ended)
        finally:
            self._start_decoding(ended)

    def _advance_prefills(self, tokens: float | None, ended: list[Request]) -> None:
        while True:
            request = self._next_prefill()
            if request is None:
                return
            try:
                spent = request.slices.advance(tokens)
            except KvsieveError as error:  # what the method cannot do with this prompt: this request fails
                self._fail(request, error)
                continue
            except Exception as error:  # a bug in one request must not fail the others
                log.exception("prefill failed")
                self._fail(request, error)
                continue
            if request.slices.done:
                self.ended += 1
                self.prefilling.remove(request)
                ended.append(request)
            if tokens is not None:
                tokens -= spent
                if tokens <= 0:
                    return

    def _next_prefill(self) -> Request | None:
        if self.prefilling:
            return self.prefilling[0]
        while self.waiting and len(self.running) + len(self.prefilling) + len(self.parked) < self.max_batch:
            request = self.waiting.popleft()
            if request.cancelled.is_set():
                continue
            cache = request.prefix_cache if request.prefix_cache is not None else self.prefix_cache
            request.start(self.model, self.tokenizer, self.eos, cache)
            self.prefilling.append(request)
            return request
        return None

    def _start_decoding(self, ended: list[Request]) -> None:
        """The requests' prefills are done: each of their answers (n: a request and its forks) joins the batch."""
        joining = []
        for request in ended:
            try:
                request.prefill_done()
                answers = [] if request.select_only else [request, *request.forks]
                for answer in answers:
                    if not answer.complete:
                        self.batch.check(answer.row, answer.decode_cache)
            except Exception as error:  # its first token could not be picked, or it cannot join: it fails alone
                if not isinstance(error, KvsieveError):
                    log.exception("starting to decode failed")
                request.fail(error)
                continue
            for answer in answers:
                if answer.complete:  # the first token ended it
                    answer.finish(kv_entries(answer.decode_cache))
                else:
                    joining.append(answer)
        joining = self._joinable(self.parked + joining)
        if joining:
            self.batch.join([(answer.row, answer.decode_cache) for answer in joining])
            self.running.extend(joining)

    def _joinable(self, ready: list[Request]) -> list[Request]:
        """Of the prefilled answers `ready` (oldest first), those that join the batch now; the rest wait in
        `parked`. An answer whose cache holds per-head budgets makes the batch's tables segmented (`kv.tables`),
        which an evicting answer cannot decode in: neither joins while the other kind decodes, nor while an older
        answer of the other kind waits (so neither kind waits for ever)."""
        segmented = self.batch.tables.segmented
        evicting = any(answer.row.evict is not None for answer in self.running)
        heads_wait = evict_waits = False
        joining: list[Request] = []
        self.parked = []
        for answer in ready:
            heads = any(is_segmented(layer) for layer in answer.decode_cache.layers)
            evicts = answer.row.evict is not None
            if (heads and (evicting or evict_waits)) or (evicts and (segmented or heads_wait)):
                self.parked.append(answer)
                heads_wait, evict_waits = heads_wait or heads, evict_waits or evicts
                continue
            joining.append(answer)
            segmented, evicting = segmented or heads, evicting or evicts
        return joining

    def _fail(self, request: Request, error: Exception) -> None:
        self.ended += 1
        self.prefilling.remove(request)
        request.fail(error)

    def _row(self, request: Request) -> int:
        return next(i for i, running in enumerate(self.running) if running is request)

    def _drop_cancelled(self) -> None:
        self.waiting = deque(r for r in self.waiting if not r.cancelled.is_set())
        for request in [r for r in self.prefilling if r.cancelled.is_set()]:
            self.ended += 1
            request.slices.close()
            self.prefilling.remove(request)
        for request in [r for r in self.parked if r.cancelled.is_set()]:
            self.ended += 1
            self.parked.remove(request)
        self._leave([r for r in self.running if r.cancelled.is_set()])

    def _leave(self, leaving: list[Request]) -> None:
        if leaving:  # a cancelled answer's cache is read by no one: its entries are not copied out of the tables
            self.ended += len(leaving)
            keep = [r.keep_cache and not r.cancelled.is_set() for r in leaving]
            self.batch.remove([request.row for request in leaving], keep_entries=keep)
            self.running = [r for r in self.running if all(r is not gone for gone in leaving)]
