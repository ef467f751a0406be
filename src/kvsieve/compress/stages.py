"""`Compress` prunes the cache once after prefill; `Evict` keeps it at a budget while decoding.

Both observe the feed's attention (post-RoPE queries and keys) to score the prompt with their
method, then keep per layer and KV head the best `budget` entries. Decoding continues from the
logical position (the pipeline passes explicit position ids), as SnapKV and H2O do.
The attention scale is head_dim ** -0.5, as in every supported architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache

from kvsieve.attention import Observer
from kvsieve.compress.cache import prune_layer, resolve_budget
from kvsieve.compress.methods import Method, supports_decode
from kvsieve.compress.scorers import attention_probs, keep_indices, per_kv_head
from kvsieve.errors import KvsieveError


def _scaling(query: torch.Tensor) -> float:
    return query.shape[-1] ** -0.5


def _check_budget(budget: int | float) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
        raise KvsieveError(f"Budget must be a token count >= 1 or a fraction in (0, 1], got {budget!r}.")


@dataclass
class Compress:
    """Prune the cache after prefill to `budget` entries per layer and KV head (count or fraction)."""

    method: Method
    budget: int | float
    kept_positions: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)
    _scores: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_budget(self.budget)

    @property
    def name(self) -> str:
        return self.method.name

    def observers(self) -> list[Observer]:
        self._scores = {}
        if self.method.position_only:
            return []

        def score(layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
            # Only active during the feed: every call (a prompt, or one chunk, even of one token) scores it.
            self._scores[layer] = self.method.prefill_scores(query[0], key[0], _scaling(query))

        return [score]

    def compress(self, cache: Cache, kept_positions: list[torch.Tensor] | None = None) -> dict[str, Any]:
        """Prune `cache` to the budget by the scores observed during the feed.

        `kept_positions` (per layer, (kv_heads, n)) map the cache entries to the keys of the feed's
        last forward pass when the feed pruned them itself (chunked prefill); None when the cache
        holds exactly those keys.
        """
        if kept_positions is not None:
            self._scores = {layer: s.gather(1, kept_positions[layer]) for layer, s in self._scores.items()}
        n = cache.get_seq_length()
        budget, note = resolve_budget(self.budget, n)
        sinks, recent = self.method.protected(budget)
        self.kept_positions = []
        for layer in range(len(cache.layers)):
            kv_heads = cache.layers[layer].keys.shape[1]
            scores = self._scores.get(layer, torch.zeros(kv_heads, n))
            indices = keep_indices(scores, budget, sinks, recent)
            prune_layer(cache, layer, indices)
            self.kept_positions.append(indices)
        return {"budget": budget, "from": n, **({"note": note} if note else {})}


@dataclass
class Evict:
    """Keep the cache at `budget` while decoding, evicting by a running score every `interval` steps.

    The score of a cached token is its prompt score (the method's prefill scorer) updated at
    every step with the new query's attention row: score <- alpha * score + row (A2SF eq. 6;
    H2O: alpha = 1). Position-only methods (StreamingLLM, local) need no score.
    """

    method: Method
    budget: int | float
    interval: int = 1
    _state: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _budget: int = field(default=0, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_budget(self.budget)
        if not supports_decode(self.method):
            raise KvsieveError(
                f"{self.method.name} has no per-step eviction rule; use it as a compress stage "
                "(--compress), and h2o, a2sf, streaming or local for --evict."
            )
        if self.interval < 1:
            raise KvsieveError(f"Eviction interval must be at least 1 step, got {self.interval}.")

    @property
    def name(self) -> str:
        return self.method.name

    def observers(self) -> list[Observer]:
        """Observers for the feed: they (re)start the running scores from the prompt (or last chunk)."""
        self._state = {}
        return [] if self.method.position_only else [self.observe_prompt]

    def observe_prompt(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Feed pass: the initial scores of the keys it attended over, by the method's prefill scorer."""
        self._state[layer] = self.method.prefill_scores(query[0], key[0], _scaling(query))

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Decoding step: fold the new query's attention row into the running score (A2SF eq. 6)."""
        if self.method.position_only:
            return
        row = per_kv_head(attention_probs(query[0], key[0], _scaling(query))[:, 0], key.shape[1])  # (g, L)
        state = self._state.get(layer)
        if state is None:
            state = torch.zeros_like(row)
        state = torch.cat([state, state.new_zeros(row.shape[0], row.shape[1] - state.shape[1])], dim=1)
        self._state[layer] = self.method.step_alpha * state + row

    def start(self, cache: Cache, kept_positions: list[torch.Tensor] | None) -> dict[str, Any]:
        """Align scores with a cache the feed or a compress stage already pruned, then prune to the budget.

        `kept_positions` (per layer, (kv_heads, n)) map the cache entries to the keys of the
        feed's last forward pass; None when the cache holds exactly those keys.
        """
        if kept_positions is not None:
            self._state = {layer: s.gather(1, kept_positions[layer]) for layer, s in self._state.items()}
        length = cache.get_seq_length()
        self._budget, note = resolve_budget(self.budget, max(length, 1))
        self._steps = 0
        self._prune(cache)
        details = {"evict": self.name, "budget": self._budget, "from": length, "interval": self.interval}
        return {**details, **({"note": note} if note else {})}

    def after_step(self, cache: Cache) -> None:
        self._steps += 1
        if self._steps % self.interval == 0:
            self._prune(cache)

    def _prune(self, cache: Cache) -> None:
        sinks, recent = self.method.protected(self._budget)
        for layer in range(len(cache.layers)):
            _, kv_heads, length, _ = cache.layers[layer].keys.shape
            if length <= self._budget:
                continue
            state = self._state.get(layer, torch.zeros(kv_heads, length))
            indices = keep_indices(state, self._budget, sinks, recent)
            prune_layer(cache, layer, indices)
            if layer in self._state:
                self._state[layer] = state.gather(1, indices)
