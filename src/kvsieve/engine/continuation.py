"""A prefilled cache continued with tokens the caller chooses: teacher forcing, or a decoding loop of one's own.

`run` and the server pick each next token themselves (`engine.output`); perplexity, the streaming study and the
policy grid feed tokens they already know, or pick them by their own rule, on top of a `prefill` result. Both go
through the engine's one decoding step (`engine.batch.DecodeBatch`, one row), so what is measured is what
`generate` decodes, eviction included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache, PreTrainedModel

from kvsieve.compress.stages import EvictRun
from kvsieve.decode import extend
from kvsieve.engine.batch import DecodeBatch, Row
from kvsieve.engine.pipeline import PrefillResult
from kvsieve.kv.cache import kv_entries


class Continuation:
    """One cache fed token by token from `position` on: `feed(token)` gives the logits of the token after it."""

    def __init__(self, model: PreTrainedModel, cache: Cache, position: int, evict: EvictRun | None = None):
        """Continue `cache` (updated in place, as a request's is) at logical `position`, evicting by `evict`'s rule
        after every step where it is given (an `EvictRun` already started on this cache)."""
        self.evict = evict
        self._batch = DecodeBatch(model)
        self._cache, self._start = cache, position

    @classmethod
    def after(cls, model: PreTrainedModel, done: PrefillResult) -> Continuation:
        """The continuation of a `prefill` result: its cache, at its next position, under its eviction."""
        return cls(model, done.prefilled.cache, done.prefilled.next_position, done.state.evict)

    @property
    def position(self) -> int:
        """The logical position the next fed token takes."""
        return self._batch.rows[0].position if self._batch.rows else self._start

    @property
    def entries(self) -> int:
        """Cache entries per layer and KV head held now."""
        return self._batch.entries(0) if self._batch.rows else kv_entries(self._cache)

    def feed(self, token: int) -> torch.Tensor:
        """Feed `token` at `position` (evicting after the step where a rule is given); its (vocab,) logits."""
        if not self._batch.rows:
            self._batch.add(Row(token, self._start, self.evict), self._cache)
        self._batch.rows[0].token = token
        return self._batch.step()[0]


def forced_logits(model: PreTrainedModel, done: PrefillResult, targets: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """(len(targets), vocab) logits that predict each of `targets` after `done`'s prompt, each target fed in turn.

    The first row is the prefill's own last logits. Without an eviction rule the targets but the last run as one
    forward pass on top of the cache (the same logits as feeding them one by one); with one, token by token, so
    that the rule evicts after every step as it does while decoding.
    """
    targets = torch.as_tensor(targets)
    rows = [done.prefilled.last_logits[None]]
    with torch.no_grad():
        if len(targets) > 1 and done.state.evict is None:
            cache, position = done.prefilled.cache, done.prefilled.next_position
            rows.append(extend(model, cache, targets[None, :-1], position, logits_to_keep=len(targets) - 1))
        elif len(targets) > 1:
            continuation = Continuation.after(model, done)
            rows.extend(continuation.feed(token)[None] for token in targets[:-1].tolist())
    return torch.cat(rows)
