"""The interface of a KV policy: how it scores cached tokens and which positions it always keeps.

A policy is a small frozen dataclass registered with `@component(tag, "policy")`. The stages
that prune KV use it the same way: `Compress` once after prefill, `Evict` after every decoding
step, and the chunked feeds (FM / IM / IMDC) at every chunk. Scores are (kv_heads, n), higher
means keep, computed in float32 whatever the model's dtype; query head h votes for KV head
h // n_rep (`kvsieve.compress.scorers`).

To add a policy: one module in `compress/policies/` with a subclass that implements
`prompt_scores` (and `step_scores` for a per-step rule, or sets `step_alpha`), plus one line in
`kvsieve/registry.py` naming its preset. Nothing else changes.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvsieve.compress.scorers import attention_probs, per_kv_head


class Policy:
    """Base class of the KV policies (SnapKV, H2O, A2SF, StreamingLLM, local window, TOVA, KNorm).

    Subclass attributes:
    - `position_only`: keeps tokens by position alone (no scores at all);
    - `step_alpha`: for accumulating policies, the per-step rule score <- alpha * score + row
      (A2SF eq. 6; H2O alpha = 1; TOVA alpha = 0); None when the policy has no such rule.
    """

    tag: ClassVar[str]
    kind: ClassVar[str]
    position_only: ClassVar[bool] = False
    step_alpha: ClassVar[float | None] = None

    @property
    def name(self) -> str:
        return self.tag

    @property
    def decodes(self) -> bool:
        """Whether the policy has a per-step eviction rule (usable by `Evict`)."""
        return self.position_only or self.step_alpha is not None

    def prompt_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """(kv_heads, n) scores of the keys (kv_heads, n, d) from queries (h, q, d), the last q of n
        positions; None for position-only policies."""
        return None

    def step_scores(
        self, previous: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, scaling: float
    ) -> torch.Tensor | None:
        """Running scores (kv_heads, n) after one decoding step: `previous` (kv_heads, n - 1 or fewer)
        scored the older keys, query (h, 1, d) is the new token's, key (kv_heads, n, d) all cached keys.

        Default: score <- step_alpha * score + the new query's attention row (A2SF eq. 6).
        """
        if self.position_only or self.step_alpha is None:
            return None
        row = per_kv_head(attention_probs(query, key, scaling)[:, 0], key.shape[0])  # (g, n)
        if previous is None:
            return row
        grown = torch.zeros_like(row)
        grown[:, : previous.shape[1]] = previous
        return grown.mul_(self.step_alpha).add_(row)

    def protected(self, budget: int) -> tuple[int, int]:
        """(sinks, recent): the first and last positions kept regardless of score, within `budget`."""
        return 0, 0
