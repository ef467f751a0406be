"""`Compress` prunes the cache once after prefill; `Evict` keeps it at a budget while decoding.

Both are frozen configuration. `begin()` returns a per-run object (`CompressRun`, `EvictRun`)
that holds what one request learns: the scores observed during the feed (post-RoPE queries and
keys), the resolved budget, the positions kept. So one configuration serves any number of
concurrent requests. Decoding continues from the logical position (the pipeline passes explicit
position ids), as SnapKV and H2O do. The attention scale is head_dim ** -0.5, as in every
supported architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache

from kvsieve.attention import Observer
from kvsieve.compress.cache import prune_layer, resolve_budget
from kvsieve.compress.policies.a2sf import A2SF
from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.compress.policy import Policy
from kvsieve.compress.scorers import keep_indices
from kvsieve.errors import KvsieveError
from kvsieve.spec import component, option

BUDGET_HELP = "KV entries kept per layer and KV head: a count (1024) or a fraction of the prompt (0.25)"


def _scaling(query: torch.Tensor) -> float:
    return query.shape[-1] ** -0.5


def _check_budget(budget: int | float) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
        raise KvsieveError(f"Budget must be a token count >= 1 or a fraction in (0, 1], got {budget!r}.")
    if isinstance(budget, float) and budget > 1:
        raise KvsieveError(f"Budget {budget} is not a fraction in (0, 1]; give a fraction or a whole token count.")


def _check_policy(policy: object) -> None:
    if not isinstance(policy, Policy):
        raise KvsieveError(f"{policy!r} is not a KV policy; use one of the registered policies (kvsieve methods).")


def _align(scores: dict[int, torch.Tensor], kept: list[torch.Tensor] | None) -> dict[int, torch.Tensor]:
    """Scores of the feed's last attended keys, gathered to the cache entries the feed kept."""
    if kept is None:
        return scores
    return {layer: s.gather(1, kept[layer]) for layer, s in scores.items()}


def _layer_scores(scores: dict[int, torch.Tensor], layer: int, keys: torch.Tensor, policy: Policy) -> torch.Tensor:
    """The observed scores of `layer`, or zeros (recency decides) for a position-only policy."""
    if layer in scores:
        return scores[layer]
    if not policy.position_only:
        raise KvsieveError(
            f"The {policy.name} policy saw no attention at layer {layer}; run the model through kvsieve "
            "(kvsieve.load_model, or kvsieve.prepare(model) for a model you loaded yourself)."
        )
    return torch.zeros(keys.shape[1], keys.shape[2], device=keys.device)


@component("compress", "compress")
@dataclass(frozen=True)
class Compress:
    """Prune the cache after prefill to `budget` entries per layer and KV head."""

    policy: Policy = option(help="the KV policy that scores the prompt's tokens", kind="policy", factory=SnapKV)
    budget: int | float = option(1024, BUDGET_HELP)

    def __post_init__(self) -> None:
        _check_policy(self.policy)
        _check_budget(self.budget)

    @property
    def name(self) -> str:
        return self.policy.name

    def begin(self) -> CompressRun:
        """A fresh per-run state for one request."""
        return CompressRun(self)


