"""The interface of a KV policy: how it scores cached tokens and which positions it always keeps.

A policy is a small frozen dataclass registered with `@component(tag, "policy")`. The stages
that prune KV use it the same way: `Compress` once after prefill, `Evict` after every decoding
step, and the chunked feeds (FM / IM / IMDC) at every chunk. Scores are (kv_heads, n), higher
means keep, computed in float32 whatever the model's dtype; query head h votes for KV head
h // n_rep (`kvsieve.compress.scorers`).

To add a policy: one module in `compress/policies/` with a subclass that implements
`prompt_scores` (and, for a per-step rule, sets `step_alpha`, or `row_scores` with `step_reads_attention` for
another rule on the step's attention row, or `step_scores` for one that reads more), plus one line in
`kvsieve/registry.py` naming its preset. Nothing else changes.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvsieve.compress.scorers import accumulated_attention, attention_probs, per_kv_head
from kvsieve.errors import KvsieveError


class Policy:
    """Base class of the KV policies (SnapKV, H2O, A2SF, StreamingLLM, local window, TOVA, KNorm).

    Subclass attributes:
    - `position_only`: keeps tokens by position alone (no scores at all);
    - `step_alpha`: for accumulating policies, the per-step rule score <- alpha * score + row
      (A2SF eq. 6; H2O alpha = 1); None when the policy has no such rule;
    - `accumulates`: the prompt scores are A2SF eq. 5's accumulated attention with that same
      alpha (H2O, A2SF).

    Policies whose prompt scores are made from accumulated attention (`summed_alpha`, `from_sums`:
    H2O, A2SF, Collie) get it from kvsieve's dense attention pass itself, with no second pass.
    """

    tag: ClassVar[str]
    kind: ClassVar[str]
    position_only: ClassVar[bool] = False
    step_alpha: ClassVar[float | None] = None
    accumulates: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.tag

    @property
    def decodes(self) -> bool:
        """Whether the policy has a per-step eviction rule (usable by `Evict`)."""
        return self.position_only or self.step_alpha is not None

    def prompt_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """(kv_heads, n) scores of the keys (kv_heads, n, d) from queries (h, q, d), the last q of n
        positions; None for position-only policies. Default: `from_sums` of A2SF eq. 5 with `summed_alpha`."""
        if self.summed_alpha is not None:
            return self.from_sums(self.accumulated_scores(query, key, scaling), query.shape[1])
        return None

    @property
    def summed_alpha(self) -> float | None:
        """The alpha of the accumulated attention (A2SF eq. 5) the prompt scores are made from by
        `from_sums`, or None when they are not: H2O / A2SF their step_alpha; Collie 1."""
        return float(self.step_alpha) if self.accumulates else None

    def accumulated_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        """A2SF eq. 5 with `summed_alpha` (the second pass); for one query (a decoding step) its attention row."""
        return accumulated_attention(
            query, key, scaling, alpha=self.summed_alpha if self.summed_alpha is not None else 1.0
        )

    def from_sums(self, sums: torch.Tensor, queries: int) -> torch.Tensor:
        """Prompt scores (kv_heads, n) from the accumulated attention `sums` of `queries` queries: the sums here."""
        return sums

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
        rather than `step_scores` computing them again. Default: the policies with a `step_alpha`."""
        return not self.position_only and self.step_alpha is not None

    def row_scores(self, previous: torch.Tensor | None, row: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """Running scores (kv_heads, n) after one decoding step from its attention `row` (h, n) float32, for the
        policies that `step_reads_attention`. Default: score <- step_alpha * score + the row summed per KV head (A2SF
        eq. 6)."""
        return self.accumulate(previous, per_kv_head(row, kv_heads))

    def accumulate(self, previous: torch.Tensor | None, row: torch.Tensor) -> torch.Tensor:
        """A2SF eq. 6 in place on the new step's attention `row` (kv_heads, n): row + step_alpha * previous.

        `previous` scores the older entries (the first previous.shape[1]); the newest have none yet.
        """
        if previous is not None:
            row[:, : previous.shape[1]].add_(previous, alpha=self.step_alpha)
        return row

    @property
    def scored_queries(self) -> int | None:
        """How many of the prompt's last queries its scores read: then a request continuing a stored
        prefix scores exactly as a one-pass prefill when it runs at least that many new tokens. 0 for
        position-only policies; accumulating ones (`summed_alpha`) read every query and continue the
        prefix's stored sums instead; None where no such bound is known (no reuse)."""
        if self.position_only or self.summed_alpha is not None:
            return 0
        return None

    def protected(self, budget: int) -> tuple[int, int]:
        """(sinks, recent): the first and last positions kept regardless of score, within `budget`."""
        return 0, 0


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
