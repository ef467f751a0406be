"""`Compress` prunes the cache once after prefill; `Evict` keeps it at a budget while decoding.

Both are frozen configuration. `begin()` returns a per-run object (`CompressRun`, `EvictRun`)
that holds what one request learns: the scores observed during the feed's last pass (post-RoPE
queries and keys), the resolved budget, the positions kept. So one configuration serves any
number of concurrent requests. Decoding continues from the logical position (the pipeline passes
explicit position ids), as SnapKV and H2O do, unless the eviction policy re-encodes positions
(StreamingLLM's `reencode`, as in its paper): then `EvictRun` keeps every entry at its place in
the cache in time order (0 .. n-1, by its age stamp), re-rotating the kept keys after each
eviction, and the next token goes at position n (`EvictRun.position`). Scores use the scale
head_dim ** -0.5, the model's own in every supported family but Gemma 2/3 checkpoints whose
`query_pre_attn_scalar` differs from head_dim (Gemma 2 27B: 144 against 128; Gemma 3 270M: equal),
where the scores' softmax runs at a slightly other temperature than the model's attention.

Layer by layer: after a one-pass prefill, a layer's cache is used by nobody but that layer's own
attention, so the pipeline hands each run a `finisher` that prunes layer j as soon as its
attention is done (as kvpress's forward hooks do). The uncompressed cache of all layers then
never exists at once, and the prefill's peak falls by the bytes the pruning removes.

While decoding in the engine's batch, `EvictRun` keeps the cache in preallocated buffers (`DecodeBuffer`; its
in-buffer half is `kv.in_place`): new entries are written in place and an eviction moves at most `interval`
entries per KV head. StreamingLLM's re-encoded positions are `kv.reencoding`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache

from kvsieve.attention import AccumulatedScores, AttentionMaxima, AttentionRows, Finisher, Observer, PassReader
from kvsieve.compress.policies.a2sf import A2SF
from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.compress.policy import LayerPass, Policy, observed_scores
from kvsieve.compress.scorers import accumulated_attention, keep_indices
from kvsieve.errors import KvsieveError
from kvsieve.kv.cache import (
    EntryTables,
    budgeted_layers,
    is_windowed,
    kv_entries,
    prune_layer,
    resolve_budget,
)
from kvsieve.kv.heads import SegmentedLayer, head_counts, is_segmented
from kvsieve.kv.in_place import InPlaceEviction
from kvsieve.kv.reencoding import Reencoding
from kvsieve.models import Architecture, logit_scale
from kvsieve.spec import component, option

BUDGET_HELP = "KV entries kept per layer and KV head: a count (1024) or a fraction of the prompt (0.25)"


def _reencodes(policy: Policy) -> bool:
    """Whether `policy` assigns positions by place in the cache (StreamingLLM's `reencode`)."""
    return bool(getattr(policy, "reencode", False))


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


@dataclass(frozen=True)
class PrefixSums:
    """The accumulated attention (A2SF eq. 5) of a prompt prefix's `queries` queries, per alpha and layer.

    A request that starts from a stored prefix runs only its new queries; with these sums its
    accumulating policies still score every prompt query, exactly as a one-pass prefill would:
    A_{n,k} = sum over the new queries + alpha^(new queries) * the prefix's sums.
    """

    queries: int
    sums: dict[float, dict[int, torch.Tensor]]


def accumulating(policies: list[Policy]) -> list[float]:
    """The distinct alphas whose accumulated attention `policies` make their prompt scores from."""
    return sorted({p.summed_alpha for p in policies if not p.position_only and p.summed_alpha is not None})


def _continued(
    prior: PrefixSums | None, alpha: float, layer: int, sums: torch.Tensor, queries: int
) -> tuple[torch.Tensor, int]:
    """A pass's accumulated attention of its `queries` queries, plus the prefix's before them (eq. 5)."""
    if prior is None:
        return sums, queries
    before = prior.sums[alpha][layer]
    sums = sums.clone()
    sums[:, : before.shape[1]] += (alpha**queries) * before
    return sums, queries + prior.queries


def sum_recorders(
    alphas: list[float], into: dict[float, dict[int, torch.Tensor]], prior: PrefixSums | None = None
) -> list[Observer]:
    """Observers storing every layer's accumulated attention, one per alpha, in `into[alpha][layer]`
    (continuing `prior`'s sums)."""
    observers = []
    for alpha in alphas:
        layers = into.setdefault(alpha, {})

        def receive(layer: int, sums: torch.Tensor, queries: int, layers=layers, alpha=alpha) -> None:
            layers[layer] = _continued(prior, alpha, layer, sums, queries)[0]

        def reference(query: torch.Tensor, key: torch.Tensor, scaling: float, alpha=alpha) -> torch.Tensor:
            return accumulated_attention(query, key, scaling, alpha=alpha)

        observers.append(AccumulatedScores(alpha, receive, reference))
    return observers


def score_observers(
    policy: Policy,
    into: dict[int, torch.Tensor],
    prior: PrefixSums | None = None,
    blind: bool = False,
    arch: Architecture | None = None,
    within: torch.Tensor | None = None,
) -> list[Observer | PassReader]:
    """Observers storing `policy`'s scores of every layer's keys in `into`; none for position-only policies.

    The one place a prompt scorer's `reads` are supplied: each layer's pass as a `LayerPass`, its values where the
    policy reads them, the layer's rotary embedding from `arch` (the model's; a policy that reads it refuses to run
    without).

    Policies whose scores are made from accumulated attention (H2O, A2SF, Collie) take it from the
    prefill attention itself, added to the `prior` sums of a stored prefix's queries when the pass
    continues one. `blind`: the pass's queries add nothing (a question asked of a context compressed without it,
    question-agnostic reuse: the question must not choose what is evicted later either); the scores are the prior
    sums' alone, zero for the pass's own keys. `within`: a second pass's `Reread.within`, the cached keys its
    attention maxima are normalised over besides the pass's own.
    """
    if policy.position_only:
        return []
    alpha = policy.summed_alpha
    if alpha is not None:

        def receive(layer: int, sums: torch.Tensor, queries: int) -> None:
            if blind and prior is None:
                into[layer] = torch.zeros_like(sums)
                return
            if blind:
                sums, queries = torch.zeros_like(sums), 0
            into[layer] = policy.from_sums(*_continued(prior, alpha, layer, sums, queries))

        return [AccumulatedScores(alpha, receive, policy.accumulated_scores)]

    if "attention_max" in policy.reads:  # from the attention's own softmax rows where it computes them

        def highest(layer: int, maxima: torch.Tensor) -> None:
            into[layer] = torch.zeros_like(maxima) if blind else maxima

        def reference(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
            scores = policy.prompt_scores(LayerPass(query, key, scale=scaling))
            if scores is None:
                raise KvsieveError(f"{policy.name} reads attention maxima but computes none from a pass.")
            return scores

        return [AttentionMaxima(highest, reference, within)]

    if "rotary" in policy.reads and arch is None:
        raise KvsieveError(
            f"{policy.name} reads the layers' rotary embedding, which this stage was not given; run it through "
            "kvsieve.prefill / kvsieve.run (they pass the model)."
        )

    def score(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        seen = LayerPass(
            query[0],
            key[0],
            value[0] if "values" in policy.reads else None,
            arch.rotary(layer) if arch is not None and "rotary" in policy.reads else None,
        )
        scores = policy.prompt_scores(seen)
        into[layer] = torch.zeros_like(scores) if blind else scores

    return [PassReader(score)]


@component("compress", "compress")
@dataclass(frozen=True)
class Compress:
    """Prune the cache after prefill to `budget` entries per layer and KV head."""

    policy: Policy = option(help="the KV policy that scores the prompt's tokens", kind="policy", factory=SnapKV)
    budget: int | float = option(1024, BUDGET_HELP)
    head_budgets: bool = option(
        False,
        "AdaKV: a layer's KV heads share its budget x heads as one top-k over all their scores, each head holding "
        "its own count (a cache of per-head segments, so the memory follows the budget)",
    )
    head_floor: float = option(0.2, "with head_budgets, the share of the budget each head keeps at least (AdaKV's)")

    def __post_init__(self) -> None:
        _check_policy(self.policy)
        _check_budget(self.budget)
        if not 0 <= self.head_floor <= 1:
            raise KvsieveError(f"head_floor is a share of the budget in [0, 1], got {self.head_floor}.")
        if self.head_budgets and (self.policy.position_only or self.policy.accumulates or self.policy.decodes):
            raise KvsieveError(
                "head_budgets shares a layer's budget among its KV heads by a prompt scorer's scores; "
                f"{self.policy.name} keeps tokens by position alone or scores them while decoding. Use a prompt "
                "scorer (snapkv, expected-attention, kvzip, knorm, pyramidkv)."
            )
        if _reencodes(self.policy):
            raise KvsieveError(
                f"{self.policy.name}'s reencode places tokens by their place in the cache while decoding; it needs "
                "the evict stage (--set evict=streaming --set evict.policy.reencode=true), not compress, which "
                "keeps every token's position."
            )

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
    total: int = 0  # entries per layer before pruning (0: not resolved yet)
    pruned: dict[int, torch.Tensor] = field(default_factory=dict)  # layers pruned during the prefill
    held: int = 0  # the budget as a count of entries, set by `hold` (0: the configured budget)
    allocated: dict[int, int] = field(default_factory=dict)  # budgets the policy chose from all layers' scores

    def observers(
        self, prior: PrefixSums | None = None, blind: bool = False, arch: Architecture | None = None
    ) -> list[Observer | PassReader]:
        """Score observers for the feed's last pass (a prompt, or a chunked feed's last chunk), continuing
        the `prior` sums of a stored prefix; none for a run that `hold`s, which prunes nothing. `arch`: the model's,
        for a policy that reads its rotary embedding (`score_observers`). A policy that reads a second pass scores none
        of the prompt's own (`rereads`)."""
        if self.held or "second_pass" in self.config.policy.reads:
            return []
        return score_observers(self.config.policy, self.scores, prior, blind, arch)

    @property
    def rereads(self) -> bool:
        """Whether its scores come from the policy's second pass over the cache (`kvsieve.feed.reconstruction`), run
        after the feed and before `compress`: a policy that reads one, on a run that prunes (not one that `hold`s)."""
        return "second_pass" in self.config.policy.reads and not self.held

    def resolve_budget(self, tokens: int) -> None:
        """Take a fractional budget of `tokens` prompt tokens rather than of the entries the cache holds
        (a compressed prefix holds fewer entries than the tokens it covers)."""
        self.total = tokens

    def hold(self, entries: int) -> None:
        """Keep the `entries` the cache will hold after this pass, pruning nothing: new tokens appended to a
        context already compressed to its budget without them (question-agnostic reuse, `pipeline.prefill`)."""
        self.total = self.held = entries

    def _budget(self) -> int:
        return self.held or resolve_budget(self.config.budget, self.total)[0]

    def finisher(self, cache: Cache) -> Finisher:
        """Prune each layer of `cache` (a one-pass prefill's) right after that layer's attention."""

        def finish(layer: int) -> None:
            if not is_windowed(cache.layers[layer]) and not self.rereads:  # scores come after the whole pass
                self.pruned[layer] = self._prune(cache, layer, self.scores)

        return finish

    def compress(self, cache: Cache, kept_positions: list[torch.Tensor] | None = None) -> dict[str, Any]:
        """Prune `cache` in place to the budget by the scores observed during the feed.

        `kept_positions` (per layer, (kv_heads, n)) map the cache entries to the keys of the feed's
        last forward pass when the feed pruned them itself (chunked prefill); None when the cache
        holds exactly those keys. Layers the finisher already pruned are kept as they are.
        Afterwards `self.kept_positions` say which entries survived.
        """
        scores = _align(self.scores, kept_positions)
        layers = budgeted_layers(cache)
        if layers and not self.held and not self.pruned:  # budgets chosen from every layer's scores at once
            self.total = self.total or cache.layers[layers[0]].keys.shape[2]
            self.allocated = self.config.policy.allocate(scores, self._budget(), layers) or {}
        self.kept_positions = [
            self.pruned[layer] if layer in self.pruned else self._prune(cache, layer, scores)
            for layer in range(len(cache.layers))
        ]
        note = None if self.held else resolve_budget(self.config.budget, self.total)[1]
        details = {"budget": self._budget(), "from": self.total, "layer_by_layer": bool(self.pruned)}
        if self.config.policy.budgets_per_layer:
            details["layer_entries"] = [int(kept.shape[-1]) for kept in self.kept_positions]
        return {**details, **({"held": True} if self.held else {}), **({"note": note} if note else {})}

    def _prune(self, cache: Cache, layer: int, scores: dict[int, torch.Tensor]) -> torch.Tensor:
        """Prune `layer` to its budget (the policy's `allocate`d one, else its `layer_budget`); the kept entries. A
        windowed layer, or one within its budget, keeps all of its entries; with `head_budgets` the layer becomes a
        `SegmentedLayer` (`_prune_heads`)."""
        segmented = cache.layers[layer]
        if is_segmented(segmented) and self.held:  # a question on a context compressed per head: kept as it is
            columns = torch.arange(max(segmented.counts), device=segmented.device).expand(segmented.kv_heads, -1)
            return columns.masked_fill(columns >= segmented.lengths[:, None], -1)
        if is_segmented(segmented):
            raise KvsieveError(
                "This cache holds per-head budgets already (compress.head_budgets): it is compressed for good, and "
                "cannot be compressed again, stored as a prefix or continued by another method."
            )
        keys = cache.layers[layer].keys
        self.total = self.total or keys.shape[2]
        windowed = is_windowed(cache.layers[layer])  # never budgeted (nor in `budgeted_layers`)
        if windowed:
            budget = keys.shape[2]
        elif layer in self.allocated:
            budget = self.allocated[layer]
        else:
            budget = self.config.policy.layer_budget(self._budget(), layer, budgeted_layers(cache))
        if windowed or keys.shape[2] <= budget:
            return torch.arange(keys.shape[2], device=keys.device).expand(keys.shape[1], -1)
        sinks, recent = self.config.policy.protected(budget)
        layer_scores = observed_scores(scores, layer, keys, self.config.policy)
        if self.config.head_budgets:
            return self._prune_heads(cache, layer, layer_scores, budget)
        indices = keep_indices(layer_scores, budget, sinks, recent)
        prune_layer(cache, layer, indices)
        return indices

    def _prune_heads(self, cache: Cache, layer: int, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """AdaKV: the layer's KV heads keep `head_counts` entries each (budget x heads in all), the best of their own
        scores, in a `SegmentedLayer` that holds exactly those. Returns the kept positions (kv_heads, longest), each
        head's padded with -1 after its own (they are not a rectangle; nothing gathers by them)."""
        entry = cache.layers[layer]
        n = scores.shape[1]
        sinks, recent = self.config.policy.protected(budget)
        position = torch.arange(n, device=scores.device)
        protected = (position < sinks) | (position >= n - recent)
        counts = head_counts(scores, budget, self.config.head_floor, protected).tolist()  # the one read of the layer
        kept = [keep_indices(scores[g : g + 1], count, sinks, recent)[0] for g, count in enumerate(counts)]
        cache.layers[layer] = SegmentedLayer.kept(entry.keys, entry.values, kept, room=0)  # held as kept
        padded = torch.full((len(kept), max(counts)), -1, dtype=torch.long, device=scores.device)
        for g, index in enumerate(kept):
            padded[g, : index.shape[0]] = index
        return padded


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
        if not self.policy.decodes or self.policy.budgets_per_layer:
            raise KvsieveError(
                f"{self.policy.name} has no per-step eviction rule with one budget for every layer; use it as a "
                "compress stage (--set compress=NAME), or a policy with one (h2o, a2sf, tova, knorm, streaming, "
                "local) to evict."
            )
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise KvsieveError(f"Eviction interval must be a whole number of steps >= 1, got {self.interval!r}.")

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def reencodes(self) -> bool:
        """Whether positions are re-encoded by place in the cache (decoding feeds at the cache length)."""
        return _reencodes(self.policy)

    def begin(self) -> EvictRun:
        """A fresh per-run state for one request."""
        return EvictRun(self, reencoding=Reencoding() if self.reencodes else None)


@dataclass
class EvictRun(InPlaceEviction):
    """One request's eviction: running scores per layer, the resolved budget, steps since start.

    On a cache in preallocated `DecodeBuffer` layers (the engine's decoding batch, which calls
    `in_place`) steps write and evict in place, in `buffers` (`EntryTables`: the row's key and value tables and
    each entry's age, since the entries are no longer in time order). On any other cache eviction gathers the
    kept entries into new tensors, in time order.

    With a re-encoding policy, `reencoding` (`Reencoding`) holds each entry's RoPE position, which is always its
    rank in time order among the live entries, and rotates the kept keys after each eviction.
    """

    config: Evict
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    budget: int = 0
    total: int = 0  # entries per layer when the budget was resolved (0: not yet)
    steps: int = 0
    buffers: EntryTables | None = None  # the tables and ages it evicts in (`in_place`), else None
    reencoding: Reencoding | None = None  # StreamingLLM's positions by place in the cache, else None
    layers: list[int] = field(default_factory=list)  # the layers it evicts: all but a hybrid model's windowed ones

    def observers(
        self, prior: PrefixSums | None = None, blind: bool = False, arch: Architecture | None = None
    ) -> list[Observer | PassReader]:
        """Observers for the feed's last pass: they start the running scores from the prompt (or last chunk),
        continuing the `prior` sums of a stored prefix; `blind` and `arch` as in `score_observers`."""
        return score_observers(self.config.policy, self.scores, prior, blind, arch)

    def hold(self, entries: int) -> None:
        """The budget is the `entries` the cache will hold after this pass: new tokens appended to a context
        already compressed to its budget without them (question-agnostic reuse, `pipeline.prefill`) are all kept,
        and decoding evicts down to that size from then on."""
        self.total = self.budget = entries

    def finisher(self, cache: Cache) -> Finisher:
        """Prune each layer of `cache` (a one-pass prefill's) to the budget right after that layer's attention."""

        def finish(layer: int) -> None:
            if is_windowed(cache.layers[layer]):
                return
            keys = cache.layers[layer].keys
            self._resolve(keys.shape[2])
            if self.reencoding is not None:  # a one-pass prefill's keys sit at positions 0 .. n-1
                self.reencoding.place(layer, keys)
            self._prune_layer(cache, layer)

        return finish

    @property
    def reads_attention(self) -> bool:
        """Whether its per-step rule reads nothing but the step's attention row (`Policy.step_reads_attention`)."""
        return self.config.policy.step_reads_attention

    def step_observers(self) -> list[Observer | AttentionRows]:
        """Observers for one request's decoding steps. A policy whose step rule reads only the new query's
        attention takes it from the step's own attention (`AttentionRows`), the others score the step themselves
        (`observe`)."""
        policy = self.config.policy
        if policy.position_only:
            return []
        if policy.step_reads_attention:
            return [AttentionRows(self._observe_first_row)]
        return [self.observe]

    def _observe_first_row(self, layer: int, probs: torch.Tensor, kv_heads: int) -> None:
        self.observe_attention(layer, probs[0], kv_heads)

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Decoding step: the policy's per-step rule updates the running scores."""
        updated = self.config.policy.step_scores(self.scores.get(layer), query[0], key[0], logit_scale(query.shape[-1]))
        if updated is not None:
            self.scores[layer] = updated

    def observe_attention(self, layer: int, row: torch.Tensor, kv_heads: int) -> None:
        """Decoding step of a policy that `step_reads_attention`: its rule on the step's attention `row` (h, n)."""
        self.scores[layer] = self.config.policy.row_scores(self.scores.get(layer), row, kv_heads)

    def start(
        self, cache: Cache, kept_positions: list[torch.Tensor] | None, model: torch.nn.Module | None = None
    ) -> dict[str, Any]:
        """Align scores with a cache the feed or a compress stage already pruned, then prune to the budget.

        `kept_positions` (per layer, (kv_heads, n)) map the cache entries to the keys of the
        feed's last forward pass; None when the cache holds exactly those keys. Layers the
        finisher already pruned are within the budget and stay as they are.

        A re-encoding policy needs `model` (its rotary embedding) and a one-pass feed, whose last
        pass placed key i at position i (so `kept_positions` are the entries' positions): the kept
        keys are then rotated to positions 0 .. n-1 and decoding continues at `position(cache)`.
        """
        self.scores = _align(self.scores, kept_positions)
        self.layers = budgeted_layers(cache)
        self._resolve(max(kv_entries(cache), 1))
        self.steps = 0
        if self.reencoding is not None:
            if model is None:
                raise KvsieveError(
                    f"{self.config.name} with reencode rotates the cached keys with the model's rotary embedding; "
                    "pass the model to EvictRun.start (kvsieve.prefill and kvsieve.run do)."
                )
            for layer in self.layers:  # the finisher's layers have theirs
                kept = None if kept_positions is None else kept_positions[layer]
                self.reencoding.place(layer, cache.layers[layer].keys, kept)
        for layer in self.layers:
            self._prune_layer(cache, layer)
        if self.reencoding is not None:
            self.reencoding.start(model)
            for layer in self.layers:
                self._reencode(cache, layer)
        _, note = resolve_budget(self.config.budget, self.total)
        details = {
            "evict": self.config.name,
            "budget": self.budget,
            "from": self.total,
            "interval": self.config.interval,
        }
        return {**details, **({"note": note} if note else {})}

    def observed(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """`layer`'s running scores of its `keys` (zeros, so that recency decides, for a position-only policy)."""
        return observed_scores(self.scores, layer, keys, self.config.policy)

    def position(self, length: int, logical: int) -> int:
        """The position of the next token fed on a cache of `length` entries: that length when
        re-encoding, else `logical`."""
        return length if self.config.reencodes else logical

    def after_step(self, cache: Cache) -> None:
        self.steps += 1
        if self.reencoding is not None:
            self.reencoding.grow(cache)
        if self._one_over(cache):  # in buffers, one new entry over the budget, evicted now: the steady eviction
            for layer in self.layers:
                cache.layers[layer].truncate(self.budget)  # its new entry stays at column `budget`, for the eviction
            keys, values = self.buffers.tables
            self._evict_newest(keys, values, 0, None)
            return
        if self.buffers is not None:
            self.buffers.stamp(kv_entries(cache))
        if self.steps % self.config.interval == 0:
            if self.buffers is not None:
                self._evict_in_buffers(cache)
            else:
                for layer in self.layers:
                    self._prune_layer(cache, layer)

    def _resolve(self, total: int) -> None:
        if not self.total:
            self.total = total
            self.budget, _ = resolve_budget(self.config.budget, total)

    def _prune_layer(self, cache: Cache, layer: int) -> None:
        entry = cache.layers[layer]
        n = entry.keys.shape[2]
        if n <= self.budget:
            return
        scores = self.observed(layer, entry.keys)
        sinks, recent = self.config.policy.protected(self.budget)
        indices = keep_indices(scores, self.budget, sinks, recent)
        prune_layer(cache, layer, indices)
        if layer in self.scores:
            self.scores[layer] = self.scores[layer].gather(1, indices)
        if self.reencoding is not None:
            self.reencoding.gather(layer, indices)
            if self.reencoding.rotating:
                self._reencode(cache, layer)

    def _reencode(self, cache: Cache, layer: int) -> None:
        """Rotate `layer`'s keys to their places in time order (`Reencoding.rotate`)."""
        stamps = None if self.buffers is None else self.buffers.stamps[self.layers.index(layer)]
        self.reencoding.rotate(cache, layer, stamps, shared=self.config.policy.position_only)


def observe_rows(runs: Sequence[EvictRun], layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
    """`EvictRun.observe` for several rows at once: runs of one policy whose layers hold the same number of
    entries, query (rows, h, 1, d) and key (rows, kv_heads, n, d) row r's. The policy's per-step rule runs once,
    vectorized over the rows (`torch.func.vmap`), so a batch of R rows launches each of its kernels once instead
    of R times (what a GPU's captured step replays one by one)."""
    policy = runs[0].config.policy
    if len(runs) == 1 or policy.position_only or any(layer not in run.scores for run in runs):
        for r, run in enumerate(runs):
            run.observe(layer, query[r : r + 1], key[r : r + 1])
        return
    previous = torch.stack([run.scores[layer] for run in runs])
    scaling = logit_scale(query.shape[-1])
    updated = torch.func.vmap(lambda p, q, k: policy.step_scores(p, q, k, scaling))(previous, query, key)
    for run, scores in zip(runs, updated, strict=True):
        run.scores[layer] = scores


def observe_attention_rows(runs: Sequence[EvictRun], layer: int, probs: torch.Tensor, kv_heads: int) -> None:
    """`EvictRun.observe_attention` for several rows at once, as `observe_rows`: runs of one policy that
    `step_reads_attention`, whose layers hold the same number of entries n; probs (rows, h, n) row r's attention."""
    policy = runs[0].config.policy
    if len(runs) == 1 or any(layer not in run.scores for run in runs):
        for r, run in enumerate(runs):
            run.observe_attention(layer, probs[r], kv_heads)
        return
    previous = torch.stack([run.scores[layer] for run in runs])
    updated = torch.func.vmap(lambda p, row: policy.row_scores(p, row, kv_heads))(previous, probs)
    for run, scores in zip(runs, updated, strict=True):
        run.scores[layer] = scores