@dataclass
class CompressRun:
    """One request's compression: scores observed during the feed, then the positions kept."""

    config: Compress
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    kept_positions: list[torch.Tensor] = field(default_factory=list)

    def observers(self) -> list[Observer]:
        if self.config.policy.position_only:
            return []

        def score(layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
            # Every feed pass (a prompt, or one chunk, even of one token) rescores the keys it attended.
            self.scores[layer] = self.config.policy.prompt_scores(query[0], key[0], _scaling(query))

        return [score]

    def compress(self, cache: Cache, kept_positions: list[torch.Tensor] | None = None) -> dict[str, Any]:
        """Prune `cache` in place to the budget by the scores observed during the feed.

        `kept_positions` (per layer, (kv_heads, n)) map the cache entries to the keys of the feed's
        last forward pass when the feed pruned them itself (chunked prefill); None when the cache
        holds exactly those keys. Afterwards `self.kept_positions` say which entries survived.
        """
        scores = _align(self.scores, kept_positions)
        n = cache.get_seq_length()
        budget, note = resolve_budget(self.config.budget, n)
        sinks, recent = self.config.policy.protected(budget)
        self.kept_positions = []
        for layer in range(len(cache.layers)):
            keys = cache.layers[layer].keys
            indices = keep_indices(_layer_scores(scores, layer, keys, self.config.policy), budget, sinks, recent)
            prune_layer(cache, layer, indices)
            self.kept_positions.append(indices)
        return {"budget": budget, "from": n, **({"note": note} if note else {})}


@component("evict", "evict")
@dataclass(frozen=True)
class Evict:
    """Keep the cache at `budget` while decoding, evicting by a running score every `interval` steps.

    The score of a cached token starts as its prompt score (the policy's prompt scorer) and is
    updated at every step by the policy's rule (A2SF eq. 6: score <- alpha * score + row; H2O
    alpha = 1; TOVA the newest row; KNorm the key norms). Position-only policies need no score.
    """

    policy: Policy = option(help="the KV policy that scores and evicts", kind="policy", factory=A2SF)
    budget: int | float = option(1024, BUDGET_HELP)
    interval: int = option(1, "evict every this many decoding steps (the cache grows by at most interval - 1)")

    def __post_init__(self) -> None:
        _check_policy(self.policy)
        _check_budget(self.budget)
        if not self.policy.decodes:
            raise KvsieveError(
                f"{self.policy.name} has no per-step eviction rule; use it as a compress stage "
                "(--set compress=NAME), or a policy with one (h2o, a2sf, tova, knorm, streaming, local) to evict."
            )
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise KvsieveError(f"Eviction interval must be a whole number of steps >= 1, got {self.interval!r}.")

    @property
    def name(self) -> str:
        return self.policy.name

    def begin(self) -> EvictRun:
        """A fresh per-run state for one request."""
        return EvictRun(self)


@dataclass
class EvictRun:
    """One request's eviction: running scores per layer, the resolved budget, steps since start."""

    config: Evict
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    budget: int = 0
    steps: int = 0

    def observers(self) -> list[Observer]:
        """Observers for the feed: they (re)start the running scores from the prompt (or last chunk)."""
        return [] if self.config.policy.position_only else [self.observe_prompt]

    def observe_prompt(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Feed pass: the initial scores of the keys it attended over, by the policy's prompt scorer."""
        self.scores[layer] = self.config.policy.prompt_scores(query[0], key[0], _scaling(query))

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Decoding step: the policy's per-step rule updates the running scores."""
        updated = self.config.policy.step_scores(self.scores.get(layer), query[0], key[0], _scaling(query))
        if updated is not None:
            self.scores[layer] = updated

    def start(self, cache: Cache, kept_positions: list[torch.Tensor] | None) -> dict[str, Any]:
        """Align scores with a cache the feed or a compress stage already pruned, then prune to the budget.

        `kept_positions` (per layer, (kv_heads, n)) map the cache entries to the keys of the
        feed's last forward pass; None when the cache holds exactly those keys.
        """
        self.scores = _align(self.scores, kept_positions)
        length = cache.get_seq_length()
        self.budget, note = resolve_budget(self.config.budget, max(length, 1))
        self.steps = 0
        self._prune(cache)
        details = {"evict": self.config.name, "budget": self.budget, "from": length, "interval": self.config.interval}
        return {**details, **({"note": note} if note else {})}

    def after_step(self, cache: Cache) -> None:
        self.steps += 1
        if self.steps % self.config.interval == 0:
            self._prune(cache)

    def _prune(self, cache: Cache) -> None:
        sinks, recent = self.config.policy.protected(self.budget)
        for layer in range(len(cache.layers)):
            keys = cache.layers[layer].keys
            if keys.shape[2] <= self.budget:
                continue
            scores = _layer_scores(self.scores, layer, keys, self.config.policy)
            indices = keep_indices(scores, self.budget, sinks, recent)
            prune_layer(cache, layer, indices)
            if layer in self.scores:
                self.scores[layer] = scores.gather(1, indices)
