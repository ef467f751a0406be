"""The two kinds of KV policy: a prompt scorer, or a per-step rule.

A policy is a small frozen dataclass registered with `@component(tag, "policy")`, of one of two kinds:

- `PromptScorer` (SnapKV, KNorm, TOVA, StreamingLLM, the local window, Collie, Expected Attention): scores the cached
  keys from one layer's pass (`LayerPass`: the pass's queries, the keys, the values, the layer's rotary embedding),
  or by position alone. Write `prompt_scores` and name what it reads in `reads` (or set `position_only`). Set
  `rescores` for a rule that evicts while decoding by scoring again at every step (TOVA, KNorm).
- `StepRule` (H2O, A2SF): running scores, score <- step_alpha * score + the new query's attention (A2SF eq. 6),
  whose prompt scores are the same sum over the prompt's queries (eq. 5), made inside kvsieve's attention pass.
  Set `step_alpha`.

Either may override `protected` (positions kept whatever their score) and `layer_budget` (a budget per layer).
What a scorer reads is handed over in one place, `kvsieve.compress.stages.score_observers`, which builds each layer's
`LayerPass` from the attention's own arguments and checks the `reads` it cannot supply (the rotary embedding without
the model) before any pass runs. The stages that prune KV read every policy the same way (the members of `Policy`
below): `Compress` once after prefill, `Evict` after every decoding step, and the chunked feeds (FM / IM / IMDC) at
every chunk. Scores are (kv_heads, n), higher means keep, computed in float32 whatever the model's dtype; query head
h votes for KV head h // n_rep (`kvsieve.compress.scorers`).

To add a policy: one module in `compress/policies/` with a subclass of one kind, plus one line in
`kvsieve/registry.py` naming its preset. Nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvsieve.compress.scorers import accumulated_attention, attention_probs, per_kv_head
from kvsieve.errors import KvsieveError
from kvsieve.models import Rotary, logit_scale

Reading = Literal["queries", "keys", "values", "rotary", "second_pass", "attention_max"]


@dataclass(frozen=True)
class Reread:
    """One pass of a policy's second pass (`Policy.second_pass`): its token ids (1, m), run on top of a cache of n
    entries, and `within`, a (n,) bool mask of the cached entries its scores' softmax runs over besides the pass's own
    m keys (KVzip's sinks and the chunk the pass repeats); None: every cached entry. An entry outside scores 0 in
    that pass. The pass's hidden states still attend to every entry: only the scores are normalised over fewer keys.
    """

    tokens: torch.Tensor
    within: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerPass:
    """What a prompt scorer reads of one layer's forward pass (the prompt's, or a chunk's), batch row 0.

    query (h, q, d) and key (kv_heads, n, d) post-RoPE, the queries the last q of the n key positions; value
    (kv_heads, n, d) where the policy `reads` values; `rotary` the layer's rotary embedding where it reads it
    (`kvsieve.models.Rotary`: moving a query or key to other positions), else None. Scores use `scaling`. A policy
    that reads "second_pass" (KVzip) scores the passes its `second_pass` names rather than the prompt's own.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor | None = None
    rotary: Rotary | None = None
    scale: float | None = None  # None: head_dim ** -0.5

    @property
    def scaling(self) -> float:
        """The logits' scale: `scale`, else head_dim ** -0.5 (`kvsieve.compress.stages`' note on Gemma's
        query_pre_attn_scalar)."""
        return logit_scale(self.query.shape[-1], self.scale)


class Policy:
    """What the stages read of a KV policy; a policy subclasses one of its two kinds, `PromptScorer` or `StepRule`,
    which set these members (the defaults: a one-shot policy without scores of its own)."""

    tag: ClassVar[str]
    kind: ClassVar[str]
    position_only: ClassVar[bool] = False  # keeps tokens by position alone (no scores at all)
    reads: ClassVar[frozenset[Reading]] = frozenset({"queries", "keys"})  # what `prompt_scores` reads of a pass
    accumulates: ClassVar[bool] = False  # the prompt scores are A2SF eq. 5 with `step_alpha` (a `StepRule`)

    @property
    def name(self) -> str:
        return self.tag

    @property
    def decodes(self) -> bool:
        """Whether the policy has a per-step eviction rule (usable by `Evict`)."""
        return self.position_only

    def protected(self, budget: int) -> tuple[int, int]:
        """(sinks, recent): the first and last positions kept regardless of score, within `budget`."""
        return 0, 0

    def layer_budget(self, budget: int, layer: int, layers: list[int]) -> int:
        """The entries `layer` keeps when the stage's budget is `budget` per layer on average over the budgeted
        `layers`. Default: `budget` in every layer."""
        return budget

    @property
    def budgets_per_layer(self) -> bool:
        """Whether `layer_budget` (or `allocate`) gives the layers budgets of their own, which only the compress stage
        applies."""
        return type(self).layer_budget is not Policy.layer_budget

    def allocate(self, scores: dict[int, torch.Tensor], budget: int, layers: list[int]) -> dict[int, int] | None:
        """Budgets per layer chosen from every layer's `scores` at once (KVzip's selection across layers), `budget`
        per layer on average over the budgeted `layers`; None (the default): `layer_budget`'s, layer by layer."""
        return None

    def prompt_scores(self, seen: LayerPass) -> torch.Tensor | None:
        """(kv_heads, n) scores of the pass's n keys; None for position-only policies. Default: `from_sums` of A2SF
        eq. 5 with `summed_alpha` (where the attention pass cannot give them, `score_observers`)."""
        if self.summed_alpha is not None:
            sums = self.accumulated_scores(seen.query, seen.key, seen.scaling)
            return self.from_sums(sums, seen.query.shape[1])
        return None

    def second_pass(self, ids: torch.Tensor, encode: Callable[[str], list[int]]) -> list[Reread]:
        """For a policy that reads "second_pass": each pass run on top of a cache holding `ids` (1, n) and dropped
        again, whose `LayerPass`es it scores (`kvsieve.feed.reconstruction`); `encode` turns text into the model's
        token ids."""
        raise NotImplementedError(f"{self.name} reads no second pass.")

    @property
    def step_alpha(self) -> float | None:
        """A `StepRule`'s forgetting factor (A2SF eq. 6); None for the other kind."""
        return None

    @property
    def summed_alpha(self) -> float | None:
        """The alpha of the accumulated attention (A2SF eq. 5) the prompt scores are made from by `from_sums`
        (inside the attention pass), or None when they are not: a `StepRule` its step_alpha; Collie 1."""
        return None if self.step_alpha is None or not self.accumulates else float(self.step_alpha)

    def accumulated_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        """A2SF eq. 5 with `summed_alpha` (the second pass); for one query (a decoding step) its attention row."""
        return accumulated_attention(
            query, key, scaling, alpha=self.summed_alpha if self.summed_alpha is not None else 1.0
        )

    def from_sums(self, sums: torch.Tensor, queries: int) -> torch.Tensor:
        """Prompt scores (kv_heads, n) from the accumulated attention `sums` of `queries` queries: the sums here."""
        return sums

    def from_second_pass(self, best: torch.Tensor) -> torch.Tensor:
        """Prompt scores (kv_heads, n) from the best score each cached entry got over the second pass's passes (a
        policy with a `second_pass`): that best here."""
        return best

    def step_scores(
        self, previous: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, scaling: float
    ) -> torch.Tensor | None:
        """Running scores (kv_heads, n) after one decoding step: `previous` (kv_heads, n - 1 or fewer)
        scored the older keys, query (h, 1, d) is the new token's, key (kv_heads, n, d) all cached keys.

        Default: the policy's rule on the new query's attention row (`row_scores`) where it has one, else None.
        """
        if not self.step_reads_attention:
            return None
        return self.row_scores(previous, attention_probs(query, key, scaling)[:, 0], key.shape[0])

    @property
    def step_reads_attention(self) -> bool:
        """Whether the per-step rule reads nothing but the new query's attention row (`row_scores`): then a decoding
        step hands it the attention's own probabilities (`kvsieve.attention.AttentionRows`, one pass over the keys)
        rather than `step_scores` computing them again."""
        return False

    def row_scores(self, previous: torch.Tensor | None, row: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """Running scores (kv_heads, n) after one decoding step from its attention `row` (h, n) float32, for the
        policies that `step_reads_attention`."""
        raise NotImplementedError(f"{self.name} has no rule on a step's attention row.")

    @property
    def scored_queries(self) -> int | None:
        """How many of the prompt's last queries its scores read: then a request continuing a stored
        prefix scores exactly as a one-pass prefill when it runs at least that many new tokens. 0 for
        position-only policies; accumulating ones (`summed_alpha`) read every query and continue the
        prefix's stored sums instead; None where no such bound is known (no reuse)."""
        if self.position_only or self.summed_alpha is not None:
            return 0
        return None


class PromptScorer(Policy):
    """Kind 1: the cached keys scored from the prompt's last queries, from the keys alone, or by position alone.

    Write `prompt_scores` (a `LayerPass` -> (kv_heads, n)) and its `reads`, or set `position_only`. With
    `rescores`, `Evict` scores again after every decoding step with the newest query as the only one
    (`step_scores`; a rule that reads only that query's attention row may give `row_scores` and set
    `step_reads_attention`, so the step's own attention is reused)."""

    rescores: ClassVar[bool] = False

    @property
    def decodes(self) -> bool:
        return self.position_only or self.rescores

    def step_scores(
        self, previous: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, scaling: float
    ) -> torch.Tensor | None:
        if self.step_reads_attention or not self.rescores:
            return super().step_scores(previous, query, key, scaling)
        return self.prompt_scores(LayerPass(query, key))


class StepRule(Policy):
    """Kind 2: running scores, score <- step_alpha * score + the new query's attention (A2SF eq. 6).

    Set `step_alpha` (1: H2O's plain sum). The prompt's scores are the same sum over its queries (eq. 5), taken
    from kvsieve's attention pass itself (no second pass); `from_sums` may post-process them (A2SF pools them)."""

    accumulates: ClassVar[bool] = True

    @property
    def step_alpha(self) -> float:
        return 1.0

    @property
    def decodes(self) -> bool:
        return True

    @property
    def step_reads_attention(self) -> bool:
        return True

    def row_scores(self, previous: torch.Tensor | None, row: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """score <- step_alpha * score + the row summed per KV head (A2SF eq. 6)."""
        return self.accumulate(previous, per_kv_head(row, kv_heads))

    def accumulate(self, previous: torch.Tensor | None, row: torch.Tensor) -> torch.Tensor:
        """A2SF eq. 6 in place on the new step's attention `row` (kv_heads, n): row + step_alpha * previous.

        `previous` scores the older entries (the first previous.shape[1]); the newest have none yet.
        """
        if previous is not None:
            row[:, : previous.shape[1]].add_(previous, alpha=self.step_alpha)
        return row


def observed_scores(scores: dict[int, torch.Tensor], layer: int, keys: torch.Tensor, policy: Policy) -> torch.Tensor:
    """The observed scores of `layer`, or zeros (recency decides) for a position-only policy."""
    if layer in scores:
        return scores[layer]
    if not policy.position_only:
        raise KvsieveError(
            f"The {policy.name} policy saw no attention at layer {layer}; run the model through kvsieve "
            "(kvsieve.load_model, or kvsieve.prepare(model) for a model you loaded yourself)."
        )
    return torch.zeros(keys.shape[1], keys.shape[2], device=keys.device)
