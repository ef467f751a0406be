"""One request's lifecycle: waiting -> prefill in slices -> decoding steps -> finished.

A `Request` owns everything one prompt's run learns: its prefill (the method's stages from a stored prefix
where one fits, `engine.prefill_run`, in budgeted slices, `engine.slices`), its answer so far, its sampling
generator and its row in the decode batch. The stage objects stay frozen configuration. The
scheduler (`engine.scheduler`) moves requests by steps; `kvsieve.generate` and every CLI command
drive theirs to the end through the same scheduler, and `kvsieve serve` drives many at once.

A request reports what happens through `emit` (`engine.events`): `Started` once its prefill is done,
`Text` for each piece of the answer that became final, then `Finished` or `Failed`. A
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

from kvsieve.compress.cache import wrap_cache
from kvsieve.decode import Sampling, TextStream, TokenLogprob, adjust, next_token, prompt_logprobs, token_logprob
from kvsieve.engine.batch import Row
from kvsieve.engine.events import Event, Failed, Finished, GenerationResult, Selected, Started, Text, json_safe
from kvsieve.engine.prefill_run import prefill_tokens, prefill_with_reuse, select_stage_only
from kvsieve.engine.prefix_cache import PrefixCache
from kvsieve.engine.slices import PrefillSlices
from kvsieve.pipeline import Prefill, StageRecord
from kvsieve.prompt import Prompt
from kvsieve.spec import MethodSpec
from kvsieve.structured import Constraint


class Request:
    """One prompt through `spec`'s stages and `sampling`; see the module docstring.

    boundary: tokens of reusable context at the start of the prompt (a chat's earlier messages),
        where the request stores its prefix state for later requests when a prefix cache is on;
    use_cache: look up and store prefix states (off: the whole prompt runs through the method);
    keep_cache: the cache an answer decoded into stays in its result (`GenerationResult.state`) once it leaves
        the batch; off (the server, which reads no cache), its entries are not copied out of the batch's tables.
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
    ):
        self.prompt, self.spec, self.sampling = prompt, spec, sampling
        self.emit = emit or (lambda event: None)
        self.boundary, self.use_cache, self.select_only = boundary, use_cache, select_only
        self.keep_cache = keep_cache
        self.cancelled = threading.Event()
        self.arrived = time.perf_counter()
        self.slices: PrefillSlices | None = None
        self.prefilled: Prefill | None = None
        self.answer: TextStream | None = None
        self.row: Row | None = None
        self.info: dict[str, Any] = {}
        self.result: GenerationResult | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.error: Exception | None = None
        self._generator: torch.Generator | None = None
        self._reuse: dict[str, Any] = {}
        self._logprobs: list[TokenLogprob] = []  # sampled tokens' entries not yet emitted
        self.constraint: Constraint | None = None  # the answer's grammar (Sampling.grammar)
        self.index = 0  # which of the n answers this request decodes (forks: 1 .. n-1)
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
        self._begin_answer(eos)
        self.slices = PrefillSlices(model, self._select if self.select_only else lambda: self._prefill(cache))

    def _begin_answer(self, eos: set[int]) -> None:
        """A fresh answer: its text, grammar state and log-probabilities."""
        self.answer = TextStream(self.tokenizer, self.sampling, eos)
        if self.sampling.grammar is not None:
            self.constraint = Constraint(self.tokenizer, self.model.config.vocab_size, self.sampling.grammar)
        self._logprobs = []

    def _prefill(self, cache: PrefixCache | None) -> Prefill:
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
        if self.sampling.seed is not None:
            self._generator = torch.Generator().manual_seed(self.sampling.seed)
        self._first_token_at = time.perf_counter()
        self.decode_cache = done.prefilled.cache
        self.row = Row(0, done.prefilled.next_position, done.state.evict)
        logits = done.prefilled.last_logits
        self.forks = [self._fork(index, logits) for index in range(1, self.sampling.n)]
        self.sample(logits)

    def _fork(self, index: int, logits: torch.Tensor) -> Request:
        """Answer `index` of n from the same prefill: a copy of the prefilled cache and eviction state, its
        own answer and sampling generator (seeded seed + index), its first token picked from `logits`."""
        fork = copy.copy(self)  # the prompt, method, record and events are shared
        fork.index, fork.forks = index, []
        fork._begin_answer(self.answer.eos)
        if self.sampling.seed is not None:
            fork._generator = torch.Generator().manual_seed((self.sampling.seed + index) % 2**64)
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in self.decode_cache.layers]
        fork.decode_cache = wrap_cache(self.model, layers)
        fork.row = Row(0, self.row.position, copy.deepcopy(self.row.evict))
        fork.sample(logits)
        return fork

    # ------------------------------------------------------------------------- decoding

    def sample(self, logits: torch.Tensor) -> bool:
        """Pick the next token from (vocab,) raw logits (penalties applied here); True when the answer is complete."""
        sampling, answer = self.sampling, self.answer
        chosen = adjust(logits, sampling, self.prompt.ids[0], answer.tokens) if sampling.adjusts else logits
        if self.constraint is not None:
            chosen = self.constraint.mask(chosen)
        early = len(answer.tokens) < sampling.min_tokens
        token = next_token(chosen, sampling, self._generator, answer.eos if early else ())
        if self.constraint is not None:
            self.constraint.accept(token)
        if sampling.logprobs is not None:
            self._logprobs.append(token_logprob(logits, token, sampling.logprobs))
        return self.add_token(token)

    def add_token(self, token: int) -> bool:
        """Record `token`, emit the text it makes final; True when the answer is complete."""
        self.row.token = token
        piece = self.answer.add(token)
        if piece:
            self.emit(Text(piece, len(self.answer.tokens), self._take_logprobs(), self.index))
        return self.answer.finish is not None

    def _take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens not yet reported (an EOS that ended the answer is not one)."""
        taken, self._logprobs = self._logprobs, []
        if self.answer.finish == "eos" and taken and taken[-1].token in self.answer.eos:
            taken.pop()
        return taken

    def finish(self, kv_entries: int) -> None:
        """The answer is complete with `kv_entries` cache entries left: build the result, emit Finished."""
        done, answer = self.prefilled, self.answer
        seconds = time.perf_counter() - self._first_token_at
        steps = len(answer.tokens) - 1  # forward passes: the first token came from the prefill's logits
        selected = done.state.selected
        kind = "sampling" if self.sampling.temperature else "greedy"
        self.result = GenerationResult(
            text=answer.text,
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
        )
        info = {**self.info, "kv_entries_at_end": kv_entries}
        self.emit(Finished(answer.finish, len(answer.tokens), info, self._take_logprobs(), self.index))

    def fail(self, error: Exception) -> None:
        self.error = error
        self.slices = None
        self.emit(Failed(error))
