"""A2SF (arXiv 2407.20485): accumulated attention with a forgetting factor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.compress.policy import StepRule
from kvsieve.compress.scorers import check_pool_size, pool_scores
from kvsieve.errors import KvsieveError
from kvsieve.spec import component, option


@component("a2sf", "policy")
@dataclass(frozen=True)
class A2SF(StepRule):
    """A_k = sum_q alpha^(n-q) S_{q,k} (eq. 5), updated per step as alpha * A + row (eq. 6).

    The whole budget goes to the score, as in the paper; `recent` > 0 keeps a recent tail as the
    authors' later one-shot code does. `pool_size` > 1 average-pools the prompt scores over
    neighbouring tokens (beyond the paper, as SnapKV pools its votes), so a retrieved passage is
    kept whole rather than as its highest-scored tokens; the per-step rule is unchanged.
    """

    alpha: float = option(0.2, "forgetting factor in [0, 1] (1 = H2O's accumulation, 0 = last row only)")
    recent: int = option(0, "newest tokens always kept, outside the score (paper: 0)")
    pool_size: int = option(
        1, "tokens each prompt score is average-pooled over, odd (paper: 1, no pooling)", was="kernel"
    )

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 <= self.alpha <= 1:
            raise KvsieveError(f"A2SF forgetting factor alpha must be within [0, 1], got {self.alpha!r}.")
        if isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 0:
            raise KvsieveError(f"A2SF recent tail must be a whole number >= 0, got {self.recent!r}.")
        check_pool_size(self.pool_size)

    @property
    def step_alpha(self) -> float:
        return float(self.alpha)

    def from_sums(self, sums: torch.Tensor, queries: int) -> torch.Tensor:
        return pool_scores(sums, self.pool_size)

    def protected(self, budget: int) -> tuple[int, int]:
        if self.recent > budget:
            raise KvsieveError(f"A2SF recent tail {self.recent} exceeds the budget {budget}.")
        return 0, self.recent
