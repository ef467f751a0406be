"""One request's lifecycle: waiting -> prefill in slices -> decoding steps -> finished.

A `Request` owns everything one prompt's run learns: its prefill (the method's stages from a stored prefix
where one fits, `engine.prefill_run`, in budgeted slices, `engine.slices`), its cache and its row in the decode
batch; what turns its logits into reported text (sampling, the n answers' generators, events) is its `Output`
(`engine.output`). The stage objects stay frozen configuration. The scheduler (`engine.scheduler`) moves requests
by steps; `kvsieve.generate` and every CLI command drive theirs to the end through the same scheduler, and
`kvsieve serve` drives many at once.

A request reports what happens through `emit` (`engine.events`): `Started` once its prefill is done,
`Text` for each piece of the answer that became final (its output), then `Finished` (its output) or `Failed`. A
`select_only` request (the server's --upstream relay) stops after the select stage and reports
the kept token ids (`Selected`).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.decode import Sampling, prompt_logprobs
from kvsieve.engine.batch import Row
from kvsieve.engine.events import Event, Failed, GenerationResult, Selected, Started, json_safe
from kvsieve.engine.output import Output
from kvsieve.engine.pipeline import PrefillResult, StageRecord
from kvsieve.engine.prefill_run import prefill_tokens, prefill_with_reuse, select_stage_only
from kvsieve.engine.prefix_cache import PrefixCache
from kvsieve.engine.slices import PrefillSlices
from kvsieve.kv.cache import wrap_cache
from kvsieve.kv.heads import carry_segments
from kvsieve.prompt import Prompt
from kvsieve.spec import MethodSpec


class Request:
    """One prompt through `spec`'s stages and `sampling`; see the module docstring.

    boundary: tokens of reusable context at the start of the prompt (a chat's earlier messages),
        where the request stores its prefix state for later requests when a prefix cache is on;
    use_cache: look up and store prefix states (off: the whole prompt runs through the method);
    keep_cache: the cache an answer decoded into stays in its result (`GenerationResult.state`) once it leaves
        the batch; off (the server, which reads no cache), its entries are not copied out of the batch's tables;
    prefix_cache: the prefix cache this request reads and stores in, where it is not its scheduler's (an evaluation
        that compares reuse budgets, each a cache of its own, in one decode batch: `kvsieve ruler`).
    """

    def __init__(
        self,
        prompt: Prompt,
        spec: MethodSpec,
        sampling: Sampling,
        emit: Callable[[Event], None] | None = None,
        *,
        boundary: int = 0,
        use_cache: bool = True,
        select_only: bool = False,
        keep_cache: bool = True,
        prefix_cache: PrefixCache | None = None,
    ):
        self.prompt, self.spec, self.sampling = prompt, spec, sampling
        self.emit = emit or (lambda event: None)
        self.boundary, self.use_cache, self.select_only = boundary, use_cache, select_only
        self.keep_cache = keep_cache
        self.prefix_cache = prefix_cache
        self.cancelled = threading.Event()
        self.arrived = time.perf_counter()
        self.slices: PrefillSlices | None = None
        self.prefilled: PrefillResult | None = None
        self.output: Output | None = None  # this answer's sampling, text and events (`start`)
        self.row: Row | None = None
        self.info: dict[str, Any] = {}
        self.result: GenerationResult | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.error: Exception | None = None
        self._reuse: dict[str, Any] = {}
        self.forks: list[Request] = []  # the other n-1 answers, forked when the prefill is done
        self.decode_cache: Cache | None = None  # the cache this answer decodes from
        self.model: PreTrainedModel | None = None
        self._first_token_at = 0.0

    # ------------------------------------------------------------------------- prefill

    def start(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos: set[int], cache: PrefixCache | None
    ) -> None:
        """Set the prefill up (it runs in the scheduler's slices); nothing is computed yet."""
        self.model, self.tokenizer = model, tokenizer
        self.output = Output(tokenizer, model.config.vocab_size, self.sampling, eos, self.prompt.ids[0], self.emit)
        self.slices = PrefillSlices(model, self._select if self.select_only else lambda: self._prefill(cache))

    def _prefill(self, cache: PrefixCache | None) -> PrefillResult:
        done, self._reuse = prefill_with_reuse(
            self.model, self.prompt, self.spec, self.sampling, cache, boundary=self.boundary, use_cache=self.use_cache
        )
        return done

    def _select(self) -> Selected:
        return select_stage_only(self.model, self.prompt, self.spec)

    def prefill_done(self) -> None:
        """The prefill has returned: report it and pick the first token (the answer may end there)."""
        if self.select_only:
            self.emit(self.slices.result)
            return
        self.prefilled = done = self.slices.result
        self.slices = None
        self.info = {
            "method": self.spec.name,
            **self._reuse,
            "prefill_tokens": prefill_tokens(done, self.prompt.length, self._reuse["cached_tokens"]),
            "kv_entries": done.kv_length,
            "prefill_seconds": round(done.seconds, 6),  # from its first slice: queueing not included
            "stages": [json_safe(asdict(record)) for record in done.stages],
            "settings": {
                stage: value for stage, value in self.spec.to_dict().items() if stage not in ("name", "summary")
            },
        }
        if self.spec.evict is not None:  # eviction started on the prefilled cache; it goes on while decoding
            started = StageRecord("evict", self.spec.evict.name, 0.0, done.evict_details)
            self.info["stages"].append(json_safe(asdict(started)))
        prompt = None
        if self.sampling.prompt_logprobs is not None:
            prompt = prompt_logprobs(done.prefilled.logits, self.prompt.ids[0], self.sampling.prompt_logprobs)
            done.prefilled.logits = None  # (L, vocab): not kept while decoding
        self.emit(Started(self.info, prompt))
        self._first_token_at = time.perf_counter()
        self.decode_cache = done.prefilled.cache
        self.row = Row(0, done.prefilled.next_position, done.state.evict)
        logits = done.prefilled.last_logits
        self.forks = [self._fork(index, logits) for index in range(1, self.sampling.n)]
        self.sample(logits)

    def _fork(self, index: int, logits: torch.Tensor) -> Request:
        """Answer `index` of n from the same prefill: a copy of the prefilled cache and eviction state, its
        own output (`Output.fork`: sampling generator seeded seed + index), its first token picked from `logits`."""
        fork = copy.copy(self)  # the prompt, method, record and events are shared
        fork.forks, fork.output = [], self.output.fork(index)
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in self.decode_cache.layers]
        fork.decode_cache = carry_segments(self.decode_cache, wrap_cache(self.model, layers), share=False)
        fork.row = Row(0, self.row.position, copy.deepcopy(self.row.evict))
        fork.sample(logits)
        return fork

    # ------------------------------------------------------------------------- decoding

    def sample(self, logits: torch.Tensor) -> bool:
        """Pick the next token from (vocab,) raw logits and feed it next; True when the answer is complete."""
        self.row.token = token = self.output.pick(logits)
        return self.output.add(token)

    @property
    def complete(self) -> bool:
        """Whether the answer has ended (its first token may end it)."""
        return self.output.finish is not None

    def finish(self, kv_entries: int) -> None:
        """The answer is complete with `kv_entries` cache entries left: build the result, emit Finished."""
        done, answer = self.prefilled, self.output
        seconds = time.perf_counter() - self._first_token_at
        steps = len(answer.tokens) - 1  # forward passes: the first token came from the prefill's logits
        selected = done.state.selected
        kind = "sampling" if self.sampling.temperature else "greedy"
        self.result = GenerationResult(
            text=answer.text.text,
            tokens=answer.tokens,
            finish_reason=answer.finish,
            prompt_tokens=self.prompt.length,
            prefill_seconds=done.seconds,
            decode_seconds=seconds,
            decode_tokens_per_s=steps / seconds if steps and seconds > 0 else 0.0,
            prefill_kv_length=done.kv_length,
            kv_cache_length=kv_entries,
            stages=[*done.stages, StageRecord("decode", kind, seconds, done.evict_details)],
            selected_indices=None if selected is None else selected.tolist(),
            selected_text=None if selected is None else self.tokenizer.decode(done.ids[0]),
            state=done.state,
            logits=answer.logits,
        )
        answer.finished({**self.info, "kv_entries_at_end": kv_entries})

    def fail(self, error: Exception) -> None:
        self.error = error
        self.slices = None
        self.emit(Failed(error))
