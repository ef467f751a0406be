"""H2O (Zhang et al. 2023): heavy hitters by accumulated attention, half the budget for recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

from kvsieve.compress.policy import StepRule
from kvsieve.spec import component


@component("h2o", "policy")
@dataclass(frozen=True)
class H2O(StepRule):
    """Attention accumulated over all queries (alpha = 1); the newest half of the budget always kept."""

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, budget // 2
